"""`Adapted`: what a DoRA or dropout weight becomes inside `lora(fn)`.

At `lora`'s boundary (where `w` is frozen) a [`DoraWeight`] is replaced by its
`LoraWeight` and the per-output-feature factor `g = m / ||V||`, computed there once
per call for the whole (stacked) weight, with the norm held constant; a
[`LoraDropout`] adds its keys; a `MixedWeight` (several adapters' factors side by
side on the rank axis, `lorax.mixed_batch`) adds its rank gate. The rules
(`_rules/variants.py`) then only scale an output or an input by `g`, feed `drop(x)`
to the low-rank path and scale its rank-`k` intermediate by the gate, never a norm:
one value type for the variants, so LoRA's own rules stay as they are.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import Array, lax

from .. import _engine
from .._weight import LoraWeight
from .dora import DoraWeight, weight_norm
from .dropout import LoraDropout
from .mixed import MixedWeight, gated_lora


class Adapted(_engine.ArrayValue):
    """`lw`'s array times `g` (broadcast, `w`'s rank, `None`: 1), with LoRA dropout of
    `rate` on the low-rank path's input when `key` (one per batch slice) is set, and
    the low-rank path's rank axis scaled by `gate` (`(*batch, k)`, one row per batch
    slice) when set."""

    lw: LoraWeight
    g: Array | None
    key: Array | None
    rate: float = eqx.field(static=True, default=0.0)
    gate: Array | None = None

    def aval(self) -> jax.core.ShapedArray:
        return self.lw.aval()

    def materialise(self) -> Array:
        lw = self.lw if self.gate is None else gated_lora(self.lw, self.gate)
        v = type(lw).materialise(lw)
        return v if self.g is None else v * self.g.astype(v.dtype)

    materialized_as = "materialized (DoRA: m * V / ||V||; LoRA dropout not applied)"

    @staticmethod
    def default(primitive: Any, values: Any, params: dict[str, Any]) -> Any:
        return _engine.materialize_fallback(primitive, values, params)


def frozen_lora(lw: LoraWeight) -> LoraWeight:
    return LoraWeight(lax.stop_gradient(lw.w), lw.a, lw.b, lw.alpha, m_axes=lw.m_axes)


def magnitude_scale(dw: DoraWeight) -> Array:
    """`m / ||V||` with the norm a constant: gradients reach `m` only through it."""
    lw = dw.as_lora()
    norm = weight_norm(lw, dw.output_factor)
    return dw.m / norm.astype(dw.m.dtype)


def adapt(x: Any) -> Any:
    """A `DoraWeight`, `LoraDropout` or `MixedWeight` as an `Adapted` with a frozen
    `w`; others unchanged."""
    if isinstance(x, MixedWeight):
        return Adapted(frozen_lora(x.weight), None, None, 0.0, x.gate)
    if isinstance(x, LoraDropout):
        inner = x.weight
        if isinstance(inner, DoraWeight):
            return Adapted(frozen_lora(inner), magnitude_scale(inner), x.key, x.rate)
        return Adapted(frozen_lora(inner), None, x.key, x.rate)
    if isinstance(x, DoraWeight):
        return Adapted(frozen_lora(x), magnitude_scale(x), None, 0.0)
    return x


def drop(x: Array, key: Array, rate: float) -> Array:
    """Inverted dropout of `x` with one key (the first, for a weight still stacked)."""
    if key.ndim:
        key = key.reshape(-1)[0]
    keep = jax.random.bernoulli(key, 1.0 - rate, jnp.shape(x))
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
