"""`lorax.lora(fn)`: JAX transformations inside and outside `fn`, policies, pytrees.

Every check compares with the dense reference `fn(lw.materialize(), ...)`: values
eagerly and under `jax.jit`, and gradients with respect to the factors `a` and `b`.
`on_materialize="error"` makes a missing or broken low-rank rule fail loudly.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import ad_checkpoint as _ad_checkpoint

import lorax
from conftest import assert_close
from lora_testing import (
    F32,
    put,
    is_lw as _is_lw,
    make_lw,
    dense,
    grad_and_out as _grad_and_out,
)


# -- helpers ---------------------------------------------------------------------


def _cotangents(ref):
    rng = np.random.default_rng(123)
    leaves = [x for x in jax.tree.leaves(ref) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return [put(rng.standard_normal(x.shape).astype(x.dtype)) for x in leaves]


def assert_factor_grads(got, want, dtype=F32):
    """Gradients reach `a` and `b` exactly as through the merged weight; `w` gets none."""
    got_l = jax.tree.leaves(got, is_leaf=_is_lw)
    want_l = jax.tree.leaves(want, is_leaf=_is_lw)
    n = 0
    for g, r in zip(got_l, want_l, strict=True):
        if _is_lw(g):
            n += 1
            assert_close(g.a, r.a, dtype)
            assert_close(g.b, r.b, dtype)
            assert not np.any(np.asarray(g.w)), "the frozen weight must get no gradient"
        elif jnp.issubdtype(jnp.result_type(g), jnp.inexact):
            assert_close(g, r, dtype)
    assert n > 0, "no LoraWeight among the differentiated arguments"


def _assert_outputs(out, ref, dtype):
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert not _is_lw(o)
        assert jnp.shape(o) == jnp.shape(r) and jnp.result_type(o) == jnp.result_type(r)
        assert_close(o, r, dtype)


def check(fn, *args, argnum=0, dtype=F32, policy="error", grad=True, eager_grad=False):
    """`lora(fn)` vs the dense reference: values eagerly; values and factor
    gradients under `jax.jit`; and, with `eager_grad`, gradients eagerly too."""
    g = lorax.lora(fn, on_materialize=policy)
    if not grad:
        ref = jax.jit(lambda a: fn(*dense(a)))(args)
        _assert_outputs(g(*args), ref, dtype)
        _assert_outputs(jax.jit(g)(*args), ref, dtype)
        return ref
    cts = _cotangents(jax.eval_shape(lambda a: fn(*dense(a)), args))
    both = lambda args: (_grad_and_out(fn, cts, argnum, True)(args),  # noqa: E731
                         _grad_and_out(g, cts, argnum, False)(args))
    (want, ref), (got, out) = jax.jit(both)(args)  # one compile for reference and lora
    _assert_outputs(g(*args), ref, dtype)
    _assert_outputs(out, ref, dtype)
    assert_factor_grads(got, want, dtype)
    if eager_grad:
        got, _ = _grad_and_out(g, cts, argnum, False)(args)
        assert_factor_grads(got, want, dtype)
    return ref


def _walk_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _walk_eqns(inner)


def weight_sized_math(fn, args, shapes):
    """Arithmetic eqns (incl. nested jaxprs) whose output has one of `shapes` (any order)."""
    keys = {tuple(sorted(s)) for s in shapes}
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    arith = {"dot_general", "add", "add_any", "mul", "sub"}
    return [
        e for e in _walk_eqns(jaxpr)
        if e.primitive.name in arith
        and any(tuple(sorted(getattr(v.aval, "shape", ()))) in keys for v in e.outvars)
    ]


@pytest.fixture
def lw():
    return make_lw(0, (4, 3), (4, 2), (2, 3), alpha=3.0)


@pytest.fixture
def x():
    return put(np.random.default_rng(7).standard_normal((5, 4)).astype(F32))


# -- eager, jit, grad -------------------------------------------------------------


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["bias"])
    return h @ params["w2"]


@pytest.fixture
def mlp_params():
    return {
        "w1": make_lw(1, (4, 6), (4, 2), (2, 6)),
        "w2": make_lw(2, (6, 3), (6, 1), (1, 3), alpha=1.5),
        "bias": put(np.linspace(-1.0, 1.0, 6, dtype=F32)),
    }


def test_eager_jit_and_grad_match_reference(mlp_params, x):
    ref = check(mlp, mlp_params, x, eager_grad=True)
    assert ref.shape == (5, 3)
    # The update really contributes: the reference differs from the frozen model.
    p = {k: np.asarray(v.w if _is_lw(v) else v) for k, v in mlp_params.items()}
    frozen = np.tanh(np.asarray(x) @ p["w1"] + p["bias"]) @ p["w2"]
    assert not np.allclose(ref, frozen, atol=1e-2)


def test_update_is_scaled_by_alpha_over_rank(lw, x):
    # Independent of `materialize`: spell out w + (alpha / k) * b @ a by hand.
    out = lorax.lora(lambda w, x: x @ w, on_materialize="error")(lw, x)
    by_hand = x @ (np.asarray(lw.w) + (3.0 / 2) * np.asarray(lw.b) @ np.asarray(lw.a))
    assert_close(out, by_hand)


def test_jit_inside_fn(mlp_params, x):
    check(lambda p, x: jax.jit(mlp)(p, x), mlp_params, x)


def test_matmul_stays_low_rank(mlp_params, x):
    fn = lorax.lora(mlp, on_materialize="error")
    shapes = [(4, 6), (6, 3)]
    assert weight_sized_math(fn, (mlp_params, x), shapes) == []
    loss = lambda p: jnp.sum(fn(p, x) ** 2)  # noqa: E731
    assert weight_sized_math(jax.grad(loss), (mlp_params,), shapes) == []


def test_grad_inside_fn_wrt_input(lw, x):
    def f(w, x):
        return jax.grad(lambda x: jnp.sum(jnp.tanh(x @ w)))(x)

    check(f, lw, x)


def test_grad_inside_fn_wrt_weight(lw, x):
    # d/dW sum(tanh(x W)) evaluated at the merged weight, then differentiated
    # again with respect to the factors from outside.
    def f(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    check(f, lw, x)


@pytest.mark.slow
def test_value_and_grad_inside_fn(lw, x):
    def f(w, x):
        val, g = jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x @ w)))(x)
        return val, g

    check(f, lw, x)


# -- vmap --------------------------------------------------------------------------


def test_vmap_outside_over_input(lw):
    xs = put(np.random.default_rng(3).standard_normal((6, 5, 4)).astype(F32))
    f = lambda w, x: jax.nn.relu(x @ w)  # noqa: E731
    vf = jax.vmap(lorax.lora(f, on_materialize="error"), in_axes=(None, 0))
    ref_f = jax.vmap(f, in_axes=(None, 0))
    assert_close(vf(lw, xs), ref_f(lw.materialize(), xs))
    loss = lambda fn, lw: jnp.sum(jnp.sin(fn(lw, xs)))  # noqa: E731
    got, want = jax.jit(lambda lw: (jax.grad(functools.partial(loss, vf))(lw),
                                    jax.grad(lambda lw: loss(ref_f, lw.materialize()))(lw)))(lw)
    assert_factor_grads(got, want)


def test_vmap_outside_over_stacked_weight(x):
    # vmapping the pytree slices w, a and b together: each call sees one layer.
    stack = make_lw(4, (3, 4, 2), (3, 4, 2), (3, 2, 2))
    f = lorax.lora(lambda w, x: jnp.tanh(x @ w), on_materialize="error")
    out = jax.vmap(f, in_axes=(0, None))(stack, x)
    ref = jax.vmap(lambda w: jnp.tanh(x @ w))(stack.materialize())
    assert_close(out, ref)


def test_vmap_inside_over_input(lw, x):
    check(lambda w, x: jax.vmap(lambda xi: jnp.tanh(xi @ w))(x), lw, x)


def test_vmap_inside_over_stacked_weight(x):
    stack = make_lw(5, (3, 4, 2), (3, 4, 2), (3, 2, 2))
    xs = jnp.stack([x, 2 * x, -x])
    check(lambda s, xs: jax.vmap(lambda w, x: jnp.tanh(x @ w), in_axes=0)(s, xs), stack, xs)
    # Stacked weight on the left of the contraction too (W @ x-style).
    check(lambda s, x: jax.vmap(lambda w, xi: w @ xi[:2], in_axes=0)(s, xs[:, 0]), stack, xs)


# -- checkpoint / remat -------------------------------------------------------------


def _has_remat(jaxpr):
    return any(e.primitive is _ad_checkpoint.remat_p for e in _walk_eqns(jaxpr))


def test_checkpoint_inside_fn(lw, x):
    policy = jax.checkpoint_policies.nothing_saveable

    def f(w, x):
        block = jax.checkpoint(lambda w, x: jnp.sin(x @ w) @ w.T, policy=policy)
        return block(w, x)

    check(f, lw, x)
    fn = lorax.lora(f, on_materialize="error")
    loss = lambda lw: jnp.sum(fn(lw, x) ** 2)  # noqa: E731
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(lw).jaxpr
    assert _has_remat(grad_jaxpr), "the checkpoint was dropped, not kept"
    assert weight_sized_math(jax.grad(loss), (lw,), [(4, 3)]) == []


def test_remat_closure_over_weight(lw, x):
    check(lambda w, x: jax.remat(lambda x: jnp.tanh(x @ w))(x), lw, x)


# -- control flow ------------------------------------------------------------------------


def _scan_model(stack, x):
    def body(h, w):
        h = jnp.tanh(h @ w)
        return h, jnp.sum(h, axis=-1)

    return lax.scan(body, x, stack)


@pytest.fixture
def stack():
    # Per-layer factors: b (L, in, k), a (L, k, out).
    return make_lw(6, (3, 4, 4), (3, 4, 2), (3, 2, 4))


def test_scan_over_stacked_weights(stack, x):
    h, ys = check(_scan_model, stack, x, eager_grad=True)
    assert h.shape == (5, 4) and ys.shape == (3, 5)


def test_scan_body_sees_one_layer(stack, x):
    seen = []

    def body(h, w):
        seen.append((type(w).__name__, w.shape))
        return h @ w, None

    lorax.lora(lambda s, x: lax.scan(body, x, s)[0], on_materialize="error")(stack, x)
    assert seen and all(shape == (4, 4) for _, shape in seen)


def test_scan_with_weight_as_const_and_carry_output(lw, x):
    def f(w, x):
        def body(c, xi):
            return c + jnp.sum(xi @ w), jnp.cos(xi @ w)

        return lax.scan(body, jnp.zeros(()), x)

    check(f, lw, x)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond(lw, x, sign):
    def f(w, x):
        return lax.cond(jnp.sum(x) * sign > 0, lambda w: jnp.tanh(x @ w), lambda w: -(x @ w), w)

    xx = jnp.abs(x)
    check(f, lw, xx)
    # Branch taken matters: the two branches give different answers.
    out = lorax.lora(f, on_materialize="error")(lw, xx)
    expected = jnp.tanh(xx @ lw.materialize()) if sign > 0 else -(xx @ lw.materialize())
    assert_close(out, expected)


def test_cond_closure(lw, x):
    check(lambda w, x: lax.cond(x[0, 0] > 0, lambda: x @ w, lambda: 2 * (x @ w)), lw, x)


def test_fori_loop_static_bounds(x):
    w = make_lw(8, (4, 4), (4, 2), (2, 4))
    check(lambda w, x: lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x), w, x)


def test_while_loop_values_and_forward_mode(x):
    w = make_lw(9, (4, 4), (4, 2), (2, 4))

    def f(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)

        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    # Reverse mode is unavailable for while_loop; check values and a JVP.
    check(f, w, x, grad=False)
    g = lorax.lora(f, on_materialize="error")
    da = jnp.ones_like(w.a)
    tangent = dataclasses.replace(w, w=jnp.zeros_like(w.w), a=da, b=jnp.zeros_like(w.b))
    _, got = jax.jvp(lambda w: g(w, x), (w,), (tangent,))
    _, want = jax.jvp(lambda w: f(w.materialize(), x), (w,), (tangent,))
    assert_close(got, want)
    assert np.abs(np.asarray(want)).max() > 1e-3


# -- custom_jvp / custom_vjp ------------------------------------------------------------


@pytest.mark.parametrize("act", [jax.nn.relu, jax.nn.gelu, pytest.param(jax.nn.silu, marks=pytest.mark.slow)],
                         ids=["relu", "gelu", "silu"])
def test_activations(lw, x, act):
    check(lambda w, x: act(x @ w), lw, x)


@jax.custom_jvp
def _triple_jvp(x):
    return jnp.sin(x)


@_triple_jvp.defjvp
def _(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), 3.0 * jnp.cos(x) * t


@jax.custom_vjp
def _double_grad(x):
    return x


_double_grad.defvjp(lambda x: (x, None), lambda _, g: (2.0 * g,))


@pytest.mark.parametrize("custom, factor", [(_triple_jvp, 3.0), (_double_grad, 2.0)],
                         ids=["custom_jvp", "custom_vjp"])
def test_custom_derivative_on_activations(lw, x, custom, factor):
    plain = {_triple_jvp: jnp.sin, _double_grad: lambda h: h}[custom]
    f = lambda w, x: jnp.tanh(custom(x @ w))  # noqa: E731
    check(f, lw, x)
    # The custom rule is really used: gradients are `factor` times the plain ones.
    g = lorax.lora(f, on_materialize="error")
    got, plain_grad = jax.jit(lambda lw: (
        jax.grad(lambda lw: jnp.sum(g(lw, x)))(lw),
        jax.grad(lambda lw: jnp.sum(jnp.tanh(plain(x @ lw.materialize()))))(lw)))(lw)
    assert_close(got.a, factor * plain_grad.a)
    assert_close(got.b, factor * plain_grad.b)


@jax.custom_vjp
def _matmul_3x(w, x):
    return x @ w


_matmul_3x.defvjp(lambda w, x: (x @ w, (w, x)), lambda r, g: (3.0 * (r[1].T @ g), g @ r[0].T))


def test_custom_vjp_receiving_the_weight_materializes(lw, x):
    f = lambda w, x: jnp.tanh(_matmul_3x(w, x))  # noqa: E731
    with pytest.warns(lorax.LoraMaterializationWarning) as rec:
        out = lorax.lora(f)(lw, x)
    msg = str(rec[0].message)
    assert "materialized" in msg and "custom_vjp_call" in msg and "(4, 3)" in msg
    # Only the LoraWeight is named, not the plain activation passed alongside it.
    assert "(5, 4)" not in msg and "_DenseArrayValue" not in msg
    assert_close(out, f(lw.materialize(), x))
    check(f, lw, x, policy="allow")
    got = jax.grad(lambda lw: jnp.sum(lorax.lora(f, on_materialize="allow")(lw, x)))(lw)
    plain = jax.grad(lambda lw: jnp.sum(jnp.tanh(x @ lw.materialize())))(lw)
    assert_close(got.a, 3.0 * plain.a)  # the custom bwd rule reached the factors
    assert_close(got.b, 3.0 * plain.b)
    with pytest.raises(lorax.LoraMaterializationError, match="custom_vjp_call"):
        lorax.lora(f, on_materialize="error")(lw, x)


@jax.custom_jvp
def _matmul_jvp(w, x):
    return x @ w


@_matmul_jvp.defjvp
def _(primals, tangents):
    (w, x), (tw, tx) = primals, tangents
    return x @ w, tx @ w + x @ tw


@pytest.mark.parametrize("f", [lambda w, x: jnp.sin(_matmul_jvp(w, x)),
                               lambda w, x: x @ jax.nn.relu(w)], ids=["custom_jvp", "relu_of_weight"])
def test_custom_jvp_receiving_the_weight_materializes(lw, x, f):
    # A custom_jvp rule is written for plain arrays. Handing it a LoraWeight's
    # tangent as a LoraWeight would be wrong (the update is bilinear in b, a).
    with pytest.warns(lorax.LoraMaterializationWarning, match=r"custom_jvp_call.*\(4, 3\)"):
        out = lorax.lora(f)(lw, x)
    assert_close(out, f(lw.materialize(), x))
    check(f, lw, x, policy="allow")
    tangent = dataclasses.replace(lw, w=jnp.zeros_like(lw.w), a=jnp.ones_like(lw.a), b=jnp.zeros_like(lw.b))
    _, got = jax.jvp(lambda w: lorax.lora(f, on_materialize="allow")(w, x), (lw,), (tangent,))
    _, want = jax.jvp(lambda w: f(w.materialize(), x), (lw,), (tangent,))
    assert np.abs(np.asarray(want)).max() > 1e-3
    assert_close(got, want)
    with pytest.raises(lorax.LoraMaterializationError, match="custom_jvp_call"):
        lorax.lora(f, on_materialize="error")(lw, x)


# -- pytrees, kwargs, outputs --------------------------------------------------------------


def test_lora_weights_nested_in_pytrees_and_kwargs(x):
    w1 = make_lw(10, (4, 3), (4, 2), (2, 3))
    w2 = make_lw(11, (3, 2), (3, 1), (1, 2), alpha=0.5)
    w3 = make_lw(12, (4, 2), (4, 2), (2, 2))

    def f(tree, x, *, extra, scale=1.0):
        (d,), t = tree
        h = x @ d["layers"][0]["w"] + t[1]
        h = jnp.tanh(h) @ d["layers"][1][0]
        return {"out": scale * h + x @ extra["w3"], "aux": [h.sum(), t[0]]}

    tree = ([{"layers": [{"w": w1}, (w2,)]}], (jnp.int32(3), jnp.ones(3)))
    kwargs = dict(extra={"w3": w3}, scale=2.0)
    out = lorax.lora(f, on_materialize="error")(tree, x, **kwargs)  # real kwargs
    ref = jax.jit(lambda t, e: f(dense(t), x, extra=dense(e), scale=2.0))(tree, kwargs["extra"])
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    jax.tree.map(assert_close, out, ref)

    # Gradients w.r.t. every LoraWeight, wherever it sits (positional and keyword).
    def g(params, x):
        tree, extra = params
        return f(tree, x, extra=extra, scale=2.0)

    got = check(g, (tree, kwargs["extra"]), x)
    jax.tree.map(assert_close, got, ref)
    n_lws = len([l for l in jax.tree.leaves((tree, kwargs), is_leaf=_is_lw) if _is_lw(l)])
    assert n_lws == 3


def test_returns_lora_weight_and_passes_through_non_array_args(lw):
    out = lorax.lora(lambda w, name, n: (w, name * n), on_materialize="error")(lw, "ab", 2)
    assert out[1] == "abab"
    assert _is_lw(out[0])
    assert_close(out[0].materialize(), lw.materialize())


def test_no_lora_weight_behaves_like_original(x):
    def f(x, y, *, flag):
        # Reads a concrete value: only possible if nothing is traced.
        if flag and float(x.sum()) > 0:
            return {"a": x * y, "b": [int(x.shape[0])]}
        return {"a": x - y, "b": [0]}

    g = lorax.lora(f, on_materialize="error")
    for flag in (True, False):
        ref = f(jnp.abs(x), 2.0, flag=flag)
        out = g(jnp.abs(x), 2.0, flag=flag)
        assert jax.tree.structure(out) == jax.tree.structure(ref)
        assert out["b"] == ref["b"] and type(out["b"][0]) is int
        assert out["a"].dtype == ref["a"].dtype and out["a"].shape == ref["a"].shape
        np.testing.assert_array_equal(out["a"], ref["a"])  # exact: `f` itself ran, untraced
    assert g.__name__ == "f" and g.__wrapped__ is f
    assert jax.grad(lambda x: g(x, 3.0, flag=False)["a"].sum())(x).sum() == x.size


# -- materialization policies ------------------------------------------------------------


def _no_rule(w, x):
    return x @ jnp.sin(w)  # `sin` has no low-rank rule


def test_policy_warn_is_the_default(lw, x):
    assert issubclass(lorax.LoraMaterializationWarning, UserWarning)
    with pytest.warns(lorax.LoraMaterializationWarning) as rec:
        out = lorax.lora(_no_rule)(lw, x)
    assert_close(out, _no_rule(lw.materialize(), x))
    msgs = [str(r.message) for r in rec if r.category is lorax.LoraMaterializationWarning]
    assert len(msgs) == 1
    assert "materialized" in msgs[0] and "`sin`" in msgs[0] and "(4, 3)" in msgs[0]


def test_policy_warn_gradients_are_correct(lw, x):
    with pytest.warns(lorax.LoraMaterializationWarning):
        check(_no_rule, lw, x, policy="warn")


def test_policy_error_raises(lw, x):
    with pytest.raises(lorax.LoraMaterializationError, match=r"sin.*\(4, 3\)"):
        lorax.lora(_no_rule, on_materialize="error")(lw, x)
    with pytest.raises(lorax.LoraMaterializationError):
        jax.jit(lorax.lora(_no_rule, on_materialize="error"))(lw, x)
    assert not issubclass(lorax.LoraMaterializationError, Warning)


def test_policy_allow_is_silent(lw, x):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lorax.lora(_no_rule, on_materialize="allow")(lw, x)
        check(_no_rule, lw, x, policy="allow")
    assert_close(out, _no_rule(lw.materialize(), x))


def test_policy_is_scoped_to_the_call(lw, x):
    strict = lorax.lora(_no_rule, on_materialize="error")
    with pytest.raises(lorax.LoraMaterializationError):
        strict(lw, x)
    # The failed strict call must not leak its policy into later calls.
    with pytest.warns(lorax.LoraMaterializationWarning):
        lorax.lora(_no_rule)(lw, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lorax.lora(_no_rule, on_materialize="allow")(lw, x)
    with pytest.raises(lorax.LoraMaterializationError):
        strict(lw, x)


@pytest.mark.parametrize("bad", ["ignore", "WARN", "", None])
def test_invalid_policy_rejected_at_wrap_time(bad):
    called = []
    with pytest.raises(ValueError, match="on_materialize"):
        lorax.lora(lambda w: called.append(w), on_materialize=bad)
    assert called == []


# -- LoraWeight construction ---------------------------------------------------------------


@pytest.mark.parametrize(
    "w_shape, b_shape, a_shape",
    [
        ((4, 3), (5, 2), (2, 3)),  # M mismatch
        ((4, 3), (4, 2), (2, 5)),  # N mismatch
        ((4, 3), (4, 2), (3, 3)),  # rank mismatch
        ((2, 4, 3), (3, 4, 2), (2, 2, 3)),  # batch mismatch
        ((4, 3), (4,), (2, 3)),  # b too short
        ((12,), (12, 2), (2,)),  # no N axis
        ((4, 3), (4, 3, 2), (2, 3)),  # extra axis on b only
    ],
)
def test_mismatched_shapes_raise_value_error_with_shapes(w_shape, b_shape, a_shape):
    with pytest.raises(ValueError) as err:
        lorax.LoraWeight(jnp.zeros(w_shape), a=jnp.zeros(a_shape), b=jnp.zeros(b_shape))
    msg = str(err.value)
    for shape in (w_shape, b_shape, a_shape):
        assert str(tuple(shape)) in msg


def test_valid_structures():
    assert make_lw(0, (4, 3), (4, 2), (2, 3)).structure == (0, 1, 1)
    assert make_lw(0, (6, 2, 3), (6, 2), (2, 2, 3)).structure == (0, 1, 2)
    assert make_lw(0, (2, 3, 4), (2, 3, 1), (1, 4)).structure == (0, 2, 1)
    assert make_lw(0, (5, 4, 3), (5, 4, 2), (5, 2, 3)).structure == (1, 1, 1)


def test_alpha_must_be_static():
    with pytest.raises(TypeError, match="alpha"):
        jax.jit(lambda al: lorax.LoraWeight(jnp.zeros((2, 2)), jnp.zeros((1, 2)), jnp.zeros((2, 1)), al))(1.0)


def test_dataclasses_replace(lw):
    new_a = jnp.full_like(lw.a, 0.25)
    lw2 = dataclasses.replace(lw, a=new_a)
    assert _is_lw(lw2) and lw2 is not lw
    assert lw2.alpha == lw.alpha and lw2.rank == lw.rank
    np.testing.assert_array_equal(lw2.a, new_a)
    np.testing.assert_array_equal(lw2.b, lw.b)
    np.testing.assert_array_equal(lw2.w, lw.w)
    np.testing.assert_array_equal(lw.a, make_lw(0, (4, 3), (4, 2), (2, 3)).a)  # original untouched
    assert_close(lw2.materialize(), lw.w + 1.5 * lw.b @ new_a)
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        dataclasses.replace(lw, a=jnp.zeros((2, 7)))


# -- derivatives through the low-rank path's custom JVP ----------------------------------
#
# With several activation rows axes the output-side factor's contraction carries its own
# JVP (its cotangent as a canonical matmul): forward mode, reverse mode, second order and
# unperturbed factors must all agree with the materialised weight.


@pytest.mark.parametrize("pattern, w_shape, b_shape, a_shape, x_shape", [
    ("bsd,dhk->bshk", (6, 2, 3), (6, 2), (2, 2, 3), (2, 3, 6)),     # x @ W, rows (b, s)
    ("hkd,bshk->bsd", (2, 3, 6), (2, 3, 2), (2, 6), (2, 3, 2, 3)),  # W first, heads contracted
    ("od,bsd->bos", (5, 4), (5, 2), (2, 4), (2, 3, 4)),             # W @ x, rows (b, s)
])
def test_multi_row_contraction_derivatives(pattern, w_shape, b_shape, a_shape, x_shape):
    w = make_lw(21, w_shape, b_shape, a_shape)
    x = jnp.asarray(np.random.default_rng(3).standard_normal(x_shape), jnp.float32)
    x_first = pattern.startswith("bsd")
    f = lambda w, x: jnp.tanh(  # noqa: E731
        jnp.einsum(pattern, x, w) if x_first else jnp.einsum(pattern, w, x))
    check(f, w, x)
    g = lorax.lora(f, on_materialize="error")
    assert "custom_jvp_call" in str(jax.make_jaxpr(g)(w, x))  # the path under test is taken
    ref = lambda w, x: f(w.materialize(), x)  # noqa: E731
    rng = np.random.default_rng(4)
    tangent = dataclasses.replace(
        w, w=jnp.zeros_like(w.w), a=jnp.asarray(rng.standard_normal(w.a.shape), w.a.dtype),
        b=jnp.asarray(rng.standard_normal(w.b.shape), w.b.dtype))
    dx = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    # Forward mode, factors and input perturbed together, then each alone.
    for t_w, t_x in ((tangent, dx), (tangent, jnp.zeros_like(dx)),
                     (dataclasses.replace(tangent, a=jnp.zeros_like(w.a)), dx)):
        _, got = jax.jvp(g, (w, x), (t_w, t_x))
        _, want = jax.jvp(ref, (w, x), (t_w, t_x))
        assert_close(got, want, rtol=1e-5)
    # Second order: a Hessian-vector product w.r.t. the output-side factor.
    def hvp(fn):
        def loss_a(a):
            return jnp.sum(fn(dataclasses.replace(w, a=a), x) ** 2)
        return jax.jvp(jax.grad(loss_a), (w.a,), (tangent.a,))[1]
    assert_close(hvp(g), hvp(ref), rtol=1e-4)
    # Only the input-side factor trained (the output side's tangent is a symbolic zero).
    got = jax.grad(lambda b: jnp.sum(g(dataclasses.replace(w, b=b), x) ** 2))(w.b)
    want = jax.grad(lambda b: jnp.sum(ref(dataclasses.replace(w, b=b), x) ** 2))(w.b)
    assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("fn", [3, "model", None])
def test_lora_refuses_a_non_callable_at_once(fn):
    with pytest.raises(TypeError, match=r"lora: fn must be a callable .*; got "):
        lorax.lora(fn)
