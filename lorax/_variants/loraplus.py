"""LoRA+ (Hayou et al. 2024): the output-side factor learns `ratio` times faster."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import _engine
from .._checks import check_finite
from .._spec import LORA_FREEZE, as_lora_spec, check_spec_structure
from .._weight import LoraWeight, factor_axes, unchecked_replace
from .dora import DoraWeight


def _output_factor(node: LoraWeight, spec_val: Any) -> str:
    m = getattr(node, "m", None) if isinstance(node, DoraWeight) else None
    if m is not None and hasattr(m, "shape") and hasattr(node.a, "shape"):
        # m: (*batch, *(M or 1s), *(N or 1s)); a: (*batch, k, *N); b: (*batch, *M, k).
        a, b = node.a, node.b
        nb = a.ndim + b.ndim - m.ndim - 2
        nm = b.ndim - nb - 1
        _, m_axes, n_axes = factor_axes(tuple(m.shape), (nb, nm, m.ndim - nb - nm), node.m_axes)
        if tuple(m.shape[i] for i in n_axes) == tuple(a.shape[nb + 1:]) and all(
                m.shape[i] == 1 for i in m_axes):
            return "a"
        return "b"
    ls = as_lora_spec(spec_val) if spec_val is not None else None
    input_factor = (ls.input_factor if ls is not None else None) or "b"
    return "a" if input_factor == "b" else "b"


def loraplus(ratio: float = 16.0, spec: Any = None) -> optax.GradientTransformation:
    """LoRA+: multiply the updates of each LoRA weight's output-side factor by `ratio`.

    Chained after an optimizer whose updates are proportional to its learning rate
    (SGD, Adam, AdamW with its weight decay, Lion, ...), this is exactly that
    optimizer with learning rate `lr` for the input-side factor and `ratio * lr`
    for the output-side one (PEFT's `lora_B`), as PEFT's
    `create_loraplus_optimizer` builds with two parameter groups. As there, DoRA
    magnitudes and other trained vectors (ndim <= 1: biases, norms) get the
    faster rate too. PEFT's separate learning rate for embedding factors is not
    reproduced (they follow their output side like any weight).

    The output side is the factor the layer's input does not meet first: `a` for
    `x @ w` (lorax's convention; Flax/Haiku kernels, embeddings), `b` for
    `LoraSpec(input_factor="a")` weights (torch/Equinox `(out, in)` weights used
    as `w @ x`, which [`lorax.infer_layout`][] detects); a `DoraWeight`'s
    magnitude says it by itself.

    **Arguments:**

    - `ratio`: the output side's learning-rate multiple (LoRA+'s `lambda`; the
      paper and PEFT suggest 16).
    - `spec`: the spec the parameters were built with, for `input_factor`s;
      `None` treats every plain `LoraWeight` as `x @ w`.

    **Returns:**

    An `optax.GradientTransformation` with no state, for the LoRA tree or the
    trainable half from [`lorax.partition`][] (and inside [`lorax.wrap_optimizer`][]).

    !!! Example

        ```python
        import jax, jax.numpy as jnp, optax
        import lorax

        spec = {"w": 4}
        lp = lorax.init_lora({"w": jnp.ones((16, 8))}, spec, jax.random.PRNGKey(0))
        trainable, frozen = lorax.partition(lp, spec)
        opt = optax.chain(optax.adamw(1e-4), lorax.loraplus(16.0, spec))
        state = opt.init(trainable)
        ```
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0:
        raise ValueError(f"lorax.loraplus: ratio must be a positive number, got {ratio!r}.")
    ratio = check_finite("lorax.loraplus", "ratio", ratio, positive=True)  # nan, inf

    def scale(x: Any) -> Any:
        if x is None or not hasattr(x, "dtype") or x.dtype == jax.dtypes.float0:
            return x
        return x * jnp.asarray(ratio, x.dtype)

    def node_update(spec_val: Any, u: Any) -> Any:
        if isinstance(u, LoraWeight):
            out = _output_factor(u, spec_val)
            fields = {out: scale(getattr(u, out))}
            if isinstance(u, DoraWeight):
                fields["m"] = scale(u.m)
            return unchecked_replace(u, **fields)
        return jax.tree_util.tree_map(
            lambda x: scale(x) if getattr(x, "ndim", 2) <= 1 else x, u)

    # Where the spec freezes, the trainable half from `partition` holds `None` and
    # `wrap_optimizer`'s masking a `MaskedNode`: each stands for a parameter, and so
    # does the spec's `None` where the parameters have one.
    is_none = lambda x: x is None or isinstance(x, optax.MaskedNode)  # noqa: E731
    full_spec = jax.tree_util.tree_map(lambda s: LORA_FREEZE if s is None else s, spec,
                                       is_leaf=is_none)

    def check_spec(tree: Any) -> None:
        if spec is not None:
            check_spec_structure(full_spec, tree, "lorax.loraplus", is_none)

    def init(params: Any) -> optax.EmptyState:
        check_spec(params)
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        check_spec(updates)
        is_node = lambda x: isinstance(x, LoraWeight) or _engine.is_value(x)  # noqa: E731
        if spec is None:
            new = jax.tree_util.tree_map(lambda u: node_update(None, u), updates,
                                         is_leaf=is_node)
        else:
            new = jax.tree_util.tree_map(node_update, spec, updates,
                                         is_leaf=lambda x: x is None)
        return new, state

    return optax.GradientTransformation(init, update)
