"""lorax's per-call decisions hold on every call, whatever the process traced before.

quax caches the re-traced body of a nested `jax.jit` per (jaxpr, tree structure), and
JAX caches lorax's own jitted rule bodies: a decision made while tracing a rule (the
materialise policy, `infer_layout`'s recording) must not be reused from an earlier call
made under another policy. Each model here calls a jitted function inside: a plain
`@jax.jit` helper, a Flax `nn.jit` module and an `nnx.jit` function.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import lorax
from lorax import _engine
from quax import _primitives as quax_primitives

X = jnp.ones((2, 4))


def _plain_jit():
    # Built per test: a warning is given when a body is traced, as JAX's own are.
    @jax.jit
    def tanh_layer(w, x):
        return x @ jnp.tanh(w)  # tanh has no low-rank rule: W is materialised

    params = {"w": jnp.ones((4, 3))}
    return (lambda p, x: tanh_layer(p["w"], x)), params, r"^w$"


class _TanhDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.normal(), (x.shape[-1], 3))
        return x @ jnp.tanh(kernel)


def _linen_jit():
    model = nn.jit(_TanhDense)()
    params = model.init(jax.random.PRNGKey(0), X)["params"]
    return (lambda p, x: model.apply({"params": p}, x)), params, "kernel"


def _nnx_jit():
    class Model(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.ones((4, 3)))

    @nnx.jit
    def forward(model, x):
        return x @ jnp.tanh(model.kernel[...])

    graphdef, state = nnx.split(Model())
    return (lambda s, x: forward(nnx.merge(graphdef, s), x)), state, "kernel"


MODELS = {"jax.jit": _plain_jit, "nn.jit": _linen_jit, "nnx.jit": _nnx_jit}


def _lora_params(params, targets):
    spec = lorax.simple_spec(params, targets=targets, rank=2)
    spec = jax.tree.map(lambda s: lorax.LoraSpec(2, batch_ndim=0, m_ndim=1) if s == 2 else s,
                        spec)
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    # Non-zero `b`: the materialised weight then differs from `w`.
    return jax.tree.map(lambda l: lorax.LoraWeight(l.w, l.a, l.b + 0.5, alpha=l.alpha)
                        if isinstance(l, lorax.LoraWeight) else l,
                        lp, is_leaf=lambda l: isinstance(l, lorax.LoraWeight))


def _call(fn, lp, policy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lorax.LoraMaterializationWarning)
        return lorax.lora(fn, on_materialize=policy)(lp, X)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("history", [(), ("warn",), ("allow", "warn"), ("error",)])
def test_error_policy_raises_whatever_was_called_before(model, history):
    fn, params, targets = MODELS[model]()
    lp = _lora_params(params, targets)
    for policy in history:
        if policy == "error":
            with pytest.raises(lorax.LoraMaterializationError):
                _call(fn, lp, policy)
        else:
            _call(fn, lp, policy)
    with pytest.raises(lorax.LoraMaterializationError):
        _call(fn, lp, "error")
    _call(fn, lp, "allow")  # and the other way round: an error is not cached either


@pytest.mark.parametrize("model", MODELS)
def test_warn_policy_warns_after_an_allow_call(model):
    fn, params, targets = MODELS[model]()
    lp = _lora_params(params, targets)
    _call(fn, lp, "allow")
    with pytest.warns(lorax.LoraMaterializationWarning):
        lorax.lora(fn)(lp, X)


@pytest.mark.parametrize("model", MODELS)
def test_error_policy_under_an_outer_jit(model):
    fn, params, targets = MODELS[model]()
    lp = _lora_params(params, targets)
    jax.jit(lambda lp: _call(fn, lp, "allow"))(lp)
    with pytest.raises(lorax.LoraMaterializationError):
        jax.jit(lambda lp: lorax.lora(fn, on_materialize="error")(lp, X))(lp)


def _dense_model(model):
    """The same models with a plain `x @ W` (no tanh): every use has a rule."""
    if model == "jax.jit":
        lin = jax.jit(lambda w, x: x @ w)
        return (lambda p, x: lin(p["w"], x)), {"w": jnp.ones((4, 3))}, r"^w$"
    if model == "nn.jit":
        dense = nn.jit(nn.Dense)(3)
        params = dense.init(jax.random.PRNGKey(0), X)["params"]
        return (lambda p, x: dense.apply({"params": p}, x)), params, "kernel"
    linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(linear)
    forward = nnx.jit(lambda m, x: m(x))
    return (lambda s, x: forward(nnx.merge(graphdef, s), x)), state, "kernel"


@pytest.mark.parametrize("model", MODELS)
def test_infer_layout_gives_the_same_spec_on_every_call(model):
    fn, params, targets = _dense_model(model)
    spec = lorax.simple_spec(params, targets=targets, rank=2)
    first = lorax.infer_layout(fn, params, spec, X)
    lp = lorax.init_lora(params, first, jax.random.PRNGKey(0))
    for i in range(10):
        lorax.lora(fn, on_materialize="error")(lp, X)  # interleaved: lora's traces too
        assert lorax.infer_layout(fn, params, spec, X) == first, f"call {i + 2}"
    want = lorax.LoraSpec(rank=2, batch_ndim=0, m_ndim=1)
    assert [s for s in jax.tree.leaves(first) if isinstance(s, lorax.LoraSpec)] == [want]


def test_nested_jit_is_retraced_once_per_policy_not_per_call():
    """Keying quax's cache on the decisions must not re-trace on every call: the
    nested body gets one cache entry per policy, and repeated calls add none."""
    lin = jax.jit(lambda w, x: x @ w)
    fn = lambda p, x: lin(p["w"], x)  # noqa: E731
    lp = lorax.init_lora({"w": jnp.ones((4, 3))}, {"w": 2}, jax.random.PRNGKey(0))
    cache = quax_primitives._jit_quax_cache
    assert isinstance(cache, _engine._DecisionKeyedCache)

    def keys():  # (finalizers of other tests' jaxprs may remove entries meanwhile)
        return {(decision[0], key) for decision, entries in cache._by_decision.items()
                for key in entries}

    start = keys()
    for _ in range(3):
        lorax.lora(fn)(lp, X)
    warn = keys() - start
    assert [policy for policy, _ in warn] == ["warn"]
    for _ in range(3):
        lorax.lora(fn, on_materialize="error")(lp, X)
    error = keys() - start - warn
    assert [policy for policy, _ in error] == ["error"]
    assert {key for _, key in warn} == {key for _, key in error}  # one body, two policies
    lorax.infer_layout(fn, {"w": jnp.ones((4, 3))}, {"w": 2}, X)
    assert not keys() - start - warn - error  # recording traces cache nothing


def test_scan_bodies_hold_the_policy_too():
    def fn(p, x):
        def body(h, w):
            return h @ jnp.tanh(w), None
        return jax.lax.scan(body, x, p["w"])[0]

    lp = lorax.init_lora({"w": jnp.ones((3, 4, 4))},
                         {"w": lorax.LoraSpec(2, batch_ndim=1, m_ndim=1)}, jax.random.PRNGKey(0))
    _call(fn, lp, "allow")
    with pytest.raises(lorax.LoraMaterializationError):
        _call(fn, lp, "error")
