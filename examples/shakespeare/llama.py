"""A small Llama forward pass in plain JAX (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings).

Written with no LoRA in mind: parameters are a dict of arrays, dense kernels are
`(in, out)` and the per-layer ones are stacked along a leading layer axis and run
under `lax.scan`, so one layer is traced and compiled once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax


class Config(NamedTuple):
    n_layers: int
    dim: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    rope_theta: float
    norm_eps: float
    vocab: int


def rms_norm(x, w, eps):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, theta):
    """Rotary embedding, HF's half-split ("rotate_half") layout. x: (B, T, heads, head_dim)."""
    t, d = x.shape[1], x.shape[-1]
    freqs = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs  # (T, d/2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q, k, v):
    """Causal grouped-query attention. q: (B, T, H, d); k, v: (B, T, KV, d)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / jnp.sqrt(d).astype(q.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h * d)


def block(cfg: Config, x, layer):
    b, t, _ = x.shape
    head_dim = cfg.dim // cfg.n_heads
    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    q = rope((h @ layer["q"]).reshape(b, t, cfg.n_heads, head_dim), cfg.rope_theta)
    k = rope((h @ layer["k"]).reshape(b, t, cfg.n_kv_heads, head_dim), cfg.rope_theta)
    v = (h @ layer["v"]).reshape(b, t, cfg.n_kv_heads, head_dim)
    x = x + attention(q, k, v) @ layer["o"]
    h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
    return x + (jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]


def hidden_states(cfg: Config, params, tokens):
    """Final-norm hidden states, (B, T, dim)."""
    x = params["embed"][tokens]
    x, _ = lax.scan(lambda x, layer: (block(cfg, x, layer), None), x, params["layers"])
    return rms_norm(x, params["final_norm"], cfg.norm_eps)


def logits(cfg: Config, params, tokens):
    return hidden_states(cfg, params, tokens) @ params["embed"].T


def loss(cfg: Config, params, windows):
    """Mean next-token cross-entropy over `(B, T + 1)` token windows."""
    out = logits(cfg, params, windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(out, windows[:, 1:]).mean()


def generate(cfg: Config, params, prompt, n_new: int, key, temperature=0.8, top_k=40):
    """Sample `n_new` tokens after `prompt` (1-d int array), without a KV cache.

    Every step runs the whole fixed-length buffer; the causal mask keeps the unfilled
    tail from affecting earlier positions, so one compiled shape serves every step.
    """
    n_prompt = prompt.shape[0]
    buf = jnp.zeros(n_prompt + n_new, jnp.int32).at[:n_prompt].set(prompt)

    def step(i, carry):
        buf, key = carry
        h = hidden_states(cfg, params, buf[None])[0, i - 1]
        top, idx = lax.top_k(h @ params["embed"].T / temperature, top_k)
        key, sub = jax.random.split(key)
        return buf.at[i].set(idx[jax.random.categorical(sub, top)]), key

    buf, _ = lax.fori_loop(n_prompt, n_prompt + n_new, step, (buf, key))
    return buf[n_prompt:]
