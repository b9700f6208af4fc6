"""A quantized weight's contraction as one op that XLA partitions per mesh axis.

Under `jit` on an Auto mesh a rule sees no shardings: they are decided later, by XLA's
propagation. Which of a quantized weight's mesh axes to gather depends on the
activation it meets, so the decision waits for the partitioner
(`jax.experimental.custom_partitioning`), which calls `_partition` with the shardings
propagation chose and takes the per-device computation back
(`lorax._sharding.split_contraction` decides):

- a mesh axis that shards the activation's own axes (its batch or tokens: FSDP, data
  parallelism) gathers the weight's codes along it, never dequantized values;
- one that shards only the weight (tensor parallelism) leaves its codes where they are:
  each device dequantizes its own blocks and contracts with the matching slice of the
  activation, partial sums reduced over the axis when it splits the contraction
  (row-parallel), the output left split when it splits the weight's output axes
  (column-parallel) — the dense tensor-parallel dot's own communication.

The dequantized weight lives only inside the op, so no float array the size of a weight
crosses devices whatever propagation chose around it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from .. import _engine, _sharding
from .._quant import _formats as F
from .._quant._array import QuantizedArray
from ._contract import arrange, contract

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _names(plan: Any) -> dict[int, str]:
    """A Shardy factor name per label: the activation's own labels first."""
    labels = sorted({*plan.xl, *plan.wl, *plan.out}, key=lambda l: (l in plan.wl, l))
    return {l: ("x" if l not in plan.wl else "w") + _LETTERS[i] for i, l in enumerate(labels)}


def _rule(plan: Any, kinds: tuple[str, ...], const_ndims: tuple[int, ...]) -> str:
    """The op's sharding rule. The block label is a factor of its own in the leaves
    (blocks) and another where it meets the activation or the output (values), so
    propagation never splits a dimension into parts of a mesh axis across the two; the
    partitioner lines them up (`partition`). Double quantization's leaves share the
    weight's leading axes."""
    f, block = _names(plan), plan.wl[-1]
    side = lambda labels: " ".join(f"{f[l]}_k" if l == block else f[l] for l in labels)  # noqa: E731
    lead = " ".join(f[l] for l in plan.wl[:-2])
    per_block = " ".join(f[l] for l in plan.wl[:-1]) + f" {f[block]}_n"
    leaf = {"codes": per_block + " bytes", "scales": per_block, "mins": per_block,
            "scale_scales": f"{lead} groups", "scale_offset": f"{lead} one"}
    consts = [" ".join(f"c{i}_{d}" for d in range(n)) for i, n in enumerate(const_ndims)]
    return f"{', '.join([side(plan.xl), *(leaf[k] for k in kinds), *consts])} -> {side(plan.out)}"


def _double_dequantized(fmt: F.Format, codes: Array, ss: Array, so: Array,
                        where: tuple | None) -> Array:
    """`F.double_dequantize` of this device's block `(*lead, R, n_blocks)` of the absmax
    codes: `where` is `(first row, first block, blocks in all)` along the last two
    axes, over which the groups of 256 run (`None`: the whole array)."""
    if where is None:
        return F.double_dequantize(fmt, codes, ss, so)
    r0, b0, n_blocks = where
    rows, blocks = codes.shape[-2:]
    flat = (r0 + jnp.arange(rows))[:, None] * n_blocks + (b0 + jnp.arange(blocks))[None, :]
    scale = jnp.take(ss, flat // F.DOUBLE_QUANT_BLOCK, axis=-1)
    return F.second_level(fmt, codes) * scale + so[..., None]


def _compute(plan: Any, kinds: tuple[str, ...], x: Array, leaves: tuple,
             where: tuple | None = None) -> Array:
    meta, got = plan.meta, dict(zip(kinds, leaves))
    scales = got["scales"]
    if "scale_scales" in got:
        scales = _double_dequantized(F.FORMATS[meta.qtype], scales, got["scale_scales"],
                                     got["scale_offset"], where)
    w = QuantizedArray(got["codes"], scales, got.get("mins"), qtype=meta.qtype,
                       block_size=meta.block_size, axis=meta.axis,
                       dense_dtype=meta.dense_dtype).dequantize_storage()
    y, labels = contract(w, plan.wl, x, plan.xl, plan.out, **dict(plan.params)) if plan.w_first \
        else contract(x, plan.xl, w, plan.wl, plan.out, **dict(plan.params))
    return arrange(y, labels, plan.out)


def _specs(mesh: Any, shapes: Any) -> list[tuple]:
    """Each operand's mesh axes per dimension; one that is no plain layout of the mesh's
    axes (part of an axis) counts as whole, which the partitioner then makes it."""
    specs = []
    for s in shapes:
        spec = _engine.mesh_spec(s.sharding, mesh, len(s.shape))
        specs.append((None,) * len(s.shape) if spec is None else spec)
    return specs


def _where(mesh: Any, w_spec: tuple, local: tuple) -> tuple:
    """This device's first row and block of the absmax codes (`local`: their local
    shape) and the blocks in all, inside a partitioned body."""
    def start(entry: Any, size: int) -> Any:
        axes = _sharding._mesh_axes(entry)
        return jax.lax.axis_index(axes) * size if axes else 0
    ways = math.prod(mesh.shape[a] for a in _sharding._mesh_axes(w_spec[-1]))
    return start(w_spec[-2], local[-2]), start(w_spec[-1], local[-1]), local[-1] * ways


def _leaf_specs(kinds: tuple[str, ...], w_spec: tuple) -> list[tuple]:
    per_block = {"codes": (*w_spec, None), "scales": w_spec, "mins": w_spec}
    lead = (*w_spec[:-2], None)
    return [per_block.get(k, lead) for k in kinds]


@functools.lru_cache(maxsize=256)
def _op(plan: Any, kinds: tuple[str, ...], avals: tuple) -> tuple[Any, tuple]:
    """The custom-partitioned op for `plan` at these operand avals, and its constants
    (the format's tables, passed as replicated operands: the op's body may close over
    no array)."""
    structs = [jax.ShapeDtypeStruct(s, d) for s, d in avals]
    closed = jax.make_jaxpr(lambda x, *leaves: _compute(plan, kinds, x, leaves))(*structs)
    consts, n = tuple(closed.consts), len(avals)

    @custom_partitioning
    def op(*args: Array) -> Array:
        return jax.core.eval_jaxpr(closed.jaxpr, args[n:], *args[:n])[0]

    def decide(mesh: Any, arg_shapes: Any, result: Any = None) -> Any:
        x_spec, codes_spec = _specs(mesh, arg_shapes[:2])
        out_spec = None if result is None else _engine.mesh_spec(
            result.sharding, mesh, len(result.shape))
        return _sharding.split_contraction(x_spec, codes_spec[:-1], plan.xl, plan.wl, plan.out,
                                           out_spec)

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> tuple:
        x_spec, w_spec, out_spec, reduce = decide(mesh, arg_shapes, result_shape)

        def lower(x: Array, *rest: Array) -> Array:
            leaves = rest[: n - 1]
            where = _where(mesh, w_spec, leaves[1].shape) if "scale_scales" in kinds else None
            y = _compute(plan, kinds, x, leaves, where)
            return jax.lax.psum(y, reduce) if reduce else y

        named = lambda spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
        return mesh, lower, named(out_spec), (
            named(x_spec), *map(named, _leaf_specs(kinds, w_spec)), *(named(()) for _ in consts))

    def infer(mesh: Any, arg_shapes: Any, result_shape: Any) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(*decide(mesh, arg_shapes)[2]))

    op.def_partition(partition, infer_sharding_from_operands=infer, decode_shardings=False,
                     sharding_rule=_rule(plan, kinds, tuple(c.ndim for c in consts)))
    return op, consts


KINDS = ("codes", "scales", "mins", "scale_scales", "scale_offset")


def quantized_contraction(plan: Any, x: Array, leaves: tuple,
                          batched: Callable[[Array, tuple], Array]) -> Array:
    """`plan.apply(W, x)` for the quantized weight of `leaves` (codes, scales, mins,
    double quantization's two; `None` where absent), partitioned per mesh axis (module
    docstring). Every leaf crosses devices as stored: codes, not values. Under `vmap`
    (the partitioner has no batching rule) `batched(x, leaves)` runs instead, mapped."""
    kinds = tuple(k for k, leaf in zip(KINDS, leaves) if leaf is not None)
    args = (x, *(leaf for leaf in leaves if leaf is not None))
    op, consts = _op(plan, kinds, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in args))

    @custom_vmap
    def run(x: Array, *present: Array) -> Array:
        return op(x, *present, *consts)

    @run.def_vmap
    def _(size: int, in_batched: list, x: Array, *present: Array) -> tuple[Array, bool]:
        def one(x: Array, *present: Array) -> Array:
            it = iter(present)
            return batched(x, tuple(None if leaf is None else next(it) for leaf in leaves))
        axes = tuple(0 if b else None for b in in_batched)
        return jax.vmap(one, in_axes=axes, axis_size=size)(x, *present), True

    return run(*args)
