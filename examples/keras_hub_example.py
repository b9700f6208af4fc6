"""KerasHub: LoRA-fine-tune a tiny random-init `GPT2CausalLM` through `stateless_call`.

The recipe of examples/keras_example.py on a KerasHub task model built from a small
config (no preset, nothing downloaded): `GPT2CausalLM(backbone=GPT2Backbone(...),
preprocessor=None)` takes `{"token_ids", "padding_mask"}` and returns logits through the
tied token embedding. LoRA goes on that embedding, the attention (`EinsumDense` kernels
`(embed, heads, head_dim)`) and the MLP kernels; the model learns to continue repeating
patterns, and the merged weights are assigned back into the KerasHub model.

    .venv/bin/python examples/keras_hub_example.py [--steps 150] [--seed 0] [--rank 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import lorax  # noqa: E402

VOCAB, SEQ, DIM, PERIOD = 32, 8, 64, 3


def build_model() -> keras.Model:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=DIM,
        intermediate_dim=4 * DIM, max_sequence_length=SEQ, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def inputs(ids):
    ids = jax.numpy.asarray(ids)
    return {"token_ids": ids, "padding_mask": jax.numpy.ones_like(ids)}


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
    rng = np.random.default_rng(args.seed)  # the data
    keras.utils.set_random_seed(args.seed)

    model = build_model()
    names = [v.path for v in model.trainable_variables]
    params = {v.path: v.value for v in model.trainable_variables}
    stats = [v.value for v in model.non_trainable_variables]  # seed-generator state

    def apply(params, stats, ids, training=False):
        return model.stateless_call([params[n] for n in names], stats, inputs(ids),
                                  training=training)

    eval_ids, eval_targets = batch(rng, 256)
    # Paths read like "transformer_layer_0/self_attention/query/kernel".
    spec = lorax.simple_spec(params, targets=r"(query|value|feedforward_.*)/kernel|token_embedding",
                             rank=args.rank)
    spec = lorax.infer_layout(apply, params, spec, stats, eval_ids)
    print(lorax.summary(params, spec))
    lora_params = lorax.init_lora(params, spec, jax.random.PRNGKey(args.seed))
    lora_apply = lorax.lora(apply, on_materialize="error")

    base = jax.tree.map(np.array, params)  # host copy: W must not move
    trainable, frozen = lorax.partition(lora_params, spec)
    optimizer = optax.adam(1e-2)  # GPT-2 initialises small: logits start near uniform
    opt_state = optimizer.init(trainable)

    @jax.jit
    def step(trainable, frozen, stats, opt_state, ids, targets):
        def loss_fn(t):
            logits, stats_out = lora_apply(lorax.combine(t, frozen), stats, ids, training=True)
            return xent(logits, targets), stats_out
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), stats, opt_state

    predict = jax.jit(lambda p, s, ids: lora_apply(p, s, ids)[0])
    before = float(xent(predict(lora_params, stats, eval_ids), eval_targets))
    for i in range(args.steps):
        loss, trainable, stats, opt_state = step(trainable, frozen, stats, opt_state,
                                                 *batch(rng, args.batch))
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.4f}")
    lora_params = lorax.combine(trainable, frozen)
    out = predict(lora_params, stats, eval_ids)
    after = float(xent(out, eval_targets))
    acc = float((out.argmax(-1) == eval_targets)[:, PERIOD - 1 :].mean())
    print(f"held-out loss {before:.4f} -> {after:.4f}, next-token accuracy {acc:.1%}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        lorax.save_adapter(path, lora_params, spec)
        print(f"adapter: {os.path.getsize(path):,} bytes")
        loaded, _ = lorax.load_adapter(path, params)
    np.testing.assert_array_equal(predict(loaded, stats, eval_ids), out)

    # Merged weights go back into the ordinary KerasHub model.
    merged = lorax.merge_params(loaded)
    for v in model.trainable_variables:
        v.assign(merged[v.path])
    for v, s in zip(model.non_trainable_variables, stats):
        v.assign(s)
    merged_out = model(inputs(eval_ids), training=False)
    diff = float(np.abs(np.asarray(merged_out) - np.asarray(out)).max())
    is_lora = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    frozen_ok = all(jax.tree.leaves(jax.tree.map(
        lambda lw, w: np.array_equal(lw.w, w) if is_lora(lw) else True,
        lora_params, base, is_leaf=is_lora)))
    print(f"adapter reloaded bit-exact; merged vs LoRA max diff {diff:.2e}; "
          f"frozen weights unchanged: {frozen_ok}")
    assert after < before, (before, after)
    assert diff < 1e-4 and frozen_ok
    return {"loss_before": before, "loss_after": after, "accuracy": acc, "merge_diff": diff}


if __name__ == "__main__":
    main()
