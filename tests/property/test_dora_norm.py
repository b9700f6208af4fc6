"""Property tests: DoRA's norm identity and its layer against the materialised formula.

`weight_norm` computes `||w + s b @ a||` per output feature from `||w||^2`, `b^T w` and
rank-k products; here it is compared with the norm of the materialised weight (float64
numpy) over random batch / M / N axis counts, sizes, ranks, scales and both output
sides, and `lora(f)` of a `DoraWeight` with the materialised `m * V / ||V||` (values and
the gradients of a, b and m).

The identity subtracts: where the update cancels most of a feature's weight
(`||V|| << ||W|| + s ||BA||`) its float32 result loses digits, as DoRA's scale
`m / ||V||` itself blows up there. Examples are kept to `||V||` at least a tenth of
that bound (an adapter far from erasing its base, as in training). The layer's
gradients sum such `1 / ||V||`-scaled terms over features, and terms of opposite signs
can cancel to far less than their size, so the layer test runs in float64: it checks
the formula, and the identity test checks float32's accuracy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_close
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import lorax
from lorax._variants.dora import DoraWeight, magnitude_shape, weight_norm


@st.composite
def weights(draw):
    nb = draw(st.integers(0, 1))
    nm = draw(st.integers(1, 2))
    nn = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(nb + nm + nn))
    k = draw(st.integers(1, 4))
    alpha = draw(st.sampled_from([0.5, 1.0, 4.0, 16.0]))
    side = draw(st.sampled_from(["a", "b"]))
    seed = draw(st.integers(0, 2**16))
    return nb, nm, nn, shape, k, alpha, side, seed


def _make(nb, nm, nn, shape, k, alpha, seed):
    r = np.random.default_rng(seed)
    batch, m, n = shape[:nb], shape[nb:nb + nm], shape[nb + nm:]
    w = r.standard_normal(shape).astype(np.float32)
    a = r.standard_normal((*batch, k, *n)).astype(np.float32)
    b = r.standard_normal((*batch, *m, k)).astype(np.float32)
    return lorax.LoraWeight(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), alpha)


def _well_conditioned(lw, side):
    nb, nm, nn = lw.structure
    axes = tuple(range(nb, nb + nm)) if side == "a" else tuple(range(nb + nm, lw.ndim))
    w = np.asarray(lw.w, np.float64)
    d = np.asarray(lw.delta(), np.float64)
    norm = lambda v: np.sqrt(np.sum(v * v, axis=axes))  # noqa: E731
    return bool(np.all(norm(w + d) >= 0.1 * (norm(w) + norm(d))))


def _direct(lw, side):
    nb, nm, nn = lw.structure
    v = np.asarray(lw.w, np.float64) + np.asarray(lw.delta(), np.float64)
    axes = tuple(range(nb, nb + nm)) if side == "a" else tuple(range(nb + nm, lw.ndim))
    return np.sqrt(np.sum(v * v, axis=axes, keepdims=True))


@given(weights())
def test_norm_identity_matches_the_materialised_norm(params):
    nb, nm, nn, shape, k, alpha, side, seed = params
    lw = _make(nb, nm, nn, shape, k, alpha, seed)
    assume(_well_conditioned(lw, side))
    got = weight_norm(lw, side)
    assert got.shape == magnitude_shape(shape, lw.axes, side)
    assert_close(got, _direct(lw, side), rtol=1e-5, atol=1e-5)


# Each example traces and differentiates a new program: a quarter of the profile's count.
@settings(max_examples=max(5, settings.default.max_examples // 4))
@given(weights())
def test_dora_layer_matches_the_materialised_formula(params):
    with jax.enable_x64(True):
        _check_layer(*params)


def _check_layer(nb, nm, nn, shape, k, alpha, side, seed):
    lw32 = _make(nb, nm, nn, shape, k, alpha, seed)
    lw = lorax.LoraWeight(*(x.astype(jnp.float64) for x in (lw32.w, lw32.a, lw32.b)), alpha)
    assume(_well_conditioned(lw, side))
    r = np.random.default_rng(seed + 1)
    m = jnp.asarray(np.abs(r.standard_normal(magnitude_shape(shape, lw.axes, side))) + 0.5)
    # Contract the input side's axes with x; keep batch axes as dot batch dims.
    in_axes = tuple(range(nb, nb + nm)) if side == "a" else tuple(range(nb + nm, len(shape)))
    x = jnp.asarray(r.standard_normal((*shape[:nb], 3, *(shape[i] for i in in_axes))))
    dims = (((tuple(range(nb + 1, x.ndim))), in_axes), (tuple(range(nb)), tuple(range(nb))))

    def f(w, x):
        return jax.lax.dot_general(x, w, dims)

    def ref(a, b, m):
        v = lw.w + lorax.LoraWeight(lw.w, a, b, alpha).delta()
        axes = in_axes
        norm = jax.lax.stop_gradient(jnp.sqrt(jnp.sum(v * v, axis=axes, keepdims=True)))
        return f(m * v / norm, x)

    def ours(a, b, m):
        return lorax.lora(f, on_materialize="error")(DoraWeight(lw.w, a, b, m, alpha), x)

    assert ours(lw.a, lw.b, m).dtype == jnp.float64
    _close64(ours(lw.a, lw.b, m), ref(lw.a, lw.b, m))
    proj = jnp.asarray(r.standard_normal(ref(lw.a, lw.b, m).shape))
    g = jax.grad(lambda *p: jnp.sum(jnp.sin(ours(*p)) * proj), argnums=(0, 1, 2))(lw.a, lw.b, m)
    g_ref = jax.grad(lambda *p: jnp.sum(jnp.sin(ref(*p)) * proj), argnums=(0, 1, 2))(lw.a, lw.b, m)
    for u, v in zip(g, g_ref):
        _close64(u, v)


def _close64(actual, expected):
    # float64 throughout (`assert_close` compares in float32): relative to the largest
    # value, as `assert_close` does, at float64's scale.
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype == np.float64
    mag = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-9 * mag)
