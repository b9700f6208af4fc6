"""Keras 3 (JAX backend): LoRA-fine-tune a small Keras transformer through `stateless_call`.

Keras keeps its weights in variables; `model.stateless_call(trainable, non_trainable, x)`
runs the model on values given explicitly, so a dict of the trainable values, keyed by
variable path, is a pytree lorax can put `LoraWeight`s into. The unmodified model
(`Embedding`, causal `MultiHeadAttention` with `EinsumDense` kernels, `Dense` MLP) learns
to continue repeating patterns; at the end the merged weights are assigned back into
the Keras variables and Keras' own `predict` gives the tuned model's output.

    .venv/bin/python examples/keras_example.py [--steps 150] [--seed 0] [--rank 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import lorax  # noqa: E402

VOCAB, SEQ, DIM, PERIOD = 32, 8, 64, 3


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    ids = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM)(ids)
    x = x + keras.layers.MultiHeadAttention(4, DIM // 4)(x, x, use_causal_mask=True)
    x = x + keras.layers.Dense(DIM)(keras.layers.Dense(4 * DIM, activation="gelu")(x))
    return keras.Model(ids, keras.layers.Dense(VOCAB)(x))


def batch(rng, n):
    """Three random tokens repeated (a b c a b c ...); predict each next token."""
    seq = np.tile(rng.integers(0, VOCAB, (n, PERIOD)), SEQ // PERIOD + 1)
    return seq[:, :SEQ], seq[:, 1 : SEQ + 1]


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)

    model = build(args.seed)
    variables, others = model.trainable_variables, [v.value for v in model.non_trainable_variables]
    params = {v.path: v.value for v in variables}  # paths read like "dense/kernel"

    def apply(params, ids):
        return model.stateless_call([params[v.path] for v in variables], others, ids)[0]

    eval_ids, eval_targets = batch(rng, 256)
    spec = lorax.simple_spec(params, targets=r"kernel|embeddings", rank=args.rank)
    spec = lorax.infer_layout(apply, params, spec, eval_ids)  # EinsumDense: multi-axis kernels
    print(lorax.summary(params, spec))
    lora_params = lorax.init_lora(params, spec, jax.random.PRNGKey(args.seed))
    lora_apply = lorax.lora(apply, on_materialize="error")

    base = jax.tree.map(np.array, params)
    trainable, frozen = lorax.partition(lora_params, spec)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)

    @jax.jit
    def step(trainable, frozen, opt_state, ids, targets):
        loss, grads = jax.value_and_grad(
            lambda t: xent(lora_apply(lorax.combine(t, frozen), ids), targets))(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state

    predict = jax.jit(lora_apply)
    before = float(xent(predict(lora_params, eval_ids), eval_targets))
    for i in range(args.steps):
        loss, trainable, opt_state = step(trainable, frozen, opt_state, *batch(rng, args.batch))
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.4f}")
    lora_params = lorax.combine(trainable, frozen)
    out = predict(lora_params, eval_ids)
    after = float(xent(out, eval_targets))
    print(f"held-out loss {before:.4f} -> {after:.4f}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        lorax.save_adapter(path, lora_params, spec)
        loaded, _ = lorax.load_adapter(path, params)
    np.testing.assert_array_equal(predict(loaded, eval_ids), out)

    # The merged weights go back into the Keras model: an ordinary Keras model again.
    merged = lorax.merge_params(loaded)
    for v in variables:
        v.assign(merged[v.path])
    diff = float(np.abs(model.predict(eval_ids, verbose=0) - np.asarray(out)).max())
    is_lora = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    frozen_ok = all(np.array_equal(lp.w, base[k]) for k, lp in lora_params.items() if is_lora(lp))
    print(f"adapter reloaded bit-exact; Keras predict (merged) vs LoRA max diff {diff:.2e}; "
          f"frozen weights unchanged: {frozen_ok}")
    assert after < before, (before, after)
    assert diff < 1e-4 and frozen_ok
    return {"loss_before": before, "loss_after": after, "merge_diff": diff}


if __name__ == "__main__":
    main()
