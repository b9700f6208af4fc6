"""`gather` on a `LoraWeight`: row lookups (embeddings) and slices of stacked weights.

- Indexing only batch axes (picking one layer of a stack) gives a `LoraWeight`.
- Indexing `W`'s `M` axes with the `N` axes taken whole (`E[ids]`,
  `jnp.take(E, ids, axis=0)`, Flax/Haiku/Equinox `Embed`) gives
  `gather(W) + s * gather(B) @ A`: the lookup costs O(ids * k * N) extra.
- Indexing `N` axes with `M` whole (`E2[:, ids]`) is the mirror image.
In both lookups each batch axis must be taken whole or be a gather batching axis
(`vmap` over a stacked table), so the other factor needs no gather. An index
column for an axis the gather takes whole is ignored under clamping modes: that
is what `vmap` makes of a per-example `E[i]` (`jax.vmap(eqx.nn.Embedding)`).
Anything else is materialized under the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from .. import _engine
from .._placement import read_frozen
from .._weight import LoraWeight
from .dot import scale
from ._contract import arrange, factor_contract, gate_rank


def _touched(dn: lax.GatherDimensionNumbers, slice_sizes: Sequence[int], shape: Sequence[int]) -> set[int]:
    """Operand axes the gather indexes or does not take whole."""
    touched = {*dn.collapsed_slice_dims, *dn.start_index_map, *dn.operand_batching_dims}
    touched |= {d for d, (s, n) in enumerate(zip(slice_sizes, shape)) if s != n}
    return touched


def _remap(dn: lax.GatherDimensionNumbers, axis_map: dict[int, int], offset_dims: Sequence[int]) -> lax.GatherDimensionNumbers:
    return lax.GatherDimensionNumbers(
        offset_dims=tuple(offset_dims),
        collapsed_slice_dims=tuple(axis_map[d] for d in dn.collapsed_slice_dims),
        start_index_map=tuple(axis_map[d] for d in dn.start_index_map),
        operand_batching_dims=tuple(axis_map[d] for d in dn.operand_batching_dims),
        start_indices_batching_dims=dn.start_indices_batching_dims,
    )


_CLAMPING = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _drop_whole_columns(dn: lax.GatherDimensionNumbers, indices: Any, slice_sizes: Sequence[int],
                        shape: Sequence[int], mode: Any) -> tuple[lax.GatherDimensionNumbers, Any]:
    """Drop index columns for axes sliced whole: clamping pins their start to 0."""
    if lax.GatherScatterMode.from_any(mode) not in _CLAMPING:
        return dn, indices
    keep = [
        i for i, d in enumerate(dn.start_index_map)
        if d in dn.collapsed_slice_dims or slice_sizes[d] != shape[d]
    ]
    keep = keep or [0]  # every axis whole (a one-row table): one column still says "gather"
    if len(keep) == len(dn.start_index_map):
        return dn, indices
    dn = dn._replace(start_index_map=tuple(dn.start_index_map[i] for i in keep))
    return dn, jnp.asarray(indices)[..., np.asarray(keep)]


def _factor_params(params: dict) -> dict:
    """Out-of-bounds slices of a factor are 0, so `W`'s fill value is the result."""
    if lax.GatherScatterMode.from_any(params.get("mode")) is lax.GatherScatterMode.FILL_OR_DROP:
        return {**params, "fill_value": 0}
    return params


@_engine.register(lax.gather_p)
def _(lw: LoraWeight, indices: ArrayLike, *, dimension_numbers: lax.GatherDimensionNumbers,
      slice_sizes: Sequence[int], **params: Any) -> Any:
    out = lora_gather(lw, indices, dimension_numbers, slice_sizes, params)
    if out is not None:
        return out
    return _engine.materialize_fallback(
        lax.gather_p, [lw, indices],
        dict(dimension_numbers=dimension_numbers, slice_sizes=slice_sizes, **params),
    )


def lora_gather(lw: LoraWeight, indices: ArrayLike, dimension_numbers: lax.GatherDimensionNumbers,
                slice_sizes: Sequence[int], params: dict, gate: Any = None) -> Any:
    """The gather rule; `gate` (a mixed batch's `(*batch, k)` rank gate) scales the
    rank axis of a lookup's low-rank path. A pick of layers returns a `LoraWeight`
    (the caller carries the gate); `None` when no low-rank form fits."""
    if not lw.contiguous:
        return None  # the lookups below read `M` and `N` as two runs of axes
    nb, nm, nn = lw.structure
    dn, indices = _drop_whole_columns(dimension_numbers, indices, slice_sizes, lw.shape, params.get("mode"))
    touched = _touched(dn, slice_sizes, lw.shape)
    batch_axes = set(range(nb))
    m_axes = set(range(nb, nb + nm))
    n_axes = set(range(nb + nm, nb + nm + nn))
    k = lw.rank
    w_params, params = params, _factor_params(params)
    gather = lambda x, dn_, sizes: lax.gather_p.bind(  # noqa: E731
        x, indices, dimension_numbers=dn_, slice_sizes=tuple(sizes), **params
    )
    # Output positions of the operand's offset (non-collapsed) axes, in axis order.
    kept = [d for d in range(lw.ndim) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    offset_of = dict(zip(kept, dn.offset_dims))

    out_rank = lw.ndim - len(dn.collapsed_slice_dims) - len(dn.operand_batching_dims) + jnp.ndim(indices) - 1
    removed = set(dn.collapsed_slice_dims) | set(dn.operand_batching_dims)

    if touched and touched <= batch_axes and removed <= batch_axes:
        # Picking layers of a stack: when W's M and N axes stay the trailing output
        # axes, the result is a stacked LoraWeight with the same factor layout.
        mn = sorted(m_axes | n_axes)
        if [offset_of[d] for d in mn] == list(range(out_rank - nm - nn, out_rank)):
            kept_b = [offset_of[d] for d in kept if d in batch_axes]
            b_dn = _remap(dn, {d: d for d in batch_axes}, [*kept_b, *range(out_rank - nm - nn, out_rank - nn + 1)])
            a_dn = _remap(dn, {d: d for d in batch_axes}, [*kept_b, *range(out_rank - nm - nn, out_rank - nm + 1)])
            b = gather(lw.b, b_dn, (*slice_sizes[: nb + nm], k))
            a = gather(lw.a, a_dn, (*slice_sizes[:nb], k, *slice_sizes[nb + nm :]))
            w = _engine.call(lax.gather_p.bind, lw.w, indices, dimension_numbers=dn,
                                  slice_sizes=tuple(slice_sizes), **w_params)
            return LoraWeight(w, a=a, b=b, alpha=lw.alpha)

    # Each batch axis must be whole or a gather batching axis, so that the factor
    # on the whole side needs no gather of its own.
    batch_ok = not (touched & batch_axes - set(dn.operand_batching_dims)) and not (
        set(dn.start_index_map) & set(dn.operand_batching_dims)
    )
    if batch_ok and touched and not touched & n_axes:
        # Row lookup: gather B, then contract its rank axis with A.
        b_axes = [*range(nb + nm), None]
        a_axes = [*range(nb), None, *sorted(n_axes)]
        return _lookup(lw, indices, dn, slice_sizes, w_params, out_rank, lw.b, b_axes, lw.a, a_axes,
                       gate)
    if batch_ok and touched and not touched & m_axes:
        # Column lookup: gather A, then contract B's rank axis with it.
        a_axes = [*range(nb), None, *sorted(n_axes)]
        b_axes = [*range(nb + nm), None]
        return _lookup(lw, indices, dn, slice_sizes, w_params, out_rank, lw.a, a_axes, lw.b, b_axes,
                       gate)
    return None


def _lookup(lw: LoraWeight, indices: Any, dn: lax.GatherDimensionNumbers, slice_sizes: Sequence[int],
            params: dict, out_rank: int, f: Any, f_axes: Sequence[int | None], o: Any,
            o_axes: Sequence[int | None], gate: Any = None) -> Any:
    """`gather(W) + s * gather(F) . O` for a gather that leaves O's non-batch axes whole.

    `F` is the factor carrying the indexed axes, `O` the other one, never gathered;
    `f_axes`/`o_axes` name the W axis behind each factor axis (`None`: the rank axis).
    Axes are matched by labels: W's axis `d` is label `d`, index batch dim `i` is
    `ndim + i`, and a batching axis of the operand shares its index dim's label.
    """
    w = lax.stop_gradient(lw.w)
    ndim = lw.ndim
    n_idx = jnp.ndim(indices) - 1
    label: dict[int | None, int] = {d: d for d in range(ndim)}
    for d, i in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        label[d] = ndim + i
    label[None] = ndim + n_idx
    f_of = {d: i for i, d in enumerate(f_axes)}

    # Labels of gather(W)'s output.
    kept = [d for d in range(ndim) if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    out_l = [0] * out_rank
    for d, p in zip(kept, dn.offset_dims):
        out_l[p] = d
    for i, p in enumerate(p for p in range(out_rank) if p not in dn.offset_dims):
        out_l[p] = ndim + i

    # gather(F) with its index batch dims first, then F's offset axes in order.
    f_offsets = [d for d in f_axes if d is None or d in kept]
    f_dn = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(n_idx, n_idx + len(f_offsets))),
        collapsed_slice_dims=tuple(f_of[d] for d in dn.collapsed_slice_dims),
        start_index_map=tuple(f_of[d] for d in dn.start_index_map),
        operand_batching_dims=tuple(f_of[d] for d in dn.operand_batching_dims),
        start_indices_batching_dims=dn.start_indices_batching_dims,
    )
    f_sizes = tuple(lw.rank if d is None else slice_sizes[d] for d in f_axes)
    gf = lax.gather_p.bind(
        f.astype(w.dtype), indices, dimension_numbers=f_dn, slice_sizes=f_sizes,
        **_factor_params(params),
    )
    gf = scale(gf, lw.scale)
    gf_l = (*range(ndim, ndim + n_idx), *(label[d] for d in f_offsets))
    o_l = tuple(label[d] for d in o_axes)
    gate_l = (*(label[d] for d in range(lw.structure[0])), label[None])
    o = o.astype(w.dtype)
    if all(l in gf_l for l in gate_l):
        gf = gate_rank(gf, gf_l, gate, gate_l)
    else:  # a batch axis was looked up at one index: gate the other factor instead
        o = gate_rank(o, o_l, gate, gate_l)
    # As in the dot rule: the other factor's cotangent as a canonical matmul.
    low, low_l = factor_contract(gf, gf_l, o, o_l, out_l, True)
    rows = read_frozen(lambda w, i: _engine.call(
        lax.gather_p.bind, w, i, dimension_numbers=dn, slice_sizes=tuple(slice_sizes),
        **params), w, indices)  # a host-resident table moves whole
    return rows + arrange(low, low_l, out_l)
