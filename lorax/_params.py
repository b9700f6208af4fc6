"""Merging LoRA parameters back into plain ones, and splitting out the trainable part."""

from __future__ import annotations

import functools
from typing import Any

import jax

from . import _engine
from ._checks import check_bool
from ._placement import in_host_memory, on_device
from ._spec import LORA_FREEZE, check_lora_leaves, check_spec_structure, path_str
from ._weight import LoraWeight, unchecked_replace


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def _merge_impl(w: jax.Array | None, lw: LoraWeight) -> jax.Array:
    if w is None or type(lw) is not LoraWeight:  # DoRA rescales the whole weight
        return lw.materialize()
    return w + lw.delta()


@functools.lru_cache(maxsize=None)
def _merger(out_sharding: Any, donate: bool) -> Any:
    # Only `w` can hold the merged result (same shape and dtype), so only it is donated.
    return jax.jit(_merge_impl, out_shardings=out_sharding, donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=None)
def _host_merger(sharding: Any) -> Any:
    # XLA adds nothing across memories: `w` comes to the device inside the program and
    # the merged weight goes back where `w` was, one weight at a time on the device.
    def merge(lw: LoraWeight) -> jax.Array:
        w = on_device(lw.w)
        return _merge_impl(w, unchecked_replace(lw, w=w))
    return jax.jit(merge, out_shardings=sharding)


def _merge(lw: LoraWeight, donate: bool, requantize: bool, where: str) -> Any:
    w = lw.w
    on_host = any(map(in_host_memory, jax.tree.leaves(w)))
    if on_host and _engine.is_value(w):
        raise ValueError(
            f"merge_params: the quantized weight at {where!r} is in host memory; put it on "
            "the device first (jax.device_put), or merge the dense weight.")
    if on_host:
        return _host_merger(w.sharding)(lw)
    if _engine.is_value(w):  # a quantized base: dense merged weight (re-quantized if asked)
        merged = _merger(None, False)(None, lw)
        if not requantize:
            return merged
        # An act-order weight (`RowOrdered`) requantizes as its codes' type, in row order.
        q = getattr(w, "inner", w)
        dq = q.scale_scales is not None
        return type(q).from_dense(merged, q.qtype, block_size=q.block_size, axis=q.axis,
                                  double_quant=dq, dtype=q.dense_dtype,
                                  scale_dtype=None if dq else q.scales.dtype)
    sharding = None if isinstance(w, jax.core.Tracer) else getattr(w, "sharding", None)
    # A sharded `w` keeps its sharding: left to propagation, the sum could come out
    # laid out like `b @ a` (or replicated) and no longer fit the model's shardings.
    # Single-device arrays keep jit's default placement (an uncommitted `w` stays so).
    if not isinstance(sharding, jax.sharding.Sharding) or len(sharding.device_set) == 1:
        sharding = None
    return _merger(sharding, donate)(w, lw)


def merge_params(lora_params: Any, destructive: bool = False, *, requantize: bool = False) -> Any:
    """Replace every `LoraWeight` by its merged weight `w + (alpha/k) * b @ a`.

    The result has the original model's tree structure and dtypes, so it runs in
    the unmodified model. Non-LoRA leaves are passed through as they are. A merged
    weight has its `w`'s sharding (each device adds its own shard of `b @ a`); a `w`
    in host memory ([`lorax.offload_frozen`][]) is merged on the device, one weight at
    a time, and the merged weight goes back to host memory.

    **Arguments:**

    - `lora_params`: a parameter tree containing `LoraWeight`s.
    - `destructive`: if `True`, donate each `LoraWeight`'s `w` to the merge so the
      merged weight can reuse its memory: the caller's `w` arrays are deleted
      afterwards. The default keeps them (lorax 0.3 deleted them by default).
      A quantized `w` is never donated (the merged weight is dense).
    - `requantize`: a `LoraWeight` whose `w` is a [`lorax.QuantizedArray`][] merges
      to the dense `dequantize(w) + (alpha/k) * b @ a`, and a frozen
      `QuantizedArray` to its dense value, so the result runs in the unmodified
      model; with `requantize=True` merged weights are quantized again with `w`'s
      format, block size and axis, and frozen ones stay as they are.

    **Returns:**

    A parameter tree of plain arrays.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        lp = lorax.init_lora({"w": jnp.ones((8, 4))}, {"w": 2}, jax.random.PRNGKey(0))
        merged = lorax.merge_params(lp)
        assert merged["w"].shape == (8, 4)
        ```
    """
    check_bool("merge_params", "destructive", destructive)
    check_bool("merge_params", "requantize", requantize)

    def merge(path: Any, x: Any) -> Any:
        if _is_lora(x):
            return _merge(x, destructive, requantize, path_str(path))
        if _engine.is_value(x) and not hasattr(x, "dequantize"):
            raise ValueError(
                f"merge_params: {path_str(path)!r} is a {type(x).__name__}, made for one "
                "lorax.lora call (lorax.dropout); merge the parameters it was made from.")
        if _engine.is_value(x) and not requantize:  # a frozen quantized weight
            return x.dequantize()
        return x

    return jax.tree_util.tree_map_with_path(merge, lora_params, is_leaf=_engine.is_value)


def split_lora_params(params: Any, spec: Any) -> Any:
    """The trainable part of `params`, for checkpoints: frozen leaves become `None`.

    `LoraWeight`s keep their `a` and `b` with `w` set to `None`; `LORA_FULL` leaves
    are kept; `LORA_FREEZE` leaves become `None`.

    **Arguments:**

    - `params`: a LoRA parameter tree (from [`lorax.init_lora`][]).
    - `spec`: the spec it was built with.

    **Returns:**

    A pytree with `params`' structure holding only trainable arrays.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        spec = {"w": 2, "v": lorax.LORA_FREEZE}
        lp = lorax.init_lora({"w": jnp.ones((8, 4)), "v": jnp.ones((4, 4))}, spec,
                             jax.random.PRNGKey(0))
        trainable = lorax.split_lora_params(lp, spec)
        assert trainable["v"] is None and trainable["w"].w is None
        ```
    """

    return _partition(params, spec, "split_lora_params")[0]


def partition(lora_params: Any, spec: Any) -> tuple[Any, Any]:
    """Split LoRA parameters into `(trainable, frozen)` halves with the same structure.

    `trainable` holds every `LoraWeight`'s `a` and `b` (its `w` set to `None`) and
    the `LORA_FULL` leaves; `frozen` holds every `w` and the `LORA_FREEZE` leaves;
    each has `None` where the other has an array. Differentiate and optimise only
    `trainable`: the gradient's bytes equal the trainable bytes exactly, optax state
    covers only trainable leaves, no dW matmul is traced, and a jitted step that
    takes `frozen` as an input never returns (or copies) a frozen weight. This is
    the memory-optimal training path; [`lorax.combine`][] puts the halves back
    together inside the step.

    **Arguments:**

    - `lora_params`: a parameter tree from [`lorax.init_lora`][].
    - `spec`: the spec it was built with.

    **Returns:**

    `(trainable, frozen)`.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, optax
        import lorax

        def loss(params, x):
            return jnp.sum(x @ params["w"] + params["bias"])

        params = {"w": jnp.ones((8, 4)), "bias": jnp.zeros(4)}
        spec = {"w": 2, "bias": lorax.LORA_FULL}
        trainable, frozen = lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(0)), spec)
        opt = optax.adam(1e-3)
        state = opt.init(trainable)  # moments for a, b and bias only

        @jax.jit
        def step(trainable, frozen, state, x):
            grads = jax.grad(lambda t: lorax.lora(loss)(lorax.combine(t, frozen), x))(trainable)
            updates, state = opt.update(grads, state, trainable)
            return optax.apply_updates(trainable, updates), state

        trainable, state = step(trainable, frozen, state, jnp.ones((2, 8)))
        ```
    """
    return _partition(lora_params, spec, "partition")


def _partition(lora_params: Any, spec: Any, where: str) -> tuple[Any, Any]:
    check_spec_structure(spec, lora_params, where)
    check_lora_leaves(spec, lora_params, where)

    def split(spec_val: Any, param: Any) -> tuple[Any, Any]:
        if _is_lora(param):
            return (unchecked_replace(param, w=None),
                    unchecked_replace(param, **dict.fromkeys(param.trainable_fields)))
        return (None, param) if spec_val == LORA_FREEZE else (param, None)

    trainable = jax.tree_util.tree_map(lambda s, p: split(s, p)[0], spec, lora_params, is_leaf=_engine.is_value)
    frozen = jax.tree_util.tree_map(lambda s, p: split(s, p)[1], spec, lora_params, is_leaf=_engine.is_value)
    return trainable, frozen


def combine(trainable: Any, frozen: Any) -> Any:
    """Inverse of [`lorax.partition`][]: one tree with every array in place.

    **Arguments:**

    - `trainable`: the first half returned by `partition` (or an updated copy).
    - `frozen`: the second half.

    **Returns:**

    The LoRA parameter tree, ready for a [`lorax.lora`][]-wrapped function.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        spec = {"w": 2}
        lp = lorax.init_lora({"w": jnp.ones((8, 4))}, spec, jax.random.PRNGKey(0))
        again = lorax.combine(*lorax.partition(lp, spec))
        assert (again["w"].materialize() == lp["w"].materialize()).all()
        ```
    """
    # A quantized weight is one frozen leaf (its trainable counterpart is `None`).
    is_none = lambda x: x is None or (_engine.is_value(x) and not _is_lora(x))  # noqa: E731
    t_leaves, t_def = jax.tree_util.tree_flatten(trainable, is_leaf=is_none)
    f_leaves, f_def = jax.tree_util.tree_flatten(frozen, is_leaf=is_none)
    if t_def != f_def:
        raise ValueError(
            "combine: `trainable` and `frozen` have different structures; pass the two "
            "halves returned by lorax.partition (or trees with the same structure)."
        )
    both = [t if f is None else f for t, f in zip(t_leaves, f_leaves)]
    return jax.tree_util.tree_unflatten(t_def, both)
