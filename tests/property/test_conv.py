"""Property tests: `conv_general_dilated` with a `LoraWeight` kernel.

`lora(f)(x, lw)` must equal `f(x, lw.materialize())`, values and gradients w.r.t. the
factors and the input, for 1-D/2-D/3-D convs with random layouts, strides,
padding and dilations. The supported factorisations put the kernel's output
feature axis `O` alone on one side: `O` last (`HWIO`-like) factors as
`(*window, in) -> k -> out` (`b: (*rest, k)`, `a: (k, O)`), `O` first (`OIHW`-like)
as `out <- k <- (in, *window)` (`b: (O, k)`, `a: (k, *rest)`). Those run with
`on_materialize="error"`, so any fallback to the dense kernel fails the test.
Grouped convs, and kernels whose `O` axis is not a whole factor group, are
materialized: still correct, with a `LoraMaterializationWarning`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from hypothesis import assume, given
from hypothesis import strategies as st
from jax import lax

import lorax

DTYPES = {
    "f32": (jnp.float32, jnp.float32),
    "bf16": (jnp.bfloat16, jnp.bfloat16),
    "bf16_w_f32_factors": (jnp.bfloat16, jnp.float32),
}
DTYPE_KEYS = tuple(DTYPES)  # f32 first: hypothesis shrinks towards it
SPATIAL = "HWD"


def _rand(rng: np.random.Generator, shape, dtype) -> jax.Array:
    # Cast on the host: an eager `astype` would compile one XLA program per shape.
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def conv_kernel_lora(rng, kernel_shape, out_axis: int, rank: int, alpha: float, dtypes):
    """A LoraWeight kernel factored around its output-feature axis (first or last)."""
    w_dtype, f_dtype = dtypes
    w = _rand(rng, kernel_shape, w_dtype)
    if out_axis == len(kernel_shape) - 1:  # (*rest, O): b (*rest, k), a (k, O)
        b = _rand(rng, (*kernel_shape[:-1], rank), f_dtype)
        a = _rand(rng, (rank, kernel_shape[-1]), f_dtype)
    else:  # (O, *rest): b (O, k), a (k, *rest)
        assert out_axis == 0
        b = _rand(rng, (kernel_shape[0], rank), f_dtype)
        a = _rand(rng, (rank, *kernel_shape[1:]), f_dtype)
    lw = lorax.LoraWeight(w, a=a, b=b, alpha=alpha)
    expected = (0, len(kernel_shape) - 1, 1) if out_axis else (0, 1, len(kernel_shape) - 1)
    assert lw.structure == expected
    return lw


def _f32_lora(lw):
    return lorax.LoraWeight(
        lw.w.astype(jnp.float32), a=lw.a.astype(jnp.float32),
        b=lw.b.astype(jnp.float32), alpha=lw.alpha,
    )


def check_conv(f, x, lw, seed: int, *, eager: bool, on_materialize: str = "error"):
    """`lora(f)(x, lw)` vs `f(x, lw.materialize())`: output (shape, dtype, values) and
    gradients w.r.t. `a`, `b` and `x` of a random projection; `w`'s gradient is 0.

    The reference runs in f32 on f32 copies of the operands (then is cast to the
    dense output dtype), so bf16 runs are checked with bf16 tolerance against the
    exact answer. It is compiled together with the jitted LoRA path (one program
    per example); `eager` adds an eager run of the LoRA path.
    """
    low = any(jnp.dtype(v.dtype) == jnp.bfloat16 for v in (x, lw.w, lw.a, lw.b))
    tol = jnp.bfloat16 if low else jnp.float32
    lora_f = lorax.lora(f, on_materialize=on_materialize)
    dense_out = jax.eval_shape(f, x, lw.materialize())
    proj = _rand(np.random.default_rng(seed + 1), dense_out.shape, jnp.float32)

    def lora_loss(x, lw, proj):
        out = lora_f(x, lw)
        return jnp.sum(proj * out.astype(jnp.float32)), out

    def ref_loss(x, lw, proj):
        out = f(x, lw.materialize())
        return jnp.sum(proj * out.astype(jnp.float32)), out

    lora_vg = jax.value_and_grad(lora_loss, (0, 1), has_aux=True)
    ref_vg = jax.value_and_grad(ref_loss, (0, 1), has_aux=True)
    x32, lw32 = x.astype(jnp.float32), _f32_lora(lw)
    both = jax.jit(lambda *args: (lora_vg(*args[:3]), ref_vg(*args[3:])))
    jit_result, ((_, ref_out), (ref_gx, ref_glw)) = both(x, lw, proj, x32, lw32, proj)
    results = [("jit", jit_result)]
    if eager:
        results.append(("eager", lora_vg(x, lw, proj)))

    expected = np.asarray(ref_out.astype(dense_out.dtype), np.float32)
    for mode, ((_, out), (gx, glw)) in results:
        assert out.shape == dense_out.shape, mode
        assert out.dtype == dense_out.dtype, (mode, out.dtype, dense_out.dtype)
        assert_close(out, expected, tol)
        assert gx.dtype == x.dtype and glw.a.dtype == lw.a.dtype and glw.b.dtype == lw.b.dtype
        assert_close(gx, ref_gx, tol)
        assert_close(glw.a, ref_glw.a, tol)
        assert_close(glw.b, ref_glw.b, tol)
        assert glw.w.shape == lw.w.shape
        np.testing.assert_array_equal(np.asarray(glw.w, np.float32), 0.0)


# -- strategies -----------------------------------------------------------------------


@st.composite
def conv_cases(draw):
    nsp = draw(st.integers(1, 3))
    sp = SPATIAL[:nsp]
    lhs_spec = "".join(draw(st.permutations(["N", "C", *sp])))
    out_spec = "".join(draw(st.permutations(["N", "C", *sp])))
    rest = "".join(draw(st.permutations(["I", *sp])))
    o_last = draw(st.booleans())
    rhs_spec = rest + "O" if o_last else "O" + rest

    max_in = 4 if nsp == 3 else 6
    n = draw(st.integers(1, 2))
    c_in = draw(st.integers(1, 3))
    c_out = draw(st.integers(1, 3))
    window = {c: draw(st.integers(1, 3)) for c in sp}
    in_size = {c: draw(st.integers(1, max_in)) for c in sp}
    # Per-spatial-axis parameters are in rhs_spec's spatial order.
    order = [c for c in rhs_spec if c in sp]
    strides = tuple(draw(st.integers(1, 2)) for _ in order)
    lhs_dil = tuple(draw(st.sampled_from([1, 1, 2])) for _ in order)
    rhs_dil = tuple(draw(st.sampled_from([1, 1, 2])) for _ in order)
    padding = draw(st.one_of(
        st.sampled_from(["SAME", "VALID"]),
        st.tuples(*[st.tuples(st.integers(-1, 2), st.integers(-1, 2)) for _ in order]),
    ))

    lhs_shape = tuple({"N": n, "C": c_in, **in_size}[c] for c in lhs_spec)
    kernel_shape = tuple({"O": c_out, "I": c_in, **window}[c] for c in rhs_spec)
    return dict(
        dimension_numbers=(lhs_spec, rhs_spec, out_spec), lhs_shape=lhs_shape,
        kernel_shape=kernel_shape, out_axis=rhs_spec.index("O"),
        params=dict(window_strides=strides, padding=padding, lhs_dilation=lhs_dil,
                    rhs_dilation=rhs_dil),
    )


def _conv_fn(dimension_numbers, params, **extra):
    return lambda x, k: lax.conv_general_dilated(
        x, k, dimension_numbers=dimension_numbers, **params, **extra
    )


def _valid(f, x, kernel_shape, dtype) -> bool:
    try:
        out = jax.eval_shape(f, x, jax.ShapeDtypeStruct(kernel_shape, dtype))
    except (TypeError, ValueError):
        return False
    return all(d > 0 for d in out.shape)


@given(case=conv_cases(), data=st.data())
def test_conv_general_dilated_random(case, data):
    """Random 1-D/2-D/3-D conv: layouts (random permutations; kernel `O` first or
    last), strides, SAME/VALID/explicit (incl. negative) padding, lhs and rhs
    dilation, three dtype set-ups, optional f32 accumulation for bf16; values and
    gradients vs the materialized kernel, under jit and (one example in five)
    eagerly."""
    draw = data.draw
    dtypes = DTYPES[draw(st.sampled_from(DTYPE_KEYS))]
    low = jnp.dtype(dtypes[0]) == jnp.bfloat16
    pet = draw(st.sampled_from([None, jnp.float32])) if low else None
    rank = draw(st.integers(1, 3))
    alpha = draw(st.sampled_from([0.5, 1.0, 4.0]))
    eager = draw(st.integers(0, 4)) == 0
    seed = draw(st.integers(0, 2**16))

    f = _conv_fn(case["dimension_numbers"], case["params"], preferred_element_type=pet)
    rng = np.random.default_rng(seed)
    x = _rand(rng, case["lhs_shape"], dtypes[0])
    assume(_valid(f, x, case["kernel_shape"], dtypes[0]))
    lw = conv_kernel_lora(rng, case["kernel_shape"], case["out_axis"], rank, alpha, dtypes)
    check_conv(f, x, lw, seed, eager=eager)


# Named layouts from real models, each with a fixed strided / dilated / padded conv.
LAYOUT_CASES = {
    "1d_NWC_WIO": (("NWC", "WIO", "NWC"), (2, 7, 3), (3, 3, 4),
                   dict(window_strides=(2,), padding="SAME", lhs_dilation=(1,), rhs_dilation=(2,))),
    "1d_NCW_OIW": (("NCW", "OIW", "NCW"), (2, 3, 7), (4, 3, 3),
                   dict(window_strides=(1,), padding=((1, 2),), lhs_dilation=(2,), rhs_dilation=(1,))),
    "2d_NHWC_HWIO": (("NHWC", "HWIO", "NHWC"), (2, 5, 6, 3), (3, 2, 3, 4),
                     dict(window_strides=(1, 2), padding="SAME", lhs_dilation=(1, 1), rhs_dilation=(1, 1))),
    "2d_NCHW_OIHW": (("NCHW", "OIHW", "NCHW"), (2, 3, 5, 6), (4, 3, 3, 2),
                     dict(window_strides=(2, 1), padding="VALID", lhs_dilation=(1, 1), rhs_dilation=(1, 2))),
    "2d_NCHW_HWIO_NHWC": (("NCHW", "HWIO", "NHWC"), (2, 3, 5, 5), (3, 3, 3, 4),
                          dict(window_strides=(1, 1), padding=((1, 0), (0, 2)), lhs_dilation=(2, 1), rhs_dilation=(1, 1))),
    "3d_NDHWC_DHWIO": (("NDHWC", "DHWIO", "NDHWC"), (1, 3, 4, 4, 2), (2, 2, 2, 2, 3),
                       dict(window_strides=(1, 2, 1), padding="SAME", lhs_dilation=(1, 1, 1), rhs_dilation=(1, 1, 2))),
    "3d_NCDHW_OIDHW": (("NCDHW", "OIDHW", "NCDHW"), (1, 2, 3, 4, 4), (3, 2, 2, 2, 2),
                       dict(window_strides=(1, 1, 1), padding="VALID", lhs_dilation=(1, 1, 1), rhs_dilation=(1, 1, 1))),
}


@pytest.mark.parametrize("dtype_key", DTYPE_KEYS)
@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_conv_named_layouts(case, dtype_key):
    """Standard 1-D/2-D/3-D layouts (channels-last HWIO and channels-first OIHW):
    values and gradients, under jit, and eagerly for f32."""
    dn, lhs_shape, kernel_shape, params = LAYOUT_CASES[case]
    dtypes = DTYPES[dtype_key]
    seed = sorted(LAYOUT_CASES).index(case)
    rng = np.random.default_rng(seed)
    x = _rand(rng, lhs_shape, dtypes[0])
    lw = conv_kernel_lora(rng, kernel_shape, dn[1].index("O"), 2, 3.0, dtypes)  # scale 1.5
    check_conv(_conv_fn(dn, params), x, lw, seed, eager=dtype_key == "f32")


# -- what is materialized, with a warning ------------------------------------------------


MATERIALIZED_CASES = {
    # feature_group_count > 1: the rule does not factor grouped convs.
    "feature_groups": (("NHWC", "HWIO", "NHWC"), (2, 5, 5, 4), (3, 3, 2, 6),
                       dict(feature_group_count=2), 3),
    # batch_group_count > 1 (as in the weight gradient of a grouped conv).
    "batch_groups": (("NHWC", "HWIO", "NHWC"), (4, 5, 5, 3), (3, 3, 3, 4),
                     dict(batch_group_count=2), 3),
    # `O` neither first nor last: it is not a whole factor group of the LoraWeight.
    "o_in_middle": (("NHWC", "HOWI", "NHWC"), (2, 5, 5, 3), (3, 4, 3, 3),
                    dict(), 2),
}


@pytest.mark.parametrize("case", sorted(MATERIALIZED_CASES))
def test_conv_without_low_rank_rule_warns_and_is_correct(case):
    dn, lhs_shape, kernel_shape, extra, nm = MATERIALIZED_CASES[case]
    rng = np.random.default_rng(7)
    x = _rand(rng, lhs_shape, jnp.float32)
    k = 2
    lw = lorax.LoraWeight(
        _rand(rng, kernel_shape, jnp.float32),
        a=_rand(rng, (k, *kernel_shape[nm:]), jnp.float32),
        b=_rand(rng, (*kernel_shape[:nm], k), jnp.float32),
        alpha=2.0,
    )
    f = _conv_fn(dn, dict(window_strides=(1, 1), padding="SAME"), **extra)

    with pytest.warns(lorax.LoraMaterializationWarning) as record:
        check_conv(f, x, lw, 0, eager=True, on_materialize="warn")
    messages = [str(w.message) for w in record
                if issubclass(w.category, lorax.LoraMaterializationWarning)]
    assert messages
    for msg in messages:
        assert "materialized" in msg
        assert "conv_general_dilated" in msg
        assert str(tuple(kernel_shape)) in msg

    # ... and under on_materialize="error" the same call is refused.
    with pytest.raises(lorax.LoraMaterializationError, match="conv_general_dilated"):
        lorax.lora(f, on_materialize="error")(x, lw)
