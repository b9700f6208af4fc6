"""Hugging Face Flax: LoRA-fine-tune a tiny GPT-2 (`FlaxGPT2LMHeadModel`) with lorax.

A random-init 2-layer GPT-2 (no download) learns a small character-level corpus through
rank-8 factors on its attention (`c_attn`, `c_proj`) and MLP (`c_fc`, `c_proj`) kernels
and on the token embedding `wte`, which GPT-2 ties to the output logits. HF's GPT-2
stores the `Conv1D` kernels as `(out, in)` and transposes them in the forward pass;
`infer_layout` reads that off the model, nothing is configured by hand. The model is
called as usual, `model(ids, params=params)`, inside `lorax.lora`.

Needs `transformers` 4.57 (the last release with Flax models), which is not in the main
environment: `pip install 'transformers~=4.57'` or `poetry install --with hf`. Without
it the example says so and exits 0.

    .venv/bin/python examples/hf_flax.py [--steps 150] [--seed 0] [--rank 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import numpy as np
import optax

import lorax

try:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the "Flax classes are deprecated" notice
except ImportError:
    transformers = None

CORPUS = ("the quick brown fox jumps over the lazy dog. "
          "pack my box with five dozen liquor jugs. "
          "how vexingly quick daft zebras jump! ")
CHARS = sorted(set(CORPUS))
SEQ = 32
TARGETS = r"(c_attn|c_proj|c_fc)/kernel|wte/embedding"


def batch(rng, data, n):
    """Random windows of the corpus: inputs and the next character of each position."""
    starts = rng.integers(0, len(data) - SEQ - 1, (n, 1))
    windows = data[starts + np.arange(SEQ + 1)]
    return windows[:, :-1], windows[:, 1:]


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def main(argv: list[str] | None = None) -> dict[str, float] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if transformers is None or not hasattr(transformers, "FlaxGPT2LMHeadModel"):
        print("hf_flax.py needs transformers 4.57 with its Flax models: "
              "pip install 'transformers~=4.57' (or poetry install --with hf). Skipping.")
        return None
    k_init, k_lora = jax.random.split(jax.random.PRNGKey(args.seed))
    rng = np.random.default_rng(args.seed)  # the data

    config = transformers.GPT2Config(vocab_size=len(CHARS), n_positions=SEQ, n_embd=64,
                                     n_layer=2, n_head=4)
    model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False)
    params = jax.jit(model.init_weights, static_argnums=1)(k_init, (1, SEQ))
    apply = lambda params, ids: model(ids, params=params).logits  # noqa: E731
    data = np.array([CHARS.index(c) for c in CORPUS * 4])
    eval_ids, eval_targets = batch(rng, data, 64)

    spec = lorax.simple_spec(params, targets=TARGETS, rank=args.rank)
    spec = lorax.infer_layout(apply, params, spec, eval_ids)
    print(lorax.summary(params, spec))
    lora_params = lorax.init_lora(params, spec, k_lora)
    lora_apply = lorax.lora(apply, on_materialize="error")

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
        ids, targets = batch(rng, data, args.batch)
        loss, trainable, opt_state = step(trainable, frozen, opt_state, ids, targets)
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.4f}")
    lora_params = lorax.combine(trainable, frozen)
    out = predict(lora_params, eval_ids)
    after = float(xent(out, eval_targets))
    acc = float((out.argmax(-1) == eval_targets).mean())
    print(f"held-out loss {before:.4f} -> {after:.4f}, next-character accuracy {acc:.1%}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        lorax.save_adapter(path, lora_params, spec, metadata={"base": "tiny random GPT-2"})
        print(f"adapter: {os.path.getsize(path):,} bytes")
        loaded, _ = lorax.load_adapter(path, params)
    np.testing.assert_array_equal(predict(loaded, eval_ids), out)

    # Merged params are an ordinary HF params dict: `model(ids, params=merged)`.
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
