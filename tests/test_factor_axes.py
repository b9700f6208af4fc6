"""Factorisations over any split of a weight's axes (`LoraWeight(..., m_axes=)`).

A Gemma attention kernel `(heads, embed, head_dim)` used as `btd,ndh->btnh` contracts
its middle axis: PEFT's `q_proj` LoRA is `ΔW[n, d, h] = Σ_k B[d, k] A[k, n, h]`, with
`M = (embed,)` and `N = (heads, head_dim)` not contiguous. Everything is checked
against an independent numpy reference of the effective weight, values and factor
gradients, with `on_materialize="error"`.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax
from conftest import assert_close
from lora_testing import put

N_HEADS, EMBED, HEAD_DIM, FFN, RANK = 4, 32, 8, 48, 3


def _np_weight(lw):
    """`w + (alpha/k) ΔW` with ΔW's axes put back where `w` has them (numpy, float64)."""
    w, b, a = (np.asarray(v, np.float64) for v in (lw.w, lw.b, lw.a))
    batch, m, n = lw.axes
    letters = iter(string.ascii_lowercase)
    ax = [next(letters) for _ in range(w.ndim)]
    k = "z"
    b_sub = "".join([ax[i] for i in batch] + [ax[i] for i in m] + [k])
    a_sub = "".join([ax[i] for i in batch] + [k] + [ax[i] for i in n])
    return w + lw.alpha / lw.rank * np.einsum(f"{b_sub},{a_sub}->{''.join(ax)}", b, a)


def _random(seed, shape, scale=1.0):
    return put(scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _q_kernel(seed=0, batch=(), scale=1.0):
    w = _random(seed, (*batch, N_HEADS, EMBED, HEAD_DIM), scale)
    b = _random(seed + 1, (*batch, EMBED, RANK), 0.5 * scale)
    a = _random(seed + 2, (*batch, RANK, N_HEADS, HEAD_DIM), 0.5)
    return lorax.LoraWeight(w, a, b, alpha=2.0, m_axes=(-2,))


# -- the value type ----------------------------------------------------------------


def test_m_axes_are_stored_from_the_end_and_contiguous_ones_as_default():
    lw = _q_kernel()
    assert lw.m_axes == (-2,) and lw.axes == (((), (1,), (0, 2)))
    assert not lw.contiguous
    same = lorax.LoraWeight(lw.w, lw.a, lw.b, alpha=2.0, m_axes=(1,))
    assert jax.tree.structure(same) == jax.tree.structure(lw)
    # Contiguous M axes are lorax 0.3's layout, stored as such (same pytree as before).
    w = jnp.zeros((6, 5))
    plain = lorax.LoraWeight(w, jnp.zeros((2, 5)), jnp.zeros((6, 2)))
    given = lorax.LoraWeight(w, jnp.zeros((2, 5)), jnp.zeros((6, 2)), m_axes=(0,))
    assert given.m_axes is None and jax.tree.structure(given) == jax.tree.structure(plain)
    assert "m_axes=(1,)" in repr(lw)


@pytest.mark.parametrize("m_axes, b_shape, a_shape, match", [
    ((1,), (4, RANK), (RANK, N_HEADS, HEAD_DIM), "do not fit"),  # b has the heads axis's size
    ((0, 1, 2), (N_HEADS, EMBED, HEAD_DIM, RANK), (RANK,), "m_axes must be"),
    ((1, 1), (EMBED, RANK), (RANK, N_HEADS, HEAD_DIM), "m_axes must be"),
    ((5,), (EMBED, RANK), (RANK, N_HEADS, HEAD_DIM), "m_axes must be"),
])
def test_factors_that_do_not_fit_the_axes_are_refused(m_axes, b_shape, a_shape, match):
    w = jnp.zeros((N_HEADS, EMBED, HEAD_DIM))
    with pytest.raises(ValueError, match=match):
        lorax.LoraWeight(w, jnp.zeros(a_shape), jnp.zeros(b_shape), m_axes=m_axes)


def test_materialize_puts_each_axis_back():
    lw = _q_kernel()
    assert_close(lw.materialize(), _np_weight(lw))
    stacked = _q_kernel(batch=(3,))
    assert stacked.axes == ((0,), (2,), (1, 3))
    assert_close(stacked.materialize(), _np_weight(stacked))


# -- rules ------------------------------------------------------------------------


def _check(fn, lw, *args):
    """Values and factor gradients of `lora(fn)` equal the reference's (rtol 1e-5)."""
    run = lorax.lora(fn, on_materialize="error")
    assert_close(jax.jit(run)(lw, *args), fn(jnp.asarray(_np_weight(lw), jnp.float32), *args),
                 rtol=1e-5)

    def loss(a, b, use_lora):
        l2 = lorax.LoraWeight(lw.w, a, b, alpha=lw.alpha, m_axes=lw.m_axes)
        out = run(l2, *args) if use_lora else fn(l2.materialize(), *args)
        return jnp.sum(jnp.sin(out))

    got = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(lw.a, lw.b, True)
    want = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(lw.a, lw.b, False)
    for g, w_ in zip(got, want):
        assert_close(g, w_, rtol=1e-5)


X = _random(10, (2, 5, EMBED))


@pytest.mark.parametrize("equation", [
    "btd,ndh->btnh",       # Gemma's q/k/v einsum
    "ndh,btd->btnh",       # weight first
    "btd,ndh->bnth",       # another output order
])
def test_dot_general_with_any_dimension_numbers(equation):
    _check(lambda w, x: jnp.einsum(equation, x, w) if equation.startswith("b")
           else jnp.einsum(equation, w, x), _q_kernel(), X)


def test_attention_output_uses_the_same_kernel_contracting_heads():
    # The weight used the other way round (contracting its N axes): x meets `a` first.
    h = _random(11, (2, 5, N_HEADS, HEAD_DIM))
    _check(lambda w, h: jnp.einsum("btnh,ndh->btd", h, w), _q_kernel(), h)


@pytest.mark.parametrize("permutation", [(1, 0, 2), (0, 2, 1), (2, 1, 0), (1, 2, 0)])
def test_transpose_keeps_the_factorisation(permutation):
    inverse = np.argsort(permutation)
    spec = "ndh"
    moved = "".join(spec[i] for i in permutation)
    _check(lambda w, x: jnp.einsum(f"btd,{moved}->btnh", x, jnp.transpose(w, permutation)),
           _q_kernel(), X)
    assert list(inverse)  # (the einsum above is the reference's own check of the layout)


def test_slices_of_heads_and_of_the_input_axis():
    _check(lambda w, x: jnp.einsum("btd,ndh->btnh", x[..., 4:20], w[1:3, 4:20]), _q_kernel(), X)
    _check(lambda w, x: jnp.einsum(
        "btd,ndh->btnh", x, jax.lax.dynamic_slice_in_dim(w, 1, 2, axis=0)), _q_kernel(), X)


def test_scan_over_stacked_layers_and_picked_layers():
    stacked = _q_kernel(batch=(3,), scale=0.1)  # well conditioned through 3 layers

    def scanned(w, x):
        def layer(h, wl):
            q = jnp.einsum("btd,ndh->btnh", h, wl)
            return h + jnp.einsum("btnh,ndh->btd", jnp.tanh(q), wl), None
        return jax.lax.scan(layer, x, w)[0]

    _check(scanned, stacked, X)
    _check(lambda w, x: jnp.einsum("btd,ndh->btnh", x, w[1]), stacked, X)


def test_quantized_base():
    lw = _q_kernel()
    q = lorax.QuantizedArray.from_dense(lw.w, "int8", axis=-2)
    qlw = lorax.LoraWeight(q, lw.a, lw.b, alpha=lw.alpha, m_axes=lw.m_axes)
    ref = lorax.LoraWeight(q.dequantize(), lw.a, lw.b, alpha=lw.alpha, m_axes=lw.m_axes)
    f = lambda w, x: jnp.einsum("btd,ndh->btnh", x, w)  # noqa: E731
    assert_close(lorax.lora(f, on_materialize="error")(qlw, X), f(ref.materialize(), X), rtol=1e-5)


def test_dora_magnitude_per_output_feature():
    lw = _q_kernel()
    dw = lorax.DoraWeight.from_lora(lw)
    assert dw.m.shape == (N_HEADS, 1, HEAD_DIM)  # the output features: heads x head_dim
    v = _np_weight(lw)
    assert_close(dw.m, np.sqrt((v * v).sum(axis=1, keepdims=True)), rtol=1e-5)
    m = dw.m * (1.0 + 0.1 * _random(20, dw.m.shape))
    dw = lorax.DoraWeight(lw.w, lw.a, lw.b, m, alpha=lw.alpha, m_axes=lw.m_axes)
    f = lambda w, x: jnp.einsum("btd,ndh->btnh", x, w)  # noqa: E731
    want = f(dw.materialize(), X)
    assert_close(lorax.lora(f, on_materialize="error")(dw, X), want, rtol=1e-5)
    ref = v * np.asarray(m) / np.sqrt((v * v).sum(axis=1, keepdims=True))
    assert_close(want, f(jnp.asarray(ref, jnp.float32), X), rtol=1e-5)


def test_sharding_constraint_shards_each_factor_like_its_axes():
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = jax.sharding.PartitionSpec("x", "y", None)  # heads over x, embed over y
    lw = _q_kernel()

    def f(w, x):
        w = jax.lax.with_sharding_constraint(w, jax.sharding.NamedSharding(mesh, spec))
        return jnp.einsum("btd,ndh->btnh", x, w)

    _check(f, lw, X)
    a_spec, b_spec = lorax._sharding.factor_specs(spec, 3, 0, lw.axes.m)
    assert b_spec == jax.sharding.PartitionSpec("y", None)           # b: (embed, k)
    assert a_spec == jax.sharding.PartitionSpec(None, "x", None)     # a: (k, heads, head_dim)


# -- lifecycle and formats ---------------------------------------------------------------


def _gemma_block(p, x):
    """A Gemma-style attention + gated FFN in plain JAX (gemma library layouts)."""
    q = jnp.einsum("btd,ndh->btnh", x, p["q_einsum"])
    k, v = (jnp.einsum("btd,ndh->btnh", x, w) for w in (p["kv_einsum"][0], p["kv_einsum"][1]))
    att = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / HEAD_DIM ** 0.5)
    o = jnp.einsum("bnts,bsnh->btnh", att, v)
    x = x + jnp.einsum("btnh,nhd->btd", o, p["attn_vec_einsum"])
    gate = jnp.dot(x, p["gating_einsum"][0])
    up = jnp.dot(x, p["gating_einsum"][1])
    return x + jnp.dot(jax.nn.gelu(gate) * up, p["linear"])


def _gemma_params():
    return {
        "q_einsum": _random(30, (N_HEADS, EMBED, HEAD_DIM), 0.2),
        "kv_einsum": _random(31, (2, N_HEADS, EMBED, HEAD_DIM), 0.2),
        "attn_vec_einsum": _random(32, (N_HEADS, HEAD_DIM, EMBED), 0.2),
        "gating_einsum": _random(33, (2, EMBED, FFN), 0.2),
        "linear": _random(34, (FFN, EMBED), 0.2),
    }


def _nudged(lp):
    return jax.tree.map(
        lambda l: lorax.LoraWeight(l.w, l.a * 5.0, l.b + 0.3, alpha=l.alpha, m_axes=l.m_axes)
        if isinstance(l, lorax.LoraWeight) else l, lp, is_leaf=lambda l: isinstance(l, lorax.LoraWeight))


def test_infer_layout_finds_pefts_factorisation_for_gemma_kernels():
    params = _gemma_params()
    spec = lorax.infer_layout(_gemma_block, params, jax.tree.map(lambda _: 4, params), X)
    assert spec["q_einsum"].m_axes == (1,) and spec["q_einsum"].batch_ndim == 0
    # k and v are picked from their stack: one factorisation each, per slice.
    assert spec["kv_einsum"].batch_ndim == 1 and spec["kv_einsum"].m_axes == (2,)
    assert spec["attn_vec_einsum"].m_axes is None and spec["attn_vec_einsum"].m_ndim == 2
    # The fused gate/up pair: separate factors per slice, as PEFT's gate_proj and up_proj.
    assert spec["gating_einsum"].batch_ndim == 1 and spec["gating_einsum"].m_axes is None
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    assert lp["q_einsum"].b.shape == (EMBED, 4)
    assert lp["q_einsum"].a.shape == (4, N_HEADS, HEAD_DIM)
    assert lp["gating_einsum"].b.shape == (2, EMBED, 4)
    lp = _nudged(lp)
    got = lorax.lora(_gemma_block, on_materialize="error")(lp, X)
    assert_close(got, _gemma_block(lorax.merge_params(lp), X), rtol=1e-5)
    ref = {k: jnp.asarray(_np_weight(v), jnp.float32) for k, v in lp.items()}
    assert_close(got, _gemma_block(ref, X), rtol=1e-5)
    assert lorax.summary(params, spec).trainable == sum(
        v.a.size + v.b.size for v in lp.values())


def test_adapter_file_round_trip(tmp_path):
    params = _gemma_params()
    spec = lorax.infer_layout(_gemma_block, params, jax.tree.map(lambda _: 4, params), X)
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
    lorax.save_adapter(tmp_path / "a.safetensors", lp, spec)
    back, back_spec = lorax.load_adapter(tmp_path / "a.safetensors", params)
    assert back["q_einsum"].m_axes == lp["q_einsum"].m_axes
    assert back_spec["q_einsum"].m_axes == (1,)
    for k in lp:
        np.testing.assert_array_equal(back[k].materialize(), lp[k].materialize())


def test_peft_export_is_torch_q_proj_and_loads_back(tmp_path):
    params = _gemma_params()
    spec = lorax.infer_layout(_gemma_block, params, jax.tree.map(lambda _: 4, params), X)
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
    q = {"q_einsum": lp["q_einsum"]}
    lorax.save_peft(tmp_path, q, base_model_name_or_path="google/gemma-3-270m",
                    module_name={"q_einsum": "model.layers.0.self_attn.q_proj"}, layout="in_out")
    from safetensors.numpy import load_file
    t = load_file(tmp_path / "adapter_model.safetensors")
    lora_a = t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    lora_b = t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert lora_a.shape == (4, EMBED) and lora_b.shape == (N_HEADS * HEAD_DIM, 4)
    # torch's q_proj weight is (heads * head_dim, embed): its update, viewed as lorax's
    # (heads, embed, head_dim) kernel, is lorax's own.
    lw = lp["q_einsum"]
    torch_delta = (lw.alpha / lw.rank) * (lora_b @ lora_a)
    as_kernel = torch_delta.reshape(N_HEADS, HEAD_DIM, EMBED).transpose(0, 2, 1)
    assert_close(as_kernel, _np_weight(lw) - np.asarray(lw.w, np.float64), rtol=1e-5)
    # And back, onto a LoRA tree with that factorisation.
    fresh = lorax.init_lora({"q_einsum": params["q_einsum"]}, {"q_einsum": spec["q_einsum"]},
                            jax.random.PRNGKey(5))
    back, back_spec = lorax.load_peft(tmp_path, fresh,
                                      module_name={"q_einsum": "model.layers.0.self_attn.q_proj"},
                                      layout="in_out")
    assert back_spec["q_einsum"].m_axes == (1,)
    assert_close(back["q_einsum"].materialize(), lw.materialize(), rtol=1e-5)


def test_explicit_per_slice_factors_for_an_einsum_gate_up_stack():
    # Upstream gemma's (2, ffn, embed) gating weight used as one einsum: infer_layout cannot
    # tell the pair from heads, so PEFT's separate gate/up factors are a LoraSpec away.
    w = _random(40, (2, FFN, EMBED), 0.2)
    f = lambda w, x: jnp.einsum("btd,nfd->btnf", x, w)  # noqa: E731
    inferred = lorax.infer_layout(lambda p, x: f(p["w"], x), {"w": w}, {"w": 2}, X)["w"]
    assert inferred.batch_ndim == 0  # one shared factorisation (a kept leading axis)
    lp = _nudged(lorax.init_lora({"w": w}, {"w": lorax.LoraSpec(2, batch_ndim=1, m_ndim=1)},
                                 jax.random.PRNGKey(0)))
    assert lp["w"].b.shape == (2, FFN, 2) and lp["w"].a.shape == (2, 2, EMBED)
    _check(f, lp["w"], X)


def test_non_contiguous_rules_without_a_low_rank_form_fall_back_with_a_reason():
    lw = _q_kernel()
    f = lambda w, x: jnp.einsum("btd,dm->btm", x, w.reshape(N_HEADS, -1).T.reshape(EMBED, -1))  # noqa: E731
    with pytest.raises(lorax.LoraMaterializationError, match="not two contiguous groups"):
        lorax.lora(lambda w, x: x @ jnp.reshape(w, (EMBED * N_HEADS, HEAD_DIM))[:EMBED],
                   on_materialize="error")(lw, X)
    assert f is not None


def test_init_lora_places_factors_by_the_weights_sharding():
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = jax.sharding.PartitionSpec("x", "y", None)
    w = jax.device_put(_random(50, (N_HEADS, EMBED, HEAD_DIM)),
                       jax.sharding.NamedSharding(mesh, spec))
    lw = lorax.init_lora({"q": w}, {"q": lorax.LoraSpec(2, batch_ndim=0, m_axes=(1,))},
                         jax.random.PRNGKey(0))["q"]
    assert lw.m_axes == (-2,)
    assert lw.b.sharding.spec == jax.sharding.PartitionSpec("y", None)
    assert lw.a.sharding.spec == jax.sharding.PartitionSpec(None, "x", None)
