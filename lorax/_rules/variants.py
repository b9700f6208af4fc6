"""Rules for the variants' value (`Adapted`: DoRA's scale, LoRA dropout, a mixed
batch's rank gate), on top of LoRA's.

DoRA's weight is `V * g` with `g = m / ||V||` constant along the input axes, so for
any use that keeps the output features free, `op(x, V * g) = op(x, V) * g`, and for
a use that contracts them (a tied embedding's logits, `h @ E.T`),
`op(x, V * g) = op(x * g, V)`: the LoRA rule runs unchanged on `V` and `g` scales an
activation-sized array. LoRA dropout hands the LoRA rule `drop(x)` for its low-rank
path, and a mixed batch (`lorax.mixed_batch`) its per-example rank gate. A
`DoraWeight`, `LoraDropout` or `MixedWeight` that reaches a primitive without passing
`lora`'s boundary (closed over rather than passed in) is converted here first; a
`DoraWeight` never reaches a `LoraWeight` rule, which would drop its magnitude. Where
no low-rank form fits, the dense fallback is `Adapted`'s own array, gate included.
"""

# No `from __future__ import annotations`: the redirect rules below are registered in
# loops, and dispatch reads their annotations (the loop variable) at registration.
import functools
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.extend.core import primitives as _prims
from jax.typing import ArrayLike

from .. import _engine
from .._variants.adapted import Adapted, adapt, drop
from .._variants.mixed import MixedWeight, gated_lora
from .._variants.dora import DoraWeight, magnitude_shape, magnitude_side
from .._variants.dropout import LoraDropout
from .._weight import LoraWeight
from ._contract import dot_labels
from . import ragged as _ragged
from .conv import lora_conv
from .gather import lora_gather
from .dot import _dot_params, lora_contract
from .._sharding import varying_axes, whole_where_one
from .sharding import sharding_constraint_p

pvary_p = _engine.pvary_p
reshard_p = _engine.reshard_p


def _side_axes(ad: Adapted) -> tuple[int, ...]:
    """`w`'s axes along which `g` varies besides the batch axes (the output features)."""
    lw = ad.lw
    side = magnitude_side(lw.shape, ad.g.shape, lw.axes)
    return lw.axes.n if side == "a" else lw.axes.m


def _place(g: Array, g_labels: Sequence[int], target: Sequence[int], dtype: Any) -> Array:
    """`g` (one axis per label) transposed and reshaped to broadcast against `target`."""
    target = list(target)
    order = sorted(range(len(g_labels)), key=lambda i: target.index(g_labels[i]))
    sizes = {g_labels[i]: g.shape[i] for i in range(len(g_labels))}
    g = jnp.transpose(g, order)
    return g.reshape([sizes.get(l, 1) for l in target]).astype(dtype)


# -- dot_general -------------------------------------------------------------------------


def _dot(ad: Adapted, x: Any, ad_first: bool, dimension_numbers: Any, precision: Any,
         preferred_element_type: Any, params: dict) -> Any:
    lw = ad.lw
    if ad_first:
        wl, xl, out = dot_labels(lw.ndim, jnp.ndim(x), dimension_numbers)
    else:
        xl, wl, out = dot_labels(jnp.ndim(x), lw.ndim, dimension_numbers)
    fresh = itertools.count(max((*wl, *xl)) + 1)
    dot_params = _dot_params(precision, preferred_element_type, params)
    x_low = None if ad.key is None else drop(x, ad.key, ad.rate)
    if ad.g is None:
        return lora_contract(lw, wl, x, xl, out, ad_first, fresh, x_low, ad.gate, **dot_params)
    nb = lw.structure[0]
    axes = (*range(nb), *_side_axes(ad))
    g_labels = [wl[d] for d in axes]
    g = ad.g.reshape([ad.g.shape[d] for d in axes])
    if all(l in out for l in g_labels):
        y = lora_contract(lw, wl, x, xl, out, ad_first, fresh, x_low, ad.gate, **dot_params)
        return y * _place(g, g_labels, out, y.dtype)
    if all(l in xl for l in g_labels):
        gx = _place(g, g_labels, xl, jnp.result_type(x))
        x_low = None if x_low is None else x_low * gx
        return lora_contract(lw, wl, x * gx, xl, out, ad_first, fresh, x_low, ad.gate,
                             **dot_params)
    args = [ad, x] if ad_first else [x, ad]
    return _engine.materialize_fallback(lax.dot_general_p, args,
                     dict(dimension_numbers=dimension_numbers, precision=precision,
                          preferred_element_type=preferred_element_type, **params),
                     "DoRA's output features are neither all kept nor all contracted")


@_engine.register(lax.dot_general_p)
def _(lhs: Adapted, rhs: ArrayLike, *, dimension_numbers: Any, precision: Any,
      preferred_element_type: Any, **params: Any) -> Any:
    return _dot(lhs, rhs, True, dimension_numbers, precision, preferred_element_type, params)


@_engine.register(lax.dot_general_p)
def _(lhs: ArrayLike, rhs: Adapted, *, dimension_numbers: Any, precision: Any,
      preferred_element_type: Any, **params: Any) -> Any:
    return _dot(rhs, lhs, False, dimension_numbers, precision, preferred_element_type, params)


# -- ragged_dot (MoE experts) ---------------------------------------------------------------


def _ragged_g(ad: Adapted, x: Any, group_sizes: Any, dn: Any) -> Array | None:
    """DoRA's `g` for each output row of a ragged product: the row's group's `g`, laid
    out against the output; `None` when `g` is not along the output features of a
    weight whose one batch axis is the group axis."""
    lw = ad.lw
    nb = lw.structure[0]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    side = _side_axes(ad)
    if nb != 1 or tuple(dn.rhs_group_dimensions) != (0,) or rb or set(side) & set(rc):
        return None
    ndim = jnp.ndim(x)
    free = [d for d in range(ndim) if d not in lc and d not in lb]
    ragged = dn.lhs_ragged_dimensions[0]
    rows = jnp.shape(x)[ragged]
    groups = ad.g.reshape(ad.g.shape[0], *(ad.g.shape[d] for d in side))  # (E, *out)
    row_group = jnp.repeat(jnp.arange(groups.shape[0]), group_sizes, total_repeat_length=rows)
    g_rows = groups[row_group]                                             # (rows, *out)
    shape = [1] * (len(lb) + len(free)) + list(g_rows.shape[1:])
    shape[len(lb) + free.index(ragged)] = rows
    return g_rows.reshape(shape)


if _ragged.ragged_dot_general_p is not None:
    @_engine.register(_ragged.ragged_dot_general_p)
    def _(lhs: ArrayLike, rhs: Adapted, group_sizes: ArrayLike, *rest: ArrayLike,
          **params: Any) -> Any:
        dn = params["ragged_dot_dimension_numbers"]
        x_low = None if rhs.key is None else drop(lhs, rhs.key, rhs.rate)
        if rhs.gate is not None:
            return _engine.materialize_fallback(
                _ragged.ragged_dot_general_p, [lhs, rhs, group_sizes, *rest], params,
                "a mixed batch's adapters on a ragged product (no rule for the rank gate)")
        if rhs.g is None:
            return _ragged.rule(lhs, rhs.lw, group_sizes, rest, params, x_low)
        g = _ragged_g(rhs, lhs, group_sizes, dn)
        if g is None:
            return _engine.materialize_fallback(
                _ragged.ragged_dot_general_p, [lhs, rhs, group_sizes, *rest], params,
                "DoRA on a ragged product needs one group axis and g along the output")
        y = _ragged.rule(lhs, rhs.lw, group_sizes, rest, params, x_low)
        return y * g.astype(y.dtype)

    for _cls in (DoraWeight, LoraDropout, MixedWeight):
        @_engine.register(_ragged.ragged_dot_general_p)
        def _(lhs: ArrayLike, rhs: _cls, group_sizes: ArrayLike, *rest: ArrayLike,  # type: ignore[valid-type]
              **params: Any) -> Any:
            return _engine.call(
                lambda x, w, gs, *r: _ragged.ragged_dot_general_p.bind(x, w, gs, *r, **params),
                lhs, adapt(rhs), group_sizes, *rest)


# -- conv ----------------------------------------------------------------------------------


@_engine.register(lax.conv_general_dilated_p)
def _(lhs: ArrayLike, rhs: Adapted, *, dimension_numbers: lax.ConvDimensionNumbers,
      feature_group_count: int, batch_group_count: int, **params: Any) -> Any:
    dn = dimension_numbers
    all_params = dict(dimension_numbers=dn, feature_group_count=feature_group_count,
                      batch_group_count=batch_group_count, **params)
    lw = rhs.lw
    low = None if rhs.key is None else drop(lhs, rhs.key, rhs.rate)

    def conv(x: Any, x_low: Any) -> Any:
        return lora_conv(x, lw, x_low, dn, feature_group_count, batch_group_count, params,
                         rhs.gate)

    if rhs.g is None:
        y = conv(lhs, low)
    else:
        side = _side_axes(rhs)
        if lw.structure[0] or len(side) != 1:
            y = None
        elif side[0] == dn.rhs_spec[0]:  # output channels: scale the output
            y = conv(lhs, low)
            if y is not None:
                shape = [1] * y.ndim
                shape[dn.out_spec[1]] = rhs.g.size
                y = y * rhs.g.reshape(shape).astype(y.dtype)
        elif side[0] == dn.rhs_spec[1] and feature_group_count == 1:  # input channels
            shape = [1] * jnp.ndim(lhs)
            shape[dn.lhs_spec[1]] = rhs.g.size
            gx = rhs.g.reshape(shape).astype(jnp.result_type(lhs))
            y = conv(lhs * gx, None if low is None else low * gx)
        else:
            y = None
    if y is None:
        return _engine.materialize_fallback(lax.conv_general_dilated_p, [lhs, rhs], all_params,
                         "the kernel's factorisation or DoRA's side does not fit a conv")
    return y


# -- gather --------------------------------------------------------------------------------


def _gather_like(g: Array, indices: Any, dn: lax.GatherDimensionNumbers,
                 slice_sizes: Sequence[int], params: dict) -> Array:
    """`gather(g)` with `w`'s gather: unit axes of `g` are looked up at 0, so the result
    broadcasts against `gather(w)`."""
    sizes = tuple(min(s, d) for s, d in zip(slice_sizes, g.shape))
    keep = np.asarray([0 if g.shape[d] == 1 else 1 for d in dn.start_index_map])
    idx = jnp.asarray(indices)
    if not keep.all():
        idx = idx * jnp.asarray(keep, idx.dtype)
    return lax.gather_p.bind(g, idx, dimension_numbers=dn, slice_sizes=sizes, **params)


@_engine.register(lax.gather_p)
def _(ad: Adapted, indices: ArrayLike, *, dimension_numbers: lax.GatherDimensionNumbers,
      slice_sizes: Sequence[int], **params: Any) -> Any:
    if ad.gate is None:
        out = _engine.call(functools.partial(
            lax.gather_p.bind, dimension_numbers=dimension_numbers,
            slice_sizes=tuple(slice_sizes), **params), ad.lw, indices)
    else:
        out = lora_gather(ad.lw, indices, dimension_numbers, slice_sizes, params, ad.gate)
        if out is None or isinstance(out, LoraWeight):
            # A lookup with no low-rank form is correct dense (the gate is in `ad`'s
            # array); a pick of layers would need the gate gathered alike.
            return _engine.materialize_fallback(
                lax.gather_p, [ad, indices],
                dict(dimension_numbers=dimension_numbers, slice_sizes=slice_sizes, **params),
                "a mixed batch's rank gate on this gather")
    g = None if ad.g is None else _gather_like(ad.g, indices, dimension_numbers, slice_sizes,
                                               params)
    if isinstance(out, LoraWeight):
        if ad.key is not None:
            raise ValueError(
                "lorax.dropout: a gather picks layers of a stacked LoRA weight, and the "
                "dropout keys cannot follow it; run the layers with lax.scan or index them "
                "with a slice / dynamic_slice.")
        return Adapted(out, g, None, ad.rate)
    return out if g is None else out * g.astype(out.dtype)


# -- structural ops: the same op on `lw`, on `g` and on the keys -----------------------------


def _lift(ad: Adapted, op: Any, g_op: Any, key_op: Any) -> Any:
    """`op(lw)`, with `g`, the keys and the rank gate following it (`g_op(g, out)`,
    `key_op(key, out)`, and `key_op` on each rank slice of the gate; `out` is `None`
    when the LoRA rule's result is dense)."""
    out = _engine.call(op, ad.lw)
    if isinstance(out, LoraWeight):
        g = None if ad.g is None else g_op(ad.g, out)
        key = None if ad.key is None else key_op(ad.key, out)
        gate = None if ad.gate is None else jax.vmap(
            lambda v: key_op(v, out), in_axes=-1, out_axes=-1)(ad.gate)
        return Adapted(out, g, key, ad.rate, gate)
    if ad.gate is not None:  # dense: the gate goes into the factors first
        out = _engine.call(op, gated_lora(ad.lw, ad.gate))
    if ad.g is None:
        return out
    return out * g_op(ad.g, None).astype(out.dtype)


def _bind(prim: Any, **params: Any) -> Any:
    return functools.partial(prim.bind, **params)


def _full_g(ad: Adapted) -> Array:
    return jnp.broadcast_to(ad.g, ad.lw.shape)


@_engine.register(lax.transpose_p)
def _(ad: Adapted, *, permutation: Sequence[int]) -> Any:
    perm = tuple(permutation)
    nb = ad.lw.structure[0]
    return _lift(ad, _bind(lax.transpose_p, permutation=perm),
                 lambda g, _: lax.transpose(g, perm),
                 lambda k, _: jnp.transpose(k, perm[:nb]))


@_engine.register(lax.convert_element_type_p)
def _(ad: Adapted, **params: Any) -> Any:
    return _lift(ad, _bind(lax.convert_element_type_p, **params), lambda g, _: g, lambda k, _: k)


@_engine.register(_prims.copy_p)
def _(ad: Adapted) -> Any:
    return ad


@_engine.register(lax.slice_p)
def _(ad: Adapted, *, start_indices: Sequence[int], limit_indices: Sequence[int],
      strides: Sequence[int] | None) -> Any:
    strides = tuple(strides or (1,) * ad.ndim)
    nb = ad.lw.structure[0]

    def g_op(g: Array, _: Any) -> Array:
        unit = [s == 1 for s in g.shape]
        return lax.slice(g, [0 if u else s for u, s in zip(unit, start_indices)],
                         [1 if u else s for u, s in zip(unit, limit_indices)],
                         [1 if u else s for u, s in zip(unit, strides)])

    def key_op(k: Array, _: Any) -> Array:
        return k[tuple(slice(s, e, st) for s, e, st in
                       zip(start_indices[:nb], limit_indices[:nb], strides[:nb]))]

    return _lift(ad, _bind(lax.slice_p, start_indices=tuple(start_indices),
                             limit_indices=tuple(limit_indices), strides=strides),
                 g_op, key_op)


@_engine.register(lax.dynamic_slice_p)
def _(ad: Adapted, *indices: Any, slice_sizes: Sequence[int]) -> Any:
    nb = ad.lw.structure[0]

    def g_op(g: Array, _: Any) -> Array:
        idx = [jnp.zeros_like(i) if s == 1 else i for i, s in zip(indices, g.shape)]
        return lax.dynamic_slice(g, idx, [1 if s == 1 else z for s, z in zip(g.shape, slice_sizes)])

    def key_op(k: Array, _: Any) -> Array:
        return lax.dynamic_slice(k, indices[:nb], slice_sizes[:nb]) if nb else k

    return _lift(ad, lambda lw: lax.dynamic_slice(lw, indices, slice_sizes), g_op, key_op)


@_engine.register(lax.squeeze_p)
def _(ad: Adapted, *, dimensions: Sequence[int]) -> Any:
    dims = tuple(sorted(d % ad.ndim for d in dimensions))
    nb = ad.lw.structure[0]
    return _lift(ad, _bind(lax.squeeze_p, dimensions=tuple(dimensions)),
                 lambda g, _: lax.squeeze(g, dims),
                 lambda k, _: jnp.squeeze(k, tuple(d for d in dims if d < nb)))


def _regroup(ad: Adapted, prim: Any, params: dict, new_shape: Sequence[int]) -> Any:
    side = None if ad.g is None else magnitude_side(ad.lw.shape, ad.g.shape, ad.lw.axes)

    def g_op(g: Array, out: Any) -> Array:
        if out is None:  # the LoRA rule fell back to the dense weight: so does g
            return _full_g(ad).reshape(new_shape)
        return g.reshape(magnitude_shape(tuple(out.shape), out.axes, side))

    def key_op(k: Array, out: Any) -> Array:
        batch = tuple(out.shape[: out.structure[0]])
        if int(np.prod(batch)) != k.size:
            raise ValueError(
                "a reshape regroups the batch axes of a stacked LoRA weight "
                f"({tuple(k.shape)} -> {batch}); its lorax.dropout keys or mixed-batch rank "
                "gates cannot follow.")
        return k.reshape(batch)

    return _lift(ad, _bind(prim, **params), g_op, key_op)


@_engine.register(lax.reshape_p)
def _(ad: Adapted, *, new_sizes: Sequence[int], dimensions: Any, **params: Any) -> Any:
    return _regroup(ad, lax.reshape_p, dict(new_sizes=tuple(new_sizes), dimensions=dimensions,
                                            **params), new_sizes)


@_engine.register(lax.broadcast_in_dim_p)
def _(ad: Adapted, *, shape: Sequence[int], broadcast_dimensions: Sequence[int],
      **params: Any) -> Any:
    return _regroup(ad, lax.broadcast_in_dim_p,
                    dict(shape=tuple(shape), broadcast_dimensions=tuple(broadcast_dimensions),
                         **params), shape)


# -- sharding ------------------------------------------------------------------------------


@_engine.register(pvary_p)
def _(ad: Adapted, *, axes: Any) -> Any:
    def vary(x: Any) -> Any:
        if x is None:
            return None
        new = tuple(a for a in axes if a not in varying_axes(x))
        return pvary_p.bind(x, axes=new) if new else x

    return Adapted(_engine.call(lambda lw: pvary_p.bind(lw, axes=axes), ad.lw), vary(ad.g),
                   vary(ad.key), ad.rate, vary(ad.gate))


def _layout_rule(prim: Any) -> None:
    """`with_sharding_constraint` / `reshard` of an adapted weight: its LoRA part laid out
    by the LoRA rule, the variant's own parts as they are."""
    @_engine.register(prim)
    def _(ad: Adapted, **params: Any) -> Any:
        bind = lambda lw: prim.bind(lw, **params)  # noqa: E731
        out = _engine.call(bind, ad.lw)
        if isinstance(out, LoraWeight):
            return Adapted(out, _moved_gain(prim, ad.g, params), ad.key, ad.rate, ad.gate)
        if ad.gate is not None:
            out = _engine.call(bind, gated_lora(ad.lw, ad.gate))
        return out if ad.g is None else out * ad.g.astype(out.dtype)


def _moved_gain(prim: Any, g: Any, params: dict) -> Any:
    """DoRA's per-output gain under `reshard`: moved with its weight (its summed, size-1
    axes whole), as Explicit axes need for the product it scales. Under
    `with_sharding_constraint` propagation places it."""
    if g is None or prim is not reshard_p:
        return g
    dst = params["dst_sharding"]
    spec = whole_where_one(dst.spec, g.shape)
    return reshard_p.bind(g, **dict(params, dst_sharding=dst.update(spec=spec)))


_LAYOUT_PRIMS = tuple(p for p in (sharding_constraint_p, reshard_p) if p is not None)
for _prim in _LAYOUT_PRIMS:
    _layout_rule(_prim)


# -- a DoraWeight or LoraDropout that did not pass `lora`'s boundary -------------------------
#
# Converted on the spot (a closed-over weight, a nested `_engine.call`). DoraWeight is a
# LoraWeight, so every primitive with a LoraWeight rule needs this, or the LoRA rule would
# run and silently drop the magnitude (tests/variants/test_dora.py checks the coverage).

_Raw = (DoraWeight, LoraDropout, MixedWeight)


def _redirect_unary(prim: Any) -> None:
    for cls in _Raw:
        @_engine.register(prim)
        def _(x: cls, **params: Any) -> Any:  # type: ignore[valid-type]
            return _engine.call(functools.partial(prim.bind, **params), adapt(x))


for _prim in (lax.transpose_p, lax.convert_element_type_p, _prims.copy_p, lax.slice_p,
              lax.squeeze_p, lax.reshape_p, lax.broadcast_in_dim_p, pvary_p, *_LAYOUT_PRIMS):
    _redirect_unary(_prim)

for _cls in _Raw:
    @_engine.register(lax.dynamic_slice_p)
    def _(x: _cls, *indices: Any, slice_sizes: Sequence[int]) -> Any:  # type: ignore[valid-type]
        return _engine.call(lambda v: lax.dynamic_slice(v, indices, slice_sizes), adapt(x))


def _redirect_binary(prim: Any) -> None:
    for cls in _Raw:
        @_engine.register(prim)
        def _(x: cls, y: ArrayLike, **params: Any) -> Any:  # type: ignore[valid-type]
            return _engine.call(functools.partial(prim.bind, **params), adapt(x), y)

        if prim is lax.gather_p:
            continue

        @_engine.register(prim)
        def _(x: ArrayLike, y: cls, **params: Any) -> Any:  # type: ignore[valid-type]
            return _engine.call(functools.partial(prim.bind, **params), x, adapt(y))


_redirect_binary(lax.dot_general_p)
_redirect_binary(lax.conv_general_dilated_p)
_redirect_binary(lax.gather_p)


def _two_weights(prim: Any) -> None:
    # Two low-rank weights in one product (W1 @ W2) with DoRA on either side: correct
    # dense, not low-rank.
    for left, right in ((DoraWeight, LoraWeight), (LoraWeight, DoraWeight),
                        (DoraWeight, DoraWeight)):
        @_engine.register(prim)
        def _(x: left, y: right, **params: Any) -> Any:  # type: ignore[valid-type]
            return _engine.materialize_fallback(prim, [x, y], params,
                                                "both operands are low-rank weights, one with DoRA")


_two_weights(lax.dot_general_p)
