"""Which memory a frozen leaf lives in, and where it moves to be read.

A frozen weight may live in host memory (a sharding with `memory_kind="pinned_host"`):
the device then holds only the trainable factors, the activations and the one layer of
frozen codes being used. Nothing moves at `lora()`'s boundary. A rule that reads a
host-resident leaf moves what it reads, where it reads it (`on_device`): under
`lax.scan` over stacked layers that is the current layer's slice, inside the loop body,
in the forward pass, in a recomputation and in the backward pass alike. The backward
pass keeps the host leaf, not the moved copy: a quantized weight's contraction is a
`custom_vjp` whose residuals are its leaves, and a dense weight's product recomputes
its move (`read_frozen`), so `lax.scan` never stacks device copies of every layer.
Inside a `jax.checkpoint` whose policy recomputes them (`_engine.recomputed`: per-layer
remat), the moved copy is the residual instead: the backward pass recomputes the layer,
moving its weights once for the recomputation and the layer's gradient together, where
keeping the host leaf would move them twice.

XLA:CPU accepts the memory kinds and computes the same values (its host and device
memory are one); the moves show in a program exported for `cuda` as
`annotate_device_placement` calls.

Putting a tree's frozen weights, or an optimizer's state, in host memory in the first
place is `_offload`'s (`offload_frozen`, `offload_state`): it builds on the weights,
which read through this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from . import _engine

HOST = "pinned_host"


def in_host_memory(x: Any) -> bool:
    """`x` is an array (or tracer) typed in host memory."""
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        return False
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def on_device(x: Any) -> Any:
    """`x` in device memory: moved if it is typed in host memory, else as it is (`None` too)."""
    if not in_host_memory(x):
        return x
    return jax.device_put(x, jax.memory.Space.Device)


def read_frozen(product: Callable[..., Any], w: Any, *operands: Any) -> Any:
    """`product(w, *operands)`, `w` read in device memory.

    A `w` in host memory is moved inside a `jax.checkpoint`, so differentiation keeps
    `w` itself for the backward pass and moves it again there, rather than saving the
    moved copy (per layer, under `lax.scan`: every layer's weight on the device). Inside
    a recomputing checkpoint already (`_engine.recomputed`), the moved copy is named for
    it to recompute, and the backward pass reads the recomputation's.
    """
    if not in_host_memory(w):
        return product(w, *operands)
    if _engine.recomputed():
        return product(checkpoint_name(on_device(w), _engine.RECOMPUTED), *operands)
    return jax.checkpoint(lambda w, *ops: product(on_device(w), *ops),
                          prevent_cse=False)(w, *operands)


def _to_host(x: Any, memory_kind: str) -> Any:
    """`x` (an array or a `ShapeDtypeStruct`) in memory `memory_kind`, its sharding kept."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:  # a NumPy array or a bare ShapeDtypeStruct: the default device's
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharding = sharding.with_memory_kind(memory_kind)
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract (compile-only planning): retyped
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, sharding)
