"""Equinox models, unmodified, through lorax (weights are `(out, in)`, used as `W @ x`)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .harness import check_lora_model


def _check(model, args, targets, call=None, **kw):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    call = call or (lambda m, *a: jax.vmap(m)(*a))

    def apply(p, *a):
        return call(eqx.combine(p, static), *a)

    return check_lora_model(apply, params, args, targets, **kw)


def test_mlp():
    mlp = eqx.nn.MLP(6, 3, width_size=16, depth=2, key=jax.random.PRNGKey(0))
    _check(mlp, (jnp.ones((4, 6)),), "weight", expected_lora=3)


def test_conv2d():
    conv = eqx.nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1, key=jax.random.PRNGKey(0))
    lp = _check(conv, (jnp.ones((2, 3, 8, 8)),), "weight", expected_lora=1)
    assert lp.weight.b.shape == (8, 2)  # OIHW: out <- k <- in x window


def test_multihead_attention():
    mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=jax.random.PRNGKey(0))
    x = jnp.ones((2, 5, 8))
    _check(mha, (x,), "weight", call=lambda m, x: jax.vmap(lambda t: m(t, t, t))(x),
           expected_lora=4)


def test_embedding():
    emb = eqx.nn.Embedding(30, 8, key=jax.random.PRNGKey(0))
    _check(emb, (jnp.array([0, 5, 29]),), "weight", rank=3, expected_lora=1)


def test_qlora_on_an_int8_base():
    mlp = eqx.nn.MLP(8, 3, width_size=16, depth=2, key=jax.random.PRNGKey(0))
    _check(mlp, (jnp.ones((4, 8)),), "weight", expected_lora=3, quantize="int8")
    emb = eqx.nn.Embedding(30, 8, key=jax.random.PRNGKey(0))
    _check(emb, (jnp.array([0, 5, 29]),), "weight", rank=3, expected_lora=1, quantize="int8")


def test_dora():
    """DoRA on `(out, in)` weights: infer_layout sees `W @ x`, so each magnitude runs
    along the output rows (the torch convention), for Linear, Conv2d and attention."""
    mlp = eqx.nn.MLP(6, 3, width_size=16, depth=2, key=jax.random.PRNGKey(0))
    lp = _check(mlp, (jnp.ones((4, 6)),), "weight", expected_lora=3, dora=True, rtol=1e-5,
                atol=1e-5)
    assert lp.layers[0].weight.m.shape == (16, 1)
    conv = eqx.nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1, key=jax.random.PRNGKey(0))
    lp = _check(conv, (jnp.ones((2, 3, 8, 8)),), "weight", expected_lora=1, dora=True,
                rtol=1e-5, atol=1e-5)
    assert lp.weight.m.shape == (8, 1, 1, 1)
    mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=jax.random.PRNGKey(0))
    _check(mha, (jnp.ones((2, 5, 8)),), "weight",
           call=lambda m, x: jax.vmap(lambda t: m(t, t, t))(x), expected_lora=4, dora=True,
           rtol=1e-5, atol=1e-5)
