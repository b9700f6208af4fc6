"""LoRA dropout: `x @ W + s * (drop(x) @ b) @ a` with the documented masks, and no
dropout at all without a key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lorax
from conftest import assert_close

RATE = 0.3


def _mask_drop(x, key, rate=RATE):
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def _lora_params(shape, spec, seed=0):
    r = np.random.default_rng(seed)
    w = jnp.asarray(r.standard_normal(shape), jnp.float32)
    lp = lorax.init_lora({"w": w}, {"w": spec}, jax.random.PRNGKey(seed))
    lw = lp["w"]
    b = jnp.asarray(r.standard_normal(lw.b.shape), jnp.float32)
    return {"w": lorax.LoraWeight(lw.w, lw.a * 30, b, alpha=2.0)}


def _key(i=7):
    return jax.random.key(i)


def test_no_key_is_plain_lora():
    lp = _lora_params((8, 6), 3)
    assert lorax.dropout(lp, None, RATE) is lp
    assert lorax.dropout(lp, _key(), 0.0) is lp


def test_dense_matches_reference_mask_and_gradients():
    lp = _lora_params((8, 6), 3)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((5, 8)), jnp.float32)
    model = lambda p, x: jnp.tanh(x @ p["w"])  # noqa: E731
    lw = lp["w"]
    key = _key()

    def ref(a, b):
        xd = _mask_drop(x, jax.random.fold_in(key, 0))
        return jnp.tanh(x @ lw.w + lw.scale * (xd @ b) @ a)

    def ours(a, b):
        p = {"w": lorax.LoraWeight(lw.w, a, b, lw.alpha)}
        return lorax.lora(model, on_materialize="error")(lorax.dropout(p, key, RATE), x)

    assert_close(ours(lw.a, lw.b), ref(lw.a, lw.b), rtol=1e-5, atol=1e-5)
    assert_close(jax.jit(ours)(lw.a, lw.b), ref(lw.a, lw.b), rtol=1e-5, atol=1e-5)
    plain = lorax.lora(model)(lp, x)
    assert float(jnp.abs(plain - ref(lw.a, lw.b)).max()) > 1e-2  # the mask matters
    g = jax.grad(lambda a, b: ours(a, b).sum(), argnums=(0, 1))(lw.a, lw.b)
    g_ref = jax.grad(lambda a, b: ref(a, b).sum(), argnums=(0, 1))(lw.a, lw.b)
    for u, v in zip(g, g_ref):
        assert_close(u, v, rtol=1e-5, atol=1e-5)


def test_scan_draws_a_fresh_mask_per_layer():
    n_layers = 3
    lp = _lora_params((n_layers, 8, 8), lorax.LoraSpec(2, batch_ndim=1, m_ndim=1))
    lw = lp["w"]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8)), jnp.float32) 

    def model(p, x):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w / 3), None), x, p["w"])[0]

    key = _key(3)
    layer_keys = jax.random.split(jax.random.fold_in(key, 0), n_layers)

    def ref():
        h = x
        for layer in range(n_layers):
            hd = _mask_drop(h, layer_keys[layer])
            h = jnp.tanh((h @ lw.w[layer] + lw.scale * (hd @ lw.b[layer]) @ lw.a[layer]) / 3)
        return h

    got = lorax.lora(model, on_materialize="error")(lorax.dropout(lp, key, RATE), x)
    assert_close(got, ref(), rtol=1e-5, atol=1e-5)
    # Negative control: one key for every layer gives a different result.
    same = [jax.random.fold_in(key, 0)] * n_layers
    h = x
    for layer in range(n_layers):
        hd = _mask_drop(h, same[layer])
        h = jnp.tanh((h @ lw.w[layer] + lw.scale * (hd @ lw.b[layer]) @ lw.a[layer]) / 3)
    assert float(jnp.abs(h - got).max()) > 1e-3


def test_indexing_layers_follows_the_keys():
    lp = _lora_params((2, 8, 8), lorax.LoraSpec(2, batch_ndim=1, m_ndim=1))
    lw = lp["w"]
    x = jnp.ones((3, 8))
    key = _key(4)
    keys = jax.random.split(jax.random.fold_in(key, 0), 2)
    model = lambda p, x: jnp.tanh(x @ p["w"][1])  # noqa: E731
    got = lorax.lora(model, on_materialize="error")(lorax.dropout(lp, key, RATE), x)
    want = jnp.tanh(x @ lw.w[1] + lw.scale * (_mask_drop(x, keys[1]) @ lw.b[1]) @ lw.a[1])
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_shares_the_mask_unless_the_key_is_batched():
    lp = _lora_params((8, 6), 3)
    lw = lp["w"]
    xs = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8)), jnp.float32)
    model = lambda p, x: x @ p["w"]  # noqa: E731
    f = lorax.lora(model, on_materialize="error")
    key = _key(5)
    got = jax.vmap(lambda x: f(lorax.dropout(lp, key, RATE), x))(xs)
    k0 = jax.random.fold_in(key, 0)
    want = jax.vmap(lambda x: x @ lw.w + lw.scale * (_mask_drop(x, k0) @ lw.b) @ lw.a)(xs)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    keys = jax.random.split(key, 4)
    got = jax.vmap(lambda x, k: f(lorax.dropout(lp, k, RATE), x))(xs, keys)
    want = jax.vmap(lambda x, k: x @ lw.w + lw.scale * (
        _mask_drop(x, jax.random.fold_in(k, 0)) @ lw.b) @ lw.a)(xs, keys)
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_conv_and_dora_with_dropout():
    r = np.random.default_rng(4)
    w = jnp.asarray(r.standard_normal((3, 3, 4, 5)), jnp.float32)
    spec = {"w": lorax.LoraSpec(2, dora=True)}
    lp = lorax.init_lora({"w": w}, spec, jax.random.PRNGKey(0))
    dw = lp["w"]
    dw = lorax.DoraWeight(dw.w, dw.a * 10, jnp.asarray(r.standard_normal(dw.b.shape), jnp.float32),
                          dw.m * 1.5, dw.alpha)
    x = jnp.asarray(r.standard_normal((2, 6, 6, 4)), jnp.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn)  # noqa: E731
    key = _key(6)
    got = lorax.lora(lambda p, x: conv(x, p["w"]), on_materialize="error")(
        lorax.dropout({"w": dw}, key, RATE), x)
    xd = _mask_drop(x, jax.random.fold_in(key, 0))
    low = dw.scale * jnp.einsum("hwik,ko->hwio", dw.b, dw.a)
    v = dw.w + low
    g = dw.m / jnp.sqrt(jnp.sum(v * v, axis=(0, 1, 2), keepdims=True))
    want = (conv(x, dw.w) + conv(xd, low)) * g.reshape(1, 1, 1, 5)
    assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_embedding_lookup_has_no_dropout():
    lp = _lora_params((10, 8), 2)
    ids = jnp.array([1, 4, 4])
    f = lorax.lora(lambda p, i: jnp.take(p["w"], i, axis=0), on_materialize="error")
    np.testing.assert_array_equal(f(lorax.dropout(lp, _key(), RATE), ids), f(lp, ids))


@pytest.mark.parametrize("rate", [-0.1, 1.0, True, "0.1", float("nan"), np.float32(1.5)])
def test_bad_rate(rate):
    with pytest.raises(ValueError, match="rate must be a number in"):
        lorax.dropout(_lora_params((4, 4), 2), _key(), rate)


def test_a_numpy_rate_is_a_rate():
    lp = _lora_params((4, 4), 2)
    x = jnp.ones((3, 4))
    f = lorax.lora(lambda p, x: x @ p["w"])
    np.testing.assert_array_equal(f(lorax.dropout(lp, _key(), np.float32(RATE)), x),
                                  f(lorax.dropout(lp, _key(), float(np.float32(RATE))), x))


def test_bad_key():
    with pytest.raises(ValueError, match="one jax.random key"):
        lorax.dropout(_lora_params((4, 4), 2), jax.random.split(_key(), 3), RATE)
    # A raw uint32 key works like a typed one.
    lp = _lora_params((8, 6), 3)
    x = jnp.ones((2, 8))
    f = lorax.lora(lambda p, x: x @ p["w"])
    raw = f(lorax.dropout(lp, jax.random.PRNGKey(3), RATE), x)
    typed = f(lorax.dropout(lp, jax.random.wrap_key_data(jax.random.PRNGKey(3)), RATE), x)
    np.testing.assert_array_equal(raw, typed)


def test_the_constructor_checks_what_dropout_checks():
    """`lorax.LoraDropout` is public: built by hand, a bad rate, weight or key is named
    where it is built, not met as a wrong mask (or a shape error) inside the model."""
    lw = _lora_params((4, 4), 2)["w"]
    key = jax.random.key(0)
    for rate in (1.0, -0.5, "0.1", True):
        with pytest.raises(ValueError, match=r"LoraDropout: rate must be a number in \[0, 1\)"):
            lorax.LoraDropout(lw, key, rate)
    with pytest.raises(TypeError, match="LoraDropout: weight must be a LoraWeight"):
        lorax.LoraDropout(jnp.ones((4, 4)), key, RATE)
    for bad in (jax.random.PRNGKey(0), jax.random.split(key, 2)):
        with pytest.raises(ValueError, match=r"LoraDropout: key must be typed jax.random keys of shape \(\)"):
            lorax.LoraDropout(lw, bad, RATE)
    stacked = _lora_params((3, 4, 4), lorax.LoraSpec(2, batch_ndim=1))["w"]
    with pytest.raises(ValueError, match=r"key must be typed jax.random keys of shape \(3,\)"):
        lorax.LoraDropout(stacked, key, RATE)
    lorax.LoraDropout(stacked, jax.random.split(key, 3), RATE)
    x = jnp.ones((2, 4))
    f = lorax.lora(lambda p, x: x @ p["w"])
    by_hand = f({"w": lorax.LoraDropout(lw, jax.random.fold_in(key, 0), RATE)}, x)
    np.testing.assert_array_equal(by_hand, f(lorax.dropout({"w": lw}, key, RATE), x))
