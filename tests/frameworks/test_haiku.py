"""Haiku modules, unmodified, through lorax (including BatchNorm state)."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp

from .harness import check_lora_model


def _check(fn, x, targets, **kw):
    model = hk.without_apply_rng(hk.transform(fn))
    params = model.init(jax.random.PRNGKey(0), x)
    return check_lora_model(model.apply, params, (x,), targets, **kw)


def test_linear_and_mlp():
    _check(lambda x: hk.nets.MLP([16, 16, 4])(hk.Linear(8)(x)), jnp.ones((3, 6)), "w$",
           expected_lora=4)


def test_conv1d_conv2d():
    def fn(x):
        h = hk.Conv2D(6, 3, stride=2)(x)
        h = h.reshape(h.shape[0], -1, 6)
        return hk.Conv1D(4, 3, rate=2)(h)

    _check(fn, jnp.ones((2, 8, 8, 3)), "w$", expected_lora=2)


def test_embed_and_multi_head_attention():
    def fn(ids):
        h = hk.Embed(40, 8)(ids)
        return hk.MultiHeadAttention(num_heads=2, key_size=4, w_init_scale=1.0)(h, h, h)

    _check(fn, jnp.array([[1, 2, 3, 39]]), "embeddings|w$", expected_lora=5)


def test_resnet_with_batchnorm_state():
    def fn(x, is_training):
        net = hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=5,
                             channels_per_group=(4, 4, 4, 4), bottleneck=False)
        return net(x, is_training=is_training)

    model = hk.transform_with_state(fn)
    # Random input: with a constant image, batch-norm divides by a near-zero variance
    # and any rounding difference is amplified a thousandfold.
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 16, 16, 3))
    params, state = model.init(jax.random.PRNGKey(0), x, True)
    apply = lambda p, s, x: model.apply(p, s, None, x, True)  # noqa: E731
    check_lora_model(apply, params, (state, x), r"conv|logits/w", rtol=1e-3, atol=1e-4,
                     eager=False)


def test_qlora_on_an_int8_base():
    def fn(ids):
        h = hk.Embed(40, 8)(ids)
        h = hk.MultiHeadAttention(num_heads=2, key_size=4, w_init_scale=1.0)(h, h, h)
        return hk.nets.MLP([16, 8])(h)

    _check(fn, jnp.array([[1, 2, 3, 39]]), "w$", expected_lora=6, quantize="int8")


def test_dora():
    def fn(ids):
        h = hk.Embed(40, 8)(ids)
        h = hk.MultiHeadAttention(num_heads=2, key_size=4, w_init_scale=1.0)(h, h, h)
        h = hk.Conv1D(8, 3)(h)
        return hk.nets.MLP([16, 8])(h)

    _check(fn, jnp.array([[1, 2, 3, 39]]), "embeddings|w$", expected_lora=8, dora=True,
           rtol=1e-5, atol=1e-5)
