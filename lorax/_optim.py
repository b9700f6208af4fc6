"""`wrap_optimizer`: an optax optimizer that updates only what the spec trains."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from . import _engine
from ._checks import check_optimizer
from ._spec import LORA_FREEZE, check_lora_leaves, check_spec_structure
from ._weight import LoraWeight, unchecked_replace

_TRAIN, _FREEZE = "lorax_train", "lorax_freeze"


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def _labels(spec: Any, params: Any) -> Any:
    check_spec_structure(spec, params, "wrap_optimizer")
    check_lora_leaves(spec, params, "wrap_optimizer")

    def label_tree(spec_val: Any, param: Any) -> Any:
        if isinstance(param, LoraWeight):
            return _lora_labels(param)
        return _FREEZE if spec_val == LORA_FREEZE else _TRAIN

    return jax.tree_util.tree_map(label_tree, spec, params, is_leaf=_engine.is_value)


def _lora_labels(lw: LoraWeight) -> LoraWeight:
    return unchecked_replace(lw, w=_FREEZE, **dict.fromkeys(lw.trainable_fields, _TRAIN))


def freeze() -> optax.GradientTransformation:
    """Updates of `-0.0` and no state: `p + (-0.0)` is `p` bit for bit, for every `p`.

    (`optax.set_to_zero` gives `+0.0`, and `-0.0 + 0.0 == +0.0` flips a sign bit.)
    """

    def init(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        return jax.tree_util.tree_map(_frozen_update, updates), state

    return optax.GradientTransformation(init, update)


def _frozen_update(u: Any) -> Any:
    if jnp.dtype(u.dtype) == jax.dtypes.float0:
        # An integer leaf (a quantized weight's codes) under `jax.grad(allow_int=True)`:
        # integer zeros, which `optax.apply_updates` adds without changing a bit.
        return jnp.zeros(u.shape, jnp.uint8)
    return jnp.full_like(u, -0.0)


def wrap_optimizer(optimizer: optax.GradientTransformation, spec: Any) -> optax.GradientTransformation:
    """Wrap `optimizer` so that it only updates and keeps state for trainable parameters.

    Frozen leaves (spec `LORA_FREEZE`) and every `LoraWeight.w` get an update of
    `-0.0` (so `optax.apply_updates` leaves them bit-identical) and no optimizer
    state at all: Adam moments exist only for `LoraWeight` factors and `LORA_FULL`
    leaves. (Under `jax.jit` the frozen `w + (-0.0)` folds away entirely; run
    eagerly, XLA:CPU flushes subnormal weights to zero in that addition, as in any
    arithmetic, so keep subnormal weights on the [`lorax.partition`][] path.) Works with any optax optimizer, chains and `optax.adamw`'s weight decay
    included; put `optax.MultiSteps` *inside* (`wrap_optimizer(optax.MultiSteps(opt,
    k), spec)`) so that its gradient accumulators, too, exist only for trainable
    leaves.

    This is the lorax 0.3 path (the whole LoRA tree goes through `jax.grad`). For
    the leanest training step, use [`lorax.partition`][] instead.

    **Arguments:**

    - `optimizer`: any `optax.GradientTransformation`.
    - `spec`: the spec the parameters were initialised with.

    **Returns:**

    An `optax.GradientTransformation` to `init`/`update` with the whole LoRA
    parameter tree.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, optax
        import lorax

        params = {"w": jnp.ones((8, 4))}
        spec = {"w": 2}
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
        opt = lorax.wrap_optimizer(optax.adam(1e-3), spec)
        state = opt.init(lp)
        ```
    """
    check_optimizer("wrap_optimizer", optimizer)
    if isinstance(optimizer, optax.MultiSteps):
        optimizer = optimizer.gradient_transformation()
    return optax.multi_transform(
        {_TRAIN: optimizer, _FREEZE: freeze()},
        lambda params: _labels(spec, params),
    )
