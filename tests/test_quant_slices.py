"""Slices through a quantized weight's block axis dequantize only the blocks the range
covers, then trim: whatever the alignment, static or dynamic, equal to slicing the
dense weight. Whole-block static slices stay quantized. A chunked cross-entropy over a
Llama-3-sized vocabulary (128,256 rows, chunks that are not whole blocks) runs with
`on_materialize="error"` and never holds the dense table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax
from lora_testing import gguf_blocks

CASES = {
    "nf4": lambda w: lorax.QuantizedArray.from_dense(w, "nf4"),
    "nf4-double": lambda w: lorax.QuantizedArray.from_dense(w, "nf4", double_quant=True),
    "q4_1": lambda w: lorax.QuantizedArray.from_dense(w, "q4_1"),
    "int8": lambda w: lorax.QuantizedArray.from_dense(w, "int8"),  # one block spans the axis
    "q4_k": lambda w: lorax.QuantizedArray.from_gguf(gguf_blocks("q4_k", (w.shape[1], 768)), "q4_k"),
}


def _weight(case):
    w = jax.random.normal(jax.random.PRNGKey(0), (768, 24))
    return CASES[case](w)


def _close(got, want, case):
    # Double quantization's scales are recomputed in another fusion: last-bit differences.
    tol = 1e-6 if case == "nf4-double" else 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("start, limit, stride", [(5, 300, 3), (64, 200, 1), (700, 768, 1),
                                                  (0, 1, 1), (255, 513, 2)])
def test_static_slices_through_the_blocks(case, start, limit, stride):
    qa = _weight(case)
    out = lorax.lora(lambda q: q[start:limit:stride], on_materialize="error")(qa)
    got = out.dequantize() if isinstance(out, lorax.QuantizedArray) else out
    _close(got, qa.dequantize()[start:limit:stride], case)


@pytest.mark.parametrize("case", list(CASES))
def test_whole_block_slices_stay_quantized(case):
    qa = _weight(case)
    bs = qa.block_size
    if bs >= qa.shape[0] or case == "nf4-double":
        pytest.skip("one block spans the axis / double-quantized scales are regrouped")
    out = lorax.lora(lambda q: q[bs:3 * bs], on_materialize="error")(qa)
    assert isinstance(out, lorax.QuantizedArray) and out.shape == (2 * bs, 24)
    _close(out.dequantize(), qa.dequantize()[bs:3 * bs], case)


@pytest.mark.parametrize("case", list(CASES))
def test_dynamic_slices_through_the_blocks(case):
    qa = _weight(case)
    ref = qa.dequantize()

    @jax.jit
    def take(q, i):
        return lorax.lora(lambda q, i: jax.lax.dynamic_slice_in_dim(q, i, 100),
                          on_materialize="error")(q, i)

    for i in (0, 3, 70, 500, 667, 700, 10_000, -5):  # past the end and negative: clamped
        out = take(qa, i)
        got = out.dequantize() if isinstance(out, lorax.QuantizedArray) else out
        _close(got, jax.lax.dynamic_slice_in_dim(ref, i, 100), case)


def test_int8_slices_anywhere_stay_quantized():
    """int8's one block spans the axis and holds a byte per value: any range of the axis
    is a range of its code bytes under the same per-channel scales, so a chunk of an
    int8 embedding is never dequantized whole (8B under FSDP: 1.6 GiB less)."""
    qa = _weight("int8")
    ref = qa.dequantize()
    static = lorax.lora(lambda q: q[5:300:3], on_materialize="error")(qa)
    dynamic = jax.jit(lorax.lora(lambda q, i: jax.lax.dynamic_slice_in_dim(q, i, 100),
                                 on_materialize="error"))(qa, 667)
    for out, want in ((static, ref[5:300:3]), (dynamic, ref[667:767])):
        assert isinstance(out, lorax.QuantizedArray) and out.nbytes < qa.nbytes / 2
        _close(out.dequantize(), want, "int8")


def test_slices_of_other_axes_and_the_block_axis_together():
    qa = _weight("nf4")
    out = lorax.lora(lambda q: q[10:130, 3:20:2], on_materialize="error")(qa)
    _close(out, qa.dequantize()[10:130, 3:20:2], "nf4")


# -- a real vocabulary ---------------------------------------------------------------------

V, D, CHUNKS = 128_256, 16, 16  # Llama 3's vocabulary: 8,016 rows per chunk, not whole blocks


def _chunked_loss(p, h, targets):
    """Logits against the tied embedding chunk by chunk (the main job's loss)."""
    size = V // CHUNKS

    def chunk(carry, i):
        m, s, picked = carry
        e = jax.lax.dynamic_slice_in_dim(p["embed"], i * size, size)  # (size, D)
        logits = h @ e.T
        new_m = jnp.maximum(m, logits.max(-1))
        s = s * jnp.exp(m - new_m) + jnp.exp(logits - new_m[:, None]).sum(-1)
        inside = (targets >= i * size) & (targets < (i + 1) * size)
        at = jnp.take_along_axis(logits, jnp.clip(targets - i * size, 0, size - 1)[:, None], 1)[:, 0]
        return (new_m, s, jnp.where(inside, at, picked)), None

    init = (jnp.full(h.shape[:1], -jnp.inf), jnp.zeros(h.shape[:1]), jnp.zeros(h.shape[:1]))
    (m, s, picked), _ = jax.lax.scan(jax.checkpoint(chunk), init, jnp.arange(CHUNKS))
    return jnp.mean(m + jnp.log(s) - picked)


def test_chunked_loss_over_a_llama3_vocabulary_keeps_the_embedding_quantized():
    embed = jax.random.normal(jax.random.PRNGKey(0), (V, D)) / 4
    params = {"embed": embed}
    spec = {"embed": 4}  # LoRA on the tied embedding; nf4 blocks of 64 run along the vocabulary
    lp = lorax.init_lora(lorax.quantize(params, spec, "nf4"), spec, jax.random.PRNGKey(1))
    h = jax.random.normal(jax.random.PRNGKey(2), (8, D))
    targets = jnp.array([0, 8015, 8016, 64_000, 128_255, 3, 100_000, 77])
    trainable, frozen = lorax.partition(lp, spec)

    def loss(t, f):
        return lorax.lora(_chunked_loss, on_materialize="error")(lorax.combine(t, f), h, targets)

    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(trainable, frozen)
    # The reference: the same loss on the dense (dequantized + BA) table, and the
    # factor gradients through the materialised weight.
    ref_loss = lambda t: _chunked_loss(lorax.merge_params(lorax.combine(t, frozen)), h, targets)
    want, want_grads = jax.value_and_grad(ref_loss)(trainable)
    np.testing.assert_allclose(value, want, rtol=2e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)
    # Compiled temporaries: a few chunks' worth, far below the dense table's bytes.
    temp = step.lower(trainable, frozen).compile().memory_analysis().temp_size_in_bytes
    assert temp < V * D * 4 / 4, temp
