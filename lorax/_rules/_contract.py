"""Pairwise contractions over labelled axes, the common language of the LoRA rules.

Every rule rewrites `op(W + s * B @ A, x)` as `op(W, x) + s * op2(op1(x, F1), F2)`.
Describing operands by axis labels (one int per axis, as in einsum) lets one
routine emit each `dot_general` with the right dimension numbers in the caller's
operand order, whatever the original dimension numbers were.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from jax import lax
from jax import Array

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


def arrange(x: Array, labels: Sequence[int], target: Sequence[int]) -> Array:
    """Transpose `x` from `labels` order to `target` order (a no-op when they agree)."""
    labels = tuple(labels)
    target = tuple(target)
    if labels == target:
        return x
    return lax.transpose(x, tuple(labels.index(l) for l in target))
