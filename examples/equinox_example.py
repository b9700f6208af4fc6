"""Equinox: LoRA-fine-tune a patch-attention model (`Conv2d`, `MultiheadAttention`, `MLP`).

An Equinox model is its own pytree; `eqx.partition(model, eqx.is_inexact_array)` splits
off the arrays, and `eqx.combine(params, static)` inside the function rebuilds the
unmodified model around whatever lorax passes in (`LoraWeight`s included). Equinox
layers hold `(out, in)` weights and compute `W @ x` per example under `jax.vmap`; lorax
handles both. The frozen random-init model is fitted to a fixed random teacher network
(regression); the merged weights give an ordinary Equinox model at the end.

    .venv/bin/python examples/equinox_example.py [--steps 150] [--seed 0] [--rank 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lorax

DIM, OUT = 32, 8


class PatchAttention(eqx.Module):
    patchify: eqx.nn.Conv2d
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.MLP

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.patchify = eqx.nn.Conv2d(3, DIM, kernel_size=4, stride=4, key=k1)
        self.attn = eqx.nn.MultiheadAttention(num_heads=4, query_size=DIM, key=k2)
        self.head = eqx.nn.MLP(DIM, OUT, width_size=64, depth=2, key=k3)

    def __call__(self, image):  # one (3, 16, 16) image -> (OUT,)
        tokens = self.patchify(image).reshape(DIM, -1).T  # 16 patches of DIM features
        tokens = tokens + self.attn(tokens, tokens, tokens)
        return self.head(tokens.mean(0))


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    k_model, k_teacher, k_lora = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    rng = np.random.default_rng(args.seed)  # the data
    batch = lambda n: rng.normal(size=(n, 3, 16, 16)).astype(np.float32)  # noqa: E731

    model, teacher = PatchAttention(k_model), PatchAttention(k_teacher)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    apply = lambda params, x: jax.vmap(eqx.combine(params, static))(x)  # noqa: E731
    eval_x = batch(256)
    eval_y = jax.vmap(teacher)(eval_x)

    # Every `weight` (conv, the four attention projections, the MLP's three layers).
    spec = lorax.simple_spec(params, targets="weight", rank=args.rank)
    spec = lorax.infer_layout(apply, params, spec, eval_x)
    print(lorax.summary(params, spec))
    lora_params = lorax.init_lora(params, spec, k_lora)
    lora_apply = lorax.lora(apply, on_materialize="error")

    def loss_fn(lora_params, x):
        return jnp.mean((lora_apply(lora_params, x) - jax.vmap(teacher)(x)) ** 2)

    base = jax.tree.map(np.array, params)  # host copy: W must not move
    trainable, frozen = lorax.partition(lora_params, spec)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)

    @jax.jit
    def step(trainable, frozen, opt_state, x):
        loss, grads = jax.value_and_grad(lambda t: loss_fn(lorax.combine(t, frozen), x))(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state

    predict = jax.jit(lora_apply)
    mse = lambda pred: float(jnp.mean((pred - eval_y) ** 2))  # noqa: E731
    before = mse(predict(lora_params, eval_x))
    for i in range(args.steps):
        loss, trainable, opt_state = step(trainable, frozen, opt_state, batch(args.batch))
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.5f}")
    lora_params = lorax.combine(trainable, frozen)
    out = predict(lora_params, eval_x)
    after = mse(out)
    print(f"held-out MSE to the teacher {before:.5f} -> {after:.5f}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        lorax.save_adapter(path, lora_params, spec)
        print(f"adapter: {os.path.getsize(path):,} bytes")
        loaded, _ = lorax.load_adapter(path, params)
    np.testing.assert_array_equal(predict(loaded, eval_x), out)

    # Merged weights make an ordinary Equinox model again.
    tuned = eqx.combine(lorax.merge_params(loaded), static)
    run = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))
    merged_out = run(tuned, eval_x)
    diff = float(np.abs(np.asarray(merged_out) - np.asarray(out)).max())
    is_lora = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    frozen_ok = all(jax.tree.leaves(jax.tree.map(
        lambda lw, w: np.array_equal(lw.w, w) if is_lora(lw) else True,
        lora_params, base, is_leaf=is_lora)))
    print(f"adapter reloaded bit-exact; merged vs LoRA max diff {diff:.2e}; "
          f"frozen weights unchanged: {frozen_ok}")
    assert after < before, (before, after)
    assert diff < 1e-4 and frozen_ok
    return {"loss_before": before, "loss_after": after, "merge_diff": diff}


if __name__ == "__main__":
    main()
