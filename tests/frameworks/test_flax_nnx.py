"""Flax NNX modules through nnx.split / nnx.merge, unmodified, through lorax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .harness import check_lora_model


def _check(model, args, targets, **kw):
    graphdef, state = nnx.split(model)

    def apply(state, *args):
        return nnx.merge(graphdef, state)(*args)

    return check_lora_model(apply, state, args, targets, **kw)


def test_linear_and_linear_general():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(6, 8, rngs=rngs)
            self.gen = nnx.LinearGeneral(8, (2, 4), rngs=rngs)

        def __call__(self, x):
            return self.gen(jax.nn.relu(self.lin(x)))

    _check(M(nnx.Rngs(0)), (jnp.ones((3, 6)),), "kernel", expected_lora=2)


def test_conv_and_embed():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(20, 4, rngs=rngs)
            self.conv = nnx.Conv(4, 6, kernel_size=(3,), rngs=rngs)

        def __call__(self, ids):
            return self.conv(self.embed(ids))

    _check(M(nnx.Rngs(0)), (jnp.array([[1, 2, 3, 19]]),), "kernel|embedding", expected_lora=2)


def test_multi_head_attention():
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                 rngs=nnx.Rngs(0))
    _check(mha, (jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8)),), "kernel", expected_lora=4)


class _EmbedConvGeneral(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(20, 8, rngs=rngs)
        self.conv = nnx.Conv(8, 8, kernel_size=(3,), rngs=rngs)
        self.gen = nnx.LinearGeneral(8, (2, 4), rngs=rngs)

    def __call__(self, ids):
        return self.gen(jax.nn.relu(self.conv(self.embed(ids))))


def test_qlora_on_an_int8_base():
    _check(_EmbedConvGeneral(nnx.Rngs(0)), (jnp.array([[1, 2, 3, 19]]),), "kernel",
           expected_lora=2, quantize="int8")


def test_dora():
    _check(_EmbedConvGeneral(nnx.Rngs(0)), (jnp.array([[1, 2, 3, 19]]),), "kernel|embedding",
           expected_lora=3,
           dora=True, rtol=1e-5, atol=1e-5)
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8, decode=False,
                                 rngs=nnx.Rngs(0))
    _check(mha, (jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8)),), "kernel",
           expected_lora=4, dora=True, rtol=1e-5, atol=1e-5)
