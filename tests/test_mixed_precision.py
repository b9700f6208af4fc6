"""Mixed precision as people run it: a bf16 (or quantized, dequantizing to bf16) frozen
base, bf16 activations, float32 factors and optimizer state. The base contraction runs
in bf16 (no float32 copy of the weight), the factors are cast to the compute dtype
where they meet the activations (float32 master copies, bf16 arithmetic), and the
factor gradients come back in float32. Values and gradients match a float32 reference
at bf16 tolerances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lorax

D, F, K, T = 256, 512, 8, 16
SPEC = {"up": K, "down": K}


def _params(dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"up": (jax.random.normal(k1, (D, F)) / 16).astype(dtype),
            "down": (jax.random.normal(k2, (F, D)) / 23).astype(dtype)}


def mlp(p, x):
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


def _lora(base, dtype):
    params = _params(dtype)
    if base != "dense":
        params = lorax.quantize(params, SPEC, base, dtype=dtype)
    lp = lorax.init_lora(params, SPEC, jax.random.PRNGKey(1), dtype=jnp.float32)
    # Non-zero b: the factor path shows in values and in a's gradient.
    return jax.tree.map(lambda lw: lorax.LoraWeight(lw.w, lw.a, lw.b + 0.02, alpha=lw.alpha)
                        if isinstance(lw, lorax.LoraWeight) else lw, lp,
                        is_leaf=lambda x: isinstance(x, lorax.LoraWeight))


def _as_f32(lp):
    """The same weights (the same codes) computed in float32: the reference."""
    def w32(w):
        if isinstance(w, lorax.QuantizedArray):
            return lorax.QuantizedArray(w.codes, w.scales, w.mins, qtype=w.qtype,
                                        block_size=w.block_size, axis=w.axis,
                                        dense_dtype=jnp.float32)
        return w.astype(jnp.float32)

    return {k: lorax.LoraWeight(w32(lw.w), lw.a, lw.b, alpha=lw.alpha) for k, lw in lp.items()}


def _loss(trainable, frozen, x):
    y = lorax.lora(mlp, on_materialize="error")(lorax.combine(trainable, frozen), x)
    return jnp.mean(y.astype(jnp.float32) ** 2)


@pytest.mark.parametrize("base", ["dense", "nf4", "q8_0"])
def test_bf16_base_f32_factors_match_the_f32_reference(base):
    x = jax.random.normal(jax.random.PRNGKey(2), (T, D)).astype(jnp.bfloat16).astype(jnp.float32)
    lp16 = _lora(base, jnp.bfloat16)
    lp32 = _as_f32(lp16)
    assert lp16["up"].w.dtype == jnp.bfloat16 and lp16["up"].a.dtype == jnp.float32
    y = lorax.lora(mlp, on_materialize="error")(lp16, x.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    ref = lorax.lora(mlp)(lp32, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=0.05, atol=0.05)
    g16 = jax.grad(_loss)(*lorax.partition(lp16, SPEC), x.astype(jnp.bfloat16))
    g32 = jax.grad(_loss)(*lorax.partition(lp32, SPEC), x)
    for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
        assert a.dtype == jnp.float32  # master copies get float32 gradients
        # bf16 arithmetic: compare as vectors, relative to the reference's norm.
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 0.03 * np.linalg.norm(b)


@pytest.mark.parametrize("base", ["dense", "nf4"])
def test_no_float32_contraction_with_the_base(base):
    """Every dot that reads the weight runs on bf16 operands: the base is never upcast."""
    lp = _lora(base, jnp.bfloat16)
    x = jnp.ones((T, D), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(_loss))(*lorax.partition(lp, SPEC), x)
    big = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                shapes = [v.aval.shape for v in eqn.invars]
                if any(np.prod(s) >= D * F for s in shapes):
                    big.append([v.aval.dtype for v in eqn.invars])
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
                walk(sub)
            for p in eqn.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))

    walk(jaxpr.jaxpr)
    assert big, "the base contraction was not found"
    assert all(d == jnp.bfloat16 for dtypes in big for d in dtypes), big


def test_optimizer_state_is_float32_and_adam_steps_lower_the_loss():
    lp = _lora("nf4", jnp.bfloat16)
    trainable, frozen = lorax.partition(lp, SPEC)
    x = jax.random.normal(jax.random.PRNGKey(2), (T, D)).astype(jnp.bfloat16)
    opt = optax.adam(1e-2)
    state = opt.init(trainable)
    assert {l.dtype for l in jax.tree.leaves(state) if l.ndim} == {jnp.dtype(jnp.float32)}

    @jax.jit
    def step(t, s):
        loss, g = jax.value_and_grad(_loss)(t, frozen, x)
        u, s = opt.update(g, s, t)
        return optax.apply_updates(t, u), s, loss

    losses = []
    for _ in range(5):
        trainable, state, loss = step(trainable, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert {l.dtype for l in jax.tree.leaves(trainable)} == {jnp.dtype(jnp.float32)}
