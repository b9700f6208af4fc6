"""`QuantizedArray` operands: dequantize per use, inside the operation, and again in
the backward pass.

Memory is the point of a quantized base, and XLA decides it, not the jaxpr (see
docs/qlora.md, "Keeping the base quantized"). Two things keep the dense weight from
outliving its use:

- every dequantization reads the codes through `_after(codes, x)`, a bitwise no-op
  that depends on the data of the activation it is about to meet. XLA:CPU otherwise
  schedules all of a step's dequantizations at its start (they depend on parameters
  only), which holds every layer's dense weight at once;
- the base contraction is a `custom_vjp` whose residuals are the quantized leaves;
  its backward pass dequantizes again, tied to the incoming cotangent, so it can
  neither be merged with the forward pass's dequantization nor scheduled before it
  is needed. (`jax.checkpoint` or an `optimization_barrier` do not survive
  XLA:CPU's pipeline: the barrier is expanded, then the two dequantizations are
  merged again.) Host-resident leaves inside a `jax.checkpoint` that recomputes
  them are the exception: the residuals are their moved copies, which the
  recomputation makes anyway.

The weight is frozen: its cotangents are zero, and forward-mode differentiation
through the base contraction is not defined (a `custom_vjp`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike

from .. import _engine
from .._quant import _formats as F
from .._quant._array import QuantizedArray
from .._placement import in_host_memory, on_device
from .._sharding import explicitly_typed, gathered, labelled_out_sharding, manual
from ._contract import arrange, contract, dot_labels
from .gather import _drop_whole_columns
from .quant_partitioned import quantized_contraction

_INT_OF_WIDTH = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _after(codes: Array, dep: Array) -> Array:
    """`codes` (or float scales, bit for bit), with a data dependence on `dep` that XLA
    cannot see through.

    `min(bits & INT_MAX, 0)` is 0 for every bit pattern, NaN and inf included, but no
    XLA pass proves it, so the dequantization reading the result waits for `dep`.
    """
    if dep.size == 0:
        return codes
    if jnp.issubdtype(codes.dtype, jnp.floating):
        as_int = _INT_OF_WIDTH[jnp.dtype(codes.dtype).itemsize]
        tied = _after(lax.bitcast_convert_type(codes, as_int), dep)
        return lax.bitcast_convert_type(tied, codes.dtype)
    # One element, sliced where it is: flattening `dep` first would make a sharded
    # activation be all-gathered whole just to read it (FSDP).
    first = lax.reshape(lax.slice(dep, (0,) * dep.ndim, (1,) * dep.ndim), ())
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = jnp.real(first)
    width = jnp.dtype(first.dtype).itemsize
    if jnp.issubdtype(first.dtype, jnp.bool_):
        first, width = first.astype(jnp.int8), 1
    itype = _INT_OF_WIDTH[width]
    bits = first if first.dtype == itype else lax.bitcast_convert_type(first, itype)
    zero = jnp.minimum(bits & jnp.iinfo(itype).max, 0)
    return codes | zero.astype(codes.dtype)


def _leaves(qa: QuantizedArray) -> tuple:
    return qa.codes, qa.scales, qa.mins, qa.scale_scales, qa.scale_offset


def _rebuild(like: QuantizedArray, leaves: tuple, **static: Any) -> QuantizedArray:
    return like.with_leaves(leaves, **static)


def _dense_storage(meta: "_Meta", leaves: tuple, dep: Array | None) -> Array:
    # Sharded leaves are gathered as codes, then dequantized (see `_sharding.gathered`).
    # Host-resident leaves (`lorax.offload_frozen`) move here, as codes, before use.
    codes, scales, mins, ss, so = (None if x is None else gathered(on_device(x), meta.mesh)
                                   for x in leaves)
    qa = QuantizedArray(codes, scales, mins, scale_scales=ss, scale_offset=so,
                        qtype=meta.qtype, block_size=meta.block_size, axis=meta.axis,
                        dense_dtype=meta.dense_dtype)
    return (qa if dep is None else _tied(qa, dep)).dequantize_storage()


def _tied(qa: QuantizedArray, dep: Array) -> QuantizedArray:
    # A product XLA's GPU compiler fuses into the GEMM must read the codes as they are
    # (an operation on them ends the fusion), so such a weight waits on its scales.
    if qa.scaled_in_dense_dtype:
        return qa.with_leaves((qa.codes, _after(qa.scales, dep), *_leaves(qa)[2:]))
    return qa.with_leaves((_after(qa.codes, dep), *_leaves(qa)[1:]))


@dataclasses.dataclass(frozen=True)
class _Meta:
    qtype: str
    block_size: int
    axis: int
    dense_dtype: Any
    mesh: Any = None  # the Auto mesh the leaves are sharded on, if any


def _meta(qa: QuantizedArray) -> _Meta:
    return _Meta(qa.qtype, qa.block_size, qa.axis, qa.dense_dtype, _engine.current_mesh())


# -- dot_general ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _DotPlan:
    meta: _Meta
    w_first: bool
    wl: tuple[int, ...]  # labels of W in storage order
    xl: tuple[int, ...]
    out: tuple[int, ...]
    x_shape: tuple[int, ...]
    x_dtype: Any
    params: tuple

    def transposed(self, dy: Array) -> "_DotPlan":
        """The plan of `x`'s cotangent: `dy` (labels `out`) contracted with the weight."""
        # `x`'s cotangent is typed by its operands (`contract`), not as the product was.
        params = tuple((k, v) for k, v in self.params
                       if k not in ("preferred_element_type", "out_sharding"))
        return dataclasses.replace(self, xl=self.out, out=self.xl, x_shape=tuple(dy.shape),
                                   x_dtype=jnp.dtype(dy.dtype), params=params)

    def apply(self, w: Array, x: Array) -> Array:
        params = dict(self.params)
        if self.w_first:
            y, yl = contract(w, self.wl, x, self.xl, self.out, **params)
        else:
            y, yl = contract(x, self.xl, w, self.wl, self.out, **params)
        return arrange(y, yl, self.out)


# The base op `y = op(W, x)`, linear in `x`, as a function of the quantized leaves.
# `plan` is static: a hashable description with `apply(w_storage, x)`, `x_shape`,
# `x_dtype` and `meta`.


def _plan_storage(plan: Any, leaves: tuple, dep: Array) -> Array:
    # A plan with `tie = False` dequantizes without the data dependence (see _RaggedPlan).
    return _dense_storage(plan.meta, leaves, dep if getattr(plan, "tie", True) else None)


def _partitioned(plan: Any, x: Array) -> bool:
    """A dot on an Auto mesh: one op that XLA partitions per mesh axis (tensor
    parallelism keeps the codes where they are; see `quant_partitioned`)."""
    return isinstance(plan, _DotPlan) and plan.meta.mesh is not None and not manual(x)


def _apply(plan: Any, x: Array, leaves: tuple, aux: tuple) -> Array:
    # Inside the custom_vjp, so its residuals are what `_qlinear` chose (the leaves where
    # they live, or inside a recomputing checkpoint their moved copies), not this move.
    leaves = tuple(map(on_device, leaves))
    if _partitioned(plan, x):
        return quantized_contraction(plan, x, leaves, functools.partial(_gathered_apply, plan))
    return plan.apply(_plan_storage(plan, leaves, x), x, *aux)


def _gathered_apply(plan: Any, x: Array, leaves: tuple) -> Array:
    return plan.apply(_plan_storage(plan, leaves, x), x)


def _qlinear(plan: Any, x: Array, leaves: tuple, aux: tuple = ()) -> Array:
    """The base op on quantized leaves. Inside a recomputing `jax.checkpoint`
    (`_engine.recomputed`), host-resident leaves' moved copies are the residuals (the
    recomputation moves them once for both passes); elsewhere the leaves themselves."""
    hosts = tuple(map(in_host_memory, leaves))
    keep = hosts if any(hosts) and _engine.recomputed() else ()
    return _qlinear_vjp(plan, keep, x, leaves, aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qlinear_vjp(plan: Any, keep: tuple, x: Array, leaves: tuple, aux: tuple = ()) -> Array:
    return _apply(plan, x, leaves, aux)


def _qlinear_fwd(plan: Any, keep: tuple, x: Array, leaves: tuple,
                 aux: tuple = ()) -> tuple[Array, tuple]:
    if not keep:
        return _apply(plan, x, leaves, aux), (leaves, aux)
    moved = tuple(None if m is None else checkpoint_name(on_device(m), _engine.RECOMPUTED)
                  for m in leaves)
    return _apply(plan, x, moved, aux), (moved, aux)


def _qlinear_bwd(plan: Any, keep: tuple, res: tuple, dy: Array) -> tuple[Array, Any, Any]:
    # `aux`: further operands the op is not differentiated in (a ragged_dot's group sizes).
    leaves, aux = res
    hosts = keep or tuple(map(in_host_memory, leaves))
    zeros = tuple(None if x is None else _zero_cotangent(x, h) for x, h in zip(leaves, hosts))
    zero_aux = jax.tree_util.tree_map(lambda x: _zero_cotangent(x, in_host_memory(x)), aux)
    moved = tuple(map(on_device, leaves))
    if _partitioned(plan, dy):
        t = plan.transposed(dy)
        dx = quantized_contraction(t, dy, moved, functools.partial(_gathered_apply, t))
        dx = dx.astype(plan.x_dtype)
        return dx, zeros, zero_aux
    w = _plan_storage(plan, moved, dy)
    aval = jax.ShapeDtypeStruct(plan.x_shape, plan.x_dtype)
    (dx,) = jax.linear_transpose(lambda x: plan.apply(w, x, *aux), aval)(dy)
    return dx, zeros, zero_aux


def _zero_cotangent(x: Array, host: bool) -> Array:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return np.zeros(x.shape, jax.dtypes.float0)
    zero = jnp.zeros(x.shape, x.dtype)
    # Typed as the primal leaf, host memory included (the frozen leaf's cotangent is dropped).
    return jax.device_put(zero, jax.memory.Space.Host) if host else zero


_qlinear_vjp.defvjp(_qlinear_fwd, _qlinear_bwd)


def _storage_labels(qa: QuantizedArray, labels: Sequence[int]) -> tuple[int, ...]:
    b = qa.ndim + qa.axis
    return (*labels[:b], *labels[b + 1 :], labels[b])


def quantized_dot(qa: QuantizedArray, x: Array, *, w_first: bool, dimension_numbers: Any,
                  **params: Any) -> Array:
    """`dot_general` of the quantized weight with `x`, in the caller's operand order."""
    lhs, rhs = (qa, x) if w_first else (x, qa)
    ll, rl, out = dot_labels(lhs.ndim, rhs.ndim, dimension_numbers)
    wl, xl = (ll, rl) if w_first else (rl, ll)
    params = {k: v for k, v in params.items() if not (k == "out_sharding" and v is None)}
    plan = _DotPlan(_meta(qa), w_first, _storage_labels(qa, wl), tuple(xl), tuple(out),
                    tuple(x.shape), jnp.dtype(x.dtype), tuple(sorted(params.items())))
    return _qlinear(plan, x, _leaves(qa))


def _dot_ok(params: dict) -> str | None:
    try:
        hash(tuple(sorted(params.items())))
    except TypeError:
        return "an unhashable dot_general parameter"
    return None


def _dot_rule(lhs: Any, rhs: Any, w_first: bool, dimension_numbers: Any, params: dict) -> Any:
    qa, x = (lhs, rhs) if w_first else (rhs, lhs)
    why = _dot_ok(params)
    if why or _engine.is_value(x):
        return _engine.materialize_fallback(
            lax.dot_general_p, [lhs, rhs], dict(dimension_numbers=dimension_numbers, **params), why)
    x = jnp.asarray(x)
    if explicitly_typed(x) or explicitly_typed(qa.codes):
        return _explicit_quantized_dot(qa, x, w_first, dimension_numbers, params)
    return quantized_dot(qa, x, w_first=w_first, dimension_numbers=dimension_numbers, **params)


def _explicit_quantized_dot(qa: QuantizedArray, x: Array, w_first: bool,
                            dimension_numbers: Any, params: dict) -> Array:
    """The quantized product under Explicit mesh axes: computed with the axes Auto
    (`auto_axes`), its result typed as the model asked (`out_sharding`) or as its operands'
    types say. Inside, sharding propagation places the dequantization from the codes'
    layout (tested: FSDP gathers codes, tensor parallelism moves none); the partitioned op
    of the Auto-mesh path is not used there, since jax 0.12 leaves its sharding custom
    call unlowered inside `auto_axes` on CPU."""
    nd = (qa.ndim, x.ndim) if w_first else (x.ndim, qa.ndim)
    ll, rl, out = dot_labels(*nd, dimension_numbers)
    wl, xl = (ll, rl) if w_first else (rl, ll)
    spec = params.get("out_sharding") or labelled_out_sharding(
        ((x, xl), (qa.codes, _storage_labels(qa, wl))), out)
    rest = {k: v for k, v in params.items() if k != "out_sharding"}

    def product(x: Array, leaves: tuple) -> Array:
        with _engine.mesh_scope(None):
            return quantized_dot(qa.with_leaves(leaves), x, w_first=w_first,
                                 dimension_numbers=dimension_numbers, **rest)

    return jax.sharding.auto_axes(product, out_sharding=spec)(x, _leaves(qa))


@_engine.register(lax.dot_general_p)
def _(lhs: QuantizedArray, rhs: ArrayLike, *, dimension_numbers: Any, **params: Any) -> Any:
    return _dot_rule(lhs, rhs, True, dimension_numbers, params)


@_engine.register(lax.dot_general_p)
def _(lhs: ArrayLike, rhs: QuantizedArray, *, dimension_numbers: Any, **params: Any) -> Any:
    return _dot_rule(lhs, rhs, False, dimension_numbers, params)


# -- convolutions: the quantized weight as the kernel ------------------------------------


@dataclasses.dataclass(frozen=True)
class _ConvPlan:
    meta: _Meta
    ndim: int
    x_shape: tuple[int, ...]
    x_dtype: Any
    params: tuple

    def apply(self, w: Array, x: Array) -> Array:
        kernel = jnp.moveaxis(w, -1, self.ndim + self.meta.axis)
        return lax.conv_general_dilated_p.bind(x, kernel, **dict(self.params))


@_engine.register(lax.conv_general_dilated_p)
def _(lhs: ArrayLike, rhs: QuantizedArray, **params: Any) -> Any:
    try:
        items = tuple(sorted(params.items()))
        hash(items)
    except TypeError:
        return _engine.materialize_fallback(lax.conv_general_dilated_p, [lhs, rhs], params,
                                            "an unhashable convolution parameter")
    if _engine.is_value(lhs):
        return _engine.materialize_fallback(lax.conv_general_dilated_p, [lhs, rhs], params)
    lhs = jnp.asarray(lhs)
    plan = _ConvPlan(_meta(rhs), rhs.ndim, tuple(lhs.shape), jnp.dtype(lhs.dtype), items)
    return _qlinear(plan, lhs, _leaves(rhs))


# -- ragged_dot: quantized expert weights (MoE) ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class _RaggedPlan:
    meta: _Meta
    ndim: int
    x_shape: tuple[int, ...]
    x_dtype: Any
    params: tuple
    # No `_after` tie: XLA:CPU runs a ragged_dot as per-group products and fuses each
    # group's dequantization into its own; the tie blocks that fusion and leaves a whole
    # dense expert stack in temporaries (tests/test_ragged.py: 0.69 vs 1.47 stacks). The
    # custom_vjp still keeps only the quantized leaves for the backward pass.
    tie: bool = False

    def apply(self, w: Array, x: Array, group_sizes: Array, *rest: Array) -> Array:
        params = dict(self.params)
        dn = params["ragged_dot_dimension_numbers"]
        (lc, rc), (lb, rb) = dn.dot_dimension_numbers
        block = self.ndim + self.meta.axis
        order = [d for d in range(self.ndim) if d != block] + [block]  # storage's axes
        where = order.index
        free = [d for d in range(self.ndim) if d not in (*rc, *rb, *dn.rhs_group_dimensions)]
        if sorted(free, key=where) != free:  # the output would come out in another order
            return _engine.ragged_dot_general_p.bind(
                x, jnp.moveaxis(w, -1, block), group_sizes, *rest, **params)
        # The storage layout as it is (block axis last): no transposed copy of the weight.
        params["ragged_dot_dimension_numbers"] = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=((lc, tuple(map(where, rc))), (lb, tuple(map(where, rb)))),
            lhs_ragged_dimensions=dn.lhs_ragged_dimensions,
            rhs_group_dimensions=tuple(map(where, dn.rhs_group_dimensions)))
        return _engine.ragged_dot_general_p.bind(x, w, group_sizes, *rest, **params)


if _engine.ragged_dot_general_p is not None:
    @_engine.register(_engine.ragged_dot_general_p)
    def _(lhs: ArrayLike, rhs: QuantizedArray, group_sizes: ArrayLike, *rest: ArrayLike,
          **params: Any) -> Any:
        why = _dot_ok(params)
        if why or _engine.is_value(lhs):
            return _engine.materialize_fallback(_engine.ragged_dot_general_p,
                                                [lhs, rhs, group_sizes, *rest], params, why)
        lhs = jnp.asarray(lhs)
        plan = _RaggedPlan(_meta(rhs), rhs.ndim, tuple(lhs.shape), jnp.dtype(lhs.dtype),
                           tuple(sorted(params.items())))
        return _qlinear(plan, lhs, _leaves(rhs), (jnp.asarray(group_sizes), *map(jnp.asarray, rest)))


# -- gather: point lookups (embedding rows) ----------------------------------------------


def _is_point_lookup(qa: QuantizedArray, dn: lax.GatherDimensionNumbers, slice_sizes: Sequence[int],
                     indices: Any) -> bool:
    """Each indexed axis is looked up one entry at a time (collapsed or kept as a unit
    axis), every other axis taken whole."""
    idx = set(dn.start_index_map)
    return (
        not dn.operand_batching_dims
        and len(idx) == len(dn.start_index_map)
        and set(dn.collapsed_slice_dims) <= idx
        and all(slice_sizes[d] == (1 if d in idx else qa.shape[d]) for d in range(qa.ndim))
        and jnp.ndim(indices) >= 1
        and jnp.shape(indices)[-1] == len(dn.start_index_map)
    )


def _lookup_one(qa: QuantizedArray, start_index_map: Sequence[int], idx: Array) -> Array:
    """The dense entries of `qa` at one index vector `idx` (clamped), remaining axes in order."""
    fmt = qa.format
    block = qa.ndim + qa.axis
    other = [d for d in range(qa.ndim) if d != block]  # storage axis i holds logical other[i]
    codes, scales, mins = qa.codes, qa.scales, qa.mins
    if qa.scale_scales is not None:
        scales = F.double_dequantize(fmt, scales, qa.scale_scales, qa.scale_offset)
    pos = None
    # Index the storage axes from the last to the first, so positions stay valid.
    for d, i in sorted(zip(start_index_map, idx), key=lambda t: -t[0]):
        i = jnp.clip(i, 0, qa.shape[d] - 1)
        if d == block:
            j = i // qa.block_size
            pos = i % qa.block_size
            codes = lax.dynamic_index_in_dim(codes, j, codes.ndim - 2, keepdims=False)
            scales = lax.dynamic_index_in_dim(scales, j, scales.ndim - 1, keepdims=False)
            mins = None if mins is None else lax.dynamic_index_in_dim(mins, j, mins.ndim - 1, keepdims=False)
        else:
            s = other.index(d)
            codes = lax.dynamic_index_in_dim(codes, i, s, keepdims=False)
            scales = lax.dynamic_index_in_dim(scales, i, s, keepdims=False)
            mins = None if mins is None else lax.dynamic_index_in_dim(mins, i, s, keepdims=False)
    kept = [d for d in range(qa.ndim) if d not in start_index_map]
    if pos is None:  # the block axis is taken whole: dequantize the picked rows
        v = F.dequantize_blocks(fmt, codes, scales.astype(jnp.float32),
                                None if mins is None else mins.astype(jnp.float32))
        storage_order = [d for d in kept if d != block] + [block]
        v = arrange(v, storage_order, kept)
    else:  # one value per remaining row: its code (or, for shared codes, its block)
        v = F.value_at(fmt, codes, scales, mins, pos, qa.block_size)
    return v.astype(qa.dense_dtype)


def quantized_lookup(qa: QuantizedArray, indices: Array, dn: lax.GatherDimensionNumbers,
                     mode: Any, fill_value: Any) -> Array:
    """`gather` of entries of `qa`: gather their codes, dequantize only those."""
    indices = jnp.asarray(indices)
    qa = jax.tree_util.tree_map(on_device, qa)  # the table moves whole (codes, not values)
    batch_shape = indices.shape[:-1]
    flat = indices.reshape(-1, indices.shape[-1])
    rows = jax.vmap(functools.partial(_lookup_one, qa, tuple(dn.start_index_map)))(flat)
    # Indexed axes the gather keeps (as unit axes) go back in, in operand order.
    for d in sorted(set(dn.start_index_map) - set(dn.collapsed_slice_dims)):
        rows = jnp.expand_dims(rows, 1 + sum(e < d for e in range(qa.ndim)
                                             if e not in dn.collapsed_slice_dims))
    rows = rows.reshape(*batch_shape, *rows.shape[1:])
    if lax.GatherScatterMode.from_any(mode) is lax.GatherScatterMode.FILL_OR_DROP:
        bounds = jnp.asarray([qa.shape[d] for d in dn.start_index_map])
        ok = jnp.all((indices >= 0) & (indices < bounds), axis=-1)
        fill = jnp.nan if fill_value is None else fill_value
        if not jnp.issubdtype(rows.dtype, jnp.inexact) and fill_value is None:
            fill = 0
        ok = ok.reshape(*ok.shape, *([1] * (rows.ndim - ok.ndim)))
        rows = jnp.where(ok, rows, jnp.asarray(fill, rows.dtype))
    # rows: (*index batch, *offset axes); the gather puts offset axes at `offset_dims`.
    n_batch, out_rank = len(batch_shape), rows.ndim
    order = [0] * out_rank
    batch_pos = [p for p in range(out_rank) if p not in dn.offset_dims]
    for i, p in enumerate(batch_pos):
        order[p] = i
    for j, p in enumerate(dn.offset_dims):
        order[p] = n_batch + j
    return lax.transpose(rows, tuple(order)) if order != list(range(out_rank)) else rows


@_engine.register(lax.gather_p)
def _(qa: QuantizedArray, indices: ArrayLike, *, dimension_numbers: lax.GatherDimensionNumbers,
      slice_sizes: Sequence[int], mode: Any = None, fill_value: Any = None, **params: Any) -> Any:
    # `vmap` of a per-example `E[i]` adds index columns for axes taken whole.
    dn, idx = _drop_whole_columns(dimension_numbers, indices, slice_sizes, qa.shape, mode)
    if _is_point_lookup(qa, dn, slice_sizes, idx):
        return quantized_lookup(qa, jnp.asarray(idx), dn, mode, fill_value)
    return _engine.materialize_fallback(
        lax.gather_p, [qa, indices],
        dict(dimension_numbers=dimension_numbers, slice_sizes=slice_sizes, mode=mode,
             fill_value=fill_value, **params),
        "only lookups of single entries along the indexed axes keep it quantized")


# -- structural ops: the same codes, other static metadata (or the leading axes moved) ----


def _other_axes(qa: QuantizedArray) -> list[int]:
    block = qa.ndim + qa.axis
    return [d for d in range(qa.ndim) if d != block]


def _map_leaves(qa: QuantizedArray, fn: Any, touches_last_other: bool) -> tuple | None:
    """Apply `fn(leaf, n_other_axes_of_leaf)` to each leaf's leading (`other`) axes.

    The double-quantization leaves have all but the last `other` axis: `None` if
    the op touches that axis.
    """
    codes, scales, mins, ss, so = _leaves(qa)
    n = qa.ndim - 1
    out = [fn(codes, n), fn(scales, n), None if mins is None else fn(mins, n)]
    if ss is not None:
        if touches_last_other:
            return None
        out += [fn(ss, n - 1), fn(so, n - 1)]
    else:
        out += [None, None]
    return tuple(out)


@_engine.register(lax.transpose_p)
def _(qa: QuantizedArray, *, permutation: Sequence[int]) -> Any:
    perm = tuple(permutation)
    block = qa.ndim + qa.axis
    old_other = _other_axes(qa)
    storage_perm = [old_other.index(p) for p in perm if p != block]
    leaves: tuple | None = _leaves(qa)
    if storage_perm != sorted(storage_perm):  # the leading axes move: move the bytes
        leaves = _map_leaves(
            qa, lambda leaf, n: lax.transpose(leaf, (*storage_perm[:n], *range(n, leaf.ndim))),
            storage_perm[-1] != len(storage_perm) - 1)
    if leaves is None:
        return _engine.materialize_fallback(lax.transpose_p, [qa], dict(permutation=perm),
                                            "the double-quantized scales cannot follow it")
    return _rebuild(qa, leaves, axis=perm.index(block) - qa.ndim)


@_engine.register(lax.convert_element_type_p)
def _(qa: QuantizedArray, *, new_dtype: Any, **params: Any) -> Any:
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return _engine.materialize_fallback(
            lax.convert_element_type_p, [qa], dict(new_dtype=new_dtype, **params))
    return _rebuild(qa, _leaves(qa), dense_dtype=jnp.dtype(new_dtype))


@_engine.register(lax.copy_p)
def _(qa: QuantizedArray) -> Any:
    return qa


def _leading_op(qa: QuantizedArray, per_axis: dict[int, Any], fn: Any) -> tuple | str:
    """Leaves after an op on `other` axes only (`per_axis`: logical axis -> its part of
    the op; `fn(leaf, {storage axis: part})`), or why the op cannot keep `qa` quantized."""
    block = qa.ndim + qa.axis
    if block in per_axis:
        return "it removes or regroups the quantization blocks' axis"
    other = _other_axes(qa)
    by_storage = {other.index(d): v for d, v in per_axis.items()}
    leaves = _map_leaves(qa, lambda leaf, n: fn(leaf, {s: v for s, v in by_storage.items() if s < n}),
                         len(other) - 1 in by_storage)
    return "the double-quantized scales cannot follow it" if leaves is None else leaves


# -- slices through the block axis: only the blocks the range covers ------------------------


def _single_scales(qa: QuantizedArray) -> QuantizedArray:
    """`qa` with double-quantized scales expanded to plain ones (1/64 of the weight), so
    its blocks can be cut anywhere."""
    if qa.scale_scales is None:
        return qa
    scales = F.double_dequantize(qa.format, *map(on_device, (qa.scales, qa.scale_scales, qa.scale_offset)))
    return _rebuild(qa, (qa.codes, scales, qa.mins, None, None))


def _blocks(qa: QuantizedArray, cut: Any) -> QuantizedArray:
    """`qa` with `cut(leaf, axis)` applied to the blocks axis of codes, scales and mins."""
    codes, scales, mins, ss, so = _leaves(qa)
    return _rebuild(qa, (cut(codes, codes.ndim - 2), cut(scales, scales.ndim - 1),
                         None if mins is None else cut(mins, mins.ndim - 1), ss, so))


def _trimmed(qa: QuantizedArray, trim: Any) -> Array:
    """The dense value of `qa`'s (already cut) blocks, trimmed by `trim(values, axis)`
    along the block axis, which is then put back in its place."""
    # Through `_dense_storage`: a sharded table's cut blocks are gathered as codes.
    v = trim(_dense_storage(_meta(qa), _leaves(qa), None), qa.codes.ndim - 2)
    return jnp.moveaxis(v, -1, qa.ndim + qa.axis)


def _one_block_of_bytes(qa: QuantizedArray) -> bool:
    """One code byte per value and one block over the whole axis (int8's per-channel
    scales): any range of the axis is that range of code bytes under the same scales,
    so a cut through the block stays quantized."""
    fmt = F.get_format(qa.qtype)
    return (fmt.element_codes and fmt.record is None and qa.codes.shape[-2] == 1
            and qa.scale_scales is None)


def _cut_bytes(qa: QuantizedArray, cut: Any, size: int) -> QuantizedArray:
    codes = cut(qa.codes, qa.codes.ndim - 1)
    return _rebuild(qa, (codes, *_leaves(qa)[1:]), block_size=size)


def _slice_blocks(qa: QuantizedArray, start: int, limit: int, stride: int) -> Any:
    bs, k = qa.block_size, qa.shape[qa.ndim + qa.axis]
    if _one_block_of_bytes(qa):
        size = len(range(start, limit, stride))
        return _cut_bytes(qa, lambda x, ax: lax.slice_in_dim(x, start, limit, stride, axis=ax),
                          size)
    b0, b1 = start // bs, -(-limit // bs)
    aligned = start % bs == 0 and (limit % bs == 0 or limit == k) and stride == 1
    if aligned and qa.scale_scales is None:  # whole blocks: it stays quantized
        return _blocks(qa, lambda x, ax: lax.slice_in_dim(x, b0, b1, axis=ax))
    part = _blocks(_single_scales(qa), lambda x, ax: lax.slice_in_dim(x, b0, b1, axis=ax))
    return _trimmed(part, lambda v, ax: lax.slice_in_dim(
        v, start - b0 * bs, limit - b0 * bs, stride, axis=ax))


def _dynamic_slice_blocks(qa: QuantizedArray, index: Any, size: int) -> Array:
    bs, k = qa.block_size, qa.shape[qa.ndim + qa.axis]
    n_blocks = k // bs
    n = min(n_blocks, (size - 1) // bs + 2)  # blocks any start can touch
    i = jnp.clip(jnp.asarray(index), 0, k - size)  # dynamic_slice's own clamping
    if _one_block_of_bytes(qa):
        return _cut_bytes(qa, lambda x, ax: lax.dynamic_slice_in_dim(x, i, size, axis=ax), size)
    b0 = jnp.minimum(i // bs, n_blocks - n)
    part = _blocks(_single_scales(qa),
                   lambda x, ax: lax.dynamic_slice_in_dim(x, b0, n, axis=ax))
    return _trimmed(part, lambda v, ax: lax.dynamic_slice_in_dim(v, i - b0 * bs, size, axis=ax))


@_engine.register(lax.slice_p)
def _(qa: QuantizedArray, *, start_indices: Sequence[int], limit_indices: Sequence[int],
      strides: Sequence[int] | None) -> Any:
    strides = tuple(strides or (1,) * qa.ndim)
    per_axis = {d: (s, l, st) for d, (s, l, st, n) in
                enumerate(zip(start_indices, limit_indices, strides, qa.shape))
                if (s, l, st) != (0, n, 1)}
    block = qa.ndim + qa.axis

    def fn(leaf: Array, spec: dict) -> Array:
        start = [spec[i][0] if i in spec else 0 for i in range(leaf.ndim)]
        limit = [spec[i][1] if i in spec else n for i, n in enumerate(leaf.shape)]
        step = [spec[i][2] if i in spec else 1 for i in range(leaf.ndim)]
        return lax.slice(leaf, start, limit, step)

    if block in per_axis:  # the blocks get cut: plain scales cut anywhere
        qa = _single_scales(qa)
    leaves = _leading_op(qa, {d: v for d, v in per_axis.items() if d != block}, fn)
    if isinstance(leaves, str):
        return _engine.materialize_fallback(
            lax.slice_p, [qa], dict(start_indices=start_indices, limit_indices=limit_indices,
                                    strides=strides), leaves)
    out = _rebuild(qa, leaves)
    return _slice_blocks(out, *per_axis[block]) if block in per_axis else out


@_engine.register(lax.dynamic_slice_p)
def _(qa: QuantizedArray, *indices: Any, slice_sizes: Sequence[int]) -> Any:
    per_axis = {d: (indices[d], s) for d, (s, n) in enumerate(zip(slice_sizes, qa.shape)) if s != n}
    block = qa.ndim + qa.axis

    def fn(leaf: Array, spec: dict) -> Array:
        zero = jnp.zeros((), jnp.asarray(indices[0]).dtype)
        starts = [spec[i][0] if i in spec else zero for i in range(leaf.ndim)]
        sizes = [spec[i][1] if i in spec else n for i, n in enumerate(leaf.shape)]
        return lax.dynamic_slice(leaf, starts, sizes)

    if block in per_axis:  # the blocks get cut: plain scales cut anywhere
        qa = _single_scales(qa)
    leaves = _leading_op(qa, {d: v for d, v in per_axis.items() if d != block}, fn)
    if isinstance(leaves, str):
        return _engine.materialize_fallback(
            lax.dynamic_slice_p, [qa, *indices], dict(slice_sizes=slice_sizes), leaves)
    out = _rebuild(qa, leaves)
    return _dynamic_slice_blocks(out, *per_axis[block]) if block in per_axis else out


@_engine.register(lax.reshape_p)
def _(qa: QuantizedArray, *, new_sizes: Sequence[int], dimensions: Any, **params: Any) -> Any:
    """Reshapes that leave the block axis alone: the axes before it and after it are
    regrouped among themselves (which is a reshape of the stored leading axes)."""
    new = tuple(new_sizes)
    block = qa.ndim + qa.axis
    before, k = qa.shape[:block], qa.shape[block]
    n_before = math.prod(before)
    prefix = [math.prod(new[:i]) for i in range(len(new) + 1)]
    fits = [i for i in range(len(new)) if prefix[i] == n_before and new[i] == k]
    double = qa.scale_scales is not None
    if dimensions is not None or not fits or double:
        why = ("the double-quantized scales cannot follow it" if double and fits
               else "it regroups the quantization blocks' axis")
        return _engine.materialize_fallback(
            lax.reshape_p, [qa], dict(new_sizes=new_sizes, dimensions=dimensions, **params), why)
    i = fits[-1]
    other = (*new[:i], *new[i + 1:])
    codes, scales, mins, _, _ = _leaves(qa)
    leaves = (codes.reshape(*other, *codes.shape[-2:]), scales.reshape(*other, scales.shape[-1]),
              None if mins is None else mins.reshape(*other, mins.shape[-1]), None, None)
    return _rebuild(qa, leaves, axis=i - len(new))


@_engine.register(lax.squeeze_p)
def _(qa: QuantizedArray, *, dimensions: Sequence[int]) -> Any:
    dims = {d % qa.ndim for d in dimensions}
    block = qa.ndim + qa.axis
    leaves = _leading_op(qa, {d: None for d in dims},
                         lambda leaf, spec: lax.squeeze(leaf, tuple(sorted(spec))))
    if isinstance(leaves, str):
        return _engine.materialize_fallback(lax.squeeze_p, [qa], dict(dimensions=dimensions), leaves)
    # The block axis keeps its place counted from the end unless squeezed axes follow it.
    return _rebuild(qa, leaves, axis=qa.axis + sum(d > block for d in dims))
