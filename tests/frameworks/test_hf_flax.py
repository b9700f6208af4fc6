"""Hugging Face `transformers` Flax models, unmodified, through lorax.

Tiny random-init configs (no downloads): GPT-2 (Conv1D kernels stored (out, in) and
transposed in the forward pass, tied `wte` used both for the token lookup and, through
its transpose, for the logits), Llama (grouped-query attention, rotary embeddings,
gated MLP) and BERT (token-type and position lookups, pooler). Each goes through
`check_lora_model`: same outputs as the merged model, factor gradients equal to the
materialised reference, no materialisation, Adam steps that lower a loss with W fixed.

Needs the optional `hf` group (`bash scripts/test-hf`); skipped without `transformers`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

transformers = pytest.importorskip(
    "transformers",
    reason="needs transformers 4.57.x (the optional `hf` group): run `bash scripts/test-hf`",
)
if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
    pytest.skip(f"transformers {transformers.__version__} has no Flax models (needs 4.57.x)",
                allow_module_level=True)

from transformers.utils import logging as hf_logging  # noqa: E402

from .harness import check_lora_model  # noqa: E402

hf_logging.set_verbosity_error()  # the "Flax classes are deprecated" notice, once per model


def _random_params(model, seed: int = 0):
    """Random params for a model built with `_do_init=False`, drawn with numpy.

    Equivalent to `_do_init=True` for these tests (kernels and embeddings ~ N(0, 0.02²),
    norm scales around 1), without HF's eager init, which compiles every initialiser op
    one by one (~4 s of CPU per model, 10-25 s on a loaded 2-core box).
    """
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = path[-1].key
        x = rng.normal(0.0, 0.02 if name in ("kernel", "embedding") else 0.1, s.shape)
        if name in ("scale", "weight"):  # LayerNorm scale, Llama's RMSNorm weight
            x = x + 1.0
        return jnp.asarray(x, s.dtype)

    return jax.tree_util.tree_map_with_path(leaf, model.params_shape_tree)


# Batch of 2, length 8 (max_position_embeddings is 16); the second row ends in padding.
IDS = jnp.array([[5, 17, 3, 42, 8, 11, 29, 2], [7, 1, 33, 60, 4, 9, 0, 0]], jnp.int32)
MASK = jnp.array([[1] * 8, [1] * 6 + [0] * 2], jnp.int32)


def test_gpt2_lm_head_with_tied_embedding():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.FlaxGPT2LMHeadModel(cfg, seed=0, _do_init=False)
    assert cfg.tie_word_embeddings

    def apply(params, ids, mask):
        return model(ids, attention_mask=mask, params=params).logits

    lp = check_lora_model(apply, _random_params(model), (IDS, MASK),
                          r"(c_attn|c_proj|c_fc)/kernel|wte/embedding", expected_lora=9)
    h0 = lp["transformer"]["h"]["0"]
    # Conv1D kernels are (out, in) and used as x @ kernel.T: b on the out side.
    assert h0["attn"]["c_attn"]["kernel"].b.shape == (48, 2)
    assert h0["attn"]["c_attn"]["kernel"].a.shape == (2, 16)
    assert lp["transformer"]["wte"]["embedding"].b.shape == (64, 2)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_llama_causal_lm(dora):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )
    model = transformers.FlaxLlamaForCausalLM(cfg, seed=0, _do_init=False)

    def apply(params, ids, mask):
        return model(ids, attention_mask=mask, params=params).logits

    lp = check_lora_model(
        apply, _random_params(model), (IDS, MASK),
        r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|lm_head)/kernel",
        expected_lora=15, **(dict(dora=True, rtol=1e-5, atol=1e-5) if dora else {}))
    attn = lp["model"]["layers"]["0"]["self_attn"]
    assert attn["k_proj"]["kernel"].a.shape == (2, 16)  # GQA: 2 kv heads x head_dim 8
    if dora:
        assert attn["k_proj"]["kernel"].m.shape == (1, 16)


def test_bert_model():
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16,
    )
    model = transformers.FlaxBertModel(cfg, seed=0, _do_init=False)
    token_types = jnp.array([[0] * 4 + [1] * 4, [0] * 3 + [1] * 5], jnp.int32)

    def apply(params, ids, mask, token_types):
        out = model(ids, attention_mask=mask, token_type_ids=token_types, params=params)
        return out.last_hidden_state, out.pooler_output

    check_lora_model(apply, _random_params(model), (IDS, MASK, token_types),
                     r"(query|key|value|dense)/kernel", expected_lora=13)

