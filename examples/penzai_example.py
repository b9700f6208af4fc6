"""penzai: LoRA-fine-tune a layer-stacked llamalike transformer with named-axis parameters.

`pz.unbind_params(model, freeze=True)` splits a penzai model into an unbound model and its
parameter values (named arrays); binding them again inside a `lorax.lora`-wrapped function
runs the unmodified model. The values go in as a dict keyed by parameter label, so targets
read like `"transformer/blocks/attention/query.weights"`; the `blocks` axis of the layer
stack gets per-layer factors, and the tied embedding one update for both of its uses. The
model learns to continue repeating patterns; the merged values bind into an ordinary
penzai model at the end.

    .venv/bin/python examples/penzai_example.py [--steps 150] [--seed 0] [--rank 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz
from penzai.models.transformer.variants import llamalike_common

import lorax

VOCAB, SEQ, PERIOD = 32, 8, 3
TARGETS = r"(query|key|value|output|gating_linear|value_linear|out_linear)\.weights|embeddings"


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

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=64, projection_dim=16,
        mlp_hidden_dim=128, num_decoder_blocks=2, vocab_size=VOCAB, mlp_variant="swiglu",
        tie_embedder_and_logits=True, use_layer_stack=True)
    model = llamalike_common.build_llamalike_transformer(
        config, init_base_rng=jax.random.PRNGKey(args.seed))
    unbound, values = pz.unbind_params(model, freeze=True)
    params = {v.label: v.value for v in values}

    def bind(params):
        return unbound.bind_variables([dataclasses.replace(v, value=params[v.label]) for v in values])

    def apply(params, ids):
        tokens = pz.nx.wrap(ids, "batch", "seq")
        return bind(params)(tokens).unwrap("batch", "seq", "vocabulary")

    eval_ids, eval_targets = batch(rng, 256)
    spec = lorax.simple_spec(params, targets=TARGETS, rank=args.rank)
    spec = lorax.infer_layout(apply, params, spec, eval_ids)
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

    # Merged values bind into an ordinary penzai model.
    tuned = bind(lorax.merge_params(loaded))
    merged_out = jax.jit(lambda ids: tuned(pz.nx.wrap(ids, "batch", "seq")).unwrap(
        "batch", "seq", "vocabulary"))(jnp.asarray(eval_ids))
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
