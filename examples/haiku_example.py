"""Haiku: LoRA-fine-tune a conv net with BatchNorm state (`hk.transform_with_state`).

A frozen random-init `Conv2D` + `BatchNorm` + `hk.nets.MLP` classifier learns to tell
four noisy image templates apart through rank-4 factors on the conv and hidden linear
weights, while the classifier head, the biases and the BatchNorm scales/offsets train
fully (`LORA_FULL`). The BatchNorm state is an ordinary argument and result of the
step: only `params` get LoRA. (The file is not called `haiku.py`: that would shadow
the package.)

    .venv/bin/python examples/haiku_example.py [--steps 60] [--seed 0] [--rank 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import haiku as hk
import jax
import numpy as np
import optax

import lorax

CLASSES, SIZE = 4, 16


def net(x, is_training):
    for channels in (16, 32):
        x = hk.Conv2D(channels, kernel_shape=3, stride=2)(x)
        x = jax.nn.relu(hk.BatchNorm(True, True, decay_rate=0.9)(x, is_training))
    return hk.nets.MLP([64, CLASSES])(x.reshape(x.shape[0], -1))


def batch(rng, templates, n):
    """Noisy copies of one of the templates; the label says which."""
    labels = rng.integers(0, CLASSES, n)
    noise = rng.normal(0.0, 2.0, (n, SIZE, SIZE, 3))
    return (templates[labels] + noise).astype(np.float32), labels


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    k_init, k_lora = jax.random.split(jax.random.PRNGKey(args.seed))
    rng = np.random.default_rng(args.seed)  # the data

    templates = rng.normal(size=(CLASSES, SIZE, SIZE, 3))
    eval_x, eval_y = batch(rng, templates, 256)
    model = hk.transform_with_state(net)
    params, state = jax.jit(model.init, static_argnums=2)(k_init, eval_x, True)
    # Training mode returns (logits, new BatchNorm state); eval mode uses the stored averages.
    train_apply = lambda p, s, x: model.apply(p, s, None, x, True)  # noqa: E731
    eval_apply = lambda p, s, x: model.apply(p, s, None, x, False)[0]  # noqa: E731

    # First match wins: the 64 -> 4 classifier head trains fully, other weights get LoRA.
    # Haiku's BatchNorm scale/offset are (1, 1, 1, C), so `tune_vectors` (1-d leaves,
    # here the biases) does not reach them: they are named.
    spec = lorax.simple_spec(params, targets={r"linear_1/w$|batch_norm": lorax.LORA_FULL,
                                              r"w$": args.rank}, tune_vectors=True)
    spec = lorax.infer_layout(train_apply, params, spec, state, eval_x)
    print(lorax.summary(params, spec))
    lora_params = lorax.init_lora(params, spec, k_lora)
    lora_train = lorax.lora(train_apply, on_materialize="error")
    predict = jax.jit(lorax.lora(eval_apply, on_materialize="error"))

    base = jax.tree.map(np.array, params)  # host copy: W must not move
    trainable, frozen = lorax.partition(lora_params, spec)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)

    def loss_fn(trainable, frozen, state, x, y):
        logits, state = lora_train(lorax.combine(trainable, frozen), state, x)
        return xent(logits, y), state

    @jax.jit
    def step(trainable, frozen, state, opt_state, x, y):
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, state, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), state, opt_state

    before = float(xent(predict(lora_params, state, eval_x), eval_y))
    for i in range(args.steps):
        x, y = batch(rng, templates, args.batch)
        loss, trainable, state, opt_state = step(trainable, frozen, state, opt_state, x, y)
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.4f}")
    lora_params = lorax.combine(trainable, frozen)
    out = predict(lora_params, state, eval_x)
    after = float(xent(out, eval_y))
    acc = float((out.argmax(-1) == eval_y).mean())
    print(f"held-out loss {before:.4f} -> {after:.4f}, accuracy {acc:.1%}")

    # The adapter holds the factors and the fully-trained vectors; BatchNorm state is
    # the model's own business (save it with the adapter if you need it).
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        lorax.save_adapter(path, lora_params, spec)
        print(f"adapter: {os.path.getsize(path):,} bytes")
        loaded, _ = lorax.load_adapter(path, params)
    np.testing.assert_array_equal(predict(loaded, state, eval_x), out)

    merged = lorax.merge_params(loaded)
    merged_out = jax.jit(eval_apply)(merged, state, eval_x)
    diff = float(np.abs(np.asarray(merged_out) - np.asarray(out)).max())
    is_lora = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    frozen_ok = all(jax.tree.leaves(jax.tree.map(
        lambda lw, w: np.array_equal(lw.w, w) if is_lora(lw) else True,
        lora_params, base, is_leaf=is_lora)))
    print(f"adapter reloaded bit-exact; merged vs LoRA max diff {diff:.2e}; "
          f"frozen weights unchanged: {frozen_ok}")
    assert after < before, (before, after)
    assert diff < 1e-4 * max(1.0, float(np.abs(np.asarray(out)).max())) and frozen_ok
    return {"loss_before": before, "loss_after": after, "accuracy": acc, "merge_diff": diff}


if __name__ == "__main__":
    main()
