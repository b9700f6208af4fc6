"""The main job's attention in query chunks: the same values and gradients as one
softmax over all the queries, with no `(T, T)` score matrix in the program."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from conftest import assert_close
from examples.shakespeare import llama

B, T, H, KV, D = 2, 64, 8, 2, 16


def _qkv():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k1, (B, T, H, D)), jax.random.normal(k2, (B, T, KV, D)),
            jax.random.normal(k3, (B, T, KV, D)))


def _value_and_grads(qkv):
    return jax.value_and_grad(lambda q, k, v: jnp.sum(llama.attention(q, k, v) ** 2),
                              argnums=(0, 1, 2))(*qkv)


def _reference(q, k, v):
    """Causal GQA written out whole, independent of the chunking code."""
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(D)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v).reshape(B, T, H * D)


@pytest.mark.parametrize("chunk", [T, 16, 8])
def test_chunked_attention_equals_whole_causal_attention(monkeypatch, chunk):
    monkeypatch.setattr(llama, "QUERY_CHUNK", chunk)
    qkv = _qkv()
    assert_close(llama.attention(*qkv), _reference(*qkv), rtol=1e-5, atol=1e-6)
    value, grads = _value_and_grads(qkv)
    ref_value, ref_grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(_reference(q, k, v) ** 2), argnums=(0, 1, 2))(*qkv)
    assert_close(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, rtol=1e-4, atol=1e-5)


def _square_shapes(jaxpr) -> list:
    shapes = []
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes += _square_shapes(sub)
        shapes += [v.aval.shape for v in eqn.outvars
                   if len(v.aval.shape) >= 2 and v.aval.shape[-2:] == (T, T)]
    return shapes


@pytest.mark.parametrize("chunk, whole", [(16, False), (T, True)])
def test_chunks_keep_the_score_matrix_from_being_whole(monkeypatch, chunk, whole):
    monkeypatch.setattr(llama, "QUERY_CHUNK", chunk)
    # A new function each time: JAX caches a traced function's jaxpr by identity.
    jaxpr = jax.make_jaxpr(lambda qkv: _value_and_grads(qkv))(_qkv()).jaxpr
    assert bool(_square_shapes(jaxpr)) == whole  # whole: the unchunked control
