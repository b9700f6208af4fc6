"""LoRA dropout: dropout on the low-rank branch's input, `x @ W + s * (drop(x) @ b) @ a`."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from .. import _engine
from .._weight import LoraWeight


class LoraDropout(_engine.ArrayValue):
    """A [`lorax.LoraWeight`][] (or [`lorax.DoraWeight`][]) marked for LoRA dropout.

    Made by [`lorax.dropout`][] and consumed by [`lorax.lora`][]: not a parameter to
    store or differentiate with respect to. `key` holds one PRNG key per slice of
    the weight's batch axes (one per layer of a stacked weight), so that `lax.scan`
    over the layers hands each layer its own key.
    """

    weight: LoraWeight
    key: Array
    rate: float = eqx.field(static=True)

    def __check_init__(self) -> None:
        # Runs where the value is built, not when JAX rebuilds it from its leaves.
        if not isinstance(self.weight, LoraWeight):
            raise TypeError(f"LoraDropout: weight must be a LoraWeight or DoraWeight, got "
                            f"{type(self.weight).__name__}.")
        _check_rate("LoraDropout", self.rate)
        batch = tuple(self.weight.w.shape[: self.weight.structure[0]])
        key = self.key
        if not (isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                and key.shape == batch):
            raise ValueError(
                f"LoraDropout: key must be typed jax.random keys of shape {batch} (one per "
                f"slice of the weight's batch axes), got {type(key).__name__} of shape "
                f"{getattr(key, 'shape', None)} and dtype {getattr(key, 'dtype', None)}.")

    def aval(self) -> jax.core.ShapedArray:
        return self.weight.aval()

    def materialise(self) -> Array:
        # Dense, the weight has no low-rank branch to drop inputs of.
        return type(self.weight).materialise(self.weight)

    materialized_as = "materialized without LoRA dropout (no low-rank branch left to drop)"

    @staticmethod
    def default(primitive: Any, values: Any, params: dict[str, Any]) -> Any:
        return _engine.materialize_fallback(primitive, values, params)


def _check_rate(where: str, rate: Any) -> None:
    if isinstance(rate, (bool, np.bool_)) or not isinstance(
            rate, (int, float, np.integer, np.floating)) or not 0.0 <= rate < 1.0:
        raise ValueError(f"{where}: rate must be a number in [0, 1), got {rate!r}.")


def dropout(lora_params: Any, key: jax.Array | None, rate: float) -> Any:
    """LoRA dropout (PEFT's `lora_dropout`) for one call of a [`lorax.lora`][] function.

    Marks every `LoraWeight` in `lora_params` so that, inside `lorax.lora(fn)`, each
    use `x @ w` computes `x @ w + s * (drop(x) @ b) @ a`: inverted dropout
    (`drop(x) = where(keep, x / (1 - rate), 0)`) on the low-rank branch's input
    only, as PEFT does; the frozen path sees `x` itself. Call it inside the loss
    function, with a fresh key per step; without a key (evaluation) the parameters
    come back unchanged.

    Each weight gets its own key, `jax.random.fold_in(key, i)` for the `i`-th
    `LoraWeight` in flattening order, split over the weight's batch axes
    (`jax.random.split(k, n_layers)` for a stacked `(layers, ...)` weight), so
    layers run by `lax.scan` draw independent masks. Each use draws
    `jax.random.bernoulli(k, 1 - rate, x.shape)` for its input `x`. Under `vmap`,
    as with `jax.random`, examples share the mask unless the key is batched too.
    Embedding lookups (gathers) have no dropout, as in PEFT; with DoRA the
    magnitude scales the whole output, `(x @ w + s (drop(x) @ b) @ a) * m / ||V||`
    (PEFT also recomputes `drop(x) @ w` for DoRA, a second weight-sized product).

    **Arguments:**

    - `lora_params`: a parameter tree with `LoraWeight`s (from [`lorax.init_lora`][],
      or [`lorax.combine`][] inside a training step).
    - `key`: a `jax.random` key, or `None` for no dropout.
    - `rate`: the probability of dropping an input element, `0 <= rate < 1`.

    **Returns:**

    `lora_params` with each `LoraWeight` wrapped for dropout (or unchanged when `key`
    is `None` or `rate` is 0).

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        def model(params, x):
            return x @ params["w"]

        params = lorax.init_lora({"w": jnp.ones((8, 4))}, {"w": 2}, jax.random.PRNGKey(0))

        def loss(params, x, key):
            return lorax.lora(model)(lorax.dropout(params, key, 0.1), x).sum()

        grads = jax.grad(loss)(params, jnp.ones((3, 8)), jax.random.PRNGKey(1))
        ```
    """
    _check_rate("lorax.dropout", rate)
    if key is None or rate == 0.0:
        return lora_params
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape[-1:] != (2,) or key.ndim != 1:
            raise ValueError(
                f"lorax.dropout: key must be one jax.random key, got an array of shape "
                f"{key.shape} and dtype {key.dtype}.")
        key = jax.random.wrap_key_data(key)
    elif key.ndim != 0:
        raise ValueError(f"lorax.dropout: key must be one jax.random key, got shape {key.shape}.")

    leaves, treedef = jax.tree_util.tree_flatten(lora_params, is_leaf=_engine.is_value)
    out = []
    i = 0
    for leaf in leaves:
        if isinstance(leaf, LoraWeight):
            batch = tuple(leaf.w.shape[: leaf.structure[0]])
            k = jax.random.fold_in(key, i)
            keys = jax.random.split(k, math.prod(batch)).reshape(batch) if batch else k
            out.append(LoraDropout(leaf, keys, float(rate)))
            i += 1
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)
