"""GGUF's Q5 and K-quant blocks as `QuantizedArray`s: bytes as on disk, dequantized bit for
bit as gguf-py does, Q5 quantized as gguf-py does, and QLoRA on them through the dot,
gather and scan rules with the dense reference's values and gradients."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lorax
from lorax._quant import _formats as F
from tests.conftest import assert_close
from lora_testing import gguf_blocks

gguf = pytest.importorskip("gguf")

NEW = ["q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
GGUF_ALL = [n for n, f in F.FORMATS.items() if f.record is not None]


def _gtype(qtype):
    return gguf.GGMLQuantizationType[qtype.upper()]


def _bits_equal(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", GGUF_ALL)
def test_random_blocks_dequantize_bit_for_bit_like_gguf(qtype):
    data = gguf_blocks(qtype, (2, 6, 512), seed=GGUF_ALL.index(qtype))
    ref = gguf.quants.dequantize(data, _gtype(qtype))
    q = lorax.QuantizedArray.from_gguf(data, qtype, transpose=False)
    assert q.shape == ref.shape and q.nbytes == data.nbytes
    assert _bits_equal(q.dequantize(), ref)
    assert _bits_equal(jax.jit(lambda q: q.dequantize())(q), ref)
    t = lorax.QuantizedArray.from_gguf(data, qtype)  # (2, 512, 6): the (in, out) kernels
    assert t.shape == (2, 512, 6) and _bits_equal(t.dequantize(), np.swapaxes(ref, -1, -2))


def test_the_check_can_fail():
    """Negative control: one flipped code bit changes gguf-py's values, and ours with it."""
    data = gguf_blocks("q4_k", (4, 256), seed=1)
    flipped = data.copy()
    flipped[2, 100] ^= 0x10
    ours = lorax.QuantizedArray.from_gguf(flipped, "q4_k", transpose=False).dequantize()
    assert not _bits_equal(ours, gguf.quants.dequantize(data, _gtype("q4_k")))
    assert _bits_equal(ours, gguf.quants.dequantize(flipped, _gtype("q4_k")))


@pytest.mark.parametrize("qtype", ["q5_0", "q5_1"])
def test_q5_quantize_writes_gguf_s_blocks(qtype):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((48, 128)) * np.logspace(-3, 2, 48)[:, None]).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = 0.75  # a constant one
    w[2, 32:64] = -w[2, 32:64]
    ref = gguf.quants.quantize(w, _gtype(qtype))
    ours = lorax.QuantizedArray.from_dense(jnp.asarray(w), qtype, axis=-1)
    wrapped = lorax.QuantizedArray.from_gguf(ref, qtype, transpose=False)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(wrapped), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _bits_equal(ours.dequantize(), gguf.quants.dequantize(ref, _gtype(qtype)))
    # Through `lorax.quantize` (an (in, out) kernel, blocks along in): the same blocks.
    q = lorax.quantize({"w": jnp.asarray(w.T)}, {"w": 4}, qtype)["w"]
    assert q.qtype == qtype and _bits_equal(q.dequantize(), gguf.quants.dequantize(ref, _gtype(qtype)).T)


@pytest.mark.parametrize("qtype,ratio", [("q4_k", 0.141), ("q5_0", 0.172), ("q5_k", 0.172),
                                         ("q6_k", 0.205), ("q5_1", 0.188), ("q3_k", 0.107),
                                         ("q2_k", 0.082)])
def test_bytes_per_float32_are_the_formats_bits_per_weight(qtype, ratio):
    q = lorax.QuantizedArray.from_gguf(gguf_blocks(qtype, (64, 1024)), qtype)
    assert round(q.nbytes / (q.size * 4), 3) == ratio
    assert q.nbytes == 64 * 1024 // F.FORMATS[qtype].block_size * F.FORMATS[qtype].record.size


def test_k_quants_have_no_quantizer_and_say_so():
    params = {"w": jnp.ones((256, 64))}
    with pytest.raises(ValueError, match=r"no q4_k quantizer.*load_gguf.*q5_0, q5_1"):
        lorax.quantize(params, {"w": lorax.LORA_FREEZE}, "q4_k")
    with pytest.raises(ValueError, match=r"no q6_k quantizer"):
        lorax.QuantizedArray.from_dense(params["w"], "q6_k")
    with pytest.raises(ValueError, match=r"'nf4' is not a GGUF block type \(q4_0, .*q6_k\)"):
        lorax.QuantizedArray.from_gguf(np.zeros((2, 18), np.uint8), "nf4")
    with pytest.raises(ValueError, match=r"n \* 144\) for q4_k"):
        lorax.QuantizedArray.from_gguf(np.zeros((2, 140), np.uint8), "q4_k")


# -- QLoRA on the new types: dot, gather (both ways), scan ---------------------------------

DIM, VOCAB, LAYERS, K = 256, 48, 2, 3


def _lw(q, seed):
    kb, ka = jax.random.split(jax.random.PRNGKey(seed))
    return lorax.LoraWeight(q, a=0.1 * jax.random.normal(ka, (*q.shape[:-2], K, q.shape[-1])),
                            b=0.1 * jax.random.normal(kb, (*q.shape[:-1], K)), alpha=2.0)


def _model(p, ids):
    """Embedding rows (blocks taken whole), a column lookup (blocks indexed), a scanned
    stack of (in, out) kernels, and tied logits."""
    h = p["emb"][ids]
    cols = jnp.take(p["emb"], ids, axis=1)  # (VOCAB, n): one value of a block per row
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["layers"])
    return jnp.sum((h @ p["emb"].T) ** 2) + jnp.sum(jnp.sin(cols))


@pytest.mark.parametrize("qtype", NEW)
def test_qlora_values_and_factor_gradients_equal_the_dequantized_base(qtype):
    i = NEW.index(qtype)
    emb = lorax.QuantizedArray.from_gguf(gguf_blocks(qtype, (VOCAB, DIM), i, std=0.5), qtype,
                                         transpose=False)
    layers = lorax.QuantizedArray.from_gguf(gguf_blocks(qtype, (LAYERS, DIM, DIM), i + 10,
                                                        std=DIM**-0.5), qtype)
    lp = {"emb": _lw(emb, 1), "layers": _lw(layers, 2)}
    dense = jax.tree.map(lambda w: dataclasses.replace(w, w=w.w.dequantize()), lp,
                         is_leaf=lambda x: isinstance(x, lorax.LoraWeight))
    ids = jnp.array([0, 5, 47, 9])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dequantizes the whole weight
        val, g = _step(_factors(lp), lp, ids)
    val_d, g_d = _step(_factors(dense), dense, ids)  # one compile for every type
    assert_close(val, val_d, rtol=2e-5)
    for n in lp:
        assert_close(g[n][0], g_d[n][0], rtol=2e-5, atol=1e-6, err_msg=n)
        assert_close(g[n][1], g_d[n][1], rtol=2e-5, atol=1e-6, err_msg=n)


def _factors(p):
    return {n: (w.a, w.b) for n, w in p.items()}


@jax.jit
@jax.value_and_grad
def _step(f, p, ids):
    return lorax.lora(_model)({n: dataclasses.replace(w, a=f[n][0], b=f[n][1])
                               for n, w in p.items()}, ids)


@pytest.mark.parametrize("qtype", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q5_0", "q5_1"])
def test_a_tensor_with_no_rows_dequantizes_to_an_empty_array(qtype):
    """A zero-sized tensor in a file (the fuzz test found one) is empty, not a crash."""
    qa = lorax.QuantizedArray.from_gguf(np.zeros((0, F.get_format(qtype).record.size), np.uint8),
                                        qtype)
    assert qa.dequantize().shape == qa.shape and qa.shape[-1] == 0
