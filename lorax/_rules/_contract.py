"""Pairwise contractions over labelled axes, the common language of the LoRA rules.

Every rule rewrites `op(W + s * B @ A, x)` as `op(W, x) + s * op2(op1(x, F1), F2)`.
Describing operands by axis labels (one int per axis, as in einsum) lets one
routine emit each `dot_general` with the right dimension numbers in the caller's
operand order, whatever the original dimension numbers were. `factor_contract` and
`rank_major` shape the backward pass of the low-rank path for XLA (see
docs/how-it-works.md, "The low-rank path's backward").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.custom_derivatives import SymbolicZero

from .._sharding import labelled_out_sharding

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
    labels = (
        *batch,
        *(l for l in xl if l not in shared),
        *(l for l in yl if l not in shared),
    )
    if dot_params.get("out_sharding") is None:
        typed = labelled_out_sharding(((x, xl), (y, yl)), labels)
        if typed is not None:
            dot_params = {**dot_params, "out_sharding": typed}
    return lax.dot_general(x, y, dims, **dot_params), labels


def gate_rank(t: Array, tl: Sequence[int], gate: Array | None, gate_l: Sequence[int]) -> Array:
    """`t` times `gate`, whose axes are labelled `gate_l` (the weight's batch axes and the
    rank axis, all among `t`'s labels `tl`): a mixed batch's per-example rank gate."""
    if gate is None:
        return t
    tl, gate_l = tuple(tl), tuple(gate_l)
    order = sorted(range(len(gate_l)), key=lambda i: tl.index(gate_l[i]))
    sizes = dict(zip(gate_l, gate.shape))
    g = jnp.transpose(gate, order).reshape([sizes.get(l, 1) for l in tl])
    return t * g.astype(t.dtype)


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


# -- the output-side factor's contraction ----------------------------------------------
#
# The second low-rank dot, `y = t . F` (`t` the rank-k intermediate, `F` the
# output-side factor), is the one whose backward pass XLA:CPU runs badly when the
# activation has several free axes (batch and sequence). JAX computes `F`'s cotangent
# as `dot_general(g, t)`, contracting the leading (batch, sequence) axes of the
# activation-sized cotangent `g`; XLA's dot decomposition only accepts a dot whose
# operands are [batch..., free, contracting] (one free axis each), so it copies `g`
# into [features, batch*sequence] order first: one activation-sized copy per adapted
# weight per step. Here `t`'s free axes are flattened into one row axis for the part
# of the derivative that reaches `F`, which makes that dot a plain (batched) matmul
# whose operands are bitcasts of `g` and `t`. The value and the other derivatives
# stay exactly the labelled contraction the caller asked for (the forward dots are
# already canonical, and changing their layout moved activations between devices
# under FSDP sharding).


def factor_contract(
    t: Array, tl: Sequence[int], f: Array, fl: Sequence[int], keep: Collection[int],
    t_first: bool, **dot_params: Any,
) -> tuple[Array, Labels]:
    """`contract(t, f)` (or `contract(f, t)` if not `t_first`) for the rank-`k`
    intermediate `t` and the output-side factor `f`, with `f`'s cotangent computed
    as a canonical matmul. Same value, labels and derivatives as `contract`."""
    tl, fl = tuple(tl), tuple(fl)
    plan = _factor_plan(tl, fl, frozenset(keep), t_first)
    params = tuple(sorted(dot_params.items()))
    try:
        hash(params)
    except TypeError:  # an unhashable dot parameter cannot key the cache
        plan = None
    if plan is None:
        return contract(t, tl, f, fl, keep, **dot_params) if t_first else contract(
            f, fl, t, tl, keep, **dot_params)
    return _factor_dot(plan, t.shape, f.shape, params)(t, f), plan.out


class _FactorPlan(NamedTuple):
    """How one `factor_contract` splits its labels (hashable: it keys the cache)."""

    tl: Labels
    fl: Labels
    keep: frozenset
    t_first: bool
    batch: Labels  # shared and kept: leading in `t`, in the same order in `f`
    rows: Labels  # `t`'s own axes (batch, sequence, ...)
    contracted: Labels  # the rank axis
    new: Labels  # `f`'s own axes (the output features)
    out: Labels  # `contract`'s output order for the caller's operand order


def _contiguous(labels: Sequence[int], group: Collection[int]) -> bool:
    idx = [i for i, l in enumerate(labels) if l in group]
    return not idx or idx == list(range(idx[0], idx[0] + len(idx)))


def _factor_plan(tl: Labels, fl: Labels, keep: frozenset, t_first: bool) -> _FactorPlan | None:
    shared = [l for l in tl if l in fl]
    batch = tuple(l for l in shared if l in keep)
    contracted = tuple(l for l in shared if l not in keep)
    rows = tuple(l for l in tl if l not in shared)
    new = tuple(l for l in fl if l not in shared)
    if (
        len(rows) < 2  # one row axis: `dot_general(g, t)` is canonical already
        or not contracted
        or any(l not in keep for l in (*rows, *new))  # private sums: leave to `contract`
        or tl[: len(batch)] != batch
        or tuple(l for l in fl if l in batch) != batch
        or not _contiguous(tl[len(batch):], rows)
        or not _contiguous(tl[len(batch):], contracted)
    ):
        return None
    out = (*batch, *rows, *new) if t_first else (*batch, *new, *rows)
    return _FactorPlan(tl, fl, keep, t_first, batch, rows, contracted, new, out)


# One custom-JVP function per plan, shapes and dot parameters, like a jit cache.
@functools.cache
def _factor_dot(plan: _FactorPlan, t_shape: tuple, f_shape: tuple, dot_params: tuple) -> Any:
    params = dict(dot_params)
    size = dict(zip(plan.tl, t_shape))
    size.update(zip(plan.fl, f_shape))
    prod = lambda labels: math.prod(size[l] for l in labels)  # noqa: E731
    lead = (prod(plan.batch),) if plan.batch else ()
    n_rows, n_k, n_new = prod(plan.rows), prod(plan.contracted), prod(plan.new)
    out_shape = tuple(size[l] for l in plan.out)
    o = len(lead)
    bd = ((0,), (0,)) if o else ((), ())

    def value(t: Array, f: Array) -> Array:
        if plan.t_first:
            return contract(t, plan.tl, f, plan.fl, plan.keep, **params)[0]
        return contract(f, plan.fl, t, plan.tl, plan.keep, **params)[0]

    def via_matmul(t: Array, df: Array) -> Array:
        # The part of the derivative that is linear in `f`, as [B, R, K] x [B, K, N]
        # (or [B, N, K] x [B, K, R]); its transpose reads `g` as [B, R, N] in place.
        if plan.t_first:
            t2 = arrange(t, plan.tl, (*plan.batch, *plan.rows, *plan.contracted))
            f2 = arrange(df, plan.fl, (*plan.batch, *plan.contracted, *plan.new))
            y = lax.dot_general(t2.reshape(*lead, n_rows, n_k), f2.reshape(*lead, n_k, n_new),
                                (((o + 1,), (o,)), bd), **params)
        else:
            t2 = arrange(t, plan.tl, (*plan.batch, *plan.contracted, *plan.rows))
            f2 = arrange(df, plan.fl, (*plan.batch, *plan.new, *plan.contracted))
            y = lax.dot_general(f2.reshape(*lead, n_new, n_k), t2.reshape(*lead, n_k, n_rows),
                                (((o + 1,), (o,)), bd), **params)
        return y.reshape(out_shape)

    fn = jax.custom_jvp(value)

    def jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
        (t, f), (dt, df) = primals, tangents
        y = fn(t, f)
        parts = []
        if not isinstance(dt, SymbolicZero):
            parts.append(value(dt, f))
        if not isinstance(df, SymbolicZero):
            parts.append(via_matmul(t, df))
        dy = parts[0] + parts[1] if len(parts) == 2 else parts[0] if parts else jnp.zeros_like(y)
        return y, dy

    fn.defjvp(jvp, symbolic_zeros=True)
    return fn


def rank_major(f: Array, fl: Sequence[int], k: int, batch: Collection[int], rows: int) -> Array:
    """The input-side factor `f`, unchanged in value, with its cotangent produced
    rank-major.

    JAX computes an input-side factor's cotangent as `dot_general(dt, x)`, contracting
    the activation's rows, with the result's rank axis first, and then transposes it
    into the factor's layout. When the layout has the rank axis last (`b: (M, k)`),
    XLA folds that transpose into the dot, which turns the activation into a
    transposed left operand: on XLA:CPU that dot ran 7-10x slower than the same
    product left rank-major (1024x512 activation, rank 8: 0.95 ms vs 0.10 ms), more
    than all the other low-rank dots of the layer together. An identity whose tangent
    passes through `transpose . optimization_barrier . transpose` keeps that small
    transpose a separate copy of the factor's cotangent; the value is `f` itself, so
    the forward pass and its saved residuals are unchanged.

    `rows` is the number of activation rows the cotangent's dot contracts. With few
    rows per unit of rank the transposed activation is small and the extra transpose of
    the `(M, k)` cotangent costs more than it saves (4-layer MLP, 64 rows, d 512:
    rank 64 ran 1.08x hand-written with it, 1.02x without; rank 8 0.90x with it), so
    it is only used from `_RANK_MAJOR_MIN_ROWS_PER_RANK` rows per unit of rank.
    """
    fl = tuple(fl)
    order = (k, *(l for l in fl if l != k))
    rank = f.shape[fl.index(k)]
    if rank == 1:  # both layouts are the same bytes
        return f
    if rows < _RANK_MAJOR_MIN_ROWS_PER_RANK * rank:
        return f
    # Not for factors with batch axes (stacked layers, experts): there XLA:CPU (jax 0.10)
    # gives the batched dot the transposed output layout and then fails a check
    # compiling it (`dot_op_emitter.cc`: IsMonotonicWithDim0Major).
    if fl == order or any(l in batch for l in fl):
        return f
    return _rank_major_identity(fl, order)(f)


_RANK_MAJOR_MIN_ROWS_PER_RANK = 8


@functools.cache
def _rank_major_identity(fl: Labels, order: Labels) -> Any:
    fn = jax.custom_jvp(lambda f: f)

    def jvp(primals: tuple, tangents: tuple) -> tuple[Array, Array]:
        (f,), (df,) = primals, tangents
        return f, arrange(lax.optimization_barrier(arrange(df, fl, order)), order, fl)

    fn.defjvp(jvp)
    return fn
