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


def _windowed_reference(q, k, v, window, scale):
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    scores = jnp.where((j <= i) & (i - j < window), scores, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v).reshape(B, T, H * D)


@pytest.mark.parametrize("implementation", ["xla", "chunked", "auto"])
@pytest.mark.parametrize("window, scale", [(None, None), (5, 1.0), (20, 0.3)])
def test_every_implementation_gives_the_same_values_and_gradients(
        monkeypatch, implementation, window, scale):
    """`jax.nn.dot_product_attention`'s XLA path (cuDNN's stand-in off a GPU: the same
    function, the same arguments), the query chunks and `auto` (the chunks here) agree
    with the attention written out whole, sliding windows and explicit scales included."""
    monkeypatch.setattr(llama, "QUERY_CHUNK", 16)
    qkv = _qkv()
    ref_scale = D ** -0.5 if scale is None else scale
    ref = lambda q, k, v: _windowed_reference(q, k, v, window or T, ref_scale)  # noqa: E731
    att = lambda q, k, v: llama.attention(  # noqa: E731
        q, k, v, window=window, scale=scale, implementation=implementation)
    assert_close(att(*qkv), ref(*qkv), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    value, grads = jax.value_and_grad(loss(att), argnums=(0, 1, 2))(*qkv)
    ref_value, ref_grads = jax.value_and_grad(loss(ref), argnums=(0, 1, 2))(*qkv)
    assert_close(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_auto_picks_cudnn_only_where_it_applies(monkeypatch):
    q = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
    pick = llama._attention_implementation
    assert pick("auto", q) == "chunked"  # this machine has no GPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pick("auto", q) == "cudnn"
    assert pick("auto", q.astype(jnp.float32)) == "chunked"  # cuDNN: bf16/f16 only
    assert pick("auto", jnp.zeros((1, 8, 4, 256), jnp.bfloat16)) == "chunked"  # head dim
    assert pick("xla", q) == "xla"
    with pytest.raises(ValueError, match="'flash'.*expected one of"):
        pick("flash", q)


def _tiny_loss(remat, attention="auto"):
    cfg = llama.Config(2, 32, 64, 4, 2, 1e4, 1e-5, 50, attention=attention, remat=remat)
    key = jax.random.PRNGKey(3)
    shapes = dict(q=(32, 32), k=(32, 16), v=(32, 16), o=(32, 32), gate=(32, 64), up=(32, 64),
                  down=(64, 32), attn_norm=(32,), mlp_norm=(32,))
    layers = {n: 0.2 * jax.random.normal(jax.random.fold_in(key, i), (2, *s))
              for i, (n, s) in enumerate(shapes.items())}
    params = {"embed": jax.random.normal(key, (50, 32)), "final_norm": jnp.ones(32),
              "layers": layers}
    windows = jax.random.randint(key, (2, 17), 0, 50)
    return jax.value_and_grad(lambda p: llama.loss(cfg, p, windows))(params)


# "none" is slow (CI time): it differs from "dots" only in what it saves, not in the ops.
@pytest.mark.parametrize("remat", ["dots", pytest.param("none", marks=pytest.mark.slow), "offload"])
def test_remat_choices_change_no_value_or_gradient(remat):
    value, grads = _tiny_loss(remat)
    ref_value, ref_grads = _tiny_loss("layer")
    assert_close(value, ref_value, rtol=1e-6)
    jax.tree.map(lambda g, r: assert_close(g, r, rtol=1e-5), grads, ref_grads)


def test_remat_choices_keep_what_they_say():
    """What the backward pass keeps, read from the jaxpr: `layer` a remat per layer that
    saves no product, `dots` one that saves the products, `none` no remat at all."""
    def remats(remat):
        cfg = llama.Config(2, 32, 64, 4, 2, 1e4, 1e-5, 50, remat=remat)
        params = jax.eval_shape(lambda: {"embed": jnp.zeros((50, 32)), "final_norm": jnp.zeros(32),
                                         "layers": {n: jnp.zeros((2, *s)) for n, s in dict(
                                             q=(32, 32), k=(32, 16), v=(32, 16), o=(32, 32),
                                             gate=(32, 64), up=(32, 64), down=(64, 32),
                                             attn_norm=(32,), mlp_norm=(32,)).items()}})
        jaxpr = jax.make_jaxpr(lambda p: llama.hidden_states(cfg, p, jnp.zeros((1, 8), int)))(params)
        scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
        body = scan.params["jaxpr"].jaxpr
        return [e.params["policy"] for e in body.eqns if e.primitive.name.startswith("remat")]
    assert remats("layer") == [None]
    assert remats("dots") == [jax.checkpoint_policies.dots_with_no_batch_dims_saveable]
    assert remats("none") == []
    (offload,) = remats("offload")  # saves nothing on the device, the named input offloaded
    assert offload.__qualname__.startswith("save_and_offload_only_these_names")
    with pytest.raises(ValueError, match="remat 'some'"):
        remats("some")
