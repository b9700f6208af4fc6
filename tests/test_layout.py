"""infer_layout reads each weight's factorisation off real model code."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import lorax
from conftest import assert_close


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)
        return x + nn.Dense(x.shape[-1])(h), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(6, (3, 3))(x)
        x = x.reshape(x.shape[0], -1, 6)
        scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                          length=3)
        x, _ = scanned()(x, None)
        return x


def _flax():
    model = Stack()
    x = jnp.ones((2, 4, 4, 3))
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    return apply, params, x


def test_flax_layouts_inferred():
    apply, params, x = _flax()
    spec = lorax.simple_spec(params, targets="kernel", rank=2)
    spec = lorax.infer_layout(apply, params, spec, x)
    attn = spec["ScanBlock_0"]["MultiHeadDotProductAttention_0"]
    # Stacked (layers, embed, heads, head_dim): per-layer, embed -> k -> heads x head_dim.
    assert params["ScanBlock_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"].shape == (3, 6, 2, 4)
    assert attn["query"]["kernel"] == lorax.LoraSpec(2, batch_ndim=1, m_ndim=1)
    # Stacked (layers, heads, head_dim, embed): heads x head_dim -> k -> embed.
    assert attn["out"]["kernel"] == lorax.LoraSpec(2, batch_ndim=1, m_ndim=2)
    assert spec["ScanBlock_0"]["Dense_0"]["kernel"] == lorax.LoraSpec(2, batch_ndim=1, m_ndim=1)
    # Conv (3, 3, in, out): window x in -> k -> out.
    assert spec["Conv_0"]["kernel"] == lorax.LoraSpec(2, batch_ndim=0, m_ndim=3)

    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    q = lp["ScanBlock_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
    assert q.b.shape == (3, 6, 2) and q.a.shape == (3, 2, 2, 4)
    # ... and the model then runs without materialising anything.
    lp = jax.tree.map(lambda t: t, lp)
    lw = lp["ScanBlock_0"]["Dense_0"]["kernel"]
    lp["ScanBlock_0"]["Dense_0"]["kernel"] = lorax.LoraWeight(lw.w, lw.a, lw.b + 0.1)
    out = lorax.lora(apply, on_materialize="error")(lp, x)
    assert_close(out, apply(lorax.merge_params(lp), x), rtol=1e-4, atol=1e-5)


def test_equinox_out_in_weight_and_tied_embedding():
    lin = eqx.nn.Linear(8, 5, key=jax.random.PRNGKey(0))  # weight (out, in), used as W @ x
    emb = jnp.zeros((20, 8))

    def f(params, ids):
        h = params["emb"][ids]
        h = jax.vmap(params["lin"])(h)
        return h @ params["lin"].weight @ params["emb"].T  # tied logits

    params = {"lin": lin, "emb": emb}
    spec = jax.tree.map(lambda x: 0, params)
    spec = eqx.tree_at(lambda s: (s["lin"].weight, s["emb"]), spec, (2, 3))
    spec = lorax.infer_layout(f, params, spec, jnp.array([1, 2, 3]))
    assert spec["emb"] == lorax.LoraSpec(3, batch_ndim=0, m_ndim=1)
    assert spec["lin"].weight == lorax.LoraSpec(2, batch_ndim=0, m_ndim=1)


def test_explicit_values_win_and_unusable_layouts_fail_with_path():
    def f(params, x):
        return jnp.einsum("bh,hob->o", x, params["odd"]) + jnp.sum(params["unused"])

    params = {"odd": jnp.zeros((2, 4, 3)), "unused": jnp.zeros((4, 4))}
    explicit = {"odd": lorax.LoraSpec(1, batch_ndim=0, m_ndim=2), "unused": lorax.LoraSpec(1, batch_ndim=0, m_ndim=1)}
    assert lorax.infer_layout(f, params, explicit, jnp.ones((3, 2))) == explicit
    # Contracting axes 0 and 2 and keeping 1: M = (0, 2), not contiguous, is a factorisation.
    got = lorax.infer_layout(f, params, {"odd": 1, "unused": 0}, jnp.ones((3, 2)))["odd"]
    assert (got.batch_ndim, got.m_ndim, got.m_axes) == (0, 2, (0, 2))

    def g(params, x):  # a dot batch dimension that is not a leading axis of the weight
        return jnp.einsum("bh,hob->bo", x, params["odd"])

    with pytest.raises(ValueError, match=r"'odd'.*axes \[2\] as batch axes, which are not leading"):
        lorax.infer_layout(g, params, {"odd": 1, "unused": 0}, jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="'unused'.*never reaches"):
        lorax.infer_layout(f, params, {"odd": 0, "unused": 1}, jnp.ones((3, 2)))
