"""Factor shardings derived from the frozen weight's, so LoRA adds no unexpected communication.

`b: (*batch, *M, k)` follows `W`'s sharding on its batch and `M` axes, `a: (*batch, k, *N)`
on its batch and `N` axes; the rank axis is replicated unless a mesh axis is named
for it. With a tensor-parallel `W` (column- or row-sharded) the low-rank path then
needs at most one small all-reduce of the `(tokens, k)` intermediate, and an
FSDP-sharded `W` gets FSDP-sharded factors.

The same derivation serves every place a weight's layout is stated: `init_lora` and
`load_adapter` (a `NamedSharding` on the array), `jax.shard_map` (an in_spec) and
`with_sharding_constraint` inside a model (see `lorax/_rules/sharding.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def _mesh_axes(entry: Any) -> tuple[Any, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _groups(ndim: int, n_batch: int, n_m: int | tuple[int, ...]) -> tuple[list, list, list]:
    """A weight's batch, `M` and `N` axes; `n_m` is the `M` axes' count when they
    follow the batch axes, else the `M` axes themselves (`LoraWeight.axes.m`)."""
    m = list(range(n_batch, n_batch + n_m)) if isinstance(n_m, int) else list(n_m)
    return list(range(n_batch)), m, [d for d in range(n_batch, ndim) if d not in m]


def factor_specs(
    spec: Any, ndim: int, n_batch: int, n_m: int | tuple[int, ...],
    rank_axis: str | None = None,
) -> tuple[PartitionSpec, PartitionSpec]:
    """`(a_spec, b_spec)` for a weight of rank `ndim` laid out as `spec` (`n_m`: see `_groups`).

    Raises `ValueError` (saying what is wrong, for the caller to prefix with the
    parameter's path) when no factor layout follows from `spec`: a spec longer than
    the weight, unreduced/reduced axes (a partial sum of `W` has no factor
    counterpart), or a `rank_axis` that `W` already uses.
    """
    if not isinstance(spec, PartitionSpec):
        raise ValueError(f"expected a PartitionSpec for the weight, got {spec!r}")
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise ValueError(
            f"the weight's spec {spec} has unreduced/reduced mesh axes; a partial "
            "sum of the weight has no low-rank counterpart"
        )
    entries = tuple(spec)
    if len(entries) > ndim:
        raise ValueError(f"the spec {spec} has more entries than the weight has axes ({ndim})")
    entries += (None,) * (ndim - len(entries))
    used = {axis for entry in entries for axis in _mesh_axes(entry)}
    if rank_axis is not None and rank_axis in used:
        raise ValueError(
            f"rank_axis {rank_axis!r} already shards the weight (spec {spec}); the "
            "factors would need it twice. Name a mesh axis the weight does not use."
        )
    batch, m, n = ([entries[d] for d in group] for group in _groups(ndim, n_batch, n_m))
    return PartitionSpec(*batch, rank_axis, *n), PartitionSpec(*batch, *m, rank_axis)


def factor_dims(ndim: int, n_batch: int,
                n_m: int | tuple[int, ...]) -> tuple[dict[int, int], dict[int, int]]:
    """Where each of `W`'s axes sits in `a` and in `b` (`{w_axis: factor_axis}`)."""
    batch, m, n = _groups(ndim, n_batch, n_m)
    a_dims = {**{d: d for d in batch}, **{d: n_batch + 1 + i for i, d in enumerate(n)}}
    b_dims = {**{d: d for d in batch}, **{d: n_batch + i for i, d in enumerate(m)}}
    return a_dims, b_dims


def factor_shardings(
    w: Any, n_batch: int, n_m: int | tuple[int, ...], rank_axis: str | None = None
) -> tuple[Any, Any] | None:
    """`(a_sharding, b_sharding)` for a weight, or `None` if `w` is not `NamedSharding`-sharded."""
    sharding = getattr(w, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    a_spec, b_spec = factor_specs(sharding.spec, w.ndim, n_batch, n_m, rank_axis)
    return NamedSharding(sharding.mesh, a_spec), NamedSharding(sharding.mesh, b_spec)


def place_factors(w: Any, a: Any, b: Any, n_batch: int, n_m: int | tuple[int, ...],
                  rank_axis: str | None = None) -> tuple[Any, Any]:
    """`a` and `b` moved onto the shardings derived from `w`'s (unchanged if it has none).

    `device_put` of a value that is the same on every process works across hosts too.
    """
    shardings = factor_shardings(w, n_batch, n_m, rank_axis)
    if shardings is None:
        return a, b
    return jax.device_put(a, shardings[0]), jax.device_put(b, shardings[1])


def place_host_array(x: np.ndarray, sharding: Any) -> Any:
    """A host array put on `sharding` shard by shard (`None`: the default device).

    `make_array_from_callback` copies each device's slice only, so this works when
    `sharding` spans devices of other processes too (each process reads the same file).
    """
    if sharding is None:
        return jax.numpy.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes `x` varies over inside a `shard_map` (empty elsewhere)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(getattr(mat, "varying", ()))


def weight_aval(w: Any, leaves: tuple[Any, ...]) -> Any:
    """The abstract value of a weight made of `leaves`: `w`'s shape and dtype.

    Inside a `shard_map` with check_vma, it varies over every manual mesh axis one
    of the leaves varies over: JAX then casts the *other* operands to match
    before it mixes them with the weight, as it would for a plain `W + BA`.
    """
    shape = getattr(w, "shape", None)
    dtype = getattr(w, "dtype", None)
    aval = jax.core.ShapedArray(
        tuple(np.shape(w) if shape is None else shape),
        jax.numpy.result_type(w) if dtype is None else dtype,
    )
    varying = frozenset().union(*map(varying_axes, leaves))
    if not varying:
        # Sharding in types: the weight is typed as `w` is (a quantized `w`: its own aval).
        typed = w.aval() if hasattr(w, "aval") and callable(w.aval) else w
        if isinstance(typed, (jax.Array, jax.core.Tracer, jax.core.ShapedArray)) and (
                _explicit_type(typed) is not None):
            return jax.typeof(typed).update(weak_type=False) if not isinstance(
                typed, jax.core.ShapedArray) else typed
        return aval
    # A quantized `w` is no JAX type: its shape and dtype, typed like a leaf that varies.
    like = jax.typeof(w) if isinstance(w, (jax.Array, jax.core.Tracer)) else \
        jax.typeof(next(x for x in leaves if varying_axes(x))).update(shape=aval.shape,
                                                                     dtype=aval.dtype)
    return like.update(weak_type=False, manual_axis_type=like.mat.update(varying=varying))


def _mesh_of(x: Any) -> Any:
    """The (abstract) mesh `x`'s type names, or `None`."""
    return getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)


def auto_mesh(x: Any) -> Any:
    """The mesh `x` is traced on if every axis of it is Auto and it spans several
    devices, else `None` (off a mesh, in a `shard_map` body, sharding in types)."""
    mesh = _mesh_of(x)
    if mesh is None or getattr(mesh, "empty", True) or mesh.size == 1:
        return None
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is None or any(t != auto.Auto for t in mesh.axis_types):
        return None
    return mesh


def manual(x: Any) -> bool:
    """`x` is traced inside a `shard_map` body (its mesh has Manual axes)."""
    mesh = _mesh_of(x)
    kind = getattr(getattr(jax.sharding, "AxisType", None), "Manual", None)
    return kind is not None and any(t == kind for t in getattr(mesh, "axis_types", ()))


def call_mesh(leaves: Any) -> Any:
    """The first Auto mesh (abstract) among `leaves`' avals, or `None`."""
    for x in leaves:
        if isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            mesh = auto_mesh(x)
            if mesh is not None:
                return getattr(mesh, "abstract_mesh", mesh)
    return None


def _entry(axes: tuple) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def split_contraction(x_spec: tuple, w_spec: tuple, xl: tuple, wl: tuple, out: tuple,
                      out_spec: tuple | None = None) -> tuple[tuple, tuple, tuple, tuple]:
    """Where a contraction of an activation (`x_spec`, labels `xl`) with a weight
    (`w_spec`, labels `wl`) into `out` runs, per mesh axis: `(x_spec, w_spec,
    out_spec, reduce_axes)`. `out_spec`: the output's layout as propagation chose it,
    if known.

    A mesh axis on one of the activation's own axes (labels the weight lacks: batch,
    tokens), in the activation or in the output, is gathered out of the weight (FSDP);
    the activation takes the output's layout on those axes where it has one. The weight
    keeps its other axes (tensor parallelism); the activation follows the weight's layout
    on the axes they share; a weight axis left split along a summed label leaves partial
    sums, reduced over `reduce_axes` (row-parallel).
    """
    given = dict(zip(out, out_spec or (None,) * len(out)))
    own = {l: _mesh_axes(given.get(l)) or _mesh_axes(e) for l, e in zip(xl, x_spec) if l not in wl}
    act = {a for axes in own.values() for a in axes}
    kept = {l: tuple(a for a in _mesh_axes(e) if a not in act) for l, e in zip(wl, w_spec)}
    used = {a for axes in kept.values() for a in axes}
    x_kept = {l: kept[l] if l in wl else tuple(a for a in own[l] if a not in used) for l in xl}
    where = {**x_kept, **kept}
    summed = [l for l in dict.fromkeys((*xl, *wl)) if l not in out]
    reduce = tuple(dict.fromkeys(a for l in summed for a in where[l]))
    return (tuple(_entry(x_kept[l]) for l in xl), tuple(_entry(kept[l]) for l in wl),
            tuple(_entry(where[l]) for l in out), reduce)


def gathered(x: Any, mesh: Any) -> Any:
    """`x`, whole on every device of `mesh` (an `auto_mesh`; `None`: `x` as it is).

    A frozen quantized weight is dequantized where it is used. Left to XLA's sharding
    propagation, an FSDP-sharded weight is dequantized shard by shard and the
    *dequantized* float32 values are all-gathered for the dot (8x the bytes of 4-bit
    codes); constraining the codes and scales to be whole first moves the all-gather
    onto them. The mesh is read where the weight enters a rule and carried in, since
    `custom_vjp` traces its body on avals without one.
    """
    if mesh is None or manual(x):
        return x
    # Gathering a flattened view keeps the all-gather on this slice. A plain constraint
    # lets sharding propagation move the gather up to the scan's per-layer slice, still
    # `(1, ...)`-shaped, and layout assignment then wants the gathered axis outermost on
    # the whole stack: a relaid-out copy of every layer's codes, hoisted out of the loop
    # (3.9 GiB per device for Llama-3-70B under FSDP over 8).
    whole = jax.lax.with_sharding_constraint(x.reshape(-1), NamedSharding(mesh, PartitionSpec()))
    return whole.reshape(x.shape)


# -- Explicit mesh axes (sharding in types) ------------------------------------------------
#
# Under `AxisType.Explicit` a value's sharding is part of its type, and a `dot_general`
# whose operands are both split along a contracted axis must be told where its result
# lives. The model states that for its own products (`out_sharding=`); the low-rank
# products the rules add have no such annotation, so they get the one below, the layout
# Auto-mode propagation picks for them: each kept axis sharded as the operand that has it,
# a sharded contraction summed (an all-reduce of the rank-`k` intermediate, never of an
# activation-sized value).


def _explicit_type(x: Any) -> Any:
    """`x`'s sharding type, where its mesh has Explicit axes (else None)."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    kinds = getattr(mesh, "axis_types", ())
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", object())
    return sharding if any(t == explicit for t in kinds) else None


def labelled_out_sharding(operands: tuple[tuple[Any, tuple[int, ...]], ...],
                          out: tuple[int, ...]) -> PartitionSpec | None:
    """The `out_sharding` of a product of labelled operands `(array, labels)` with output
    labels `out`, under Explicit mesh axes: each output axis sharded as the first operand
    axis with its label, a mesh axis used once. None where no operand is explicitly typed
    (an Auto mesh, or none), so the product is left to sharding propagation."""
    typed = [(_explicit_type(x), labels) for x, labels in operands]
    if not any(t is not None for t, _ in typed):
        return None
    by_label: dict[int, Any] = {}
    for sharding, labels in typed:
        if sharding is None:
            continue
        for label, entry in zip(labels, sharding.spec):
            if by_label.get(label) is None:
                by_label[label] = entry
    used: set = set()
    entries = []
    for label in out:
        axes = _mesh_axes(by_label.get(label))
        if not axes or used & set(axes):
            entries.append(None)
            continue
        used.update(axes)
        entries.append(by_label[label])
    return PartitionSpec(*entries)


def explicitly_typed(x: Any) -> bool:
    """`x`'s sharding is part of its type (its mesh has Explicit axes)."""
    return x is not None and _explicit_type(x) is not None


def out_sharding_of(x: Any) -> PartitionSpec | None:
    """`x`'s own spec as an `out_sharding` for a value to be added to it, under Explicit
    axes (else None)."""
    sharding = _explicit_type(x)
    return None if sharding is None else PartitionSpec(*sharding.spec)



def whole_where_one(spec: Any, shape: tuple[int, ...]) -> PartitionSpec:
    """`spec` (padded to `shape`'s rank) with every size-1 axis whole: the layout of a
    per-output value (DoRA's norm or gain) broadcast over its weight's summed axes."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    return PartitionSpec(*(None if n == 1 else e for n, e in zip(shape, spec)))


def split_last(x: Any, size: int) -> Any:
    """`x` `(..., n)` reshaped to `(..., n // size, size)`. Under Explicit axes a split `n`
    needs its result's type stated: the `n // size` blocks split as `n` was where the
    devices divide them, else `n` gathered first (a block across two devices has no
    layout; `QuantizedArray.with_sharding` then says which layouts do)."""
    shape = (*x.shape[:-1], x.shape[-1] // size, size)
    sharding = _explicit_type(x)
    if sharding is None:
        return x.reshape(shape)
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    ways = int(np.prod([sharding.mesh.shape[a] for a in _mesh_axes(spec[-1])]))
    if shape[-2] % ways:
        spec = (*spec[:-1], None)
        x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec(*spec)))
    out = NamedSharding(sharding.mesh, PartitionSpec(*spec, None))
    return jax.lax.reshape(x, shape, out_sharding=out)
