"""DoRA: values and gradients against the materialised DoRA formula, written out here
independently of lorax (`V = W + s * B @ A`, `W' = m * V / ||V||`, the norm per output
feature over the input axes and constant under differentiation), on every kind of
weight use, plus the lifecycle (partition, optimizer, merge, adapters, summary)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lorax
from conftest import assert_close
from lorax._variants.dora import DoraWeight, weight_norm

K = 3


def _ref_weight(w, a, b, m, alpha, structure, output_factor):
    """m * V / stop_gradient(||V||), from the factors, by einsum."""
    nb, nm, nn = structure
    letters = "abcdefghij"
    batch, ms, ns = letters[:nb], letters[nb:nb + nm], letters[nb + nm:nb + nm + nn]
    k = a.shape[nb]
    v = w + (alpha / k) * jnp.einsum(f"{batch}{ms}z,{batch}z{ns}->{batch}{ms}{ns}", b, a)
    axes = tuple(range(nb, nb + nm)) if output_factor == "a" else tuple(range(nb + nm, w.ndim))
    norm = lax.stop_gradient(jnp.sqrt(jnp.sum(v * v, axis=axes, keepdims=True)))
    return m * v / norm


def _ref_tree(lp):
    def one(x):
        if isinstance(x, DoraWeight):
            w = x.w.dequantize() if isinstance(x.w, lorax.QuantizedArray) else x.w
            return _ref_weight(lax.stop_gradient(w), x.a, x.b, x.m, x.alpha, x.structure,
                               x.output_factor)
        return x
    return jax.tree.map(one, lp, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))


def _nudge(lp, key):
    """Non-zero b and a magnitude away from ||W||, so every term is exercised."""
    leaves, treedef = jax.tree.flatten(lp, is_leaf=lambda x: isinstance(x, DoraWeight))
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, DoraWeight):
            k1, k2, k3 = jax.random.split(jax.random.fold_in(key, i), 3)
            b = 0.3 * jax.random.normal(k1, x.b.shape)
            a = jax.random.normal(k2, x.a.shape)
            m = x.m * (1.0 + 0.2 * jax.random.normal(k3, x.m.shape))
            x = DoraWeight(x.w, a, b, m, x.alpha)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def _conv(x, w, dn):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)


def _cases():
    r = np.random.default_rng(0)
    n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
    return {
        # name: (model, params, spec value, x)
        "dense_x_at_w": (lambda p, x: jnp.tanh(x @ p["w"]), {"w": n(8, 6)},
                         lorax.LoraSpec(K, alpha=2.0, dora=True), n(5, 8)),
        "torch_w_at_x": (lambda p, x: jnp.tanh(x @ p["w"].T), {"w": n(6, 8)},
                         lorax.LoraSpec(K, dora=True, input_factor="a"), n(5, 8)),
        "dense_general_q": (lambda p, x: jnp.einsum("be,ehd->bhd", x, p["w"]),
                            {"w": n(8, 2, 4)},
                            lorax.LoraSpec(K, batch_ndim=0, m_ndim=1, dora=True), n(5, 8)),
        "attention_out": (lambda p, x: jnp.einsum("bhd,hde->be", x, p["w"]),
                          {"w": n(2, 4, 8)},
                          lorax.LoraSpec(K, batch_ndim=0, m_ndim=2, dora=True), n(5, 2, 4)),
        "conv_hwio": (lambda p, x: _conv(x, p["w"], ("NHWC", "HWIO", "NHWC")),
                      {"w": n(3, 3, 4, 5)}, lorax.LoraSpec(K, dora=True), n(2, 6, 6, 4)),
        "conv_oihw": (lambda p, x: _conv(x, p["w"], ("NCHW", "OIHW", "NCHW")),
                      {"w": n(5, 4, 3, 3)},
                      lorax.LoraSpec(K, batch_ndim=0, m_ndim=1, dora=True, input_factor="a"),
                      n(2, 4, 6, 6)),
        "embedding_tied": (
            lambda p, ids: jnp.take(p["e"], ids, axis=0) @ p["e"].T,
            {"e": n(10, 8)}, lorax.LoraSpec(K, dora=True), jnp.array([[1, 2, 9], [0, 3, 3]])),
        "scanned_stack": (
            lambda p, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0],
            {"w": n(3, 8, 8) / 3}, lorax.LoraSpec(K, batch_ndim=1, m_ndim=1, dora=True),
            n(5, 8)),
        "unrolled_stack": (
            lambda p, x: jnp.tanh(jnp.tanh(x @ p["w"][0]) @ p["w"][1]),
            {"w": n(2, 8, 8) / 3}, lorax.LoraSpec(K, batch_ndim=1, m_ndim=1, dora=True),
            n(5, 8)),
    }


CASES = _cases()


def _setup(name, quantize=None):
    model, params, spec_val, x = CASES[name]
    spec = {k: spec_val for k in params}
    if quantize:
        params = lorax.quantize(params, spec, quantize, min_size=0)
    lp = _nudge(lorax.init_lora(params, spec, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
    return model, lp, spec, x


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_and_gradients_match_the_dora_formula(name):
    model, lp, spec, x = _setup(name)
    assert all(isinstance(v, DoraWeight) for v in lp.values())
    f = lorax.lora(model, on_materialize="error")
    want = model(_ref_tree(lp), x)
    assert_close(f(lp, x), want, rtol=1e-5, atol=1e-5)
    assert_close(jax.jit(f)(lp, x), want, rtol=1e-5, atol=1e-5)
    assert_close(model(lorax.merge_params(lp), x), want, rtol=1e-5, atol=1e-5)

    trainable, frozen = lorax.partition(lp, spec)
    proj = jnp.asarray(np.random.default_rng(3).standard_normal(want.shape), jnp.float32)
    loss = lambda t: jnp.sum(jnp.sin(f(lorax.combine(t, frozen), x)) * proj)  # noqa: E731
    ref = lambda t: jnp.sum(jnp.sin(model(_ref_tree(lorax.combine(t, frozen)), x)) * proj)  # noqa: E731
    g, g_ref = jax.jit(jax.grad(loss))(trainable), jax.grad(ref)(trainable)
    for field in ("a", "b", "m"):
        for key in lp:
            assert_close(getattr(g[key], field), getattr(g_ref[key], field), rtol=1e-5, atol=1e-5)
        assert float(jnp.abs(getattr(g[key], field)).max()) > 0


def test_quantized_base():
    model, lp, spec, x = _setup("dense_x_at_w", quantize="int8")
    assert isinstance(lp["w"].w, lorax.QuantizedArray)
    f = lorax.lora(model, on_materialize="error")
    assert_close(f(lp, x), model(_ref_tree(lp), x), rtol=1e-5, atol=1e-5)
    trainable, frozen = lorax.partition(lp, spec)
    loss = lambda t: f(lorax.combine(t, frozen), x).sum()  # noqa: E731
    ref = lambda t: model(_ref_tree(lorax.combine(t, frozen)), x).sum()  # noqa: E731
    g, g_ref = jax.grad(loss)(trainable), jax.grad(ref)(trainable)
    for field in ("a", "b", "m"):
        assert_close(getattr(g["w"], field), getattr(g_ref["w"], field), rtol=1e-5, atol=1e-5)


def test_init_keeps_the_model_and_magnitude_is_the_column_norm():
    r = np.random.default_rng(1)
    w = jnp.asarray(r.standard_normal((8, 6)), jnp.float32)
    lp = lorax.init_lora({"w": w}, {"w": 2}, jax.random.PRNGKey(0), dora=True)
    assert lp["w"].m.shape == (1, 6)
    np.testing.assert_allclose(lp["w"].m, np.linalg.norm(np.asarray(w), axis=0, keepdims=True),
                               rtol=1e-6)
    x = jnp.ones((2, 8))
    assert_close(lorax.lora(lambda p, x: x @ p["w"])(lp, x), x @ w, rtol=1e-6, atol=1e-6)
    # (out, in) weights: one magnitude per row.
    lp = lorax.init_lora({"w": w}, {"w": lorax.LoraSpec(2, dora=True, input_factor="a")},
                         jax.random.PRNGKey(0))
    assert lp["w"].m.shape == (8, 1)
    assert lp["w"].output_factor == "b"


@pytest.mark.parametrize("name", ["dense_x_at_w", "embedding_tied", "unrolled_stack"])
def test_dora_past_the_boundary_is_converted_not_treated_as_lora(name):
    """A DoraWeight that reaches the rules without passing `lora`'s boundary (a nested
    `_engine.call`, quax used directly) still gets its magnitude: a LoraWeight rule
    would silently drop it."""
    from lorax import _engine

    model, lp, spec, x = _setup(name)
    with _engine.materialize_policy("error"):
        out = _engine.transform(model)(lp, x)
        plain = _engine.transform(model)({"w" if "w" in lp else "e": lp.get("w", lp.get("e")).as_lora()}, x)
    assert_close(out, model(_ref_tree(lp), x), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(plain - out).max()) > 1e-2  # the magnitude matters here


def _lora_rule_types():
    from quax._dispatch import _rules

    out = {}
    for prim, fn in _rules.items():
        types = set()
        for method in fn.methods:
            for t in method.signature.types:
                types.add(t)
        out[prim] = types
    return out


def test_every_lora_rule_has_a_dora_and_dropout_rule():
    """DoraWeight subclasses LoraWeight: any primitive with a LoraWeight rule and no
    DoraWeight rule would run LoRA's rule and drop the magnitude."""
    rules = _lora_rule_types()
    with_lora = [p for p, types in rules.items() if lorax.LoraWeight in types]
    assert len(with_lora) >= 10
    missing = [p.name for p in with_lora if DoraWeight not in rules[p]
               or lorax.LoraDropout not in rules[p]]
    assert missing == []


def test_lifecycle_partition_optimizer_merge_adapter(tmp_path):
    model, lp, spec, x = _setup("dense_general_q")
    s = lorax.summary(lp, spec)
    w = lp["w"]
    assert s.trainable == w.a.size + w.b.size + w.m.size
    assert lorax.summary({"w": w.w}, spec).trainable == s.trainable
    trainable, frozen = lorax.partition(lp, spec)
    assert trainable["w"].m is not None and frozen["w"].m is None and frozen["w"].a is None

    opt = lorax.wrap_optimizer(optax.adam(1e-2), spec)
    state = opt.init(lp)
    assert sum(x.size for x in jax.tree.leaves(state)) == 2 * s.trainable + 1  # mu, nu, count
    f = lorax.lora(model)
    grads = jax.grad(lambda p: f(p, x).sum())(lp)
    updates, state = opt.update(grads, state, lp)
    new = optax.apply_updates(lp, updates)
    assert float(jnp.abs(new["w"].m - lp["w"].m).max()) > 0
    np.testing.assert_array_equal(new["w"].w, lp["w"].w)

    merged = lorax.merge_params(lp)
    assert_close(model(merged, x), f(lp, x), rtol=1e-5, atol=1e-5)
    merged_d = lorax.merge_params(jax.tree.map(jnp.copy, lp), destructive=True)
    assert_close(merged_d["w"], merged["w"], rtol=1e-6, atol=1e-6)

    path = tmp_path / "dora.safetensors"
    lorax.save_adapter(path, lp, spec)
    loaded, spec2 = lorax.load_adapter(path, {"w": lp["w"].w})
    assert isinstance(loaded["w"], DoraWeight) and spec2["w"].dora
    np.testing.assert_array_equal(loaded["w"].m, lp["w"].m)
    assert_close(f(loaded, x), f(lp, x), rtol=0, atol=0)


def test_bad_magnitude_shape_is_a_clear_error():
    w = jnp.ones((8, 6))
    with pytest.raises(ValueError, match=r"\(1, 6\).*\(8, 1\).*got \(6,\)"):
        DoraWeight(w, jnp.ones((2, 6)), jnp.ones((8, 2)), jnp.ones((6,)))


def test_integer_weight_and_non_lora_input_are_clear_errors():
    with pytest.raises(ValueError, match="DoraWeight: w has dtype int32; LoRA needs a floating"):
        DoraWeight(jnp.ones((8, 6), jnp.int32), jnp.ones((2, 6)), jnp.ones((8, 2)),
                   jnp.ones((1, 6)))
    with pytest.raises(TypeError, match="from_lora: lw must be a lorax.LoraWeight, got ArrayImpl"):
        DoraWeight.from_lora(jnp.ones((8, 6)))
    lw = lorax.LoraWeight(jnp.ones((8, 6)), jnp.ones((2, 6)), jnp.ones((8, 2)))
    with pytest.raises(ValueError, match="from_lora: input_factor must be 'a' or 'b'"):
        DoraWeight.from_lora(lw, "x")


def test_weight_norm_identity_matches_direct_norm_on_large_update():
    r = np.random.default_rng(5)
    w = jnp.asarray(r.standard_normal((32, 24)), jnp.float32)
    lw = lorax.LoraWeight(w, jnp.asarray(r.standard_normal((4, 24)), jnp.float32),
                          jnp.asarray(r.standard_normal((32, 4)), jnp.float32), alpha=8.0)
    v = np.asarray(lw.materialize(), np.float64)
    assert_close(weight_norm(lw, "a"), np.linalg.norm(v, axis=0, keepdims=True), rtol=1e-5)
    assert_close(weight_norm(lw, "b"), np.linalg.norm(v, axis=1, keepdims=True), rtol=1e-5)


def test_backward_has_no_weight_sized_dot():
    from test_structure_backward import weight_shaped_ops

    for name in ("dense_x_at_w", "scanned_stack", "conv_hwio", "embedding_tied"):
        model, lp, spec, x = _setup(name)
        trainable, frozen = lorax.partition(lp, spec)
        f = lorax.lora(model, on_materialize="error")

        @jax.jit
        def loss(t):
            return jnp.sum(jnp.sin(f(lorax.combine(t, frozen), x)))

        jaxpr = jax.make_jaxpr(jax.grad(loss))(trainable)
        shapes = [v.shape for v in lp.values()] + [v.shape[v.structure[0]:] for v in lp.values()]
        assert weight_shaped_ops(jaxpr, shapes) == [], name
        # Negative control: the materialised DoRA weight is caught by the same walker.
        ref = jax.make_jaxpr(jax.grad(
            lambda t: jnp.sum(jnp.sin(model(_ref_tree(lorax.combine(t, frozen)), x)))))(trainable)
        if name != "embedding_tied":  # there the reference's W-sized op is a gather
            assert weight_shaped_ops(ref, shapes) != [], name


def test_compiled_step_holds_no_weight_sized_temporary():
    """A DoRA training step's compiled temporaries exceed plain LoRA's by much less than
    one weight (the norm's W-sized square is fused into its reduction)."""
    d, batch = 512, 8
    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.standard_normal((d, d)), jnp.float32)}

    def temp_bytes(dora):
        spec = {"w": lorax.LoraSpec(8, dora=dora)}
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
        trainable, frozen = lorax.partition(lp, spec)
        f = lorax.lora(lambda p, x: jnp.tanh(x @ p["w"]).sum())

        def step(t, frozen, x):
            g = jax.grad(lambda t: f(lorax.combine(t, frozen), x))(t)
            return jax.tree.map(lambda p, g: p - 1e-3 * g, t, g)

        x = jnp.ones((batch, d))
        compiled = jax.jit(step, donate_argnums=0).lower(trainable, frozen, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    w_bytes = d * d * 4
    lora_t, dora_t = temp_bytes(False), temp_bytes(True)
    assert dora_t - lora_t < w_bytes / 8, (lora_t, dora_t, w_bytes)


def test_stacked_quantized_base_is_dequantized_one_layer_at_a_time():
    """DoRA's norm on a stacked quantized base: the compiled step's temporaries stay
    within a couple of layers of plain QLoRA's (a whole-stack dequantization for the
    norm cost one dense layer per stacked layer)."""
    n_layers, d = 8, 256
    r = np.random.default_rng(0)
    params = {"w": jnp.asarray(r.standard_normal((n_layers, d, d)) / 16, jnp.float32)}

    def model(p, x):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]

    def temp_bytes(dora):
        spec = {"w": lorax.LoraSpec(4, batch_ndim=1, m_ndim=1, dora=dora)}
        q = lorax.quantize(params, spec, "nf4")
        lp = lorax.init_lora(q, spec, jax.random.PRNGKey(0))
        trainable, frozen = lorax.partition(lp, spec)
        f = lorax.lora(model, on_materialize="error")
        loss = lambda t, fr, x: jnp.sum(f(lorax.combine(t, fr), x))  # noqa: E731
        step = jax.jit(lambda t, fr, x: jax.grad(loss)(t, fr, x))
        x = jnp.ones((16, d))
        return step.lower(trainable, frozen, x).compile().memory_analysis().temp_size_in_bytes

    layer = d * d * 4
    plain, dora = temp_bytes(False), temp_bytes(True)
    assert dora - plain < 2 * layer, (plain / layer, dora / layer)
