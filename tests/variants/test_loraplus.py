"""LoRA+: chained after an lr-proportional optimizer, `loraplus(ratio)` is that optimizer
with two parameter groups (PEFT's `create_loraplus_optimizer`): `lr` for the input-side
factor, `ratio * lr` for the output side, DoRA magnitudes and trained vectors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lorax
from conftest import assert_close

LR, RATIO = 1e-2, 16.0


def _setup():
    r = np.random.default_rng(0)
    n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
    params = {"kernel": n(8, 6), "torch_w": n(6, 8), "dora": n(8, 6), "bias": n(6), "frozen": n(6, 6)}
    spec = {"kernel": 2, "torch_w": lorax.LoraSpec(2, input_factor="a"),
            "dora": lorax.LoraSpec(2, dora=True), "bias": lorax.LORA_FULL,
            "frozen": lorax.LORA_FREEZE}

    def model(p, x):
        h = jnp.tanh(x @ p["kernel"] + p["bias"])
        h = jnp.tanh(x @ p["torch_w"].T + h @ p["frozen"])
        return jnp.sum(jnp.sin(x @ p["dora"] + h))

    return params, spec, model, n(5, 8)


def _groups(trainable, spec):
    """PEFT's grouping, written out: 'fast' for the output side, magnitudes and vectors."""
    def label(spec_val, t):
        if isinstance(t, lorax.LoraWeight):
            ls = spec_val if isinstance(spec_val, lorax.LoraSpec) else lorax.LoraSpec(spec_val)
            out = "b" if ls.input_factor == "a" else "a"
            fields = {f: ("fast" if f in (out, "m") else "slow") for f in t.trainable_fields}
            from lorax._weight import unchecked_replace
            return unchecked_replace(t, **fields)
        return jax.tree.map(lambda x: "fast" if x.ndim <= 1 else "slow", t)
    return jax.tree.map(label, spec, trainable, is_leaf=lambda x: x is None)


def test_partition_path_equals_two_parameter_groups():
    params, spec, model, x = _setup()
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    trainable, frozen = lorax.partition(lp, spec)
    loss = lambda t: lorax.lora(model)(lorax.combine(t, frozen), x)  # noqa: E731
    ours = optax.chain(optax.adamw(LR, weight_decay=0.1), lorax.loraplus(RATIO, spec))
    ref = optax.multi_transform(
        {"slow": optax.adamw(LR, weight_decay=0.1),
         "fast": optax.adamw(LR * RATIO, weight_decay=0.1)}, _groups(trainable, spec))
    t1, t2 = trainable, trainable
    s1, s2 = ours.init(t1), ref.init(t2)
    for _ in range(3):
        u1, s1 = ours.update(jax.grad(loss)(t1), s1, t1)
        u2, s2 = ref.update(jax.grad(loss)(t2), s2, t2)
        t1, t2 = optax.apply_updates(t1, u1), optax.apply_updates(t2, u2)
    for u, v in zip(jax.tree.leaves(t1), jax.tree.leaves(t2)):
        assert_close(u, v, rtol=1e-5, atol=1e-6)
    # Control: without loraplus the result differs.
    plain = optax.adamw(LR, weight_decay=0.1)
    t3, s3 = trainable, plain.init(trainable)
    for _ in range(3):
        u3, s3 = plain.update(jax.grad(loss)(t3), s3, t3)
        t3 = optax.apply_updates(t3, u3)
    assert float(jnp.abs(t3["kernel"].a - t1["kernel"].a).max()) > 1e-3
    # Which factor is fast: a for x @ w, b for the (out, in) weight.
    d_a = jnp.abs(t1["kernel"].a - trainable["kernel"].a).max()
    d_a3 = jnp.abs(t3["kernel"].a - trainable["kernel"].a).max()
    assert float(d_a) > 5 * float(d_a3)
    d_b = jnp.abs(t1["torch_w"].b - trainable["torch_w"].b).max()
    d_b3 = jnp.abs(t3["torch_w"].b - trainable["torch_w"].b).max()
    assert float(d_b) > 5 * float(d_b3)


def test_inside_wrap_optimizer():
    params, spec, model, x = _setup()
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    opt = lorax.wrap_optimizer(optax.chain(optax.sgd(LR), lorax.loraplus(RATIO, spec)), spec)
    state = opt.init(lp)
    grads = jax.grad(lambda p: lorax.lora(model)(p, x))(lp)
    updates, _ = opt.update(grads, state, lp)
    assert_close(updates["kernel"].a, -LR * RATIO * grads["kernel"].a, rtol=1e-6)
    assert_close(updates["kernel"].b, -LR * grads["kernel"].b, rtol=1e-6)
    assert_close(updates["torch_w"].b, -LR * RATIO * grads["torch_w"].b, rtol=1e-6)
    assert_close(updates["dora"].m, -LR * RATIO * grads["dora"].m, rtol=1e-6)
    assert_close(updates["bias"], -LR * RATIO * grads["bias"], rtol=1e-6)
    np.testing.assert_array_equal(np.signbit(updates["frozen"]), True)  # -0.0: untouched


def test_without_spec_dora_still_knows_its_side():
    r = np.random.default_rng(1)
    w = jnp.asarray(r.standard_normal((6, 8)), jnp.float32)
    spec = {"w": lorax.LoraSpec(2, dora=True, input_factor="a")}
    lp = lorax.init_lora({"w": w}, spec, jax.random.PRNGKey(0))
    grads = jax.tree.map(jnp.ones_like, lorax.partition(lp, spec)[0])
    updates, _ = lorax.loraplus(4.0).update(grads, optax.EmptyState())
    assert float(updates["w"].b.max()) == 4.0 and float(updates["w"].a.max()) == 1.0


@pytest.mark.parametrize("ratio", [0, -1.0, True])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match="ratio must be a positive number"):
        lorax.loraplus(ratio)


@pytest.mark.parametrize("ratio", [float("nan"), float("inf")])
def test_non_finite_ratio(ratio):
    with pytest.raises(ValueError, match="lorax.loraplus: ratio must be a finite number > 0"):
        lorax.loraplus(ratio)


def test_a_spec_of_other_params_names_the_key_path():
    params = {"w": jnp.ones((8, 4)), "bias": jnp.zeros(4)}
    spec = {"w": 2, "bias": lorax.LORA_FULL}
    trainable, _ = lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(0)), spec)
    grads = jax.tree.map(jnp.ones_like, trainable)
    wrong = lorax.loraplus(16.0, {"w": 2})
    for call in (lambda: wrong.init(trainable),
                 lambda: wrong.update(grads, optax.EmptyState())):
        with pytest.raises(ValueError, match=r"loraplus: the spec's tree does not match.*'bias'"):
            call()
    # Frozen leaves (None in the trainable half) still match their spec values, and a
    # None parameter its None spec value.
    params, frozen = dict(params, none=None), {"w": 2, "bias": lorax.LORA_FREEZE, "none": None}
    trainable, _ = lorax.partition(lorax.init_lora(params, frozen, jax.random.PRNGKey(0)), frozen)
    opt = lorax.loraplus(16.0, frozen)
    updates, _ = opt.update(jax.tree.map(jnp.ones_like, trainable), opt.init(trainable))
    assert updates["bias"] is None
