"""`lora(fn)`: re-trace any JAX function so `LoraWeight` leaves go through low-rank rules."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax import lax

from . import _engine, _rules, _sharding  # noqa: F401  (importing _rules registers the rules)
from ._variants.adapted import adapt
from ._variants.dora import DoraWeight
from ._variants.dropout import LoraDropout
from ._variants.mixed import MixedWeight
from ._weight import LoraWeight

F = TypeVar("F", bound=Callable[..., Any])


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def _freeze(x: Any) -> Any:
    # W is frozen once, here, rather than by `stop_gradient` inside each rule. Inside a
    # `lax.scan` over stacked layers JAX hands a loop *input* to the backward pass for
    # free, but saves any value computed from it per iteration: `stop_gradient(W_i)`
    # in a rule became a stacked, model-sized copy of every weight. Frozen here, the
    # rules read the loop input itself, and no body ever sees a differentiable W.
    if isinstance(x, (DoraWeight, LoraDropout, MixedWeight)):  # DoRA's scale, keys, gates: once
        return adapt(x)
    if isinstance(x, LoraWeight):
        return dataclasses.replace(x, w=lax.stop_gradient(x.w))
    if _engine.is_value(x):  # a bare quantized weight: its scales are frozen too
        return lax.stop_gradient(x)
    return x


def lora(fn: F, *, on_materialize: _engine.MaterializePolicy = "warn") -> F:
    """Make `fn` accept `LoraWeight`s anywhere an array was expected.

    The returned function has `fn`'s signature. When it is called, `fn` is traced
    with every [`lorax.LoraWeight`][] in its arguments (at any depth of any pytree)
    standing in for the array `w + (alpha / k) * b @ a`, and each primitive that
    touches one is rewritten by a low-rank rule: `dot_general` (any dimension
    numbers), `conv_general_dilated`, `gather`, and shape-only ops that keep the
    factors apart. Every `LoraWeight`'s `w` is put behind `lax.stop_gradient`
    on the way in, so gradients reach `a` and `b` only, the backward pass has no
    dW matmul, and under `lax.scan` it reads stacked weights without copying
    them. Works eagerly and under `jax.jit`, `jax.grad`, `jax.vmap`, `jax.checkpoint`, `lax.scan`, `lax.cond`,
    `lax.while_loop` and custom_jvp/custom_vjp functions, inside or outside `fn`.

    **Arguments:**

    - `fn`: any JAX function: a Flax `apply`, a Haiku `apply`, an Equinox model,
      plain `jax.numpy` code.
    - `on_materialize`: what to do when a `LoraWeight` reaches a primitive with no
      low-rank rule, where the correct result needs the dense `w + (alpha/k) b @ a`:
      `"warn"` (default; a `LoraMaterializationWarning` naming the primitive and the
      weight's shape), `"error"` (raise `LoraMaterializationError`) or `"allow"`.

    **Returns:**

    A function with `fn`'s signature.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        def model(params, x):
            return jax.nn.relu(x @ params["w"])

        params = {"w": jnp.ones((8, 4))}
        lora_params = lorax.init_lora(params, {"w": 2}, jax.random.PRNGKey(0))
        y = lorax.lora(model)(lora_params, jnp.ones((3, 8)))
        assert y.shape == (3, 4)
        ```
    """
    if not callable(fn):
        raise TypeError(f"lora: fn must be a callable (a model's apply function, or any "
                        f"function of arrays); got {type(fn).__name__} {fn!r:.60}")
    traced = _engine.transform(fn)
    policy_guard = functools.partial(_engine.materialize_policy, on_materialize)
    policy_guard()  # validate the policy now, not at first call

    @functools.wraps(fn)
    def lora_fn(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = jax.tree_util.tree_map(_freeze, (args, kwargs), is_leaf=_engine.is_value)
        mesh = _sharding.call_mesh(jax.tree_util.tree_leaves((args, kwargs)))
        with policy_guard(), _engine.mesh_scope(mesh):
            return traced(*args, **kwargs)

    return lora_fn  # type: ignore[return-value]
