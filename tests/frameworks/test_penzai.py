"""penzai models with their parameters unbound (`pz.unbind_params(..., freeze=True)`) and
bound again inside the LoRA-wrapped function, unmodified: the llamalike transformer with
named-axis parameters, layer-stacked (per-layer factors on the `blocks` axis) and plain,
with tied embeddings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

penzai = pytest.importorskip("penzai")

from penzai import pz  # noqa: E402
from penzai.models.transformer.variants import llamalike_common  # noqa: E402

import lorax  # noqa: E402

from .harness import check_lora_model  # noqa: E402

TARGETS = r"(query|key|value|output|gating_linear|value_linear|out_linear)\.weights|embeddings"


def _llamalike(stacked: bool):
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=2, query_head_multiplier=2, embedding_dim=16, projection_dim=8,
        mlp_hidden_dim=32, num_decoder_blocks=2, vocab_size=32, mlp_variant="swiglu",
        tie_embedder_and_logits=True, use_layer_stack=stacked)
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.PRNGKey(0))
    unbound, values = pz.unbind_params(model, freeze=True)

    def apply(params, tokens):  # params: {label: NamedArray}
        bound = unbound.bind_variables(
            [dataclasses.replace(v, value=params[v.label]) for v in values])
        return bound(tokens).unwrap("batch", "seq", "vocabulary")

    return apply, {v.label: v.value for v in values}


TOKENS = pz.nx.wrap(jnp.array([[1, 2, 3, 4]]), "batch", "seq")


@pytest.mark.slow  # CI time; penzai's other tests stay
def test_layer_stacked_llamalike_with_tied_embeddings():
    apply, params = _llamalike(stacked=True)
    lp = check_lora_model(apply, params, (TOKENS,), TARGETS, rank=2, expected_lora=8)
    q = lp["transformer/blocks/attention/query.weights"].data_array
    assert q.structure[0] == 1 and q.b.shape[:2] == (2, 16)  # per-layer factors, embed -> k


@pytest.mark.slow
def test_plain_llamalike():
    apply, params = _llamalike(stacked=False)
    check_lora_model(apply, params, (TOKENS,), TARGETS, rank=2, expected_lora=15)


def test_infer_layout_same_on_the_second_call():
    """penzai's `NamedArray.__getitem__` (the embedding lookup) is a module-level
    `jax.jit`: an untied embedding table reaches its gather only inside that nested jit,
    which quax caches. Both calls must record the lookup (found by the frameworks work:
    before the fix, the second call raised "it never reaches a dot_general, conv or gather")."""
    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=1, query_head_multiplier=1, embedding_dim=4, projection_dim=2,
        mlp_hidden_dim=4, num_decoder_blocks=1, vocab_size=11, mlp_variant="swiglu",
        tie_embedder_and_logits=False)
    body, frozen = pz.unbind_params(
        llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0)),
        freeze=True)
    params = {p.label: p for p in frozen}
    apply = lambda p, t: pz.bind_variables(body, list(p.values()))(t).data_array  # noqa: E731
    tokens = pz.nx.wrap(jnp.array([[1, 2, 3]]), "batch", "seq")
    spec = lorax.simple_spec(params, targets="embedder", rank=2)
    # (penzai's NamedArray overloads `==` elementwise: compare the spec values.)
    first = jax.tree.leaves(lorax.infer_layout(apply, params, spec, tokens))
    assert lorax.LoraSpec(2, batch_ndim=0, m_ndim=1) in first
    for _ in range(3):
        assert jax.tree.leaves(lorax.infer_layout(apply, params, spec, tokens)) == first
