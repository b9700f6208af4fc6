"""Shape-only primitives that keep the low-rank structure: the result is a `LoraWeight`.

Each rule maps the op on `W` to ops on the factors (`B` carries `W`'s batch and
`M` axes, `A` its batch and `N` axes). The op on `W` itself is a transpose,
reshape, slice or cast of the frozen weight, which XLA folds into the consumer
(or which is the op the model asked for anyway); no `W + BA` is ever formed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.extend.core import primitives as _prims

from .. import _engine
from .._weight import LoraWeight
from .dot import scale


def _rebuild(lw: LoraWeight, w: Any, a: Any, b: Any, m_axes: Any = None) -> LoraWeight:
    return LoraWeight(w, a=a, b=b, alpha=lw.alpha, m_axes=m_axes)


def _not_contiguous(lw: LoraWeight, prim: Any, params: dict) -> Any:
    return _engine.materialize_fallback(
        prim, [lw], params, f"its M axes {lw.axes.m} and N axes {lw.axes.n} are not two "
        "contiguous groups, which this op needs")


# -- transpose -------------------------------------------------------------------


@_engine.register(lax.transpose_p)
def _(lw: LoraWeight, *, permutation: Sequence[int]) -> Any:
    batch, m, n = lw.axes
    nb, perm = len(batch), tuple(permutation)
    if sorted(perm[:nb]) != list(batch):
        return _engine.materialize_fallback(lax.transpose_p, [lw], dict(permutation=perm))
    w = _engine.call(lax.transpose, lw.w, perm)
    new_m = [j for j in range(nb, lw.ndim) if perm[j] in m]
    new_n = [j for j in range(nb, lw.ndim) if perm[j] in n]
    # Each factor keeps its side; its axes follow `w`'s, in their new order.
    b = lax.transpose(lw.b, (*perm[:nb], *(nb + m.index(perm[j]) for j in new_m), lw.b.ndim - 1))
    a = lax.transpose(lw.a, (*perm[:nb], nb, *(nb + 1 + n.index(perm[j]) for j in new_n)))
    if new_n == list(range(nb, nb + len(new_n))):
        # (W + B A)^T = W^T + A^T B^T: N now leads, so the factors swap roles and
        # the layout stays contiguous, which every rule reads.
        new_b = lax.transpose(a, (*range(nb), *range(nb + 1, a.ndim), nb))
        new_a = lax.transpose(b, (*range(nb), b.ndim - 1, *range(nb, b.ndim - 1)))
        return _rebuild(lw, w, new_a, new_b)
    return _rebuild(lw, w, a, b, m_axes=tuple(new_m))


# -- dtype -------------------------------------------------------------------------


@_engine.register(lax.convert_element_type_p)
def _(lw: LoraWeight, *, new_dtype: Any, **params: Any) -> Any:
    if not jnp.issubdtype(new_dtype, jnp.inexact):
        return _engine.materialize_fallback(
            lax.convert_element_type_p, [lw], dict(new_dtype=new_dtype, **params)
        )
    if jnp.dtype(new_dtype) == lw.dtype:
        return lw
    # The factors keep their own (often f32) dtype; rules cast them to `w`'s dtype
    # at the point of use, so gradients reach the factors at full precision.
    w = _engine.call(lax.convert_element_type_p.bind, lw.w, new_dtype=new_dtype, **params)
    return _rebuild(lw, w, lw.a, lw.b, lw.m_axes)


# -- reshapes that keep batch / M / N axis groups intact ------------------------------


def _group_bounds(old: Sequence[int], new: Sequence[int], nb: int, nm: int) -> tuple[int, int] | None:
    """Where the batch|M and M|N boundaries fall in `new`, if a reshape keeps them."""
    if math.prod(old) == 0:
        return None
    p_b, p_bm = math.prod(old[:nb]), math.prod(old[: nb + nm])
    prefix = [math.prod(new[:i]) for i in range(len(new) + 1)]
    i_choices = [i for i, p in enumerate(prefix) if p == p_b and i < len(new) - 1]
    # Prefer the last choice: leading unit axes become batch axes (expand_dims of
    # a stack). With a unit M group that can leave no room for M, so fall back
    # to earlier choices: any valid split is correct, the factors are reshaped
    # in row-major order on either side of it.
    for i in sorted(i_choices, reverse=True):
        for j in range(i + 1, len(new)):
            if prefix[j] == p_bm:
                return i, j
    return None


def _reshape_lora(lw: LoraWeight, new_shape: Sequence[int], prim: Any, params: dict) -> Any:
    if not lw.contiguous:
        return _not_contiguous(lw, prim, params)
    nb, nm, _ = lw.structure
    new_shape = tuple(new_shape)
    bounds = _group_bounds(lw.shape, new_shape, nb, nm)
    if bounds is None:
        return _engine.materialize_fallback(prim, [lw], params)
    i, j = bounds
    k = lw.rank
    w = _engine.call(lax.reshape, lw.w, new_shape)
    b = lax.reshape(lw.b, (*new_shape[:j], k))
    a = lax.reshape(lw.a, (*new_shape[:i], k, *new_shape[j:]))
    return _rebuild(lw, w, a, b)


@_engine.register(lax.reshape_p)
def _(lw: LoraWeight, *, new_sizes: Sequence[int], dimensions: Any, **params: Any) -> Any:
    all_params = dict(new_sizes=new_sizes, dimensions=dimensions, **params)
    if dimensions is not None:
        return _engine.materialize_fallback(lax.reshape_p, [lw], all_params)
    return _reshape_lora(lw, new_sizes, lax.reshape_p, all_params)


@_engine.register(lax.squeeze_p)
def _(lw: LoraWeight, *, dimensions: Sequence[int]) -> Any:
    dims = {d % lw.ndim for d in dimensions}
    new_shape = [s for d, s in enumerate(lw.shape) if d not in dims]
    batch, m, n = lw.axes
    if not lw.contiguous and dims <= set(batch):  # a layer of a stack: `w[i]`
        w = _engine.call(lax.squeeze, lw.w, tuple(sorted(dims)))
        a_dims = tuple(sorted(dims))
        return _rebuild(lw, w, lax.squeeze(lw.a, a_dims), lax.squeeze(lw.b, a_dims), lw.m_axes)
    if not lw.contiguous:
        return _not_contiguous(lw, lax.squeeze_p, dict(dimensions=dimensions))
    if set(m) <= dims or set(n) <= dims:
        return _squeeze_out_group(lw, dims)
    return _reshape_lora(lw, new_shape, lax.squeeze_p, dict(dimensions=dimensions))


def _squeeze_out_group(lw: LoraWeight, dims: set[int]) -> Any:
    """Squeezing away every (unit) `M` or every `N` axis: one row or column.

    `E[i]` of an embedding is `slice` + `squeeze`; once no `M` (or `N`) axis is
    left there is no factorisation to keep, but the result is output-sized:
    `squeeze(W) + s * squeeze(B) @ squeeze(A)` costs O(k * output), no weight.
    """
    nb, nm, _ = lw.structure
    w = lax.stop_gradient(lw.w)
    b_dims = tuple(d for d in sorted(dims) if d < nb + nm)
    a_dims = tuple(d if d < nb else d - nm + 1 for d in sorted(dims) if d < nb or d >= nb + nm)
    b = lax.squeeze(lw.b.astype(w.dtype), b_dims)
    a = lax.squeeze(lw.a.astype(w.dtype), a_dims)
    nb_out = nb - sum(d < nb for d in dims)
    batch = tuple(range(nb_out))
    low = lax.dot_general(b, a, (((b.ndim - 1,), (nb_out,)), (batch, batch)))
    return _engine.call(lax.squeeze, w, tuple(sorted(dims))) + scale(low, lw.scale)


@_engine.register(lax.broadcast_in_dim_p)
def _(lw: LoraWeight, *, shape: Sequence[int], broadcast_dimensions: Sequence[int],
      **params: Any) -> Any:
    all_params = dict(shape=shape, broadcast_dimensions=broadcast_dimensions, **params)
    inserts_unit_axes_only = (
        list(broadcast_dimensions) == sorted(broadcast_dimensions)
        and all(shape[d] == s for d, s in zip(broadcast_dimensions, lw.shape))
        and all(s == 1 for d, s in enumerate(shape) if d not in broadcast_dimensions)
    )
    if not inserts_unit_axes_only:
        return _engine.materialize_fallback(lax.broadcast_in_dim_p, [lw], all_params)
    return _reshape_lora(lw, shape, lax.broadcast_in_dim_p, all_params)


# -- slicing ------------------------------------------------------------------------


def _split_per_factor(lw: LoraWeight, per_axis: Sequence[Any], k_value: Any) -> tuple[list, list]:
    """Distribute per-W-axis values onto B's and A's axes (`k_value` for the rank axis)."""
    batch, m, n = ([per_axis[i] for i in group] for group in lw.axes)
    return [*batch, *m, k_value], [*batch, k_value, *n]


@_engine.register(lax.slice_p)
def _(lw: LoraWeight, *, start_indices: Sequence[int], limit_indices: Sequence[int],
      strides: Sequence[int] | None) -> Any:
    strides = strides or (1,) * lw.ndim
    k = lw.rank
    b_start, a_start = _split_per_factor(lw, start_indices, 0)
    b_limit, a_limit = _split_per_factor(lw, limit_indices, k)
    b_stride, a_stride = _split_per_factor(lw, strides, 1)
    w = _engine.call(lax.slice, lw.w, start_indices, limit_indices, strides)
    b = lax.slice(lw.b, b_start, b_limit, b_stride)
    a = lax.slice(lw.a, a_start, a_limit, a_stride)
    return _rebuild(lw, w, a, b, lw.m_axes)


@_engine.register(lax.dynamic_slice_p)
def _(lw: LoraWeight, *indices: Any, slice_sizes: Sequence[int]) -> Any:
    zero = jnp.zeros((), jnp.asarray(indices[0]).dtype) if indices else 0
    b_idx, a_idx = _split_per_factor(lw, indices, zero)
    b_sizes, a_sizes = _split_per_factor(lw, slice_sizes, lw.rank)
    w = _engine.call(lax.dynamic_slice, lw.w, indices, slice_sizes)
    b = lax.dynamic_slice(lw.b, b_idx, b_sizes)
    a = lax.dynamic_slice(lw.a, a_idx, a_sizes)
    return _rebuild(lw, w, a, b, lw.m_axes)


@_engine.register(_prims.copy_p)
def _(lw: LoraWeight) -> Any:
    return lw

