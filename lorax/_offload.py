"""`offload_frozen` and `offload_state`: frozen weights and optimizer state kept in host memory.

What moves them back to the device to be read, and when, is `_placement`'s (its
docstring tells the whole story); this module only puts a tree's leaves in host memory.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from . import _engine
from ._checks import check_optimizer
from ._placement import HOST, _to_host
from ._weight import LoraWeight, unchecked_replace


def _frozen_to_host(leaf: Any, memory_kind: str) -> Any:
    move = lambda x: _to_host(x, memory_kind)  # noqa: E731
    if isinstance(leaf, LoraWeight):
        w = leaf.w
        if w is None:  # a partition's trainable half
            return leaf
        w = jax.tree_util.tree_map(move, w) if _engine.is_value(w) else move(w)
        return unchecked_replace(leaf, w=w)  # (a partition's frozen half has no factors)
    if _engine.is_value(leaf) and hasattr(leaf, "codes"):  # a bare QuantizedArray
        return jax.tree_util.tree_map(move, leaf)
    return leaf


def offload_frozen(params: Any, *, memory_kind: str = HOST) -> Any:
    """`params` with its frozen weights in host memory, the rest where it was.

    The 24 GB recipe for a large QLoRA model: the frozen codes (35.7 GiB for
    Llama-3-70B in nf4) stay in host memory, and `lora(fn)` moves each layer's
    codes to the device when a rule reads them (inside a `lax.scan` body: one
    layer's slice per iteration). Moved are each [`lorax.LoraWeight`][]'s `w`
    (dense or a [`lorax.QuantizedArray`][]'s codes and scales) and each bare
    `QuantizedArray`; the factors `a` and `b` and every other leaf (norms,
    embeddings) stay where they are. New arrays are made: `params`' own buffers are
    neither changed nor deleted, so drop your references to them to free the
    device memory they hold. Each array keeps its sharding, in the other memory.
    On a GPU, start the process with XLA's command buffers off and its pipelined host
    offloading on:

        XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_enable_pipelined_host_offloading=true"

    With command buffers on, the copies and the layers' work take turns (Llama-3-70B
    QLoRA on an H200: 1.24x the on-device step with the flags, 1.78x without). For XLA
    to move the next layer's codes while a layer computes, a scanned layer under
    `jax.checkpoint` needs `prevent_cse=False`: the default's barrier keeps the
    backward loop waiting for each layer's copy (docs/qlora.md, "The 24 GB recipe"
    and "Overlap").

    **Arguments:**

    - `params`: a parameter tree (from [`lorax.init_lora`][] or `load_*`), or its
      frozen half from [`lorax.partition`][]; `jax.ShapeDtypeStruct` leaves get a
      host sharding (to compile a step without allocating it).
    - `memory_kind`: where the frozen leaves go (`"pinned_host"`, the default, is
      what a device can read from directly; see the platform's
      `jax.devices()[0].addressable_memories()`).

    **Returns:**

    A tree of the same structure.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = lorax.init_lora({"w": jnp.ones((64, 32))}, {"w": 4}, jax.random.PRNGKey(0))
        offloaded = lorax.offload_frozen(params)
        assert offloaded["w"].w.sharding.memory_kind == "pinned_host"
        assert offloaded["w"].a.sharding.memory_kind != "pinned_host"
        ```
    """
    _check_memory_kind(memory_kind)
    return jax.tree_util.tree_map(lambda x: _frozen_to_host(x, memory_kind), params,
                                  is_leaf=_engine.is_value)


def offload_state(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` with its state kept in host memory between steps.

    The state `init` makes is placed in host memory; `update` moves it to the device,
    runs `optimizer`'s update there and puts the new state back in host memory. Inside a
    jitted step the state then crosses the host link twice a step (in and out) and holds
    no device memory between steps: for Adam on LoRA factors, twice the factors' bytes in
    float32 (1.5 GiB at Llama-3-70B shapes, rank 16 on seven projections). When in the
    step it moves in is XLA's choice, by the card's memory: on a small card late (most
    of the state spared), with memory to spare early (docs/qlora.md, "Overlap"). The
    updates, and the values, are `optimizer`'s own. With [`lorax.offload_frozen`][], the
    device holds only the factors, the activations and the layer being computed.

    **Arguments:**

    - `optimizer`: any optax `GradientTransformation` (e.g. from
      [`lorax.wrap_optimizer`][] or `optax.adam`).

    **Returns:**

    An optax `GradientTransformation`.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, optax
        import lorax

        opt = lorax.offload_state(optax.adam(1e-3))
        params = {"a": jnp.ones((4, 8))}
        state = opt.init(params)
        assert state[0].mu["a"].sharding.memory_kind == "pinned_host"
        updates, state = jax.jit(opt.update)({"a": jnp.ones((4, 8))}, state, params)
        ```
    """
    check_optimizer("offload_state", optimizer)

    def init(params: Any) -> Any:
        return _placed(optimizer.init(params), jax.memory.Space.Host)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        updates, state = optimizer.update(updates, _placed(state, jax.memory.Space.Device),
                                          params)
        return updates, _placed(state, jax.memory.Space.Host)

    return optax.GradientTransformation(init, update)


def _placed(tree: Any, space: Any) -> Any:
    """Every array of `tree` in memory `space` (other leaves as they are)."""
    move = lambda x: jax.device_put(x, space) if isinstance(  # noqa: E731
        x, (jax.Array, jax.core.Tracer)) else x
    return jax.tree_util.tree_map(move, tree)


def _check_memory_kind(memory_kind: str) -> None:
    kinds = sorted({m.kind for d in jax.local_devices() for m in d.addressable_memories()})
    if memory_kind not in kinds:
        raise ValueError(f"offload_frozen: memory_kind {memory_kind!r} is not a memory of this "
                         f"platform's devices ({jax.default_backend()}: {kinds}); "
                         f"{HOST!r} is host memory the devices read directly.")
