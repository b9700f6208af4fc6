"""Scales stored in another dtype (`quantize(..., scale_dtype=)`), and the 8-bit form whose
dequantization is one product in the dense dtype (`QuantizedArray.scaled_in_dense_dtype`):
bit for bit the float32 product rounded once, which is what lets XLA's GPU compiler fuse it
into the matrix product (tests/test_benchmarks_gpu_compile.py checks that part)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import lorax
from lorax._quant import _formats as F
from tests.conftest import assert_close


def _bits(x: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))


def _float32_product(qa: lorax.QuantizedArray) -> jax.Array:
    """The dequantization every other form uses: float32 values, rounded once."""
    return F.dequantize_blocks(qa.format, qa.codes, qa.scales, qa.mins).astype(qa.dense_dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("qtype,block_size", [("int8", None), ("int8", 32), ("s4", None),
                                              ("s4", 128)])
def test_scales_in_the_dense_dtype_give_the_float32_product_bit_for_bit(dtype, qtype, block_size):
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(0), (256, 96))).astype(dtype)
    qa = lorax.QuantizedArray.from_dense(w, qtype, block_size=block_size, scale_dtype=dtype)
    assert qa.scales.dtype == dtype and qa.scaled_in_dense_dtype
    np.testing.assert_array_equal(_bits(qa.dequantize_storage()), _bits(_float32_product(qa)))


@given(codes=st.lists(st.integers(-128, 127), min_size=64, max_size=64),
       scale_bits=st.lists(st.integers(0x0080, 0x7F7F), min_size=2, max_size=2),
       negative=st.booleans(), int4=st.booleans())
def test_the_product_in_bfloat16_is_the_rounded_float32_product_for_any_normal_scale(
        codes, scale_bits, negative, int4):
    # Every int8 (or int4) code against any normal bfloat16 scale (the bit patterns
    # between the smallest normal and the largest finite value), either sign.
    scales = jax.lax.bitcast_convert_type(jnp.asarray(scale_bits, jnp.uint16), jnp.bfloat16)
    scales = -scales if negative else scales
    c = jnp.asarray(codes, jnp.int8).reshape(1, 2, 32)
    c = (c // 16).astype(jnp.int4) if int4 else c
    qa = lorax.QuantizedArray(c, scales.reshape(1, 2), qtype="s4" if int4 else "int8",
                              block_size=32, dense_dtype=jnp.bfloat16)
    assert qa.scaled_in_dense_dtype
    np.testing.assert_array_equal(_bits(qa.dequantize_storage()), _bits(_float32_product(qa)))


def test_gguf_q8_0_in_float16_takes_the_same_form():
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(1), (128, 64))).astype(jnp.float16)
    qa = lorax.QuantizedArray.from_dense(w, "q8_0")
    assert qa.scales.dtype == jnp.float16 and qa.scaled_in_dense_dtype
    np.testing.assert_array_equal(_bits(qa.dequantize_storage()), _bits(_float32_product(qa)))
    assert not lorax.QuantizedArray.from_dense(w.astype(jnp.bfloat16), "q8_0").scaled_in_dense_dtype


@pytest.mark.parametrize("qtype,scale_dtype,dtype", [
    ("int8", None, jnp.bfloat16), ("int8", jnp.bfloat16, jnp.float32),
    ("int8", jnp.float16, jnp.bfloat16), ("nf4", jnp.bfloat16, jnp.bfloat16),
    ("int4", jnp.bfloat16, jnp.bfloat16)])
def test_other_combinations_keep_the_float32_form(qtype, scale_dtype, dtype):
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(2), (128, 64))).astype(dtype)
    qa = lorax.QuantizedArray.from_dense(w, qtype, scale_dtype=scale_dtype)
    assert not qa.scaled_in_dense_dtype
    np.testing.assert_array_equal(np.asarray(qa.dequantize_storage()), np.asarray(_float32_product(qa)))


@pytest.mark.parametrize("qtype", ["int8", "int4", "s4", "nf4"])
def test_codes_are_computed_against_the_scales_as_stored(qtype):
    # Rounding the scales after the codes were chosen would leave codes made for other
    # scales: the error would then exceed half a step of the stored scale.
    w = jax.random.normal(jax.random.PRNGKey(3), (256, 64))
    qa = lorax.QuantizedArray.from_dense(w, qtype, block_size=32, scale_dtype=jnp.bfloat16)
    assert qa.scales.dtype == jnp.bfloat16
    again = lorax.QuantizedArray.from_dense(qa.dequantize(), qtype, block_size=32,
                                            scale_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(qa.codes))
    # Half the widest gap between two neighbouring codes, in units of the block's absmax.
    half = {"int8": 0.5 / 127, "int4": 0.5 / 8, "s4": 0.5 / 8, "nf4": float(np.diff(F.NF4_CODE).max()) / 2}[qtype]
    absmax = jnp.repeat(jnp.abs(w).reshape(8, 32, 64).max(axis=1), 32, axis=0)  # blocks of 32
    bound = absmax * half
    if qtype in ("int4", "s4"):  # the extreme is -8 steps: the other sign clips at +7
        bound = jnp.maximum(bound, jnp.abs(w) - 7 * absmax / 8 * (1 - 2**-8))
    assert (jnp.abs(qa.dequantize() - w) <= bound * (1 + 2**-8)).all()  # the scale's rounding


@pytest.mark.parametrize("qtype", ["int8", "s4"])
def test_lora_values_and_gradients_equal_the_float32_form(qtype):
    x = jax.random.normal(jax.random.PRNGKey(4), (8, 128), jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(5), (128, 64))).astype(jnp.bfloat16)
    spec = {"w": 4}
    fused = lorax.quantize({"w": w}, spec, qtype, block_size=32, scale_dtype=jnp.bfloat16)
    plain = {"w": fused["w"].with_leaves(
        (fused["w"].codes, fused["w"].scales.astype(jnp.float32), None, None, None))}
    assert fused["w"].scaled_in_dense_dtype and not plain["w"].scaled_in_dense_dtype

    def loss(p, spec_tree, x):
        lp = lorax.init_lora(p, spec_tree, jax.random.PRNGKey(6), dtype=jnp.float32)
        # A nonzero `b`, so the factors' path and the base's both carry gradient.
        lp["w"] = lorax.LoraWeight(lp["w"].w, lp["w"].a, 0.1 + lp["w"].b, lp["w"].alpha)

        def f(lp, x):
            y = lorax.lora(lambda p, x: x @ p["w"])(lp, x)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        trainable, frozen = lorax.partition(lp, spec_tree)
        return jax.value_and_grad(lambda t, x: f(lorax.combine(t, frozen), x), argnums=(0, 1))(trainable, x)

    (v1, g1), (v2, g2) = loss(fused, spec, x), loss(plain, spec, x)
    assert v1 == v2
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_requantized_merge_keeps_the_scale_dtype():
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(7), (64, 32))).astype(jnp.bfloat16)
    q = lorax.quantize({"w": w}, {"w": 2}, "int8", scale_dtype=jnp.bfloat16)
    lp = lorax.init_lora(q, {"w": 2}, jax.random.PRNGKey(8))
    merged = lorax.merge_params(lp, requantize=True)["w"]
    assert merged.scales.dtype == jnp.bfloat16 and merged.scaled_in_dense_dtype
    assert_close(merged.dequantize(), q["w"].dequantize(), atol=0, rtol=0)  # b starts at 0


@pytest.mark.parametrize("qtype,kwargs,match", [
    ("int8", dict(scale_dtype=jnp.int8), "floating-point"),
    ("q8_0", dict(scale_dtype=jnp.bfloat16), "GGUF's layout"),
    ("nf4", dict(scale_dtype=jnp.bfloat16, double_quant=True), "double_quant"),
])
def test_a_scale_dtype_that_cannot_apply_is_an_error(qtype, kwargs, match):
    params = {"w": jnp.ones((64, 64)), "frozen": jnp.ones((128, 64))}
    spec = {"w": 2, "frozen": lorax.LORA_FREEZE}
    with pytest.raises(ValueError, match=match):
        lorax.quantize(params, spec, qtype, **kwargs)
    with pytest.raises(ValueError, match=match):
        lorax.QuantizedArray.from_dense(params["w"], qtype, **kwargs)
