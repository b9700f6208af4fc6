"""Flax NNX: LoRA-fine-tune a small causal transformer through `nnx.split` / `nnx.merge`.

lorax works on the pure half of an NNX module: `nnx.split` gives a graph definition and
a `State` pytree, `lorax.init_lora` puts `LoraWeight`s into that state, and
`nnx.merge(graphdef, state)(x)` inside a `lorax.lora`-wrapped function runs the
unmodified module. The frozen random-init model (`Embed`, causal `MultiHeadAttention`,
`Linear` MLP, logits through `embed.attend`) learns to continue repeating
patterns; the merged state goes back into an ordinary module at the end.

    .venv/bin/python examples/flax_nnx.py [--steps 150] [--seed 0] [--rank 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import numpy as np
import optax
from flax import nnx

import lorax

VOCAB, SEQ, DIM, PERIOD = 32, 8, 64, 3


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.pos = nnx.Param(0.5 * jax.random.normal(rngs.params(), (SEQ, DIM)))
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=DIM, decode=False, rngs=rngs)
        self.mlp_in = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * DIM, DIM, rngs=rngs)
        self.norm1, self.norm2, self.norm3 = (nnx.LayerNorm(DIM, rngs=rngs) for _ in range(3))

    def __call__(self, ids):
        x = self.embed(ids) + self.pos[...]
        x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(ids))
        x = x + self.mlp_out(nnx.gelu(self.mlp_in(self.norm2(x))))
        return self.embed.attend(self.norm3(x))


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

    graphdef, state = nnx.split(Transformer(nnx.Rngs(args.seed)))
    apply = lambda state, ids: nnx.merge(graphdef, state)(ids)  # noqa: E731
    eval_ids, eval_targets = batch(rng, 256)

    # State paths read like "attn/query/kernel/value".
    spec = lorax.simple_spec(state, targets=r"(attn|mlp_in|mlp_out)/.*kernel|embed/embedding",
                             rank=args.rank)
    spec = lorax.infer_layout(apply, state, spec, eval_ids)
    print(lorax.summary(state, spec))
    lora_state = lorax.init_lora(state, spec, jax.random.PRNGKey(args.seed))
    lora_apply = lorax.lora(apply, on_materialize="error")

    base = jax.tree.map(np.array, state)  # host copy: W must not move
    trainable, frozen = lorax.partition(lora_state, spec)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)

    @jax.jit
    def step(trainable, frozen, opt_state, ids, targets):
        loss, grads = jax.value_and_grad(
            lambda t: xent(lora_apply(lorax.combine(t, frozen), ids), targets))(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state

    predict = jax.jit(lora_apply)
    before = float(xent(predict(lora_state, eval_ids), eval_targets))
    for i in range(args.steps):
        loss, trainable, opt_state = step(trainable, frozen, opt_state, *batch(rng, args.batch))
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.4f}")
    lora_state = lorax.combine(trainable, frozen)
    out = predict(lora_state, eval_ids)
    after = float(xent(out, eval_targets))
    # Only the tokens after the first period are predictable.
    acc = float((out.argmax(-1) == eval_targets)[:, PERIOD - 1 :].mean())
    print(f"held-out loss {before:.4f} -> {after:.4f}, next-token accuracy {acc:.1%}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        lorax.save_adapter(path, lora_state, spec)
        print(f"adapter: {os.path.getsize(path):,} bytes")
        loaded, _ = lorax.load_adapter(path, state)
    np.testing.assert_array_equal(predict(loaded, eval_ids), out)

    # Merged weights make an ordinary NNX module again.
    tuned = nnx.merge(graphdef, lorax.merge_params(loaded))
    merged_out = nnx.jit(lambda m, ids: m(ids))(tuned, eval_ids)
    diff = float(np.abs(np.asarray(merged_out) - np.asarray(out)).max())
    is_lora = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    frozen_ok = all(jax.tree.leaves(jax.tree.map(
        lambda lw, w: np.array_equal(lw.w, w) if is_lora(lw) else True,
        lora_state, base, is_leaf=is_lora)))
    print(f"adapter reloaded bit-exact; merged vs LoRA max diff {diff:.2e}; "
          f"frozen weights unchanged: {frozen_ok}")
    assert after < before, (before, after)
    assert diff < 1e-4 and frozen_ok
    return {"loss_before": before, "loss_after": after, "accuracy": acc, "merge_diff": diff}


if __name__ == "__main__":
    main()
