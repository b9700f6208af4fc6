"""lorax 0.3 code keeps working: its conv factor layout and ranks up to (and past) min(M, N)."""

from __future__ import annotations

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax
from frameworks.harness import _merged_tree, _nudge, _scalar


def _randn(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _lorax03_materialize(w, a, b, alpha):
    """lorax 0.3's meaning of a `LoraWeight`: `w + alpha/k * b @ a`, `@` broadcasting
    `a: (1, ..., 1, k, out)` over the window (numpy, float64)."""
    w, a, b = (np.asarray(x, np.float64) for x in (w, a, b))
    return w + alpha / b.shape[-1] * (b @ a)


# -- lorax 0.3's conv layout ---------------------------------------------------------------


def _conv1d(w, x):
    """lorax 0.3's own conv test function: a (window, in, out) kernel on (batch, time, in)."""
    dn = jax.lax.ConvDimensionNumbers((0, 2, 1), (2, 1, 0), (0, 2, 1))
    return jax.lax.conv_general_dilated(x, w, window_strides=(1,), padding="VALID",
                                        dimension_numbers=dn)


def _lorax03_conv_weight(alpha=1.0):
    window, hidden, out, k = 2, 13, 17, 3
    a = _randn(1, (1, k, out))  # lorax 0.3: (1, ..., 1, k, out)
    b = _randn(2, (window, hidden, k))  # lorax 0.3: (*window, in, k)
    w = _randn(3, (window, hidden, out), 0.1)
    return w, a, b


def test_lorax03_conv_example_runs_unchanged():
    w, a, b = _lorax03_conv_weight()
    x = _randn(4, (7, 11, 13))
    lw = lorax.LoraWeight(w=w, a=a, b=b)  # as lorax 0.3's README and tests build it
    assert lw.a.shape == (3, 17) and lw.b.shape == b.shape and lw.structure == (0, 2, 1)
    np.testing.assert_array_equal(np.asarray(lw.a), np.asarray(a).reshape(3, 17))
    np.testing.assert_allclose(lw.materialize(), _lorax03_materialize(w, a, b, 1.0),
                               rtol=1e-5, atol=1e-5)
    got = lorax.lora(_conv1d, on_materialize="error")(lw, x)
    want = _conv1d(lw.materialize(), x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_lorax03_conv_layout_through_the_lifecycle(tmp_path):
    w, a, b = _lorax03_conv_weight()
    x = _randn(4, (7, 11, 13))
    params = {"conv": lorax.LoraWeight(w, a, b, alpha=4.0), "bias": jnp.zeros(17)}
    spec = {"conv": 3, "bias": lorax.LORA_FULL}
    reference = _lorax03_materialize(w, a, b, 4.0)
    model = lambda p, x: _conv1d(p["conv"], x) + p["bias"]  # noqa: E731
    want = np.asarray(model({"conv": jnp.asarray(reference, jnp.float32), "bias": params["bias"]}, x))

    np.testing.assert_allclose(lorax.lora(model, on_materialize="error")(params, x), want,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lorax.merge_params(params)["conv"], reference, rtol=1e-5, atol=1e-5)
    trainable = lorax.split_lora_params(params, spec)
    assert trainable["conv"].w is None and trainable["conv"].a.shape == (3, 17)

    lorax.save_adapter(tmp_path / "adapter.safetensors", params, spec)
    loaded, loaded_spec = lorax.load_adapter(tmp_path / "adapter.safetensors", {"conv": w, "bias": params["bias"]})
    for field in ("a", "b"):
        np.testing.assert_array_equal(getattr(loaded["conv"], field), getattr(params["conv"], field))
    assert loaded["conv"].alpha == 4.0 and loaded_spec["conv"].rank == 3
    np.testing.assert_allclose(lorax.lora(model)(loaded, x), want, rtol=1e-4, atol=1e-4)


def test_lorax03_conv_layout_on_flax_conv_values_and_gradients():
    module = nn.Conv(features=6, kernel_size=(3, 3))
    x = _randn(5, (2, 8, 8, 4))
    params = module.init(jax.random.PRNGKey(0), x)
    kernel = params["params"]["kernel"]  # (3, 3, 4, 6)
    a03, b03 = _randn(6, (1, 1, 2, 6)), _randn(7, (3, 3, 4, 2), 0.3)
    lp = {"params": {**params["params"], "kernel": lorax.LoraWeight(kernel, a03, b03, alpha=2.0)}}
    reference = jnp.asarray(_lorax03_materialize(kernel, a03, b03, 2.0), jnp.float32)
    want = module.apply({"params": {**params["params"], "kernel": reference}}, x)
    lora_apply = lorax.lora(module.apply, on_materialize="error")
    np.testing.assert_allclose(lora_apply(lp, x), want, rtol=1e-4, atol=1e-4)

    def loss(factors, apply, materialize):
        lw = lorax.LoraWeight(kernel, factors["a"], factors["b"], alpha=2.0)
        k = lw.materialize() if materialize else lw
        return _scalar(apply({"params": {**params["params"], "kernel": k}}, x))

    factors = {"a": lp["params"]["kernel"].a, "b": lp["params"]["kernel"].b}
    g = jax.grad(loss)(factors, lora_apply, False)
    g_ref = jax.grad(loss)(factors, module.apply, True)
    for name in ("a", "b"):
        np.testing.assert_allclose(g[name], g_ref[name], rtol=1e-4,
                                   atol=1e-5 * float(jnp.abs(g_ref[name]).max()))


def test_shapes_that_fit_no_layout_still_fail():
    with pytest.raises(ValueError, match="factor shapes do not fit"):
        lorax.LoraWeight(jnp.zeros((2, 13, 17)), a=jnp.zeros((1, 3, 16)), b=jnp.zeros((2, 13, 3)))
    with pytest.raises(ValueError, match="factor shapes do not fit"):  # a's leading axes not 1
        lorax.LoraWeight(jnp.zeros((3, 13, 17)), a=jnp.zeros((2, 3, 17)), b=jnp.zeros((3, 13, 3)))


# -- ranks >= min(M, N) --------------------------------------------------------------------


def _check_values_and_factor_grads(apply, lp, spec, *args, rtol=1e-4, on_materialize="error"):
    lp = _nudge(lp, 3)
    lora_apply = lorax.lora(apply, on_materialize=on_materialize)
    want = apply(lorax.merge_params(lp), *args)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol), lora_apply(lp, *args), want)
    trainable, frozen = lorax.partition(lp, spec)
    g = jax.grad(lambda t: _scalar(lora_apply(lorax.combine(t, frozen), *args)))(trainable)
    g_ref = jax.grad(lambda t: _scalar(apply(_merged_tree(lorax.combine(t, frozen)), *args)))(trainable)
    for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(x, y, rtol=10 * rtol, atol=rtol * max(1.0, float(jnp.abs(y).max())))


def test_rank_at_or_above_min_dim_warns_once_and_trains():
    params = {"head": _randn(0, (16, 2)), "square": _randn(1, (4, 4)), "ok": _randn(2, (16, 16))}
    spec = {"head": 4, "square": 4, "ok": 4}
    with pytest.warns(UserWarning, match="min\\(M, N\\)") as record:
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    (warning,) = [w for w in record if "min(M, N)" in str(w.message)]
    message = str(warning.message)
    assert "head (shape (16, 2)" in message and "square (shape (4, 4)" in message
    assert "ok" not in message.replace("LoRA", "")
    assert lp["head"].a.shape == (4, 2) and lp["head"].b.shape == (16, 4)

    def model(p, x):
        h = jnp.tanh(x @ p["ok"])
        return (h[:, :4] @ p["square"]) @ p["square"].T @ jnp.ones((4, 16)) @ p["head"]

    _check_values_and_factor_grads(model, lp, spec, _randn(3, (5, 16)))


def test_lorax03_decision_fn_on_flax_attention_with_bias_tables():
    """lorax 0.3's documented `decision_fn=lambda path, w: 4` picks Flax attention biases
    `(heads, head_dim)` too: rank 4 on a (2, 3) bias is >= min(M, N)."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=6)(x)
            return nn.Dense(2)(x)  # a 2-class head

    model = Block()
    x = _randn(4, (2, 5, 8))
    params = model.init(jax.random.PRNGKey(0), x)
    spec = lorax.simple_spec(params, decision_fn=lambda path, w: 4)
    with pytest.warns(UserWarning, match="min\\(M, N\\)") as record:
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    message = str([w for w in record if "min(M, N)" in str(w.message)][0].message)
    assert "query/bias (shape (2, 3)" in message and "Dense_0/kernel (shape (8, 2)" in message
    # A bias table is added to activations, which needs it dense: it is materialized
    # (it is bias-sized), under the policy. Values and factor gradients still equal
    # the merged model's.
    _check_values_and_factor_grads(model.apply, lp, spec, x, on_materialize="allow")


def test_small_equinox_linear_with_a_large_rank():
    linear = eqx.nn.Linear(3, 5, key=jax.random.PRNGKey(0))  # weight (5, 3)
    spec = jax.tree.map(lambda _: lorax.LORA_FREEZE, linear)
    spec = eqx.tree_at(lambda m: m.weight, spec, 8)
    with pytest.warns(UserWarning, match="weight \\(shape \\(5, 3\\)"):
        lp = lorax.init_lora(linear, spec, jax.random.PRNGKey(1))
    _check_values_and_factor_grads(lambda m, x: jax.vmap(m)(x), lp, spec, _randn(1, (4, 3)))


def test_small_ranks_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lorax.init_lora({"w": jnp.ones((8, 4))}, {"w": 3}, jax.random.PRNGKey(0))
