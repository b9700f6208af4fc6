"""One check for every framework: LoRA through real model code equals the merged model.

`check_lora_model` takes an unmodified apply function, its params and inputs, and a
regex choosing the weights to LoRA. It asserts that
- `lora(apply)` on `init_lora` params (with non-zero `b`, so the update matters)
  equals `apply` on `merge_params` params,
- the factor gradients equal those taken through `LoraWeight.materialize()`,
- nothing is materialized (`on_materialize="error"`),
- a few Adam steps on the partition path lower a loss and leave every W bit-identical.

With `quantize="int8"` (or another qtype) the frozen base is quantized first (QLoRA):
the reference is then the same model on the dequantized base. With `dora=True` every
weight is a `DoraWeight`, and the reference is `DoraWeight.materialize()`: the
materialised `m * V / ||V||`, with the norm held constant as DoRA prescribes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lorax
from conftest import assert_close


def _is_lora(x):
    return isinstance(x, lorax.LoraWeight)


def _nudge(lp: Any, seed: int) -> Any:
    """Give every `b` non-zero values so the low-rank path is actually exercised (and a
    DoRA magnitude away from the weight's norms). Host-side random numbers: drawing them
    with `jax.random` eagerly compiles a kernel per leaf shape."""
    rng = np.random.default_rng(seed)

    def normal(x):
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype)

    def nudge(leaf):
        if isinstance(leaf, lorax.DoraWeight):
            return lorax.DoraWeight(leaf.w, leaf.a * 10.0, 0.1 * normal(leaf.b),
                                    leaf.m * (1.0 + 0.2 * normal(leaf.m)), alpha=leaf.alpha,
                                    m_axes=leaf.m_axes)
        if _is_lora(leaf):
            return lorax.LoraWeight(leaf.w, leaf.a * 10.0, 0.1 * normal(leaf.b),
                                    alpha=leaf.alpha, m_axes=leaf.m_axes)
        return leaf
    return jax.tree.map(nudge, lp, is_leaf=_is_lora)


def _merged_tree(lp: Any) -> Any:
    def dense(x):
        if _is_lora(x):
            return x.materialize()
        return x.dequantize() if isinstance(x, lorax.QuantizedArray) else x
    return jax.tree.map(dense, lp, is_leaf=lambda x: _is_lora(x) or isinstance(x, lorax.QuantizedArray))


def _scalar(out: Any) -> jax.Array:
    leaves = [jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(out)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    return sum(jnp.mean(jnp.sin(3.0 * x) * x) for x in leaves)


def check_lora_model(
    apply: Callable[..., Any],
    params: Any,
    args: tuple,
    targets: str,
    *,
    rank: int = 2,
    expected_lora: int | None = None,
    rtol: float = 2e-4,
    atol: float = 2e-5,
    steps: int = 3,
    quantize: str | None = None,
    dora: bool = False,
    eager: bool = True,
) -> Any:
    spec = lorax.simple_spec(params, targets=targets, rank=rank)
    spec = lorax.infer_layout(apply, params, spec, *args)
    if quantize is not None:
        # min_size: quantize the small test tables too (not the multi-axis biases).
        params = lorax.quantize(params, spec, quantize, min_size=64)
        n_q = sum(isinstance(x, lorax.QuantizedArray)
                  for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, lorax.QuantizedArray)))
        assert n_q >= 1
    lp = _nudge(lorax.init_lora(params, spec, jax.random.PRNGKey(1), dora=dora), 2)
    n_lora = sum(_is_lora(x) for x in jax.tree.leaves(lp, is_leaf=_is_lora))
    n_dora = sum(isinstance(x, lorax.DoraWeight) for x in jax.tree.leaves(lp, is_leaf=_is_lora))
    assert n_dora == (n_lora if dora else 0)
    assert n_lora >= 1, f"no weight matched {targets!r}"
    if expected_lora is not None:
        assert n_lora == expected_lora, n_lora

    lora_apply = lorax.lora(apply, on_materialize="error")
    # `eager=False` for a deep model: eagerly, every op of it compiles on its own (the
    # eager path itself is checked on the smaller models).
    want = (apply if eager else jax.jit(apply))(lorax.merge_params(lp), *args)
    # `atol` is relative to each output's magnitude (at least 1), as for the gradients.
    if eager:
        got = lora_apply(lp, *args)
        jax.tree.map(lambda g, w: assert_close(g, w, rtol=rtol, atol=atol), got, want)
    got_jit = jax.jit(lora_apply)(lp, *args)
    jax.tree.map(lambda g, w: assert_close(g, w, rtol=rtol, atol=atol), got_jit, want)

    trainable, frozen = lorax.partition(lp, spec)
    loss = lambda t: _scalar(lora_apply(lorax.combine(t, frozen), *args))  # noqa: E731
    ref_loss = lambda t: _scalar(apply(_merged_tree(lorax.combine(t, frozen)), *args))  # noqa: E731
    opt = optax.adam(1e-2)

    @jax.jit
    def step(t, state):
        value, grads = jax.value_and_grad(loss)(t)
        updates, state = opt.update(grads, state, t)
        return value, grads, optax.apply_updates(t, updates), state

    # The first step's gradients are the factor gradients at `lp`; one step more than
    # `steps` gives the loss after `steps` updates. One compiled function does both.
    values, t, state = [], trainable, opt.init(trainable)
    for i in range(steps + 1):
        value, grads, t, state = step(t, state)
        values.append(float(value))
        if i == 0:
            g = grads
    # Jitted: an eager gradient through real model code compiles every op on its own.
    g_ref = jax.jit(jax.grad(ref_loss))(trainable)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        assert_close(x, y, rtol=10 * rtol, atol=10 * atol)
    assert values[-1] < values[0]
    after = lorax.combine(t, frozen)
    for x, y in zip(jax.tree.leaves(after, is_leaf=_is_lora), jax.tree.leaves(lp, is_leaf=_is_lora)):
        if _is_lora(x):  # exact: W is frozen, so bit-identical after training
            for u, v in zip(jax.tree.leaves(x.w), jax.tree.leaves(y.w)):  # codes and scales too
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    return lp
