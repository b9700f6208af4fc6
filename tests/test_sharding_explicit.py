"""LoRA under Explicit mesh axes (sharding in types, `jax.make_mesh`'s default): the same
attention + MLP block and training step as tests/test_sharding.py, written as JAX's
sharding tutorial writes a model for that mode (weights regathered with `reshard` under
FSDP, row-parallel products told their `out_sharding`), on 8 simulated devices.

Checked against the single-device step on materialised weights, and against the same
layout on an Auto mesh: the communication the compiled step does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, reshard

import lorax
from conftest import assert_close
from test_sharding import (H, K, LAYOUTS, NAMES, assert_matches_reference,  # noqa: F401
                           collectives, data, lora_setup, loss, make_step, mesh_for, reference,
                           shardings_of)

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS from tests/conftest.py)"
)


def explicit_block(p, x, layout, rows=None):
    """tests/test_sharding.py's `block` for Explicit axes (`rows`: a row-parallel
    product's result, by default sharded as the activations are)."""
    b, t, _ = x.shape
    if layout == "fsdp":  # stored split, used whole: the tutorial's FSDP
        p = {n: reshard(w, P()) for n, w in p.items()}
    if layout == "tp" and rows is None:
        rows = P("data", None, None)

    def heads(w):
        return jnp.einsum("btd,de->bte", x, w).reshape(b, t, H, -1)

    q, k, v = heads(p["q"]), heads(p["k"]), heads(p["v"])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, -1)
    x = x + jnp.einsum("bte,ed->btd", att, p["o"], out_sharding=rows)
    h = jax.nn.gelu(jnp.einsum("btd,df->btf", x, p["up"]))
    return x + jnp.einsum("btf,fd->btd", h, p["down"], out_sharding=rows)


def explicit_mesh(layout):
    return mesh_for(layout, axis_types=(AxisType.Explicit,) * len(LAYOUTS[layout][1]))


def compiled_step(layout, mesh, data, model_loss):
    _, _, specs, x_spec = LAYOUTS[layout]
    _, lp, spec = lora_setup(data, mesh, specs)
    x = jax.device_put(data[3], NamedSharding(mesh, x_spec))
    y = jax.device_put(data[4], NamedSharding(mesh, x_spec))
    trainable, frozen = lorax.partition(lp, spec)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)
    t_shard, o_shard = shardings_of(trainable, mesh), shardings_of(opt_state, mesh)
    with jax.set_mesh(mesh):
        step = jax.jit(
            make_step(optimizer, model_loss=lorax.lora(model_loss, on_materialize="error")),
            in_shardings=(t_shard, shardings_of(frozen, mesh), o_shard, x.sharding, y.sharding),
            out_shardings=(NamedSharding(mesh, P()), t_shard, t_shard, o_shard),
        ).lower(trainable, frozen, opt_state, x, y).compile()
    return step, (trainable, frozen, opt_state, x, y), lp


def collective_bytes(hlo):
    itemsize = {"f32": 4, "bf16": 2, "s32": 4, "u8": 1, "pred": 1}
    return sum(n * np.prod(dims, dtype=int) * itemsize.get(dtype, 4)
               for (_, dtype, dims), n in collectives(hlo).items())


@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_training_step_under_explicit_axes_matches_single_device(layout, data, reference):
    mesh = explicit_mesh(layout)
    assert mesh.axis_types == (AxisType.Explicit,) * len(mesh.axis_names)
    model = lambda p, x, y: jnp.mean((explicit_block(p, x, layout) - y) ** 2)  # noqa: E731
    step, (trainable, frozen, opt_state, x, y), lp = compiled_step(layout, mesh, data, model)
    with jax.set_mesh(mesh):
        l1, g1, trainable, opt_state = step(trainable, frozen, opt_state, x, y)
        l2, _, trainable, _ = step(trainable, frozen, opt_state, x, y)

    assert_matches_reference((l1, l2), g1, trainable, reference)
    for n in NAMES:  # gradients and updates keep the factors' types
        for part in ("a", "b"):
            want = getattr(lp[n], part).sharding.spec
            assert getattr(g1[n], part).sharding.spec == want, (n, part)
            assert getattr(trainable[n], part).sharding.spec == want, (n, part)

    # The same layout on an Auto mesh: the compiled step moves no more bytes.
    auto, _, _ = compiled_step(layout, mesh_for(layout), data, loss)
    got, base = collective_bytes(step.as_text()), collective_bytes(auto.as_text())
    print(f"{layout}: collectives move {got:,} bytes (Auto mesh: {base:,})")
    assert got <= 1.05 * base, (got, base, collectives(step.as_text()), collectives(auto.as_text()))


def test_reshard_moves_a_lora_weight_and_its_factors_together(data):
    mesh = explicit_mesh("fsdp")
    _, _, specs, _ = LAYOUTS["fsdp"]
    _, lp, _ = lora_setup(data, mesh, specs)
    seen = {}

    def fn(w, x):
        whole = reshard(w, P(None, "data"))
        seen["w"] = whole
        return x @ whole

    with jax.set_mesh(mesh):
        x = reshard(jnp.asarray(data[3][:, 0]), P())
        out = jax.jit(lorax.lora(fn, on_materialize="error"))(lp["up"], x)
    assert_close(out, data[3][:, 0] @ np.asarray(lorax.merge_params(lp)["up"]), rtol=1e-5)
    assert out.sharding.spec == P(None, "data")


def test_mixed_auto_and_explicit_axes(data):
    """One Auto axis beside one Explicit axis: the tensor-parallel block with the data
    axis left to propagation."""
    shape, axes, specs, x_spec = LAYOUTS["tp"]
    devices = np.array(jax.devices()[:8]).reshape(shape)
    mesh = Mesh(devices, axes, axis_types=(AxisType.Auto, AxisType.Explicit))
    _, lp, spec = lora_setup(data, mesh, specs)
    x = jax.device_put(data[3], NamedSharding(mesh, x_spec))
    y = jax.device_put(data[4], NamedSharding(mesh, x_spec))

    def model(p, x, y):  # the data axis is Auto: not in any type
        return jnp.mean((explicit_block(p, x, "tp", rows=P(None, None, None)) - y) ** 2)

    with jax.set_mesh(mesh):
        value = jax.jit(lorax.lora(model, on_materialize="error"))(lp, x, y)
    dense = lorax.merge_params(lp)
    assert_close(value, loss({n: np.asarray(w) for n, w in dense.items()}, data[3], data[4]),
                 rtol=1e-5)


# -- QLoRA -------------------------------------------------------------------------------

QD, QF = 512, 1024  # 8 blocks of 64 along each kernel's input axis: FSDP over 4 splits them


def _mlp(layout):
    def fn(p, x):
        up, down = p["up"], p["down"]
        if layout == "fsdp":
            up, down = reshard(up, P()), reshard(down, P())
        h = jax.nn.gelu(x @ up)
        return jnp.mean(jnp.matmul(h, down, out_sharding=P("data", None, None)) ** 2)
    return fn


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_qlora_under_explicit_axes_dequantizes_where_the_codes_lie(layout):
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes: make_mesh's default
    specs = ({"up": P("data", None), "down": P("data", None)} if layout == "fsdp" else
             {"up": P(None, "model"), "down": P("model", None)})
    rng = np.random.default_rng(1)
    w = {"up": rng.standard_normal((QD, QF)) / np.sqrt(QD),
         "down": rng.standard_normal((QF, QD)) / np.sqrt(QF)}
    x_np = rng.standard_normal((8, 16, QD)).astype(np.float32)
    with jax.set_mesh(mesh):
        params = {n: reshard(jnp.asarray(v, jnp.float32), specs[n]) for n, v in w.items()}
        qp = lorax.quantize(params, {"up": K, "down": K}, "nf4")
        for n in params:  # codes and scales typed with the weight's layout
            codes_spec, scales_spec = qp[n].leaf_specs(specs[n])[:2]
            assert jax.typeof(qp[n].codes).sharding.spec == codes_spec
            assert jax.typeof(qp[n].scales).sharding.spec == scales_spec
        dense = {n: jax.jit(lambda q: q.dequantize())(q) for n, q in qp.items()}
        for n in params:
            assert dense[n].sharding.spec == specs[n]
        spec = {"up": K, "down": K}
        lp = lorax.init_lora(qp, spec, jax.random.PRNGKey(0))
        lp = {n: lorax.LoraWeight(lw.w, a=lw.a, b=reshard(jnp.asarray(
            0.1 * rng.standard_normal(lw.b.shape), jnp.float32), jax.typeof(lw.b).sharding.spec),
            alpha=lw.alpha) for n, lw in lp.items()}
        x = reshard(jnp.asarray(x_np), P("data", None, None))
        trainable, frozen = lorax.partition(lp, spec)
        fn = lorax.lora(_mlp(layout), on_materialize="error")
        step = jax.jit(jax.value_and_grad(lambda t, f, x: fn(lorax.combine(t, f), x)))
        compiled = step.lower(trainable, frozen, x).compile()
        value, grads = compiled(trainable, frozen, x)
        for n in params:
            assert grads[n].a.sharding.spec == lp[n].a.sharding.spec
            assert grads[n].b.sharding.spec == lp[n].b.sharding.spec

    # The same program, one device, on the dequantized weights with the factors merged.
    host = {n: lorax.LoraWeight(np.asarray(dense[n]), a=np.asarray(lw.a), b=np.asarray(lw.b),
                                alpha=lw.alpha) for n, lw in lp.items()}
    t_ref, f_ref = lorax.partition(host, spec)
    plain = lambda p, x: jnp.mean((jax.nn.gelu(x @ p["up"]) @ p["down"]) ** 2)  # noqa: E731
    ref_value, ref_grads = jax.value_and_grad(
        lambda t, f: lorax.lora(plain)(lorax.combine(t, f), x_np))(t_ref, f_ref)
    assert_close(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(got, want, rtol=1e-5, atol=1e-7)
    # No dense weight crosses devices: FSDP gathers the codes, TP moves none of them.
    weight = {(QD, QF), (QF, QD)}
    weight |= {s.sharding.shard_shape(s.shape) for s in dense.values()}
    moved = [(kind, dt, dims) for kind, dt, dims in collectives(compiled.as_text())
             if dt.startswith(("f", "bf")) and dims in weight]
    assert not moved, moved


# -- the other rules and the parameter lifecycle ------------------------------------------


@pytest.fixture(scope="module")
def typed_params():
    """A column-parallel kernel, an embedding table split along its features and a
    convolution split along its output channels, on an Explicit mesh, with LoRA factors."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(2)
    shapes = {"up": ((64, 128), P(None, "model")), "emb": ((100, 64), P(None, "model")),
              "conv": ((3, 3, 8, 16), P(None, None, None, "model"))}
    with jax.set_mesh(mesh):
        params = {n: reshard(jnp.asarray(rng.standard_normal(s), jnp.float32), p)
                  for n, (s, p) in shapes.items()}
        spec = dict.fromkeys(params, 4)
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
        lp = {n: lorax.LoraWeight(lw.w, a=lw.a, b=reshard(jnp.asarray(
            0.1 * rng.standard_normal(lw.b.shape), jnp.float32), jax.typeof(lw.b).sharding.spec),
            alpha=lw.alpha) for n, lw in lp.items()}
    return mesh, params, lp, spec, rng


def test_quantize_under_explicit_axes_names_a_layout_that_splits_a_block():
    mesh = jax.make_mesh((8,), ("tp",))
    with jax.set_mesh(mesh):
        w = reshard(jnp.ones((64, 32), jnp.float32), P("tp", None))  # 8 inputs a device
        q = lorax.quantize({"o": w}, {"o": K}, "nf4", block_size=8)["o"]
        assert jax.typeof(q.codes).sharding.spec == q.leaf_specs(P("tp", None))[0]
        with pytest.raises(ValueError, match=r"'o'.*4 blocks of 16\) 8 ways.*divides 8"):
            lorax.quantize({"o": w}, {"o": K}, "nf4", block_size=16)


def test_gather_and_conv_under_explicit_axes(typed_params):
    """An embedding lookup and a convolution written for Explicit axes (their results'
    `out_sharding` stated, as JAX asks there) give the merged weights' values, typed as
    asked."""
    mesh, _, lp, _, rng = typed_params
    merged = lorax.merge_params(lp)
    rows, chans = P("data", None, "model"), P("data", None, None, "model")
    lookup = lambda p, t: p["emb"].at[t].get(out_sharding=rows)  # noqa: E731
    conv = lambda p, x: jax.lax.conv_general_dilated(  # noqa: E731
        x, p["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        out_sharding=chans)
    with jax.set_mesh(mesh):
        tokens = reshard(jnp.asarray(rng.integers(0, 100, (8, 16))), P("data", None))
        images = reshard(jnp.asarray(rng.standard_normal((8, 10, 10, 8)), jnp.float32), P("data"))
        for fn, x, spec in ((lookup, tokens, rows), (conv, images, chans)):
            got = jax.jit(lorax.lora(fn, on_materialize="error"))(lp, x)
            assert got.sharding.spec == spec
            assert_close(got, jax.jit(fn)(merged, x), rtol=1e-5)


def test_lifecycle_on_an_explicitly_typed_tree(typed_params, tmp_path):
    """partition / combine, merge_params, save_adapter / load_adapter and the PEFT writer
    on factors typed on an Explicit mesh: each keeps or restores the types."""
    mesh, params, lp, spec, _ = typed_params
    trainable, frozen = lorax.partition(lp, spec)
    again = lorax.combine(trainable, frozen)
    merged = lorax.merge_params(again)
    for n, w in params.items():
        assert jax.typeof(merged[n]).sharding.spec == jax.typeof(w).sharding.spec
        assert_close(merged[n], np.asarray(w) + np.asarray(lp[n].b) @ np.asarray(lp[n].a)
                     * lp[n].scale, rtol=1e-5)
    lorax.save_adapter(tmp_path / "adapter.safetensors", lp, spec)
    loaded, _ = lorax.load_adapter(tmp_path / "adapter.safetensors", params)
    for n in params:
        for part in ("a", "b"):
            want = getattr(lp[n], part)
            got = getattr(loaded[n], part)
            assert jax.typeof(got).sharding.spec == jax.typeof(want).sharding.spec, (n, part)
            assert_close(got, want)
    lorax.save_peft(tmp_path / "peft", {"up": lp["up"]}, module_name=lambda p, i=None: p,
                    layout="in_out")
    from safetensors.numpy import load_file
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert_close(tensors["base_model.model.up.lora_B.weight"], np.asarray(lp["up"].a).T)


def test_ragged_dot_under_explicit_axes():
    """MoE experts (`lax.ragged_dot`, its result's sharding stated as Explicit axes ask):
    the merged weights' values, typed as asked. Gradients stop in JAX itself there (its
    transpose of `ragged_dot_general` infers no sharding: the dense model's too), which
    this test notices the day JAX lifts it."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(3)
    e, d, f, t = 4, 32, 64, 24
    out = P(None, "model")
    fn = lambda p, x, g: jax.lax.ragged_dot(x, p["experts"], g, out_sharding=out)  # noqa: E731
    with jax.set_mesh(mesh):
        w = reshard(jnp.asarray(rng.standard_normal((e, d, f)), jnp.float32), P(None, None, "model"))
        spec = {"experts": lorax.LoraSpec(rank=4, batch_ndim=1)}
        lw = lorax.init_lora({"experts": w}, spec, jax.random.PRNGKey(0))["experts"]
        lp = {"experts": lorax.LoraWeight(lw.w, a=lw.a, b=reshard(jnp.asarray(
            0.1 * rng.standard_normal(lw.b.shape), jnp.float32), jax.typeof(lw.b).sharding.spec),
            alpha=lw.alpha)}
        x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
        sizes = jnp.asarray([5, 7, 6, 6], jnp.int32)
        got = jax.jit(lorax.lora(fn, on_materialize="error"))(lp, x, sizes)
        merged = lorax.merge_params(lp)
        assert got.sharding.spec == out
        assert_close(got, jax.jit(fn)(merged, x, sizes), rtol=1e-5, atol=1e-5)
        with pytest.raises(NotImplementedError, match="ragged_dot_general"):
            jax.grad(lambda x: jnp.sum(fn(merged, x, sizes) ** 2))(x)


@pytest.mark.parametrize("qtype", [None, "nf4"])
def test_stacked_layers_under_scan_with_explicit_axes(qtype):
    """Layers stacked along a leading axis and run under `lax.scan` (the examples' Llama's
    layout), tensor-parallel: each slice is typed as its stack, so the factors'
    cotangents are, and LoRA and QLoRA give the merged weights' values and gradients."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(4)
    n, d, f = 3, 64, 128
    out = P("data", None, None)

    def fn(p, x):
        def body(h, layer):
            y = jax.nn.gelu(h @ layer["up"])
            return h + jnp.matmul(y, layer["down"], out_sharding=out), None
        return jnp.mean(jax.lax.scan(jax.checkpoint(body), x, p)[0] ** 2)

    with jax.set_mesh(mesh):
        params = {"up": reshard(jnp.asarray(rng.standard_normal((n, d, f)) / 8, jnp.float32),
                                P(None, None, "model")),
                  "down": reshard(jnp.asarray(rng.standard_normal((n, f, d)) / 11, jnp.float32),
                                  P(None, "model", None))}
        spec = {k: lorax.LoraSpec(rank=4, batch_ndim=1) for k in params}
        base = lorax.quantize(params, spec, qtype) if qtype else params
        lp = lorax.init_lora(base, spec, jax.random.PRNGKey(0))
        lp = {k: lorax.LoraWeight(lw.w, a=lw.a, b=reshard(jnp.asarray(
            0.1 * rng.standard_normal(lw.b.shape), jnp.float32), jax.typeof(lw.b).sharding.spec),
            alpha=lw.alpha) for k, lw in lp.items()}
        x = reshard(jnp.asarray(rng.standard_normal((8, 16, d)), jnp.float32), P("data", None, None))
        trainable, frozen = lorax.partition(lp, spec)
        value, grads = jax.jit(jax.value_and_grad(lambda t, x: lorax.lora(
            fn, on_materialize="error")(lorax.combine(t, frozen), x)))(trainable, x)
        dense = {k: np.asarray(lw.w.dequantize() if qtype else lw.w) for k, lw in lp.items()}
    for k in params:
        assert grads[k].a.sharding.spec == lp[k].a.sharding.spec
        assert grads[k].b.sharding.spec == lp[k].b.sharding.spec
    host = {k: lorax.LoraWeight(dense[k], a=np.asarray(lw.a), b=np.asarray(lw.b), alpha=lw.alpha)
            for k, lw in lp.items()}
    t_ref, f_ref = lorax.partition(host, spec)

    def plain(p, x):
        def body(h, layer):
            return h + jax.nn.gelu(h @ layer["up"]) @ layer["down"], None
        return jnp.mean(jax.lax.scan(body, x, p)[0] ** 2)

    ref_value, ref_grads = jax.value_and_grad(
        lambda t: lorax.lora(plain)(lorax.combine(t, f_ref), np.asarray(x)))(t_ref)
    assert_close(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(got, want, rtol=1e-5, atol=1e-7)
