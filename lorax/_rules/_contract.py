"""Pairwise contractions over labelled axes, the common language of the LoRA rules.

Every rule rewrites `op(W + s * B @ A, x)` as `op(W, x) + s * op2(op1(x, F1), F2)`.
Describing operands by axis labels (one int per axis, as in einsum) lets one
routine emit each `dot_general` with the right dimension numbers in the caller's
operand order, whatever the original dimension numbers were.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.ad_checkpoint import checkpoint_name

Labels = tuple[int, ...]


def dot_labels(
    lhs_ndim: int, rhs_ndim: int, dimension_numbers: Any
) -> tuple[Labels, Labels, Labels]:
    """Labels of `dot_general`'s operands and output for these dimension numbers."""
    (lc, rc), (lb, rb) = dimension_numbers
    lhs: list[int] = [-1] * lhs_ndim
    rhs: list[int] = [-1] * rhs_ndim
    label = 0
    for i, j in (*zip(lb, rb), *zip(lc, rc)):
        lhs[i] = rhs[j] = label
        label += 1
    for axes in (lhs, rhs):
        for i, l in enumerate(axes):
            if l < 0:
                axes[i] = label
                label += 1
    out = [lhs[i] for i in lb]
    out += [l for i, l in enumerate(lhs) if i not in lc and i not in lb]
    out += [l for j, l in enumerate(rhs) if j not in rc and j not in rb]
    return tuple(lhs), tuple(rhs), tuple(out)


def contract(
    x: Array,
    xl: Sequence[int],
    y: Array,
    yl: Sequence[int],
    keep: Collection[int],
    **dot_params: Any,
) -> tuple[Array, Labels]:
    """`dot_general(x, y)`, keeping labels in `keep` and summing the others.

    Shared labels that are kept become batch dimensions; shared labels that are not
    kept are contracted. Returns the result and its labels, in `dot_general`'s own
    output order (batch, then `x`'s free axes, then `y`'s), so no transpose is
    emitted here.
    """
    x, xl = _sum_private(x, tuple(xl), set(yl), keep)
    y, yl = _sum_private(y, tuple(yl), set(xl), keep)
    shared = [l for l in xl if l in yl]
    batch = [l for l in shared if l in keep]
    contracting = [l for l in shared if l not in keep]
    dims = (
        (tuple(xl.index(l) for l in contracting), tuple(yl.index(l) for l in contracting)),
        (tuple(xl.index(l) for l in batch), tuple(yl.index(l) for l in batch)),
    )
    out = lax.dot_general(x, y, dims, **dot_params)
    labels = (
        *batch,
        *(l for l in xl if l not in shared),
        *(l for l in yl if l not in shared),
    )
    return out, labels


def _sum_private(
    x: Array, xl: Labels, other: Collection[int], keep: Collection[int]
) -> tuple[Array, Labels]:
    drop = tuple(i for i, l in enumerate(xl) if l not in other and l not in keep)
    if not drop:
        return x, xl
    return x.sum(axis=drop), tuple(l for i, l in enumerate(xl) if i not in drop)


def scale(x: Array, s: float) -> Array:
    """`s * x` on the rank-`k` intermediate, the cheapest place for it."""
    return x if s == 1.0 else x * jnp.asarray(s, x.dtype)


def arrange(x: Array, labels: Sequence[int], target: Sequence[int]) -> Array:
    """Transpose `x` from `labels` order to `target` order (a no-op when they agree)."""
    labels = tuple(labels)
    target = tuple(target)
    if labels == target:
        return x
    return lax.transpose(x, tuple(labels.index(l) for l in target))


# -- the low-rank path as canonical matmuls -------------------------------------------
#
# XLA:CPU runs a dot fast when it is a 2-D matmul (or one with a single leading batch
# axis) with one contracting axis per operand: the operands are then bitcasts of the
# stored arrays, and the dots JAX derives for the backward pass have the same form.
# Any other dot_general goes through XLA's dot decomposition, which transposes its
# operands into [batch, free, contracting] order with a copy first: on a multi-axis
# (einsum) attention kernel that copied the activation and its cotangent around every
# low-rank dot, forward and backward (see docs/how-it-works.md). The factors are
# small, so they are the ones rearranged; the activation is only ever reshaped where
# that is free (its contracted axes and its other axes each one contiguous block).


def _block(labels: Sequence[int], group: Collection[int]) -> bool:
    """Whether the labels in `group` form one contiguous run of `labels` (or none)."""
    idx = [i for i, l in enumerate(labels) if l in group]
    return idx == list(range(idx[0], idx[0] + len(idx))) if idx else True


def lowrank_matmuls(
    x: Array, xl: Labels, f1: Array, f1l: Labels, f2: Array, f2l: Labels, k: int,
    out: Labels, x_first: bool, factor_scale: float, **dot_params: Any,
) -> Array | None:
    """`factor_scale * (x . f1) . f2` with labels `out`, as two canonical matmuls;
    `None` if that would need `x` (or the result) moved in memory, in which case the
    caller contracts by labels.

    `f1` carries the labels `x` contracts with plus the rank label `k`, `f2` the rank
    label plus the new output labels; labels shared by all three are batch axes (per
    layer or per expert), which must lead in `x` and in `out`. With `x_first` the
    activation is each dot's lhs (`x @ W`: `out` is batch, x's other axes, new axes),
    otherwise its rhs (`W @ x`: batch, new axes, x's other axes), as the caller wrote
    it; the factors are laid out to suit (they are small).
    """
    f1s, f2s = set(f1l), set(f2l)
    batch = [l for l in xl if l in f1s and l in f2s]
    contracted = [l for l in xl if l in f1s and l not in f2s]
    free = [l for l in xl if l not in f1s and l not in f2s]
    new = [l for l in out if l in f2s and l not in xl]
    nb = len(batch)
    want_out = (*batch, *free, *new) if x_first else (*batch, *new, *free)
    if (
        not contracted or k in xl
        or len(batch) + len(contracted) + len(free) != len(xl)
        or f1s != {*batch, *contracted, k} or len(f1l) != nb + len(contracted) + 1
        or f2s != {*batch, k, *new} or len(f2l) != nb + len(new) + 1
        or tuple(out) != want_out or tuple(xl[:nb]) != tuple(batch)
        or not _block(xl[nb:], contracted) or not _block(xl[nb:], free)
    ):
        return None
    size = dict(zip(xl, x.shape))
    size.update(zip(f1l, f1.shape))
    size.update(zip(f2l, f2.shape))
    n_batch = math.prod(size[l] for l in batch)
    rows = math.prod(size[l] for l in free)
    depth = math.prod(size[l] for l in contracted)
    cols = math.prod(size[l] for l in new)
    rank = size[k]
    contract_first = bool(free) and xl[nb] in contracted
    lead = (n_batch,) if nb else ()  # several batch axes become one; none stay none
    if x_first:
        f1 = arrange(f1, f1l, (*batch, *contracted, k)).reshape(*lead, depth, rank)
        f2 = arrange(f2, f2l, (*batch, k, *new)).reshape(*lead, rank, cols)
    else:
        f1 = arrange(f1, f1l, (*batch, k, *contracted)).reshape(*lead, rank, depth)
        f2 = arrange(f2, f2l, (*batch, *new, k)).reshape(*lead, cols, rank)
    x_shape = (*lead, depth, rows) if contract_first else (*lead, rows, depth)
    plan = (x_shape, contract_first, x_first, factor_scale, tuple(sorted(dot_params.items())))
    y = _remat_lowrank(x, f1, f2, plan)
    return y.reshape(tuple(size[l] for l in out))


def _lowrank(x: Array, f1: Array, f2: Array, plan: tuple) -> Array:
    x_shape, contract_first, x_first, factor_scale, dot_params = plan
    o = len(x_shape) - 2  # 1 with a (merged) batch axis, else 0
    bd = ((0,), (0,)) if o else ((), ())

    def mm(lhs: Array, rhs: Array, lc: int, rc: int) -> Array:
        return lax.dot_general(lhs, rhs, (((o + lc,), (o + rc,)), bd), **dict(dot_params))

    x2 = x.reshape(x_shape)
    x_c = 0 if contract_first else 1
    if x_first:
        t = checkpoint_name(scale(mm(x2, f1, x_c, 0), factor_scale), _T_NAME)  # (rows, k)
        return mm(t, f2, 1, 0)  # (rows, cols)
    t = checkpoint_name(scale(mm(f1, x2, 1, x_c), factor_scale), _T_NAME)  # (k, rows)
    return mm(f2, t, 1, 0)  # (cols, rows)


# The reshaped activation is a new value, and under `lax.scan` every value the backward
# pass reads is saved per iteration: each weight reading the same `x` (q, k, v) would
# save its own copy of it. Rematerialised, the backward pass reshapes the saved `x`
# again (a bitcast) and only the rank-k intermediate is saved.
_T_NAME = "lorax_lowrank_t"
_remat_lowrank = jax.checkpoint(
    _lowrank, prevent_cse=False, static_argnums=(3,),
    policy=jax.checkpoint_policies.save_only_these_names(_T_NAME),
)
