"""Flax linen layers, unmodified, through lorax."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from .harness import check_lora_model


def _check(module, x, targets, **kw):
    params = module.init(jax.random.PRNGKey(0), x)["params"]
    apply = lambda p, x: module.apply({"params": p}, x)  # noqa: E731
    return check_lora_model(apply, params, (x,), targets, **kw)


def test_dense_and_layernorm():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(nn.LayerNorm()(nn.relu(nn.Dense(16)(x))))

    _check(M(), jnp.ones((3, 8)), r"Dense_\d/kernel", expected_lora=2)


def test_dense_general_multi_axis():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.DenseGeneral((2, 4), axis=-1)(x)  # (b, s, 2, 4)
            return nn.DenseGeneral(6, axis=(-2, -1))(h)

    lp = _check(M(), jnp.ones((2, 3, 8)), "kernel", expected_lora=2)
    assert lp["DenseGeneral_0"]["kernel"].a.shape == (2, 2, 4)
    assert lp["DenseGeneral_1"]["kernel"].b.shape == (2, 4, 2)


def test_conv():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(8, (3, 3), strides=2, padding="SAME")(x)
            return nn.Conv(4, (3,), kernel_dilation=2, padding="VALID")(x.reshape(x.shape[0], -1, 8))

    _check(M(), jnp.ones((2, 8, 8, 3)), "kernel", expected_lora=2)


def test_embed_and_tied_attend():
    class M(nn.Module):
        @nn.compact
        def __call__(self, ids):
            embed = nn.Embed(50, 16)
            h = nn.tanh(embed(ids))
            return embed.attend(h)

    _check(M(), jnp.array([[1, 2, 3], [4, 5, 49]]), "embedding", rank=3, expected_lora=1)


def test_multi_head_attention():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)

    lp = _check(M(), jnp.ones((2, 5, 6)), "kernel", expected_lora=4)
    attn = lp["MultiHeadDotProductAttention_0"]
    assert attn["query"]["kernel"].b.shape == (6, 2)  # embed -> k -> heads x head_dim
    assert attn["out"]["kernel"].b.shape == (2, 4, 2)  # heads x head_dim -> k -> embed


class Block(nn.Module):  # the name shows in the params' keys: ScanCheckpointBlock_0
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(12)(x))), None


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=3)
        return stack()(x, None)[0]


class _TiedEmbedConvGeneral(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(50, 16)
        h = nn.tanh(embed(ids))
        h = nn.Conv(16, (3,), padding="SAME")(h)
        h = nn.DenseGeneral((2, 8), axis=-1)(h)
        return embed.attend(nn.DenseGeneral(16, axis=(-2, -1))(h))


def test_scanned_and_rematted_layers():
    lp = _check(_Scanned(), jnp.ones((2, 6)), "kernel", expected_lora=2)
    k = lp["ScanCheckpointBlock_0"]["Dense_0"]["kernel"]
    assert k.b.shape == (3, 12, 2) and k.a.shape == (3, 2, 6)  # per-layer factors


def test_qlora_dense_conv_embed_on_an_int8_base():
    _check(_TiedEmbedConvGeneral(), jnp.array([[1, 2, 3], [4, 5, 49]]), "kernel",
           expected_lora=3, quantize="int8")


def test_dora_dense_general_conv_tied_embedding_scan():
    """DoRA (every target a DoraWeight) through Flax modules: multi-axis DenseGeneral
    kernels (magnitude per output head x feature), convs (per output channel), a tied
    embedding (lookups and `attend`'s logits, which contract the magnitude's axis) and
    scanned, rematted layers (per-layer magnitudes)."""
    lp = _check(_TiedEmbedConvGeneral(), jnp.array([[1, 2, 3], [4, 5, 49]]),
                "kernel|embedding", rank=3,
                expected_lora=4, dora=True, rtol=1e-5, atol=1e-5)
    assert lp["DenseGeneral_0"]["kernel"].m.shape == (1, 2, 8)
    assert lp["Embed_0"]["embedding"].m.shape == (1, 16)

    lp = _check(_Scanned(), jnp.ones((2, 6)), "kernel", expected_lora=2, dora=True, rtol=1e-5,
                atol=1e-5)
    assert lp["ScanCheckpointBlock_0"]["Dense_0"]["kernel"].m.shape == (3, 1, 6)  # (12, 6)
