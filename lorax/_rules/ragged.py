"""`ragged_dot_general` (`lax.ragged_dot`: grouped matmuls, MoE experts) with a `LoraWeight`.

A mixture-of-experts layer runs its tokens, sorted by expert, through
`lax.ragged_dot(x, w, group_sizes)` with `w: (E, in, out)`. With per-expert factors
`b: (E, in, k)` and `a: (E, k, out)` the product splits as a dense one does, over the
same groups:

    ragged_dot(x, w + s·b@a) = ragged_dot(x, w) + s·ragged_dot(ragged_dot(x, b), a)

so no expert-sized update is formed and the low-rank work is `O(tokens·k·(in + out))`.
This is the form of `ragged_dot_general` whose weight has group axes (each group
multiplies its rows by its own expert); the other forms (a ragged contraction, as in
the weight gradient) have no LoRA weight among their operands in a forward pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import Array, lax
from jax.typing import ArrayLike
from jax.sharding import PartitionSpec as P

from .. import _engine
from .._placement import read_frozen
from .._sharding import out_sharding_of
from .._weight import LoraWeight
from .dot import scale

ragged_dot_general_p = _engine.ragged_dot_general_p


class Plan(NamedTuple):
    """The two low-rank `ragged_dot_general`s' dimension numbers (hashable, for `jit`)."""

    first: Any      # x . F1 -> t (lhs batch, lhs free, k)
    second: Any     # t . F2 -> the caller's output layout
    f1_is_b: bool   # the input meets `b` first (x @ w), else `a` (w @ x)


def plan(lw: LoraWeight, lhs_ndim: int, dn: Any) -> Plan | str:
    """How to split `ragged_dot_general(x, lw)` into two rank-`k` ones, or why not."""
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    if not lw.contiguous:
        return f"its M axes {lw.axes.m} and N axes {lw.axes.n} are not two contiguous groups"
    nb, nm, nn = lw.structure
    groups = tuple(dn.rhs_group_dimensions)
    if not groups:
        return "the weight has no group axis (a ragged contraction or batch dimension)"
    if set(groups) | set(rb) != set(range(nb)) or set(groups) & set(rb):
        return (f"the weight's {nb} batch axes are not exactly its group and batch dimensions "
                f"(groups {groups}, batch {tuple(rb)}): its factors must be per group")
    m_axes, n_axes = set(range(nb, nb + nm)), set(range(nb + nm, nb + nm + nn))
    free = [d for d in range(lhs_ndim) if d not in lc and d not in lb]
    ragged = tuple(dn.lhs_ragged_dimensions)
    if len(ragged) != 1 or ragged[0] not in free:
        return "the ragged dimension is not a free dimension of the input"
    if set(rc) == m_axes:
        f1_is_b, rc1, k2 = True, tuple(rc), nb                 # b: (*batch, *M, k); a: (*batch, k, *N)
    elif set(rc) == n_axes:
        f1_is_b, rc1, k2 = False, tuple(d - nm + 1 for d in rc), nb + nm  # a's N axes; b's k
    else:
        return "the contraction mixes the factors' two sides"
    RD = lax.RaggedDotDimensionNumbers
    first = RD(dot_dimension_numbers=((tuple(lc), rc1), (tuple(lb), tuple(rb))),
               lhs_ragged_dimensions=ragged, rhs_group_dimensions=groups)
    t_ndim = len(lb) + len(free) + 1
    second = RD(dot_dimension_numbers=(((t_ndim - 1,), (k2,)), (tuple(range(len(lb))), tuple(rb))),
                lhs_ragged_dimensions=(len(lb) + free.index(ragged[0]),),
                rhs_group_dimensions=groups)
    return Plan(first, second, f1_is_b)


def lora_ragged(x: ArrayLike, lw: LoraWeight, group_sizes: ArrayLike, rest: tuple,
                pl: Plan, params: dict, x_low: ArrayLike | None = None) -> Array:
    """`ragged(x, w) + s·ragged(ragged(x_low, F1), F2)` (`x_low`: LoRA dropout's input)."""
    key = tuple(sorted(params.items()))
    try:
        hash(key)
    except TypeError:  # an unhashable parameter: trace inline
        return _impl(x, lw.w, lw.b, lw.a, group_sizes, rest, x_low, plan=pl,
                     factor_scale=lw.scale, params=key)
    return _jit(x, lw.w, lw.b, lw.a, group_sizes, rest, x_low, plan=pl,
                factor_scale=lw.scale, params=key)


def _impl(x, w, b, a, group_sizes, rest, x_low, *, plan, factor_scale, params):
    params = dict(params)
    rest_params = {k: v for k, v in params.items() if k != "ragged_dot_dimension_numbers"}
    # The caller's output sharding is for the output; the rank-k intermediate has its own.
    low = {**rest_params, "out_sharding": None} if "out_sharding" in rest_params else rest_params

    def bind(lhs, rhs, dn, **p):
        return ragged_dot_general_p.bind(lhs, rhs, group_sizes, *rest,
                                         ragged_dot_dimension_numbers=dn, **p)

    # `w` arrives frozen (see `lora`); `_engine.call`: a quantized `w` goes to its rule.
    base = read_frozen(lambda w, x: _engine.call(
        lambda x, w: bind(x, w, params["ragged_dot_dimension_numbers"], **rest_params), x, w),
        w, x)
    f1, f2 = (b, a) if plan.f1_is_b else (a, b)
    x1 = x if x_low is None else x_low
    t = bind(x1, f1.astype(w.dtype), plan.first, **_typed(low, _rank_spec(x1, plan.first)))
    t = scale(t, factor_scale)
    y = bind(t, f2.astype(w.dtype), plan.second, **_typed(low, _sharding_of(base)))
    return base + y.astype(base.dtype)


def _rank_spec(x: Array, dn: Any) -> Any:
    """Under Explicit axes, the rank-`k` intermediate's sharding: `x`'s batch and free axes
    as `x` has them, the rank axis whole (else None: left to propagation)."""
    spec = out_sharding_of(x)
    if spec is None:
        return None
    (lc, _), (lb, _) = dn.dot_dimension_numbers
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    free = [d for d in range(x.ndim) if d not in lc and d not in lb]
    spec = P(*(entries[d] for d in (*lb, *free)), None)
    return jax.typeof(x).sharding.update(spec=spec)


def _sharding_of(x: Array) -> Any:
    return None if out_sharding_of(x) is None else jax.typeof(x).sharding


def _typed(params: dict, sharding: Any) -> dict:
    # The primitive takes a sharding on the traced (abstract) mesh, not a bare spec.
    return params if sharding is None else {**params, "out_sharding": sharding}


# Traced once per distinct shapes and parameters (see dot._contract_jit).
_jit = _engine.rule_jit(_impl, static_argnames=("plan", "factor_scale", "params"))


def rule(x: ArrayLike, lw: LoraWeight, group_sizes: ArrayLike, rest: tuple, params: dict,
         x_low: ArrayLike | None = None) -> Array:
    pl = plan(lw, jax.numpy.ndim(x), params["ragged_dot_dimension_numbers"])
    if isinstance(pl, str):
        return _engine.materialize_fallback(ragged_dot_general_p, [x, lw, group_sizes, *rest],
                                            params, pl)
    return lora_ragged(x, lw, group_sizes, rest, pl, params, x_low)


if ragged_dot_general_p is not None:
    @_engine.register(ragged_dot_general_p)
    def _(lhs: ArrayLike, rhs: LoraWeight, group_sizes: ArrayLike, *rest: ArrayLike,
          **params: Any) -> Array:
        return rule(lhs, rhs, group_sizes, rest, params)
