"""Quickstart: LoRA-fine-tune a plain-JAX MLP with lorax (runs in seconds on CPU).

    python examples/quickstart.py [--dim 512] [--layers 4] [--rank 8] [--steps 50]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import lorax


def model(params, x):
    """An MLP written with no LoRA in mind."""
    for w in params[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ params[-1]


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)

    keys = jax.random.split(jax.random.PRNGKey(0), args.layers + 3)
    d = args.dim
    params = [jax.random.normal(k, (d, d)) / d**0.5 for k in keys[: args.layers]]
    # A target the frozen model does not fit: a low-rank change of its last layer.
    target_delta = jax.random.normal(keys[-3], (d, 4)) @ jax.random.normal(keys[-2], (4, d)) / d
    x = jax.random.normal(keys[-1], (args.batch, d))
    target = model(params[:-1] + [params[-1] + target_delta], x)

    def loss_fn(p, x, y):
        return jnp.mean((model(p, x) - y) ** 2)

    spec = lorax.simple_spec(params, decision_fn=lambda path, w: args.rank)
    lora_params = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    lora_loss = lorax.lora(loss_fn)
    optimizer = lorax.wrap_optimizer(optax.adam(3e-3), spec)
    opt_state = optimizer.init(lora_params)

    @jax.jit
    def step(lora_params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lora_loss)(lora_params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, lora_params)
        return loss, optax.apply_updates(lora_params, updates), opt_state

    n_lora = sum(lw.a.size + lw.b.size for lw in lora_params)
    n_full = sum(w.size for w in params)
    print(f"trainable parameters: {n_lora:,} of {n_full:,} ({100 * n_lora / n_full:.2f}%)")
    start = time.perf_counter()
    first = None
    for i in range(args.steps):
        loss, lora_params, opt_state = step(lora_params, opt_state, x, target)
        first = float(loss) if first is None else first
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.5f}")
    elapsed = time.perf_counter() - start

    merged = lorax.merge_params(lora_params)
    diff = float(jnp.max(jnp.abs(model(merged, x) - lorax.lora(model)(lora_params, x))))
    frozen_ok = all(bool((lw.w == w).all()) for lw, w in zip(lora_params, params))
    print(f"{args.steps} steps in {elapsed:.2f}s; merged vs LoRA output max diff {diff:.2e}; "
          f"frozen weights unchanged: {frozen_ok}")
    return {"first_loss": first, "last_loss": float(loss), "merge_diff": diff,
            "frozen_ok": float(frozen_ok)}


if __name__ == "__main__":
    main()
