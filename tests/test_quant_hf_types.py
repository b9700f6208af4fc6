"""The Hugging Face checkpoints' types as `QuantizedArray`s (bitsandbytes NF4 / FP4 with its
dynamic double quantization, LLM.int8, FP8 e4m3, 4-bit with zero points): their values,
and QLoRA through the dot, gather, scan and slice rules with the dense reference's values
and gradients, nothing dense formed (`on_materialize="error"`).

The bit-for-bit agreement with the libraries that write these formats is in
tests/formats/test_safetensors_read.py (on files those libraries wrote)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lorax
from lorax._quant import _formats as F
from tests.conftest import assert_close

HF = ["bnb_nf4", "bnb_fp4", "bnb_int8", "fp8_e4m3", "int4_zp"]
DOUBLE = ["bnb_nf4", "bnb_fp4"]


def _w(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape) / shape[-2] ** 0.5


def _q(qtype, shape=(256, 96), double=False, seed=0, **kw):
    return lorax.QuantizedArray.from_dense(_w(shape, seed), qtype, double_quant=double, **kw)


def _bits_equal(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_code_books_are_bitsandbytes_own():
    # FP4: bit patterns 0..7 are 0, 0.0625, 8, 12, 4, 6, 2, 3 (divided by 12), then negated.
    assert F.FP4_CODE.tolist()[:8] == [0.0, np.float32(0.0625 / 12), np.float32(8 / 12), 1.0,
                                       np.float32(4 / 12), 0.5, np.float32(2 / 12), 0.25]
    assert not np.signbit(F.FP4_CODE[8])  # +0: bitsandbytes writes it as the integer -0
    dyn = F.BNB_DYNAMIC_CODE
    assert dyn.shape == (256,) and (np.diff(dyn) >= 0).all() and dyn[-1] == 1.0
    assert (dyn == 0).sum() == 1 and -1 < dyn[0] < -0.99  # 254 generated values, 0 and 1


@pytest.mark.parametrize("qtype", HF)
def test_round_trip_is_close_and_the_codes_are_what_the_format_stores(qtype):
    w = _w((256, 96))
    q = lorax.QuantizedArray.from_dense(w, qtype)
    fmt = F.FORMATS[qtype]
    assert q.codes.dtype == fmt.code_dtype and (q.mins is not None) == fmt.has_mins
    err = float(jnp.abs(q.dequantize() - w).max() / jnp.abs(w).max())
    assert err < {"bnb_int8": 0.01, "fp8_e4m3": 0.07}.get(qtype, 0.2), err


def test_zero_points_are_exact_for_zero_and_hold_the_format_s_formula():
    w = _w((128, 64)).at[:, 5].set(0.0)
    q = lorax.QuantizedArray.from_dense(w, "int4_zp", block_size=32)
    assert (q.dequantize()[:, 5] == 0).all()
    codes = np.asarray(F.unpack(q.format, q.codes))  # (64, 4, 32), block axis last
    want = (codes - np.asarray(q.mins, np.float32)[..., None]) * np.asarray(q.scales, np.float32)[..., None]
    assert _bits_equal(q.dequantize(jnp.float32), np.moveaxis(want.reshape(64, 128), -1, 0))


def test_bnb_int8_rounds_twice_as_bitsandbytes_does():
    q = _q("bnb_int8")
    c, s = np.asarray(q.codes, np.float32), np.asarray(q.scales)
    want = (c * s[..., None]) * np.float32(7.874015718698502e-3)  # not c * (s / 127)
    assert _bits_equal(q.dequantize(jnp.float32), want.reshape(96, 256).T)


@pytest.mark.parametrize("qtype", DOUBLE)
def test_double_quantization_uses_the_dynamic_map(qtype):
    plain, dq = _q(qtype), _q(qtype, double=True)
    assert dq.scales.dtype == jnp.uint8 and dq.nbytes < plain.nbytes
    scales = F.double_dequantize(dq.format, dq.scales, dq.scale_scales, dq.scale_offset)
    flat = np.asarray(dq.scales).reshape(-1)
    groups = np.repeat(np.asarray(dq.scale_scales), 256)[: flat.size]
    want = F.BNB_DYNAMIC_CODE[flat] * groups + np.asarray(dq.scale_offset)
    assert _bits_equal(scales, want.reshape(dq.scales.shape))
    assert_close(dq.dequantize(), plain.dequantize(), rtol=0.05, atol=0.02)


def test_dequantize_in_float32_is_the_exact_value_of_a_bf16_weight():
    q = lorax.QuantizedArray.from_dense(_w((128, 64)).astype(jnp.bfloat16), "fp8_e4m3")
    exact = q.dequantize(jnp.float32)
    assert q.dequantize().dtype == jnp.bfloat16
    assert _bits_equal(q.dequantize(), exact.astype(jnp.bfloat16))
    assert not _bits_equal(exact, exact.astype(jnp.bfloat16))  # f32 is not bf16 widened


def _lora(q, rank=4, seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    out_k, in_k = q.shape[-1], q.shape[-2]
    return lorax.LoraWeight(q, a=jax.random.normal(k1, (*q.shape[:-2], rank, out_k)) * 0.1,
                            b=jax.random.normal(k2, (*q.shape[:-2], in_k, rank)) * 0.1, alpha=2.0)


def _dense(lw):
    return dataclasses.replace(lw, w=lw.w.dequantize())


@pytest.mark.parametrize("qtype", HF + ["bnb_nf4+dq"])
def test_qlora_step_matches_the_dequantized_base(qtype):
    qt, double = qtype.split("+")[0], qtype.endswith("+dq")
    lw = _lora(_q(qt, (256, 96), double))
    x = jax.random.normal(jax.random.PRNGKey(2), (8, 256))

    def loss(lw, x):
        return jnp.sum(jnp.tanh(x @ lw) ** 2)

    _same_step(loss, lw, _dense(lw), 4, x)


def _same_step(loss, params, dense, spec, *args):
    """Values and factor gradients of `loss` on `params` and on the dense `dense`."""
    def step(p):
        t, f = lorax.partition(p, spec)
        fn = jax.value_and_grad(lambda t: lorax.lora(loss, on_materialize="error")(
            lorax.combine(t, f), *args))
        return jax.jit(fn)(t)

    (v, g), (v_d, g_d) = step(params), step(dense)
    assert_close(v, v_d)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_d), strict=True):
        assert_close(x, y)


@pytest.mark.parametrize("qtype", HF)
def test_scanned_layers_and_an_embedding_lookup_stay_quantized(qtype):
    stack = _lora(lorax.QuantizedArray.from_dense(_w((3, 128, 128)), qtype))
    table = lorax.QuantizedArray.from_dense(_w((64, 128), 3), qtype, axis=-1)
    ids = jnp.array([[1, 5, 63], [0, 2, 7]])

    def model(stack, table, ids):
        h = table[ids]
        h, _ = lax.scan(lambda h, lw: (jnp.tanh(h @ lw), None), h, stack)
        return jnp.sum(h**2)

    _same_step(lambda p, ids: model(p["stack"], p["table"], ids),
               {"stack": stack, "table": table},
               {"stack": _dense(stack), "table": table.dequantize()},
               {"stack": 4, "table": lorax.LORA_FREEZE}, ids)


@pytest.mark.parametrize("qtype", HF)
def test_slices_and_transposes_stay_quantized_with_the_values(qtype):
    q = _q(qtype, (256, 96))
    w = q.dequantize()
    x1, x2 = jnp.linspace(-1, 1, 128), jnp.linspace(-1, 1, 256)
    f = lorax.lora(lambda q: (q[64:192].T @ x1, x2 @ q[:, 10:20]), on_materialize="error")
    got, want = f(q), (w[64:192].T @ x1, x2 @ w[:, 10:20])
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


@pytest.mark.parametrize("qtype", ["bnb_nf4", "fp8_e4m3", "int4_zp", "bnb_int8"])
def test_merge_params_requantizes_to_the_same_type(qtype):
    lw = _lora(_q(qtype))
    merged = lorax.merge_params({"w": lw}, requantize=True)["w"]
    assert merged.qtype == qtype and merged.shape == lw.shape
    dense = lorax.merge_params({"w": _dense(lw)})["w"]
    assert_close(merged.dequantize(), dense, rtol=0.2, atol=0.05)


def _row_ordered(seed=0):
    """An act-order weight: rows of one group far apart, stored sorted by group."""
    from lorax._quant._permuted import RowOrdered

    q = lorax.QuantizedArray.from_dense(_w((128, 48), seed), "int4_zp", block_size=32)
    perm = np.random.default_rng(seed).permutation(128).astype(np.int32)
    return RowOrdered(q, jnp.asarray(perm), jnp.asarray(np.argsort(perm).astype(np.int32)), -2)


def test_row_ordered_products_reorder_the_activation_not_the_weight():
    w = _row_ordered()
    dense = w.dequantize()
    assert _bits_equal(dense, np.asarray(w.inner.dequantize())[np.asarray(w.perm)])
    x, z = _w((5, 128), 1), _w((48, 7), 2)
    f = lorax.lora(lambda w, x, z: (x @ w, w.T @ x.T, w @ z, jnp.einsum("ki,bk->ib", w, x)),
                   on_materialize="error")
    got = f(w, x, z)
    for g, want in zip(got, (x @ dense, (x @ dense).T, dense @ z, (x @ dense).T)):
        assert_close(g, want)


def test_row_ordered_trains_and_merges_as_its_dense_value():
    w = _row_ordered(3)
    lw = _lora(w)
    x = _w((6, 128), 4)
    _same_step(lambda lw, x: jnp.sum(jnp.tanh(x @ lw) ** 2), lw, _dense(lw), 4, x)
    merged = lorax.merge_params({"w": lw})["w"]
    assert_close(merged, lorax.merge_params({"w": _dense(lw)})["w"])
    requantized = lorax.merge_params({"w": lw}, requantize=True)["w"]
    assert requantized.qtype == "int4_zp" and requantized.shape == w.shape
    assert_close(requantized.dequantize(), merged, rtol=0.2, atol=0.05)
