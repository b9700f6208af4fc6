"""Shape-only ops on a `LoraWeight`: transpose, casts, reshapes, squeezes and slices.

Each op must keep the low-rank structure (return a `LoraWeight` whose merged
weight is the op applied to the merged weight) or, where the structure cannot
survive, fall back to the dense result with a `LoraMaterializationWarning`.
Every check runs under `on_materialize="error"` unless a fallback is expected,
and compares with the dense reference `fn(lw.materialize(), ...)`: values eagerly
and under `jax.jit`, gradients with respect to `a` and `b`.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from jax import lax

import lorax
from conftest import assert_close
from lora_testing import (
    F32,
    put,
    is_lw as _is_lw,
    make_lw,
    dense,
    np_materialize,
    grad_and_out as _grad_and_out,
)


BF16 = np.dtype(jnp.bfloat16)


# -- helpers -------------------------------------------------------------------------


def make_structured(seed, batch, m, n, k, alpha=2.0):
    batch, m, n = tuple(batch), tuple(m), tuple(n)
    return make_lw(seed, (*batch, *m, *n), (*batch, *m, k), (*batch, k, *n), alpha)


def _assert_outputs(out, ref, lora_out, dtype):
    if lora_out:
        assert _is_lw(out), f"expected a LoraWeight, got {type(out).__name__}"
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert_close(np_materialize(out), ref, dtype)
        return
    assert not any(_is_lw(o) for o in jax.tree.leaves(out, is_leaf=_is_lw))
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert_close(o, r, dtype)


def assert_factor_grads(got, want, dtype=F32):
    lws = [(g, r) for g, r in zip(jax.tree.leaves(got, is_leaf=_is_lw), jax.tree.leaves(want, is_leaf=_is_lw))
           if _is_lw(g)]
    assert lws
    for g, r in lws:
        assert_close(g.a, r.a, dtype)
        assert_close(g.b, r.b, dtype)
        # `lora` freezes W on the way in: even a LoraWeight returned by `lora(fn)`
        # and merged outside carries no gradient to its `w`.
        assert not np.any(np.asarray(g.w, F32)), "the frozen weight must get no gradient"


def check(fn, *args, lora_out=False, dtype=F32, policy="error", grad=True, eager_grad=False):
    """`lora(fn)` vs `fn` on merged weights: values eagerly and under jit; factor
    gradients under jit (and eagerly with `eager_grad`)."""
    g = lorax.lora(fn, on_materialize=policy)
    if grad:
        rng = np.random.default_rng(5)
        cts = [put(rng.standard_normal(x.shape).astype(x.dtype))
               for x in jax.tree.leaves(jax.eval_shape(lambda a: fn(*dense(a)), args))]
        both = lambda args: (_grad_and_out(fn, cts, 0, True)(args), _grad_and_out(g, cts, 0, False)(args))  # noqa: E731
        (want, ref), (got, out) = jax.jit(both)(args)  # one compile for reference and lora
        _assert_outputs(out, ref, lora_out, dtype)
        assert_factor_grads(got, want, dtype)
        if eager_grad:
            assert_factor_grads(_grad_and_out(g, cts, 0, False)(args)[0], want, dtype)
    else:
        ref = jax.jit(lambda a: fn(*dense(a)))(args)
        _assert_outputs(jax.jit(g)(*args), ref, lora_out, dtype)
    _assert_outputs(g(*args), ref, lora_out, dtype)
    return ref


def lora_weight_sized_math(fn, args, shapes):
    """Arithmetic eqns whose output has a weight's shape (in any axis order)."""
    keys = {tuple(sorted(s)) for s in shapes}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e for e in walk(jaxpr) if e.primitive.name in {"dot_general", "add", "add_any", "mul", "sub"}
            and any(tuple(sorted(getattr(v.aval, "shape", ()))) in keys for v in e.outvars)]


def expect_fallback(fn, args, prim, shape):
    """`fn` materializes with a warning naming `prim` and `shape`, and is still correct."""
    with pytest.warns(lorax.LoraMaterializationWarning) as rec:
        out = lorax.lora(fn)(*args)
    msgs = [str(r.message) for r in rec if issubclass(r.category, lorax.LoraMaterializationWarning)]
    assert any("materialized" in m and f"`{prim}`" in m and str(tuple(shape)) in m for m in msgs), msgs
    assert not _is_lw(out)
    assert_close(out, jax.jit(lambda a: fn(*dense(a)))(args))
    with pytest.raises(lorax.LoraMaterializationError, match=prim):
        lorax.lora(fn, on_materialize="error")(*args)


@pytest.fixture
def lw():
    return make_lw(0, (6, 4), (6, 2), (2, 4), alpha=3.0)


@pytest.fixture
def stack():
    return make_structured(1, (4,), (5,), (3,), 2)


# -- transpose ------------------------------------------------------------------------


def test_transpose_2d_swaps_the_factors(lw):
    out = lorax.lora(lambda w: w.T, on_materialize="error")(lw)
    assert _is_lw(out) and out.shape == (4, 6) and out.rank == 2 and out.alpha == lw.alpha
    # (W + s B A)^T = W^T + s A^T B^T: exact factor bookkeeping, nothing merged.
    np.testing.assert_array_equal(out.w, lw.w.T)
    np.testing.assert_array_equal(out.b, lw.a.T)
    np.testing.assert_array_equal(out.a, lw.b.T)
    assert_close(out.materialize(), lw.materialize().T)
    check(lambda w: w.T, lw, lora_out=True)
    check(lambda w: jnp.transpose(w).T, lw, lora_out=True, grad=False)


def test_tied_embedding_logits_stay_low_rank():
    vocab, dim, k = 11, 5, 3
    emb = make_lw(2, (vocab, dim), (vocab, k), (k, dim))
    h = put(np.random.default_rng(3).standard_normal((4, dim)).astype(np.float32))
    logits = lambda E, h: h @ E.T  # noqa: E731
    ref = check(logits, emb, h)
    assert ref.shape == (4, vocab)
    fn = lorax.lora(logits, on_materialize="error")
    assert lora_weight_sized_math(fn, (emb, h), [(vocab, dim)]) == []
    loss = lambda E: jnp.sum(jax.nn.log_softmax(fn(E, h)))  # noqa: E731
    assert lora_weight_sized_math(jax.grad(loss), (emb,), [(vocab, dim)]) == []
    # The transposed table also works on the left of a contraction.
    check(lambda E, y: E.T @ y, emb, jnp.ones((vocab, 2)))


@pytest.mark.parametrize(
    "batch, m, n, perm, keeps",
    [
        ((), (6,), (3, 2), (0, 2, 1), True),  # DenseGeneral kernel: permute N axes
        ((), (6,), (3, 2), (1, 2, 0), True),  # full M <-> N swap
        pytest.param(*((), (6,), (3, 2), (2, 1, 0), True), marks=pytest.mark.slow),  # swap and permute
        ((), (3, 2), (4,), (2, 0, 1), True),  # multi-axis M to the back
        pytest.param(*((), (3, 2), (4,), (1, 0, 2), True), marks=pytest.mark.slow),  # permute M axes
        ((), (3, 2), (4,), (0, 2, 1), True),  # splits M around N: M axes not contiguous
        pytest.param(*((4,), (5,), (3,), (0, 2, 1), True), marks=pytest.mark.slow),  # stacked transpose
        pytest.param(*((2, 3), (4,), (5,), (1, 0, 2, 3), True), marks=pytest.mark.slow),  # permute batch axes
        ((2, 3), (4,), (5,), (1, 0, 3, 2), True),  # permute batch and swap
        ((4,), (5,), (3,), (1, 0, 2), False),  # M axis becomes a batch axis
    ],
)
def test_transpose_multi_axis(batch, m, n, perm, keeps):
    lw = make_structured(4, batch, m, n, 2)
    f = lambda w: jnp.transpose(w, perm)  # noqa: E731
    if keeps:
        check(f, lw, lora_out=True, grad=len(perm) == 3)
    else:
        expect_fallback(f, (lw,), "transpose", lw.shape)


@st.composite
def structures(draw, max_batch=2, max_m=2, max_n=2, max_dim=3):
    nb = draw(st.integers(0, max_batch))
    nm = draw(st.integers(1, max_m))
    nn = draw(st.integers(1, max_n))
    dims = st.integers(1, max_dim)
    batch = draw(st.lists(dims, min_size=nb, max_size=nb))
    m = draw(st.lists(dims, min_size=nm, max_size=nm))
    n = draw(st.lists(dims, min_size=nn, max_size=nn))
    k = draw(st.integers(1, 3))
    alpha = draw(st.sampled_from([1.0, 0.5, 4.0]))
    return batch, m, n, k, alpha


def _run_recording(fn, *args):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = jax.jit(lorax.lora(fn))(*args)
    msgs = [str(r.message) for r in rec if issubclass(r.category, lorax.LoraMaterializationWarning)]
    return out, msgs


@given(structures(), st.data())
def test_transpose_property(structure, data):
    batch, m, n, k, alpha = structure
    lw = make_structured(0, batch, m, n, k, alpha)
    perm = tuple(data.draw(st.permutations(range(lw.ndim))))
    note(f"structure={lw.structure} shape={lw.shape} perm={perm}")
    nb, nm, nn = lw.structure
    # Any order of the M and N axes stays low-rank (non-contiguous M axes are an
    # `m_axes` layout); only batch axes leaving the front cannot.
    keeps = sorted(perm[:nb]) == list(range(nb))
    out, msgs = _run_recording(lambda w: jnp.transpose(w, perm), lw)
    expected = np_materialize(lw).transpose(perm)
    if keeps:
        assert _is_lw(out) and not msgs
        assert out.rank == k and out.structure[0] == nb
        assert_close(np_materialize(out), expected)
    else:
        assert not _is_lw(out)
        assert msgs and all("`transpose`" in m_ and str(lw.shape) in m_ for m_ in msgs)
        assert_close(out, expected)


# -- dtype ----------------------------------------------------------------------------------


def test_bf16_model_with_f32_factors(lw):
    x = put(np.random.default_rng(6).standard_normal((3, 6)).astype(np.float32))
    f = lambda w, x: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)  # noqa: E731
    ref = check(f, lw, x, dtype=BF16)
    assert ref.dtype == jnp.bfloat16

    cast = lorax.lora(lambda w: w.astype(jnp.bfloat16), on_materialize="error")(lw)
    assert _is_lw(cast) and cast.dtype == jnp.bfloat16 and cast.w.dtype == jnp.bfloat16
    # The factors keep full precision; rules cast them at the point of use.
    assert cast.a.dtype == jnp.float32 and cast.b.dtype == jnp.float32
    np.testing.assert_array_equal(cast.a, lw.a)
    assert_close(cast.materialize(), lw.materialize(), BF16)

    # A bf16 frozen weight with f32 factors, straight from the start.
    lw16 = lorax.LoraWeight(lw.w.astype(jnp.bfloat16), a=lw.a, b=lw.b, alpha=lw.alpha)
    ref = check(lambda w, x: x.astype(jnp.bfloat16) @ w, lw16, x, dtype=BF16, grad=False)
    assert ref.dtype == jnp.bfloat16


def test_cast_to_same_dtype_is_identity(lw):
    out = lorax.lora(lambda w: w.astype(jnp.float32),
                     on_materialize="error")(lw)
    assert _is_lw(out)
    np.testing.assert_array_equal(out.a, lw.a)
    np.testing.assert_array_equal(out.b, lw.b)


def test_copy_keeps_structure(lw):
    out = lorax.lora(lambda w: jnp.copy(w), on_materialize="error")(lw)
    assert _is_lw(out)
    np.testing.assert_array_equal(out.b, lw.b)


def test_cast_to_integer_falls_back(lw):
    expect_fallback(lambda w: w.astype(jnp.int32), (lw,), "convert_element_type", lw.shape)


# -- reshape / squeeze / expand_dims -------------------------------------------------------


def test_dense_general_kernel_reshape_round_trip():
    # Flax DenseGeneral kernel (E, H, D): b (E, k), a (k, H, D).
    kernel = make_structured(7, (), (6,), (3, 2), 2)
    flat = lorax.lora(lambda K: K.reshape(6, 6), on_materialize="error")(kernel)
    assert _is_lw(flat) and flat.structure == (0, 1, 1) and flat.a.shape == (2, 6)
    back = lorax.lora(lambda K: K.reshape(6, 6).reshape(6, 3, 2), on_materialize="error")(kernel)
    assert _is_lw(back) and back.structure == (0, 1, 2)
    check(lambda K: K.reshape(6, 6), kernel, lora_out=True, grad=False)
    check(lambda K: K.reshape(6, 6).reshape(6, 3, 2), kernel, lora_out=True)
    x = put(np.random.default_rng(8).standard_normal((4, 6)).astype(np.float32))
    check(lambda K, x: (x @ K.reshape(6, 6)).reshape(4, 3, 2), kernel, x)
    # Output projection kernel (H, D, E): M is two axes, merged by the reshape.
    out_proj = make_structured(8, (), (3, 2), (5,), 2)
    assert lorax.lora(lambda K: K.reshape(6, 5), on_materialize="error")(out_proj).structure == (0, 1, 1)
    check(lambda K, x: x @ K.reshape(6, 5), out_proj, x)


@pytest.mark.parametrize(
    "f", [lambda w: w[None], lambda w: jnp.expand_dims(w, 0),
          pytest.param(lambda w: w.reshape(1, 6, 4), marks=pytest.mark.slow)],
    ids=["none_index", "expand_dims", "reshape"],
)
def test_add_leading_unit_batch_axis(lw, f):
    out = lorax.lora(f, on_materialize="error")(lw)
    assert _is_lw(out) and out.shape == (1, 6, 4) and out.structure == (1, 1, 1)
    check(f, lw, lora_out=True)


@pytest.mark.parametrize(
    "f", [lambda w: w[0], lambda w: jnp.squeeze(w, 0),
          pytest.param(lambda w: w.reshape(6, 4), marks=pytest.mark.slow)],
    ids=["index", "squeeze", "reshape"],
)
def test_remove_leading_unit_batch_axis(f):
    s1 = make_structured(9, (1,), (6,), (4,), 2)
    out = lorax.lora(f, on_materialize="error")(s1)
    assert _is_lw(out) and out.shape == (6, 4) and out.structure == (0, 1, 1)
    check(f, s1, lora_out=True)


@pytest.mark.parametrize("new_shape", [(4, 6), (24,), (3, 8), (2, 12)])
def test_structure_breaking_reshape_falls_back(lw, new_shape):
    f = lambda w: w.reshape(new_shape)  # noqa: E731
    expect_fallback(f, (lw,), "reshape", lw.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(f, lw, policy="allow")


@st.composite
def _factorization(draw, total, min_len=1, max_len=3):
    """A random tuple of ints >= 1 whose product is `total`."""
    n = draw(st.integers(min_len, max_len))
    out = []
    rest = total
    for _ in range(n - 1):
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divisors))
        out.append(d)
        rest //= d
    out.append(rest)
    return tuple(draw(st.permutations(out)))


@given(structures(max_dim=4), st.data())
def test_reshape_property(structure, data):
    batch, m, n, k, alpha = structure
    lw = make_structured(1, batch, m, n, k, alpha)
    keep_groups = data.draw(st.booleans(), label="keep_groups")
    if keep_groups:
        new_shape = (
            *data.draw(_factorization(math.prod(batch), 0, 2)),
            *data.draw(_factorization(math.prod(m))),
            *data.draw(_factorization(math.prod(n))),
        )
    else:
        new_shape = data.draw(_factorization(lw.size, 1, 4))
    note(f"shape={lw.shape} structure={lw.structure} -> {new_shape}")
    out, msgs = _run_recording(lambda w: w.reshape(new_shape), lw)
    expected = np_materialize(lw).reshape(new_shape)
    if keep_groups:
        assert _is_lw(out) and not msgs, msgs
    if _is_lw(out):
        assert not msgs and out.rank == k
        assert_close(np_materialize(out), expected)
    else:
        assert msgs and all("`reshape`" in m_ and str(lw.shape) in m_ for m_ in msgs)
        assert_close(out, expected)


# -- squeezing away a whole M or N group: one row / column ------------------------------------


@pytest.mark.parametrize(
    "f, args",
    [
        (lambda E: E[3], ()),
        (lambda E, i: E[i], (jnp.int32(4),)),
        (lambda E: E[:, 2], ()),
        (lambda E, j: E[:, j], (jnp.int32(1),)),
        pytest.param(lambda E: E[-1], (), marks=pytest.mark.slow),
    ],
    ids=["row_static", "row_traced", "col_static", "col_traced", "row_negative"],
)
def test_single_row_or_column_is_not_materialized(lw, f, args):
    ref = check(f, lw, *args)
    assert ref.ndim == 1
    fn = lorax.lora(f, on_materialize="error")
    assert lora_weight_sized_math(fn, (lw, *args), [lw.shape]) == []


def test_single_entry_of_a_stack(stack):
    check(lambda s, i, j: s[i, j], stack, jnp.int32(3), jnp.int32(0))  # a row of one layer
    check(lambda s: s[2, :, 1], stack, grad=False)  # a column of one layer


@pytest.mark.slow
def test_single_element_of_a_stack(stack):
    check(lambda s: s[1, 2], stack)
    check(lambda s: s[1, 2, 0], stack)


# -- slicing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "f, args, shape",
    [
        (lambda s: s[1], (), (5, 3)),
        pytest.param(lambda s: s[-1], (), (5, 3), marks=pytest.mark.slow),
        (lambda s, i: s[i], (jnp.int32(2),), (5, 3)),
        (lambda s: s[1:3], (), (2, 5, 3)),
        (lambda s: s[::2], (), (2, 5, 3)),
        (lambda s, i: lax.dynamic_slice(s, (i, 0, 0), (2, 5, 3)), (jnp.int32(1),), (2, 5, 3)),
        (lambda s, i: lax.dynamic_slice(s, (i, 0, 0), (2, 5, 3)), (jnp.int32(9),), (2, 5, 3)),  # clamped
        pytest.param(lambda s, i: lax.dynamic_index_in_dim(s, i, keepdims=False), (jnp.int32(3),), (5, 3),
                     marks=pytest.mark.slow),
    ],
    ids=["static", "negative", "traced", "range", "strided", "dynamic_slice", "dynamic_slice_clamped",
         "dynamic_index"],
)
def test_slice_batch_axes(stack, f, args, shape):
    out = lorax.lora(f, on_materialize="error")(stack, *args)
    assert _is_lw(out) and out.shape == shape
    check(f, stack, *args, lora_out=True)


def test_traced_layer_index_under_jit(stack):
    x = jnp.ones((2, 5))
    f = jax.jit(lorax.lora(lambda s, i, x: x @ s[i], on_materialize="error"))
    for i in range(4):
        assert_close(f(stack, jnp.int32(i), x), x @ stack.materialize()[i])


@pytest.mark.parametrize(
    "f, args",
    [
        (lambda w: w[1:4], ()),
        (lambda w: w[:, 1:3], ()),
        (lambda w: w[::2, ::3], ()),
        pytest.param(lambda w: w[1:, -2:], (), marks=pytest.mark.slow),
        (lambda w, i, j: lax.dynamic_slice(w, (i, j), (3, 2)), (jnp.int32(2), jnp.int32(1))),
        (lambda w, i: lax.dynamic_slice(w, (0, i), (6, 2)), (jnp.int32(7),)),  # clamped
    ],
    ids=["rows", "cols", "strided", "both", "dynamic", "dynamic_clamped"],
)
def test_slice_m_and_n_axes(lw, f, args):
    check(f, lw, *args, lora_out=True)


def test_slice_multi_axis_and_stacked():
    kernel = make_structured(10, (), (6,), (3, 2), 2)
    check(lambda K: K[1:5, 1:, :1], kernel, lora_out=True, grad=False)
    stack = make_structured(11, (3,), (5,), (4,), 2)
    check(lambda s: s[1:, 2:4, ::2], stack, lora_out=True)


@st.composite
def _slices(draw, shape):
    out = []
    for size in shape:
        start = draw(st.integers(0, size - 1))
        stop = draw(st.integers(start + 1, size))
        step = draw(st.integers(1, 2))
        out.append(slice(start, stop, step))
    return tuple(out)


@given(structures(max_dim=4), st.data())
def test_static_slice_property(structure, data):
    batch, m, n, k, alpha = structure
    lw = make_structured(2, batch, m, n, k, alpha)
    idx = data.draw(_slices(lw.shape))
    out, msgs = _run_recording(lambda w: w[idx], lw)
    assert _is_lw(out) and not msgs
    assert out.structure == lw.structure
    assert_close(np_materialize(out), np_materialize(lw)[idx])
