"""`dot_general` with a `LoraWeight` on either side (or both), any dimension numbers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax import Array
from jax.typing import ArrayLike

from .. import _engine
from .._placement import read_frozen
from .._weight import LoraWeight
from ._contract import (Labels, arrange, contract, dot_labels, factor_contract, gate_rank,
                        rank_major)


def factor_labels(
    lw: LoraWeight, labels: Sequence[int], fresh: Iterator[int]
) -> tuple[Labels, Labels, int]:
    """Labels of `b` and `a` given `w`'s labels, with a fresh label for the rank axis."""
    batch, m, n = ([labels[i] for i in group] for group in lw.axes)
    k = next(fresh)
    return (*batch, *m, k), (*batch, k, *n), k


def lora_contract(
    lw: LoraWeight,
    lwl: Sequence[int],
    x: Array,
    xl: Sequence[int],
    out: Sequence[int],
    lora_first: bool,
    fresh: Iterator[int],
    x_low: Array | None = None,
    gate: Array | None = None,
    **dot_params: Any,
) -> Array:
    """Contract `lw` with the plain array `x` to labels `out`, never forming `W + BA`.

    `op(W, x) + s * ((x . F1) . F2)`, where `F1` is the factor on the side `x`
    contracts with (`b` for `x @ W`, `a` for `W @ x`), so the extra cost is
    O(batch * k * (M + N)). Each dot keeps the caller's operand order. `W` arrives
    already behind `stop_gradient` (see `lora`), so it is used as is: another
    `stop_gradient` here would be a new value that `lax.scan`'s backward pass saves
    per layer instead of reading the loop input.

    `x_low`, if given, replaces `x` on the low-rank path only (LoRA dropout:
    `op(W, x) + s * ((drop(x) . F1) . F2)`). `gate`, if given (`(*batch, k)`), scales
    the rank-`k` intermediate (a mixed batch: `op(W, x) + s * ((x . F1) * gate) . F2`).
    """
    bl, al, _ = factor_labels(lw, lwl, fresh)
    static = dict(
        n_batch=lw.structure[0], factor_scale=lw.scale, lwl=tuple(lwl), xl=tuple(xl),
        out=tuple(out), bl=bl, al=al, lora_first=lora_first,
        dot_params=tuple(sorted(dot_params.items())),
    )
    try:
        hash(tuple(static.values()))
    except TypeError:  # an unhashable parameter: trace the rule inline instead
        return _contract_impl(lw.w, lw.b, lw.a, x, x_low, gate, **static)
    return _contract_jit(lw.w, lw.b, lw.a, x, x_low, gate, **static)


def _contract_impl(w, b, a, x, x_low, gate, *, n_batch, factor_scale, lwl, xl, out, bl, al,
                   lora_first, dot_params):
    dot_params = dict(dot_params)
    b = b.astype(w.dtype)
    a = a.astype(w.dtype)
    nb = n_batch
    hits_n = any(l in xl for l in al[nb + 1 :])
    hits_m = any(l in xl for l in bl[nb:-1])
    if hits_n and not hits_m:
        (f1, f1l), (f2, f2l) = (a, al), (b, bl)
    else:
        (f1, f1l), (f2, f2l) = (b, bl), (a, al)

    def dot(p, pl, q, ql, keep, **params):
        # `p` is the LoRA-side operand; emit it where the caller had the weight.
        # `_engine.call`: a quantized `w` goes through its own rule.
        if lora_first:
            return _engine.call(contract, p, pl, q, ql, keep, **params)
        return _engine.call(contract, q, ql, p, pl, keep, **params)

    base_l = []

    def base_product(w: Array, x: Array) -> Array:
        y, yl = dot(w, lwl, x, xl, out, **dot_params)
        base_l[:] = yl
        return y

    base = read_frozen(base_product, w, x)  # a host-resident `w` is read on the device
    low_params = {k: v for k, v in dot_params.items() if k != "out_sharding"}
    rank_l = next(l for l in f1l if l in f2l and l not in lwl)
    rows = math.prod(d for d, l in zip(x.shape, xl) if l not in f1l)
    f1 = rank_major(f1, f1l, rank_l, lwl[:nb], rows)
    t, tl = dot(f1, f1l, x if x_low is None else x_low, xl, {*out, *f2l}, **low_params)
    t = gate_rank(scale(t, factor_scale), tl, gate, (*lwl[:nb], rank_l))
    y, yl = factor_contract(t, tl, f2, f2l, out, not lora_first, **low_params)
    return arrange(base, tuple(base_l), out) + arrange(y, yl, out)


# Traced once per distinct (shapes, labels, parameters), like a `jnp` function: a model
# with many same-shaped layers traces and differentiates the rule once, not per layer
# (JAX caches a jitted function's jaxpr and its linearization; bare `lax` calls in a
# rule are re-linearized one by one at every use).
_contract_jit = _engine.rule_jit(
    _contract_impl,
    static_argnames=("n_batch", "factor_scale", "lwl", "xl", "out", "bl", "al", "lora_first",
                     "dot_params"),
)


def scale(x: Array, s: float) -> Array:
    """`s * x` on the rank-`k` intermediate, the cheapest place for it."""
    return x if s == 1.0 else x * jnp.asarray(s, x.dtype)


def _dot_params(precision: Any, preferred_element_type: Any, params: dict) -> dict:
    return dict(precision=precision, preferred_element_type=preferred_element_type, **params)


@_engine.register(lax.dot_general_p)
def _(lhs: LoraWeight, rhs: ArrayLike, *, dimension_numbers: Any, precision: Any,
      preferred_element_type: Any, **params: Any) -> Array:
    ll, rl, out = dot_labels(lhs.ndim, jnp.ndim(rhs), dimension_numbers)
    fresh = itertools.count(max((*ll, *rl)) + 1)
    return lora_contract(lhs, ll, rhs, rl, out, True, fresh,
                         **_dot_params(precision, preferred_element_type, params))


@_engine.register(lax.dot_general_p)
def _(lhs: ArrayLike, rhs: LoraWeight, *, dimension_numbers: Any, precision: Any,
      preferred_element_type: Any, **params: Any) -> Array:
    ll, rl, out = dot_labels(jnp.ndim(lhs), rhs.ndim, dimension_numbers)
    fresh = itertools.count(max((*ll, *rl)) + 1)
    return lora_contract(rhs, rl, lhs, ll, out, False, fresh,
                         **_dot_params(precision, preferred_element_type, params))


@_engine.register(lax.dot_general_p)
def _(lhs: LoraWeight, rhs: LoraWeight, *, dimension_numbers: Any, precision: Any,
      preferred_element_type: Any, **params: Any) -> Array:
    # (W1 + s1 B1 A1) . (W2 + s2 B2 A2) = L1 . W2 + s2 * (L1 . B2) . A2: every
    # step is a one-sided LoRA contraction or a plain dot with a factor.
    ll, rl, out = dot_labels(lhs.ndim, rhs.ndim, dimension_numbers)
    fresh = itertools.count(max((*ll, *rl)) + 1)
    dot_params = _dot_params(precision, preferred_element_type, params)
    low_params = {k: v for k, v in dot_params.items() if k != "out_sharding"}
    w2 = lax.stop_gradient(rhs.w)
    b2l, a2l, _ = factor_labels(rhs, rl, fresh)
    base = lora_contract(lhs, ll, w2, rl, out, True, fresh, **dot_params)
    b2 = rhs.b.astype(w2.dtype)
    a2 = rhs.a.astype(w2.dtype)
    keep = (*out, *(l for l in a2l if l not in out))
    t = lora_contract(lhs, ll, b2, b2l, _natural(ll, b2l, keep), True, fresh, **low_params)
    t = scale(t, rhs.scale)
    y, yl = contract(t, _natural(ll, b2l, keep), a2, a2l, out, **low_params)
    return base + arrange(y, yl, out)


def _natural(xl: Sequence[int], yl: Sequence[int], keep: Sequence[int]) -> Labels:
    """The label order `contract(x, y, keep)` would produce."""
    shared = [l for l in xl if l in yl]
    batch = [l for l in shared if l in keep]
    return (
        *batch,
        *(l for l in xl if l not in shared and l in keep),
        *(l for l in yl if l not in shared and l in keep),
    )
