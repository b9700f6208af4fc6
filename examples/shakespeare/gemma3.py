"""Gemma 3 (text) in plain JAX, as llama.cpp computes it from a GGUF file.

What differs from `llama.py`: RMSNorm on each head's queries and keys (QK-norm); the
attention and feed-forward outputs are normed again before their residual add; five of
every six layers attend within a sliding window (rope base 10000), the sixth globally
(the file's rope base, 1e6); `head_dim` is its own number (256, not dim / heads);
queries scaled by `head_dim ** -0.5`; the embedding scaled by `sqrt(dim)` on the way in;
a GELU (tanh) gated feed-forward; the output tied to the embedding. The norm weights
are used as the GGUF stores them: llama.cpp's converter already added Gemma's `1 +`.

`params["layers"]` is a list of per-layer dicts run by a Python loop (each layer
rematerialised in the backward pass as `cfg.remat` says, as under `llama.py`'s scan): in a Q4_K_M file the
layers of one projection have different block types, which one stack cannot hold.
Attention (sliding windows included), the remat choice, the loss and sampling are
`llama.py`'s.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import llama
from .llama import rms_norm, rope


class Config(NamedTuple):
    n_layers: int
    dim: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float  # global layers
    rope_theta_local: float  # sliding-window layers
    window: int
    sliding: tuple  # per layer: True for a sliding-window layer
    norm_eps: float
    vocab: int
    attention: str = "auto"  # as llama.Config's
    remat: str = "layer"


def block(cfg: Config, sliding: bool, x, layer):
    b, t, _ = x.shape
    eps, hd = cfg.norm_eps, cfg.head_dim
    theta = cfg.rope_theta_local if sliding else cfg.rope_theta
    h = rms_norm(x, layer["attn_norm"], eps)
    q = rms_norm((h @ layer["q"]).reshape(b, t, cfg.n_heads, hd), layer["q_norm"], eps)
    k = rms_norm((h @ layer["k"]).reshape(b, t, cfg.n_kv_heads, hd), layer["k_norm"], eps)
    v = (h @ layer["v"]).reshape(b, t, cfg.n_kv_heads, hd)
    q = rope(q, theta) * hd ** -0.5
    att = llama.attention(q, rope(k, theta), v, window=cfg.window if sliding else None,
                          scale=1.0, implementation=cfg.attention) @ layer["o"]
    x = x + rms_norm(att, layer["post_attn_norm"], eps)
    h = rms_norm(x, layer["mlp_norm"], eps)
    f = (jax.nn.gelu(h @ layer["gate"], approximate=True) * (h @ layer["up"])) @ layer["down"]
    return x + rms_norm(f, layer["post_mlp_norm"], eps)


def hidden_states(cfg: Config, params, tokens):
    """Final-norm hidden states, (B, T, dim)."""
    x = params["embed"][tokens] * jnp.sqrt(jnp.float32(cfg.dim))
    for sliding, layer in zip(cfg.sliding, params["layers"]):
        x = llama.remat(cfg, functools.partial(block, cfg, sliding))(x, layer)
    return rms_norm(x, params["final_norm"], cfg.norm_eps)


def logits(cfg: Config, params, tokens):
    """`(B, T, vocab)` logits through the tied embedding."""
    return hidden_states(cfg, params, tokens) @ params["embed"].T


def loss(cfg: Config, params, windows):
    """Mean next-token cross-entropy over `(B, T + 1)` token windows (`llama.tied_loss`)."""
    h = hidden_states(cfg, params, windows[:, :-1])
    return llama.tied_loss(h, params["embed"], windows[:, 1:], cfg.vocab)


def generate(cfg: Config, params, prompt, n_new: int, key, temperature=1.0, top_p=0.9):
    """Sample `n_new` tokens after `prompt`, as `llama.generate` does."""
    return llama.sample_loop(functools.partial(hidden_states, cfg), params, prompt, n_new, key,
                             temperature, top_p)
