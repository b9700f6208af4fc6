"""Layout primitives: `shard_map`, `with_sharding_constraint`, `reshard` (Explicit mesh
axes) and `pvary` on a `LoraWeight` (and all but `pvary`'s inverse on a `QuantizedArray`,
whose codes, scales and mins follow the dense value's layout: `QuantizedArray.leaf_specs`).

The first three state a layout for `W`; the factors get the one `lorax._sharding`
derives from it (`b` on `W`'s batch and `M` axes, `a` on its batch and `N` axes, the
rank axis replicated), so each device holds the factor rows and columns that meet
its shard of `W` and the low-rank path runs shard by shard with no `W + BA` anywhere.
`pvary` is the type-level cast JAX inserts inside a `shard_map` body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core.primitives as _prims
from jax.sharding import NamedSharding

from .. import _engine
from .._sharding import factor_dims, factor_specs, varying_axes
from .._quant._array import QuantizedArray
from .._weight import LoraWeight

sharding_constraint_p = _prims.sharding_constraint_p
pvary_p = _engine.pvary_p
reshard_p = _engine.reshard_p


# -- shard_map ---------------------------------------------------------------------


def _split_quantized(qa: QuantizedArray, spec: Any) -> tuple[list, list, Callable]:
    specs = qa.leaf_specs(spec)
    present = [i for i, leaf in enumerate(qa.leaves()) if leaf is not None]

    def rebuild(taken: Sequence[Any]) -> QuantizedArray:
        leaves: list = [None] * 5
        for i, x in zip(present, taken):
            leaves[i] = x
        return qa.with_leaves(leaves)

    return ([qa.leaves()[i] for i in present], [specs[i] for i in present], rebuild)


def _split(x: Any, spec: Any) -> tuple[list, list, Callable]:
    """An operand as arrays with their in_specs, and how to put it back together."""
    if not _engine.is_value(x):
        return [x], [spec], lambda taken: taken[0]
    if type(x) is QuantizedArray:
        return _split_quantized(x, spec)
    if type(x) is not LoraWeight:  # a DoraWeight's magnitude has no spec of its own
        raise ValueError(f"a {type(x).__name__}, which lorax cannot split into arrays")
    a_spec, b_spec = factor_specs(spec, x.ndim, x.structure[0], x.axes.m)
    w_leaves, w_specs, w_rebuild = _split(x.w, spec)
    n = len(w_leaves)

    def rebuild(taken: Sequence[Any]) -> LoraWeight:
        return LoraWeight(w_rebuild(taken[:n]), taken[n], taken[n + 1], alpha=x.alpha,
                          m_axes=x.m_axes)

    return [*w_leaves, x.a, x.b], [*w_specs, a_spec, b_spec], rebuild


@_engine.register_shard_map_rule
def _shard_map(operands: Sequence[Any], in_specs: tuple) -> _engine.ShardMapPlan | str:
    leaves: list = []
    specs: list = []
    rebuilders: list = []
    for i, (x, spec) in enumerate(zip(operands, in_specs)):
        try:
            x_leaves, x_specs, rebuild_x = _split(x, spec)
        except ValueError as err:
            return f"operand {i}, of shape {tuple(x.shape)}: {err}"
        leaves += x_leaves
        specs += x_specs
        rebuilders.append((len(x_leaves), rebuild_x))

    def rebuild(flat: Sequence[Any]) -> list:
        flat = list(flat)
        out = []
        for n, rebuild_x in rebuilders:
            taken, flat = flat[:n], flat[n:]
            out.append(rebuild_x(taken))
        return out

    return _engine.ShardMapPlan(leaves, tuple(specs), rebuild)


@_engine.register(pvary_p)
def _(lw: LoraWeight, *, axes: Any) -> Any:
    # Inside a `shard_map` with check_vma, JAX casts operands to vary over the same
    # mesh axes before mixing them (`x @ W` with `x` split over 'data'). The cast
    # is a no-op on values, so it applies leaf by leaf, each over the axes it does
    # not vary over yet (`w` and `a` may be split over 'model', `b` not); under AD
    # each factor's cotangent is then summed over those axes, as W's would be.
    def vary(x: Any) -> Any:
        new = tuple(a for a in axes if a not in varying_axes(x))
        return pvary_p.bind(x, axes=new) if new else x

    return LoraWeight(vary(lw.w), a=vary(lw.a), b=vary(lw.b), alpha=lw.alpha, m_axes=lw.m_axes)


@_engine.register(pvary_p)
def _(qa: QuantizedArray, *, axes: Any) -> Any:
    def vary(x: Any) -> Any:
        new = tuple(a for a in axes if a not in varying_axes(x))
        return pvary_p.bind(x, axes=new) if new else x

    return qa.with_leaves([None if x is None else vary(x) for x in qa.leaves()])


# -- with_sharding_constraint -----------------------------------------------------------


@_engine.register(sharding_constraint_p)
def _(lw: LoraWeight, *, sharding: Any, layout: Any, context_mesh: Any,
      unconstrained_dims: Any) -> Any:
    params = dict(sharding=sharding, layout=layout, context_mesh=context_mesh,
                  unconstrained_dims=unconstrained_dims)
    if layout is not None:
        return _engine.materialize_fallback(
            sharding_constraint_p, [lw], params, "a memory layout has no factor counterpart")
    if not isinstance(sharding, NamedSharding):
        return _engine.materialize_fallback(
            sharding_constraint_p, [lw], params,
            f"factor shardings are derived from a NamedSharding, got {type(sharding).__name__}")
    nb, m = lw.structure[0], lw.axes.m
    try:
        a_spec, b_spec = factor_specs(sharding.spec, lw.ndim, nb, m)
    except ValueError as err:
        return _engine.materialize_fallback(sharding_constraint_p, [lw], params, str(err))
    a_dims, b_dims = factor_dims(lw.ndim, nb, m)
    unconstrained = frozenset(unconstrained_dims or ())

    def constrain(x: Any, spec: Any, dims: dict[int, int]) -> Any:
        return sharding_constraint_p.bind(
            x, sharding=sharding.update(spec=spec), layout=None,
            context_mesh=context_mesh,
            unconstrained_dims=frozenset(dims[d] for d in unconstrained if d in dims))

    w = (_constrain_quantized(lw.w, **params) if type(lw.w) is QuantizedArray
         else sharding_constraint_p.bind(lw.w, **params))
    a = constrain(lw.a, a_spec, a_dims)
    b = constrain(lw.b, b_spec, b_dims)
    return LoraWeight(w, a=a, b=b, alpha=lw.alpha, m_axes=lw.m_axes)


@_engine.register(sharding_constraint_p)
def _constrain_quantized(qa: QuantizedArray, *, sharding: Any, layout: Any,
                         context_mesh: Any, unconstrained_dims: Any) -> Any:
    params = dict(sharding=sharding, layout=layout, context_mesh=context_mesh,
                  unconstrained_dims=unconstrained_dims)
    why = ("a memory layout has no counterpart in the blocks" if layout is not None else
           f"leaf shardings are derived from a NamedSharding, got {type(sharding).__name__}"
           if not isinstance(sharding, NamedSharding) else
           "unconstrained dimensions" if unconstrained_dims else None)
    if why is None:
        try:
            specs = qa.leaf_specs(sharding.spec)
        except ValueError as err:
            why = str(err)
    if why is not None:
        return _engine.materialize_fallback(sharding_constraint_p, [qa], params, why)
    leaves = [None if x is None else sharding_constraint_p.bind(
        x, sharding=sharding.update(spec=spec), layout=None, context_mesh=context_mesh,
        unconstrained_dims=frozenset()) for x, spec in zip(qa.leaves(), specs)]
    return qa.with_leaves(leaves)


# -- reshard (sharding in types) --------------------------------------------------------


def _reshard_rule(value: Any, *, dst_sharding: Any, **params: Any) -> Any:
    """`jax.sharding.reshard` of a `LoraWeight` or `QuantizedArray`: each part moved to the
    layout derived from the one asked for the whole (under FSDP, a model regathers its
    weights this way before using them: the factors are regathered with `W`)."""
    spec = getattr(dst_sharding, "spec", dst_sharding)

    def move(x: Any, part_spec: Any) -> Any:
        return reshard_p.bind(x, dst_sharding=dst_sharding.update(spec=part_spec), **params)

    if type(value) is QuantizedArray:
        specs = value.leaf_specs(spec)
        return value.with_leaves([None if x is None else move(x, s)
                                  for x, s in zip(value.leaves(), specs)])
    a_spec, b_spec = factor_specs(spec, value.ndim, value.structure[0], value.axes.m)
    w = (_reshard_rule(value.w, dst_sharding=dst_sharding, **params)
         if type(value.w) is QuantizedArray else move(value.w, spec))
    return LoraWeight(w, a=move(value.a, a_spec), b=move(value.b, b_spec), alpha=value.alpha,
                      m_axes=value.m_axes)


if reshard_p is not None:
    @_engine.register(reshard_p)
    def _(lw: LoraWeight, *, dst_sharding: Any, **params: Any) -> Any:
        return _reshard_rule(lw, dst_sharding=dst_sharding, **params)

    @_engine.register(reshard_p)
    def _(qa: QuantizedArray, *, dst_sharding: Any, **params: Any) -> Any:
        return _reshard_rule(qa, dst_sharding=dst_sharding, **params)
