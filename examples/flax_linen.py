"""Flax linen: LoRA-fine-tune a small transformer (attention, MLP, tied embedding) with lorax.

A frozen random-init transformer block (stand-in for a pretrained checkpoint) learns to
reverse token sequences through rank-8 factors on its attention projections
(`DenseGeneral` kernels inside `MultiHeadDotProductAttention`), its MLP and the token
embedding, which also gives the logits through `embed.attend`. Shows `infer_layout`, the
`partition`/`combine` training path, `save_adapter`/`load_adapter` and `merge_params`.

    .venv/bin/python examples/flax_linen.py [--steps 150] [--seed 0] [--rank 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import flax.linen as nn
import jax
import numpy as np
import optax

import lorax

VOCAB, SEQ, DIM = 32, 8, 64
TARGETS = r"attn/(query|key|value|out)/kernel|mlp_(in|out)/kernel|embed/embedding"


class Transformer(nn.Module):
    """One pre-norm transformer block; logits through the tied token embedding."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, DIM, name="embed")
        x = embed(ids) + self.param("pos", nn.initializers.normal(0.5), (SEQ, DIM))
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(4 * DIM, name="mlp_in")(nn.LayerNorm()(x)))
        x = x + nn.Dense(DIM, name="mlp_out")(h)
        return embed.attend(nn.LayerNorm()(x))


def batch(rng, n):
    """Random token sequences; the target is each sequence reversed."""
    ids = rng.integers(0, VOCAB, (n, SEQ))
    return ids, ids[:, ::-1]


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    k_init, k_lora = jax.random.split(jax.random.PRNGKey(args.seed))
    rng = np.random.default_rng(args.seed)  # the data

    model = Transformer()
    eval_ids, eval_targets = batch(rng, 256)
    params = jax.jit(model.init)(k_init, eval_ids)["params"]
    apply = lambda p, ids: model.apply({"params": p}, ids)  # noqa: E731

    # Which weights get LoRA, and how each one factors (read off one abstract trace).
    spec = lorax.simple_spec(params, targets=TARGETS, rank=args.rank)
    spec = lorax.infer_layout(apply, params, spec, eval_ids)
    print(lorax.summary(params, spec))
    lora_params = lorax.init_lora(params, spec, k_lora)
    lora_apply = lorax.lora(apply, on_materialize="error")  # any dense fallback raises

    # The lean path: only the factors are differentiated and have optimizer state.
    base = jax.tree.map(np.array, params)  # host copy: W must not move
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
    acc = float((out.argmax(-1) == eval_targets).mean())
    print(f"held-out loss {before:.4f} -> {after:.4f}, reversal accuracy {acc:.1%}")

    # Only the factors go to disk; they go back onto the same base parameters.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        lorax.save_adapter(path, lora_params, spec)
        print(f"adapter: {os.path.getsize(path):,} bytes")
        loaded, _ = lorax.load_adapter(path, params)
    np.testing.assert_array_equal(predict(loaded, eval_ids), out)

    # Merged weights run in the unmodified model.
    merged = lorax.merge_params(loaded)
    merged_out = jax.jit(apply)(merged, eval_ids)
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
