"""`gather` on a `LoraWeight`: embedding lookups, column lookups, layer picks.

Row lookups `E[ids]` must cost a gather of `b` plus a rank-`k` contraction, never
the merged `(vocab, dim)` table; gathers along batch axes must return a stacked
`LoraWeight`. Real Flax, Haiku and Equinox embedding code is run with its table
swapped for a `LoraWeight`. Everything runs under `on_materialize="error"` and is
compared with the dense reference: values eager and jitted, factor gradients.
"""

from __future__ import annotations

import math

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

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


VOCAB, DIM, RANK = 9, 5, 2


# -- helpers -------------------------------------------------------------------------------


def _assert_outputs(out, ref, lora_out):
    if lora_out:
        assert _is_lw(out), f"expected a LoraWeight, got {type(out).__name__}"
        assert out.shape == ref.shape
        assert_close(np_materialize(out), ref)
        return
    for o, r in zip(jax.tree.leaves(out, is_leaf=_is_lw), jax.tree.leaves(ref), strict=True):
        assert not _is_lw(o)
        assert o.shape == r.shape and o.dtype == r.dtype
        assert_close(o, r)


def assert_factor_grads(got, want):
    pairs = [(g, r) for g, r in zip(jax.tree.leaves(got, is_leaf=_is_lw), jax.tree.leaves(want, is_leaf=_is_lw))
             if _is_lw(g)]
    assert pairs
    for g, r in pairs:
        assert_close(g.a, r.a)
        assert_close(g.b, r.b)
        # `lora` freezes W on the way in: even a LoraWeight returned by `lora(fn)`
        # and merged outside carries no gradient to its `w`.
        assert not np.any(np.asarray(g.w)), "the frozen weight must get no gradient"


def check(fn, *args, lora_out=False, grad=True, eager_grad=False):
    """`lora(fn)` vs `fn` on merged weights: values eager + jit, factor gradients."""
    g = lorax.lora(fn, on_materialize="error")
    if grad:
        rng = np.random.default_rng(5)
        cts = [put(rng.standard_normal(x.shape).astype(x.dtype))
               for x in jax.tree.leaves(jax.eval_shape(lambda a: fn(*dense(a)), args))
               if jnp.issubdtype(x.dtype, jnp.inexact)]
        both = lambda args: (_grad_and_out(fn, cts, 0, True)(args), _grad_and_out(g, cts, 0, False)(args))  # noqa: E731
        (want, ref), (got, out) = jax.jit(both)(args)  # one compile for reference and lora
        _assert_outputs(out, ref, lora_out)
        assert_factor_grads(got, want)
        if eager_grad:
            assert_factor_grads(_grad_and_out(g, cts, 0, False)(args)[0], want)
    else:
        ref = jax.jit(lambda a: fn(*dense(a)))(args)
        _assert_outputs(jax.jit(g)(*args), ref, lora_out)
    _assert_outputs(g(*args), ref, lora_out)
    return ref


def weight_sized_math(fn, args, shape):
    """Arithmetic eqns whose output has the table's shape (in any axis order)."""
    key = tuple(sorted(shape))

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
            and any(tuple(sorted(getattr(v.aval, "shape", ()))) == key for v in e.outvars)]


@pytest.fixture
def emb():
    return make_lw(0, (VOCAB, DIM), (VOCAB, RANK), (RANK, DIM), alpha=3.0)


@pytest.fixture
def emb_t():
    # A (dim, vocab) table, looked up by column.
    return make_lw(1, (DIM, VOCAB), (DIM, RANK), (RANK, VOCAB), alpha=3.0)


IDS = {
    "scalar": np.int32(7),
    "vector": np.array([3, 0, 8, 3], np.int32),
    "matrix": np.array([[1, 8, 2], [0, 0, 5]], np.int32),
}


# -- row and column lookups -------------------------------------------------------------------


@pytest.mark.parametrize("ids", IDS.values(), ids=IDS.keys())
@pytest.mark.parametrize(
    "lookup", [lambda E, i: E[i], pytest.param(lambda E, i: jnp.take(E, i, axis=0), marks=pytest.mark.slow)],
    ids=["index", "take"],
)
def test_row_lookup(emb, ids, lookup):
    ids = put(ids)
    ref = check(lookup, emb, ids)
    assert ref.shape == (*ids.shape, DIM)
    fn = lorax.lora(lookup, on_materialize="error")
    assert weight_sized_math(fn, (emb, ids), emb.shape) == []
    assert weight_sized_math(jax.grad(lambda E: jnp.sum(fn(E, ids) ** 2)), (emb,), emb.shape) == []


def test_row_lookup_eager_grads_and_negative_ids(emb):
    ids = put(np.array([[-1, 2], [0, -9]], np.int32))  # numpy-style negative indices
    ref = check(lambda E, i: E[i, :], emb, ids, eager_grad=True)
    assert_close(ref, np_materialize(emb)[np.asarray(ids)])


@pytest.mark.parametrize(
    "lookup, ids",
    [(lambda E, i: E[:, i], IDS["scalar"]), (lambda E, i: E[:, i], IDS["vector"]),
     (lambda E, i: E[:, i], IDS["matrix"]), (lambda E, i: jnp.take(E, i, axis=1), IDS["matrix"])],
    ids=["index-scalar", "index-vector", "index-matrix", "take-matrix"],
)
def test_column_lookup(emb_t, ids, lookup):
    ids = put(ids)
    ref = check(lookup, emb_t, ids)
    assert ref.shape == (DIM, *ids.shape)
    fn = lorax.lora(lookup, on_materialize="error")
    assert weight_sized_math(fn, (emb_t, ids), emb_t.shape) == []


def test_lookup_then_tied_logits(emb):
    # An LM's embed -> hidden -> tied-unembed round trip.
    def lm(E, ids):
        h = jnp.tanh(E[ids])
        return jax.nn.log_softmax(h @ E.T)

    ids = put(IDS["matrix"])
    check(lm, emb, ids)
    fn = lorax.lora(lm, on_materialize="error")
    assert weight_sized_math(jax.grad(lambda E: jnp.sum(fn(E, ids))), (emb,), emb.shape) == []


# -- out-of-bounds modes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "lookup",
    [
        lambda E, i: jnp.take(E, i, axis=0, mode="fill", fill_value=0.5),
        lambda E, i: jnp.take(E, i, axis=0),  # default: fill with NaN
        lambda E, i: jnp.take(E, i, axis=0, mode="clip"),
        lambda E, i: jnp.take(E, i, axis=1, mode="fill", fill_value=-2.0),
    ],
    ids=["fill_value", "fill_nan", "clip", "column_fill"],
)
def test_out_of_bounds_ids(emb, lookup):
    ids = put(np.array([1, VOCAB + 3, -VOCAB - 4, 4], np.int32))
    out = lorax.lora(lookup, on_materialize="error")(emb, ids)
    ref = lookup(emb.materialize(), ids)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)  # NaNs must match too
    # Out-of-bounds rows get no gradient, and no NaN leaks into the factors.
    check(lookup, emb, ids)


def test_out_of_bounds_layer_pick_with_fill():
    stack = make_lw(2, (3, 4, 2), (3, 4, 2), (3, 2, 2))
    pick = lambda s: jnp.take(s, jnp.array([2, 5]), axis=0, fill_value=0.25)  # noqa: E731
    out = lorax.lora(pick, on_materialize="error")(stack)
    assert _is_lw(out)
    np.testing.assert_allclose(np_materialize(out)[1], 0.25)
    check(pick, stack, lora_out=True)


# -- gathers along batch axes: picking layers of a stack ------------------------------------------


@pytest.fixture
def stack():
    return make_lw(3, (4, 5, 3), (4, 5, 2), (4, 2, 3))


@pytest.mark.parametrize(
    "pick, shape",
    [
        (lambda s: s[jnp.array([0, 2])], (2, 5, 3)),
        (lambda s: s[jnp.array([3, 3, 1])], (3, 5, 3)),
        (lambda s: jnp.take(s, jnp.array([[1, 0], [2, 3]]), axis=0), (2, 2, 5, 3)),
        (lambda s: s[jnp.array(2)], (5, 3)),
    ],
    ids=["two", "repeated", "matrix_ids", "scalar_array"],
)
def test_gather_layers(stack, pick, shape):
    out = lorax.lora(pick, on_materialize="error")(stack)
    assert _is_lw(out) and out.shape == shape
    assert out.structure == (len(shape) - 2, 1, 1)
    check(pick, stack, lora_out=True)


def test_gathered_layers_used_in_matmul(stack):
    x = jnp.ones((2, 5))
    check(lambda s, x: jnp.einsum("bi,lio->lbo", x, s[jnp.array([0, 2])]), stack, x)


def test_lookup_in_every_layer_of_a_stack(stack):
    # `S[:, ids]`: rows of every layer at once (batch axis taken whole).
    ids = put(np.array([[4, 0], [1, 1]], np.int32))
    check(lambda s, i: s[:, i], stack, ids)
    check(lambda s, i: s[..., i], stack, jnp.array([2, 0]))


# -- vmap: per-example lookups (`jax.vmap(eqx.nn.Embedding)`) -------------------------------------


def test_vmapped_scalar_lookup(emb, emb_t):
    ids = put(IDS["matrix"])
    check(lambda E, i: jax.vmap(jax.vmap(lambda t: E[t]))(i), emb, ids)
    check(lambda E, i: jax.vmap(lambda t: jnp.take(E, t, axis=0))(i), emb, ids, grad=False)
    check(lambda E, i: jax.vmap(lambda t: E[:, t])(i[0]), emb_t, ids, grad=False)


def test_vmapped_lookup_over_stacked_tables(stack):
    ids = put(np.array([[1, 2], [0, 0], [4, 4], [3, 1]], np.int32))
    check(lambda s, i: jax.vmap(lambda E, t: E[t])(s, i), stack, ids)
    check(lambda s, i: jax.vmap(lambda E, t: E[:, t])(s, i[:, :1] % 3), stack, ids, grad=False)


@pytest.mark.slow
def test_vmapped_scalar_lookup_over_stacked_tables(stack):
    ids = put(np.array([1, 2, 4, 0], np.int32))
    check(lambda s, i: jax.vmap(lambda E, t: E[t])(s, i), stack, ids)


def test_vmapped_layer_pick(stack):
    out = lorax.lora(lambda s: jax.vmap(lambda i: s[i])(jnp.array([3, 0, 0])), on_materialize="error")(stack)
    assert _is_lw(out) and out.shape == (3, 5, 3)
    check(lambda s: jax.vmap(lambda i: s[i])(jnp.array([3, 0, 0])), stack, lora_out=True)


# -- real framework embedding code ---------------------------------------------------------------


def _with_factors(table, seed=4):
    rng = np.random.default_rng(seed)
    v, d = table.shape
    return lorax.LoraWeight(table, a=put(rng.standard_normal((RANK, d)).astype(np.float32)),
                            b=put(rng.standard_normal((v, RANK)).astype(np.float32)), alpha=2.0)


def test_flax_linen_embed():
    ids = put(IDS["matrix"])
    model = nn.Embed(VOCAB, DIM)
    params = model.init(jax.random.PRNGKey(0), ids)
    params = {"params": {"embedding": _with_factors(params["params"]["embedding"])}}
    out = check(model.apply, params, ids)
    assert out.shape == (*ids.shape, DIM)
    query = put(np.random.default_rng(1).standard_normal((3, DIM)).astype(np.float32))
    attend = lambda p, q: model.apply(p, q, method=nn.Embed.attend)  # noqa: E731
    logits = check(attend, params, query)
    assert logits.shape == (3, VOCAB)
    fn = lorax.lora(attend, on_materialize="error")
    assert weight_sized_math(fn, (params, query), (VOCAB, DIM)) == []


@pytest.mark.parametrize("style", ["ARRAY_INDEX", "ONE_HOT"])
def test_haiku_embed(style):
    ids = put(IDS["matrix"])
    model = hk.without_apply_rng(hk.transform(
        lambda i: hk.Embed(VOCAB, DIM, lookup_style=getattr(hk.EmbedLookupStyle, style))(i)))
    params = model.init(jax.random.PRNGKey(0), ids)
    (name,) = params
    params = {name: {"embeddings": _with_factors(params[name]["embeddings"])}}
    out = check(model.apply, params, ids)
    assert out.shape == (*ids.shape, DIM)


def test_equinox_embedding():
    ids = put(IDS["matrix"])
    model = eqx.nn.Embedding(VOCAB, DIM, key=jax.random.PRNGKey(0))
    model = eqx.tree_at(lambda m: m.weight, model, _with_factors(model.weight))
    assert _is_lw(model.weight)
    check(lambda m, i: m(i[0, 1]), model, ids)  # one token: `weight[i]`
    out = check(lambda m, i: jax.vmap(jax.vmap(m))(i), model, ids, eager_grad=True)
    assert out.shape == (*ids.shape, DIM)


# -- property ----------------------------------------------------------------------------------


@given(
    vocab=st.integers(1, 8),
    dim=st.integers(1, 5),
    rank=st.integers(1, 3),
    ids_shape=st.lists(st.integers(0, 3), max_size=2).map(tuple),
    style=st.sampled_from(["index", "take", "column", "vmap"]),
    alpha=st.sampled_from([1.0, 0.5, 8.0]),
    data=st.data(),
)
def test_lookup_property(vocab, dim, rank, ids_shape, style, alpha, data):
    column = style == "column"
    shape = (dim, vocab) if column else (vocab, dim)
    lw = make_lw(data.draw(st.integers(0, 3), label="seed"), shape,
                 (shape[0], rank), (rank, shape[1]), alpha)
    ids = np.asarray(data.draw(st.lists(st.integers(0, vocab - 1), min_size=math.prod(ids_shape),
                                        max_size=math.prod(ids_shape)), label="ids"), np.int32)
    ids = ids.reshape(ids_shape)
    note(f"shape={shape} rank={rank} ids={ids.tolist()}")
    if style == "vmap" and ids.ndim == 0:
        style = "index"
    fn = {
        "index": lambda E, i: E[i],
        "take": lambda E, i: jnp.take(E, i, axis=0),
        "column": lambda E, i: E[:, i],
        "vmap": lambda E, i: jax.vmap(lambda t: E[t])(i.reshape(-1)).reshape(*i.shape, dim),
    }[style]
    lora_fn = lorax.lora(fn, on_materialize="error")
    rng = np.random.default_rng(0)
    out_shape = (dim, *ids_shape) if column else (*ids_shape, dim)
    ct = rng.standard_normal(out_shape).astype(F32)

    def loss(lw, ids):
        out = lora_fn(lw, ids)
        return jnp.vdot(put(ct), out), out

    grads, out = jax.jit(jax.grad(loss, has_aux=True))(lw, put(ids))
    merged = np_materialize(lw)
    # Numpy reference: the lookup, and its gradient scattered back onto the table.
    g_table = np.zeros(shape)
    if column:
        assert_close(out, merged[:, ids])
        np.add.at(g_table.T, ids.reshape(-1), np.moveaxis(ct, 0, -1).reshape(-1, dim))
    else:
        assert_close(out, merged[ids])
        np.add.at(g_table, ids.reshape(-1), ct.reshape(-1, dim))
    s = alpha / rank
    assert_close(grads.b, s * g_table @ np.asarray(lw.a, np.float64).T)
    assert_close(grads.a, s * np.asarray(lw.b, np.float64).T @ g_table)
    assert not np.any(np.asarray(grads.w))
