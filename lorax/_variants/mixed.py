"""`MixedWeight`: several adapters' factors side by side on the rank axis, and a gate.

`lorax.mixed_batch` runs a batch in which each example has its own adapter. Rather
than copying each example's factors (a gather: `batch * d * k` per weight, then one
matrix-vector product per example), the `N` adapters' factors are concatenated along
the rank, `b: (..., M, N*k)`, `a: (..., N*k, N)`, and each example gets a gate over
that rank axis, one for its adapter's `k` directions and zero elsewhere. Under
`vmap` over the examples the factors stay unbatched, so the low-rank path is two
ordinary matrix products for the whole batch (`N` times the rank, read once) and the
gate an elementwise product on the rank-`N*k` intermediate.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import Array

from .. import _engine
from .._weight import LoraWeight


class MixedWeight(_engine.ArrayValue):
    """`weight` (factors of rank `N*k`) with its rank axis scaled by `gate`
    (`(*batch, N*k)`: one row per slice of the weight's batch axes). Made by
    `lorax.mixed_batch`, consumed at `lora`'s boundary."""

    weight: LoraWeight
    gate: Array

    def aval(self) -> jax.core.ShapedArray:
        return self.weight.aval()

    def materialise(self) -> Array:
        lw = gated_lora(self.weight, self.gate)
        return type(lw).materialise(lw)

    materialized_as = "materialized (each example's adapter)"

    @staticmethod
    def default(primitive: Any, values: Any, params: dict[str, Any]) -> Any:
        return _engine.materialize_fallback(primitive, values, params)


def gated_lora(lw: LoraWeight, gate: Array) -> LoraWeight:
    """The plain `LoraWeight` with `b`'s rank axis scaled by `gate` (dense fallbacks)."""
    nm = lw.structure[1]
    g = gate.reshape(*gate.shape[:-1], *(1,) * nm, gate.shape[-1]).astype(lw.b.dtype)
    return LoraWeight(lw.w, lw.a, lw.b * g, lw.alpha, m_axes=lw.m_axes)
