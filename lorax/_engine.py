"""The dispatch engine behind `lora`: everything lorax knows about quax lives here.

Swapping quax for another interpreter means rewriting this module only: rules
register through `register`, `transform` re-traces a function so registered rules
apply, and `materialize_fallback` is what happens to primitives with no rule.

This is also the only module that reaches into other packages' internals. The whole
private surface, and what breaks without it:

| internal | used for |
|---|---|
| `quax._trace._QuaxTrace`, `_QuaxTracer` | custom_vjp / custom_jvp / shard_map handling quax lacks |
| `quax._values._DenseArrayValue`, `_dense` | wrapping plain arrays on a quax trace |
| `quax._primitives._jit_quax_cache`, `_while_quax_cache` | keying quax's caches of re-traced nested bodies on lorax's per-call decisions |
| `quax._compat.unpack_scan_args`, `scan_bind_params`, `quax._primitives._check_carry_stable` | lorax's own `scan` rule, which keeps each slice's memory space (host offload) |
| `jax._src.core` (`set_current_trace`, `take_current_trace`, `pvary_p`) | re-entering traces; the `pvary` rule |
| `jax._src.ad_checkpoint.remat_p`, `name_p`; `jax._src.dispatch.device_put_p`; `jax._src.interpreters.partial_eval.Recompute` | the `checkpoint` rule; asking its policy whether it recomputes a move and what a rule names (`recomputed`) |
| `jax._src.sharding_impls.parse_flatten_op_sharding`, `GSPMDSharding._hlo_sharding` | reading the shardings XLA's partitioner hands the quantized contraction (`_rules/quant_partitioned.py`) |
| `jax._src.lax.lax.ragged_dot_general_p` | the `ragged_dot` rule (MoE experts; optional: `None` where absent) |
| `jax._src.pjit.reshard_p` | the `reshard` rule (Explicit mesh axes; optional: `None` where absent) |
| `equinox._module._module.jtu` | `LoraWeight`'s own (fast) pytree registration, see `FastPytreeMeta` |

`SUPPORTED` holds the versions this surface is tested with (the package's
dependency bounds say the same). Importing lorax with a quax or JAX whose internals
moved fails here, with a message naming the versions, rather than deep inside a trace.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import operator
import re
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata as _metadata
from typing import Any, Literal

import jax
import jax.extend.core as jexc
import quax
from jax.typing import ArrayLike

# Tested range per package, `(lowest tested, first untested)`; pyproject.toml's
# dependency bounds are the same (tests/test_engine.py checks that they agree).
SUPPORTED: dict[str, tuple[str, str]] = {
    "jax": ("0.10.0", "0.13"),
    "quax": ("0.4.6", "0.5"),
    "equinox": ("0.13.8", "0.14"),
}


def _version_tuple(version: str) -> tuple[int, ...]:
    """`(0, 12, 0, 1)` for "0.12.0.1"; a pre-release tag ends its piece ("0.5.0rc1" -> 0.5.0)."""
    return tuple(int(re.match(r"\d*", piece).group() or 0) for piece in version.split("."))


def unsupported_versions(versions: dict[str, str] | None = None) -> list[str]:
    """`"<package> <version> (tested: >=lo,<hi)"` for each installed package outside `SUPPORTED`."""
    if versions is None:
        versions = {name: _metadata.version(name) for name in SUPPORTED}
    out = []
    for name, (lo, hi) in SUPPORTED.items():
        v = _version_tuple(versions[name])
        if not _version_tuple(lo) <= v < _version_tuple(hi):
            out.append(f"{name} {versions[name]} (tested: >={lo},<{hi})")
    return out


def _internals_moved(err: Exception) -> ImportError:
    bad = unsupported_versions()
    which = "; ".join(bad) if bad else ", ".join(
        f"{n} {_metadata.version(n)}" for n in SUPPORTED)
    return ImportError(
        "lorax needs internals of quax, JAX and equinox that this installation does not "
        f"have ({err!r}). Installed: {which}. Install versions in lorax's tested range "
        "(`pip install jax-lorax` resolves them: "
        + ", ".join(f"{n}>={lo},<{hi}" for n, (lo, hi) in SUPPORTED.items()) + ")."
    )


try:
    from jax._src import ad_checkpoint as _ad_checkpoint
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src import sharding_impls as _sharding_impls
    from jax._src import pjit as _pjit
    from jax._src.interpreters import partial_eval as _pe
    from equinox._module import _module as _eqx_module
    from quax import _trace as _quax_trace
    from quax import _compat as _quax_compat
    from quax import _primitives as _quax_primitives
    from quax._values import _DenseArrayValue, _dense

    from jax._src.lax import lax as _lax_internal

    remat_p = _ad_checkpoint.remat_p
    _ad_checkpoint.name_p, _pe.Recompute, _dispatch.device_put_p  # noqa: B018
    pvary_p = _core.pvary_p
    _core.set_current_trace, _core.take_current_trace  # noqa: B018
    _quax_trace._QuaxTrace, _quax_trace._QuaxTracer  # noqa: B018
    _quax_trace._QuaxTrace.process_custom_jvp_call  # noqa: B018
    _quax_primitives._jit_quax_cache  # noqa: B018
    _quax_primitives._while_quax_cache, _quax_primitives._check_carry_stable  # noqa: B018
    _quax_compat.unpack_scan_args, _quax_compat.scan_bind_params  # noqa: B018
    _eqx_module.jtu.register_pytree_with_keys  # noqa: B018
    _sharding_impls.parse_flatten_op_sharding  # noqa: B018
except (ImportError, AttributeError) as _err:
    raise _internals_moved(_err) from _err

# `lax.ragged_dot` / `ragged_dot_general`'s primitive is not public; a JAX without it
# has no ragged_dot for a rule to catch either.
ragged_dot_general_p = getattr(_lax_internal, "ragged_dot_general_p", None)
# `jax.sharding.reshard`'s primitive (sharding in types), likewise not public.
reshard_p = getattr(_pjit, "reshard_p", None)

if unsupported_versions():
    warnings.warn(
        "lorax has not been tested with " + "; ".join(unsupported_versions())
        + ". Its internals imported fine, but results are not guaranteed.",
        UserWarning, stacklevel=2,
    )

__all__ = [
    "ArrayValue",
    "FastPytreeMeta",
    "fast_pytree",
    "ShardMapPlan",
    "MaterializePolicy",
    "LoraMaterializationError",
    "LoraMaterializationWarning",
    "SUPPORTED",
    "is_value",
    "call",
    "materialize_fallback",
    "materialize_policy",
    "pvary_p",
    "ragged_dot_general_p",
    "reshard_p",
    "register",
    "register_shard_map_rule",
    "remat_p",
    "rule_jit",
    "trace_uncached",
    "transform",
    "unsupported_versions",
]

ArrayValue = quax.ArrayValue
register = quax.register


# -- pytree registration of value types --------------------------------------------


class _NoRegistration:
    """`jax.tree_util` as equinox sees it while a `FastPytreeMeta` class is created:
    everything but `register_pytree_with_keys`, which becomes a no-op."""

    def __getattr__(self, name: str) -> Any:
        return getattr(jax.tree_util, name)

    @staticmethod
    def register_pytree_with_keys(*args: Any, **kwargs: Any) -> None:
        del args, kwargs


class FastPytreeMeta(type(quax.ArrayValue)):  # type: ignore[misc]
    """Metaclass for value types that JAX flattens without equinox's flatten functions.

    A jitted step receives every `LoraWeight` of a model on every call. Equinox
    registers a Module with generated flatten functions and a tuple of static
    fields as aux data, which JAX's C++ dispatch compares in Python for every node:
    ~2x the per-call cost of the same leaves in dicts. Classes made by this
    metaclass skip equinox's registration and get a minimal one (an `itemgetter`
    flatten of the instance dict, the static fields' values as aux data, and an unflatten that sets the
    fields without running `__init__`, as equinox's does: JAX unflattens with
    `None`, labels and per-leaf statistics, which no constructor check could allow).
    `fast_pytree(cls)` says whether the fast registration took.
    """

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any],
                **kwargs: Any) -> type:
        real = _eqx_module.jtu
        _eqx_module.jtu = _NoRegistration()
        try:
            cls = super().__new__(mcs, name, bases, namespace, **kwargs)
        finally:
            _eqx_module.jtu = real
        fields = dataclasses.fields(cls)
        data = tuple(f.name for f in fields if not f.metadata.get("static", False))
        meta = tuple(f.name for f in fields if f.metadata.get("static", False))
        # Fields are read from the instance dict: equinox's `__getattribute__` is
        # Python, and was most of the flatten's cost.
        get_data = operator.itemgetter(*data)
        if len(data) == 1:  # itemgetter of one key returns the value, not a 1-tuple
            get_data = (lambda g: lambda d: (g(d),))(get_data)
        get_meta = operator.itemgetter(*meta) if meta else (lambda d: None)
        keys = tuple(jax.tree_util.GetAttrKey(n) for n in data)
        one_meta = len(meta) == 1

        def flatten(x: Any) -> tuple[tuple[Any, ...], Any]:
            d = object.__getattribute__(x, "__dict__")
            return get_data(d), get_meta(d)

        def flatten_with_keys(x: Any) -> tuple[tuple[Any, ...], Any]:
            d = object.__getattribute__(x, "__dict__")
            return tuple(zip(keys, get_data(d))), get_meta(d)

        def unflatten(aux: Any, children: Any) -> Any:
            obj = object.__new__(cls)
            d = object.__getattribute__(obj, "__dict__")
            d.update(zip(data, children))
            if one_meta:
                d[meta[0]] = aux
            elif meta:
                d.update(zip(meta, aux))
            return obj

        try:
            jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        except ValueError:
            # equinox registered the class after all (its internals moved): still a
            # correct pytree, only slower to dispatch; tests/test_engine.py notices.
            _fast_pytrees.discard(cls)
        else:
            _fast_pytrees.add(cls)
        return cls


_fast_pytrees: set[type] = set()


def fast_pytree(cls: type) -> bool:
    """Whether `cls` got `FastPytreeMeta`'s registration (not equinox's)."""
    return cls in _fast_pytrees


def transform(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` re-traced by quax so that registered rules apply to `Value` arguments.

    Pytrees are flattened here, outside quax: quax maps over its arguments while no
    JAX trace is current (JAX >= 0.11), and pytree nodes that look at the current
    trace when rebuilt (Flax NNX `Variable`s) fail there.
    """

    def flat_fn(treedef: Any, out: list, *leaves: Any) -> list:
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        out_leaves, out_tree = jax.tree_util.tree_flatten(fn(*args, **kwargs), is_leaf=is_value)
        out.append(out_tree)
        return out_leaves

    def call(*args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_value)
        out: list = []
        out_leaves = quax.quaxify(functools.partial(flat_fn, treedef, out))(*leaves)
        return jax.tree_util.tree_unflatten(out[-1], out_leaves)

    return call

def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, with the rules applying to any `Value` among the arguments.

    Rules run on their parent trace, so a value nested in another (a `LoraWeight`
    whose `w` is a `QuantizedArray`) reaches plain `lax` calls inside the outer
    value's rule. Routing those calls through here dispatches the inner value to
    its own rules; with plain arrays only, `fn` is called directly.
    """
    if any(is_value(a) for a in jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_value)):
        return transform(fn)(*args, **kwargs)
    return fn(*args, **kwargs)


MaterializePolicy = Literal["warn", "error", "allow"]
_POLICIES = ("warn", "error", "allow")
_policy: contextvars.ContextVar[MaterializePolicy] = contextvars.ContextVar(
    "lorax_materialize_policy", default="warn"
)


class LoraMaterializationWarning(UserWarning):
    """A `LoraWeight` met a primitive with no low-rank rule and was materialized."""


class LoraMaterializationError(RuntimeError):
    """Raised instead of materializing when `on_materialize="error"`."""


def is_value(x: Any) -> bool:
    return isinstance(x, quax.Value)


def materialize_policy(policy: MaterializePolicy) -> contextlib.AbstractContextManager[None]:
    # Validate here, not in the generator: a `@contextmanager` body only runs at
    # `__enter__`, and `lora` builds this guard once up front to reject a bad policy.
    if policy not in _POLICIES:
        raise ValueError(f"on_materialize must be one of {_POLICIES}, got {policy!r}.")
    return _scoped(_policy, policy)


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    """`var` set to `value` within the block."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def _report(name: str, values: Sequence[Any], why: str | None = None) -> None:
    policy = _policy.get()
    if policy == "allow":
        return
    shapes = ", ".join(
        f"{type(v).__name__} of shape {tuple(v.shape)}"
        for v in values
        if is_value(v) and type(v) is not _DenseArrayValue
    )
    what = (f"`{name}` has no low-rank rule" if why is None
            else f"`{name}` cannot stay low-rank ({why})")
    how = "; ".join(sorted({getattr(type(v), "materialized_as", "materialized")
                            for v in values if is_value(v) and type(v) is not _DenseArrayValue}))
    msg = (
        f"lorax: {what}, so {shapes} was {how} for it. The result is correct but costs "
        "a weight-sized array; pass on_materialize='allow' to `lora` to silence this or "
        "'error' to forbid it."
    )
    if policy == "error":
        raise LoraMaterializationError(msg)
    warnings.warn(msg, LoraMaterializationWarning, stacklevel=2)


def materialize_fallback(
    primitive: jexc.Primitive, values: Sequence[Any], params: dict[str, Any],
    why: str | None = None,
) -> Any:
    """The correct-but-dense path for primitives without a low-rank rule.

    `why` says, for a primitive that has a rule, why the rule could not apply.
    """
    _report(primitive.name, values, why)
    arrays = [type(v).materialise(v) if is_value(v) else v for v in values]
    return primitive.bind(*arrays, **params)



# -- decisions made while tracing, and the caches that would keep them ----------------
#
# A rule decides things a traced program does not show: whether a fallback warns,
# raises or stays quiet (the policy), and what `infer_layout` records. quax caches
# the re-traced body of a nested `jax.jit` (and of `scan`/`while` bodies) per
# (jaxpr, tree structure), and JAX caches lorax's own jitted rule bodies per
# arguments: on a hit no rule runs, so whatever the first call decided would hold
# for every later one. Both caches are therefore keyed on the decisions too, and a
# trace that records (`trace_uncached`) uses no cache at all.

_uncached: contextvars.ContextVar[bool] = contextvars.ContextVar("lorax_uncached", default=False)


def decisions() -> Any:
    """What lorax decides while tracing that the traced program does not record."""
    return _policy.get(), _mesh.get(), _recomputed.get()


# Inside a `jax.checkpoint` body (not inside a `lax.scan` within it) whose policy saves
# neither moves nor values named `RECOMPUTED`, the backward pass recomputes the body. A
# rule may then keep what it read from a frozen weight (a copy moved from host memory) as
# a residual named so: the recomputation makes it again next to the backward pass that
# reads it, instead of the backward pass making it a second time. Outside one, residuals
# are saved (stacked per layer by `lax.scan`), so rules keep the frozen weight itself.
RECOMPUTED = "lorax_frozen_read"
_recomputed: contextvars.ContextVar[bool] = contextvars.ContextVar("lorax_recomputed",
                                                                   default=False)


def recomputed() -> bool:
    """Is this trace inside a `jax.checkpoint` that recomputes values named `RECOMPUTED`?"""
    return _recomputed.get()


def _recomputes(policy: Any) -> bool:
    """Does `policy` save neither a move to the device nor a value named `RECOMPUTED`?
    (A policy saving either would keep every layer's moved copy.)"""
    if policy is None:  # `jax.checkpoint`'s default: nothing saved
        return True
    aval = jax.core.ShapedArray((1,), jax.numpy.uint8)
    try:
        saved = (policy(_ad_checkpoint.name_p, aval, name=RECOMPUTED),
                 policy(_dispatch.device_put_p, aval))
    except Exception:  # noqa: BLE001  (a policy of its own kind: keep the safe choice)
        return False
    return all(s is False or s is _pe.Recompute for s in saved)


# The Auto mesh the call's arrays are sharded on, read at `lora()`'s boundary: inside
# rules the avals may no longer carry it (`custom_vjp` traces, quax's re-traced bodies).
_mesh: contextvars.ContextVar[Any] = contextvars.ContextVar("lorax_mesh", default=None)


def mesh_spec(sharding: Any, mesh: Any, ndim: int) -> tuple | None:
    """The mesh axes along each of `ndim` dimensions of a sharding that XLA's partitioner
    hands a `custom_partitioning` callback (undecoded), or `None` where it is no plain
    layout of `mesh`'s axes (a dimension split over part of an axis)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)
    else:
        try:
            spec = tuple(_sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0])
        except Exception:  # noqa: BLE001 (XLA's shardings that name no whole mesh axes)
            return None
    return spec + (None,) * (ndim - len(spec))


def current_mesh() -> Any:
    """The abstract Auto mesh of the current `lora()` call, or `None`."""
    return _mesh.get()


def mesh_scope(mesh: Any) -> contextlib.AbstractContextManager[None]:
    return _scoped(_mesh, mesh)


@contextlib.contextmanager
def trace_uncached() -> Iterator[None]:
    """Trace every nested body afresh (and cache none): for traces that record."""
    token = _uncached.set(True)
    try:
        yield
    finally:
        _uncached.reset(token)


class _DecisionKeyedCache:
    """Stands in for one of quax's body caches: one dict per `decisions()` value."""

    def __init__(self, entries: dict) -> None:
        self._by_decision: dict[Any, dict] = {decisions(): dict(entries)}

    def get(self, key: Any, default: Any = None) -> Any:
        if _uncached.get():
            return default
        return self._by_decision.get(decisions(), {}).get(key, default)

    def __setitem__(self, key: Any, entry: Any) -> None:
        if not _uncached.get():
            self._by_decision.setdefault(decisions(), {})[key] = entry

    def pop(self, key: Any, default: Any = None) -> Any:
        # quax's weakref finalizer: the jaxpr behind `key` is gone, whatever the decisions.
        found = default
        for entries in self._by_decision.values():
            found = entries.pop(key, found)
        return found

    def __len__(self) -> int:
        return sum(map(len, self._by_decision.values()))

    def clear(self) -> None:
        self._by_decision.clear()


for _name in ("_jit_quax_cache", "_while_quax_cache"):
    if not isinstance(getattr(_quax_primitives, _name), _DecisionKeyedCache):
        setattr(_quax_primitives, _name, _DecisionKeyedCache(getattr(_quax_primitives, _name)))


def rule_jit(fn: Callable[..., Any], *, static_argnames: Sequence[str]) -> Callable[..., Any]:
    """`jax.jit(fn, static_argnames=...)` for a rule's body, traced once per distinct
    arguments *and* `decisions()`: a fallback inside it reports under every policy."""
    jitted = jax.jit(lambda *args, _decisions, **kwargs: fn(*args, **kwargs),
                     static_argnames=(*static_argnames, "_decisions"))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _uncached.get():
            return fn(*args, **kwargs)
        return jitted(*args, _decisions=decisions(), **kwargs)

    return call

# -- higher-order primitives quax leaves out -----------------------------------


@register(remat_p)
def _remat(*args: ArrayValue | ArrayLike, jaxpr: Any, prevent_cse: bool,
           differentiated: bool, policy: Any) -> Any:
    if not any(map(is_value, args)):
        return remat_p.bind(
            *args, jaxpr=jaxpr, prevent_cse=prevent_cse,
            differentiated=differentiated, policy=policy,
        )
    # Re-tracing the body under quax and checkpointing *that* keeps the saved
    # residuals low-rank; `differentiated` is set by JAX's own AD on re-binding.
    body = transform(jexc.jaxpr_as_fun(jexc.ClosedJaxpr(jaxpr, ())))
    with _scoped(_recomputed, _recomputes(policy)):
        return jax.checkpoint(body, prevent_cse=prevent_cse, policy=policy)(*args)


def _process_custom_vjp_call(self: Any, primitive: Any, fun: Any, fwd: Any, bwd: Any,
                             tracers: Sequence[Any], /, **params: Any) -> Any:
    # A custom_vjp rule is written for plain arrays, so a `LoraWeight` reaching
    # one is materialized (under the policy); everything else passes straight
    # to the parent trace with its custom gradient intact.
    values = [self.to_value(t) for t in tracers]
    if any(type(v) is not _DenseArrayValue for v in values):
        _report(primitive.name, values)
    parent = self.parent_trace
    with _core.set_current_trace(parent):
        arrays = [
            v.array if type(v) is _DenseArrayValue else type(v).materialise(v)
            for v in values
        ]
        out = parent.process_custom_vjp_call(primitive, fun, fwd, bwd, arrays, **params)
    return [_quax_trace._QuaxTracer(self, _dense(x)) for x in out]


# quax's trace defines no custom_vjp handling (JAX's base class raises), which
# breaks any model using e.g. a custom_vjp activation or loss.
if "process_custom_vjp_call" not in vars(_quax_trace._QuaxTrace):
    _quax_trace._QuaxTrace.process_custom_vjp_call = _process_custom_vjp_call


_quax_process_custom_jvp_call = getattr(
    _quax_trace._QuaxTrace.process_custom_jvp_call, "__lorax_wrapped__",
    _quax_trace._QuaxTrace.process_custom_jvp_call,
)


def _process_custom_jvp_call(self: Any, primitive: Any, fun: Any, jvp: Any,
                             tracers: Sequence[Any], /, **params: Any) -> Any:
    # Quax hands a Value's tangent to the jvp rule as the same type rebuilt from
    # the leaf tangents, so a LoraWeight's tangent would read as
    # `dw + s * db @ da`, not `dw + s * (db @ a + b @ da)`: silently wrong JVPs
    # (and a crash under grad) for anything like `jax.nn.relu(w)`. A custom_jvp
    # rule is written for plain arrays: materialize (under the policy) first.
    values = [self.to_value(t) for t in tracers]
    if any(type(v) is not _DenseArrayValue for v in values):
        _report(primitive.name, values)
        with _core.set_current_trace(self.parent_trace):
            arrays = [
                v.array if type(v) is _DenseArrayValue else type(v).materialise(v)
                for v in values
            ]
        tracers = [_quax_trace._QuaxTracer(self, _dense(x)) for x in arrays]
    return _quax_process_custom_jvp_call(self, primitive, fun, jvp, tracers, **params)


_process_custom_jvp_call.__lorax_wrapped__ = _quax_process_custom_jvp_call  # type: ignore[attr-defined]
_quax_trace._QuaxTrace.process_custom_jvp_call = _process_custom_jvp_call


# -- shard_map -------------------------------------------------------------------
#
# `shard_map` never reaches `process_primitive` (so `register` cannot catch it):
# binding it calls `trace.process_shard_map(prim, fun, args, **params)`, with the
# body as a function returning a JAX `FlatTree` and the params `mesh`, `in_specs`,
# `check_vma`, `newly_manual_axes` and `debug_info` (the same on JAX 0.10 and 0.12;
# a staged `shard_map` inside a jitted body is re-bound through the same path).
# Quax's trace defines no `process_shard_map`, which is an AttributeError there.


class ShardMapPlan:
    """How to pass `Value` operands through a `shard_map` as plain arrays.

    `leaves[i]` goes in with `in_specs[i]`; `rebuild(leaf_tracers)` turns the
    per-shard leaves back into the body's operands (a `LoraWeight` from its
    `w`, `a`, `b`).
    """

    def __init__(self, leaves: list, in_specs: tuple, rebuild: Callable[[Sequence[Any]], list]):
        self.leaves = leaves
        self.in_specs = in_specs
        self.rebuild = rebuild


# A rule returns a `ShardMapPlan`, or a string saying why the operands cannot be
# passed through low-rank (the fallback then materializes them).
_shard_map_rule: Callable[[Sequence[Any], tuple], ShardMapPlan | str] | None = None


def register_shard_map_rule(
    rule: Callable[[Sequence[Any], tuple], ShardMapPlan | str],
) -> Callable[[Sequence[Any], tuple], ShardMapPlan | str]:
    """Install `rule(operands, in_specs)` for `shard_map`s that receive a `Value`.

    `operands` holds plain arrays and non-dense `Value`s.
    """
    global _shard_map_rule
    _shard_map_rule = rule
    return rule


def _process_shard_map(self: Any, prim: Any, fun: Callable[..., Any],
                       tracers: Sequence[Any], /, **params: Any) -> Any:
    values = [self.to_value(t) for t in tracers]
    operands = [v.array if type(v) is _DenseArrayValue else v for v in values]
    in_specs = tuple(params["in_specs"])
    plan: ShardMapPlan | str = ShardMapPlan(operands, in_specs, list)
    if any(map(is_value, operands)):
        plan = ("no shard_map rule is installed" if _shard_map_rule is None
                else _shard_map_rule(operands, in_specs))
    if isinstance(plan, str):
        # Correct but dense: the body then sees each weight's shard of W + BA.
        _report(prim.name, values, plan)
        with _core.set_current_trace(self.parent_trace):
            arrays = [type(v).materialise(v) if is_value(v) else v for v in operands]
        plan = ShardMapPlan(arrays, in_specs, list)

    def body(*leaves: Any) -> Any:
        # Runs on the shard_map's inner trace. The body is traced again under a
        # quax trace with *this* trace's tag (as JAX's own JVP rule does), so the
        # rebuilt per-shard `LoraWeight`s go through the rules and so does any
        # `LoraWeight` the body closes over instead of taking as an argument.
        # `fun` returns a FlatTree whose leaves are the outputs and whose aux
        # carries the out_specs (and, under AD, more bookkeeping): keep all of it
        # and swap the leaves only.
        with _core.take_current_trace() as inner:
            trace = _quax_trace._QuaxTrace(inner, self.tag)
            args = [_quax_trace._QuaxTracer(trace, v if is_value(v) else _dense(v))
                    for v in plan.rebuild(leaves)]
            with _core.set_current_trace(trace):
                result = fun(*args)
                outs = [trace.to_value(t) for t in result.vals]
        outs = [v.array if type(v) is _DenseArrayValue else v for v in outs]
        if any(map(is_value, outs)):
            # An out_spec describes W's layout; a `LoraWeight` output has no
            # per-factor spec to go with it.
            _report(prim.name, outs, "a LoraWeight leaves the shard_map body, as an output "
                    "or as a residual for AD (jax.grad inside lora(...); put it outside)")
            outs = [type(v).materialise(v) if is_value(v) else v for v in outs]
        return result.update(outs)

    debug_info = params.get("debug_info")
    if len(plan.leaves) != len(operands) and hasattr(debug_info, "with_unknown_names"):
        # The arguments are now the factors too: the caller's names no longer line up.
        params = dict(params, debug_info=debug_info.with_unknown_names())
    params = dict(params, in_specs=plan.in_specs)
    with _core.set_current_trace(self.parent_trace):
        out = prim.bind(*plan.leaves, subfuns=(body,), **params)
    return out.map(lambda x: _quax_trace._QuaxTracer(self, _dense(x)))


_quax_trace._QuaxTrace.process_shard_map = _process_shard_map


# -- scan: bodies traced on slices that keep their memory space --------------------------
#
# quax re-traces a `scan` body against `ShapeDtypeStruct` slices of the stacked operands,
# which carry no memory space: a stack held in host memory (`memory_kind="pinned_host"`)
# reaches the rules as device memory, and their move to the device
# (`_placement.on_device`) would be a no-op while the loop reads host memory. This rule
# is quax's with slices typed as what `lax.scan` hands its body, memory space included.

_scan_cache = _DecisionKeyedCache({})


def _slice_aval(x: Any) -> Any:
    aval = jax.typeof(x)
    typed = {}
    sharding = getattr(aval, "sharding", None)
    explicit = jax.sharding.AxisType.Explicit
    if any(t == explicit for t in getattr(getattr(sharding, "mesh", None), "axis_types", ())):
        # Sharding in types: a slice is typed as the stack's other axes are.
        typed["sharding"] = sharding.update(spec=jax.sharding.PartitionSpec(
            *tuple(sharding.spec)[1:]))
    return jax.core.ShapedArray(tuple(x.shape[1:]), x.dtype,
                                memory_space=getattr(aval, "memory_space", None)
                                or jax.memory.Space.Device, **typed)


def _memory_spaces(leaves: Sequence[Any]) -> tuple:
    return tuple(getattr(jax.typeof(x), "memory_space", None) for x in leaves)


@register(jax.lax.scan_p, precedence=1)
def _scan(*args: ArrayValue | ArrayLike, jaxpr: Any, **params: Any) -> Any:
    consts, carry, xs = _quax_compat.unpack_scan_args(args, params)
    flat = [jax.tree_util.tree_flatten(group) for group in (consts, carry, xs)]
    (c_flat, c_tree), (v_flat, v_tree), (x_flat, x_tree) = flat
    nc, nv = len(c_flat), len(v_flat)
    key = (id(jaxpr), c_tree, v_tree, x_tree, _memory_spaces([*c_flat, *v_flat, *x_flat]))
    entry = _scan_cache.get(key)
    if entry is None or entry[0]() is not jaxpr:  # (a collected jaxpr's id, reused)
        fn = jexc.jaxpr_as_fun(jaxpr)

        def body(*leaves: Any) -> Any:
            c = jax.tree_util.tree_unflatten(c_tree, leaves[:nc])
            v = jax.tree_util.tree_unflatten(v_tree, leaves[nc:nc + nv])
            x = jax.tree_util.tree_unflatten(x_tree, leaves[nc + nv:])
            out = quax.quaxify(fn)(*c, *v, *x)
            _quax_primitives._check_carry_stable(v, out[:len(v)], "lax.scan")
            return out

        # A loop's residuals are stacked per iteration, recomputed or not (`recomputed`).
        with _scoped(_recomputed, False):
            traced, out_shape = jax.make_jaxpr(body, return_shape=True)(
                *c_flat, *v_flat, *map(_slice_aval, x_flat))
        # Weakly keyed, as quax's cache: the entry goes with the body's jaxpr.
        ref = weakref.ref(jaxpr, lambda _, key=key: _scan_cache.pop(key, None))
        entry = (ref, traced, jax.tree_util.tree_structure(out_shape))
        _scan_cache[key] = entry
    _, traced, out_tree = entry
    out = jax.lax.scan_p.bind(
        *c_flat, *v_flat, *x_flat, jaxpr=traced,
        **_quax_compat.scan_bind_params(params, num_consts=nc, num_carry=nv,
                                        num_xs=len(x_flat), num_ys=len(traced.out_avals) - nv))
    return jax.tree_util.tree_unflatten(out_tree, out)
