"""Frozen weights stay bit-identical and cost no optimizer state, on both training paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lorax


def _setup(subnormal=False):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "l1": {"kernel": jax.random.normal(keys[0], (16, 32)), "bias": jnp.zeros(32)},
        "l2": {"kernel": jax.random.normal(keys[1], (32, 8)), "bias": jnp.zeros(8)},
        "frozen_vec": jnp.ones(8),
    }
    # Negative zeros and tiny values are where `w + 0.0` would change bits.
    params["l1"]["kernel"] = params["l1"]["kernel"].at[0, :4].set(-0.0)
    if subnormal:
        params["l1"]["kernel"] = params["l1"]["kernel"].at[1, :4].set(1e-40)
    spec = {"l1": {"kernel": 4, "bias": lorax.LORA_FULL}, "l2": {"kernel": 2, "bias": 0},
            "frozen_vec": 0}

    def loss(p, x):
        h = jax.nn.gelu(x @ p["l1"]["kernel"] + p["l1"]["bias"])
        return jnp.mean((h @ p["l2"]["kernel"] + p["l2"]["bias"] - p["frozen_vec"]) ** 2)

    x = jax.random.normal(keys[2], (8, 16))
    return params, spec, lorax.lora(loss, on_materialize="error"), x


def _bits(x):
    return np.asarray(x).view(np.uint32)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.5),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.add_decayed_weights(0.1),
                                 optax.sgd(1e-2, momentum=0.9)),
    "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=3),
}


@pytest.mark.parametrize("eager_steps", [2, 0])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_wrap_optimizer_path_keeps_w_bit_identical(name, eager_steps):
    # Eager arithmetic on XLA:CPU flushes subnormals to zero (any `w + u` does), so
    # subnormal weights are only checked when every step is jitted, where the
    # frozen leaves' `w + (-0.0)` folds away.
    params, spec, loss, x = _setup(subnormal=eager_steps == 0)
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    opt = lorax.wrap_optimizer(OPTIMIZERS[name](), spec)
    state = opt.init(lp)
    # No optimizer state at all for W or frozen leaves: every state array is
    # factor-, trainable-bias- or scalar-sized.
    trainable_shapes = {(4, 32), (16, 4), (2, 8), (32, 2), (32,)}
    assert {x.shape for x in jax.tree.leaves(state) if x.ndim} <= trainable_shapes

    @jax.jit
    def step(lp, state):
        g = jax.grad(loss)(lp, x)
        updates, state = opt.update(g, state, lp)
        return optax.apply_updates(lp, updates), state

    first_l = float(loss(lp, x))
    for i in range(12):
        # Eager steps too: XLA folds `w + 0.0` under jit, eager arithmetic does not.
        lp, state = (step.__wrapped__ if i < eager_steps else step)(lp, state)
    for got, want in [(lp["l1"]["kernel"].w, params["l1"]["kernel"]),
                      (lp["l2"]["kernel"].w, params["l2"]["kernel"]),
                      (lp["l2"]["bias"], params["l2"]["bias"]),
                      (lp["frozen_vec"], params["frozen_vec"])]:
        np.testing.assert_array_equal(_bits(got), _bits(want))
    assert float(loss(lp, x)) < first_l
    assert not np.array_equal(lp["l1"]["bias"], params["l1"]["bias"])


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_partition_path_keeps_w_bit_identical_and_state_lean(name):
    params, spec, loss, x = _setup(subnormal=True)
    trainable, frozen = lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(1)), spec)
    opt = OPTIMIZERS[name]()
    state = opt.init(trainable)
    trainable_bytes = sum(a.nbytes for a in jax.tree.leaves(trainable))
    moments = [a for a in jax.tree.leaves(state) if a.ndim]
    assert sum(a.nbytes for a in moments) == 2 * trainable_bytes

    @jax.jit
    def step(trainable, frozen, state):
        g = jax.grad(lambda t: loss(lorax.combine(t, frozen), x))(trainable)
        updates, state = opt.update(g, state, trainable)
        return optax.apply_updates(trainable, updates), state

    for i in range(12):
        trainable, state = (step.__wrapped__ if i < 2 else step)(trainable, frozen, state)
    lp = lorax.combine(trainable, frozen)
    np.testing.assert_array_equal(_bits(lp["l1"]["kernel"].w), _bits(params["l1"]["kernel"]))
    assert lp["l1"]["kernel"].w is frozen["l1"]["kernel"].w  # never copied out of the step


def test_wrap_optimizer_spec_mismatch_names_path():
    params, spec, _, _ = _setup()
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    bad = dict(spec, extra=0)
    with pytest.raises(ValueError, match="extra"):
        lorax.wrap_optimizer(optax.adam(1e-3), bad).init(lp)


@pytest.mark.parametrize("optimizer,hint", [
    ("adam", "`optax.adam(learning_rate)` makes one"),  # the name, not the transformation
    ({"w": 2}, "got dict"),  # the spec and the optimizer swapped
    (optax.adam, "got function"),  # the factory, not called
])
def test_a_non_optimizer_is_named_by_each_consumer(optimizer, hint):
    for name, make in (("wrap_optimizer", lambda o: lorax.wrap_optimizer(o, {"w": 2})),
                       ("offload_state", lorax.offload_state)):
        with pytest.raises(TypeError, match=f"{name}: optimizer must be an optax") as err:
            make(optimizer)
        assert hint in str(err.value)
    # what is accepted: any transformation with init and update, MultiSteps included
    for ok in (optax.adam(1e-3), optax.MultiSteps(optax.sgd(1e-2), 2),
               optax.chain(optax.clip(1.0), optax.sgd(1e-2))):
        lp = lorax.init_lora({"w": jnp.ones((4, 4))}, {"w": 2}, jax.random.PRNGKey(0))
        lorax.wrap_optimizer(ok, {"w": 2}).init(lp)


def test_wrap_optimizer_refuses_a_rank_over_a_plain_array():
    """Given the base tree, Adam's moments would cover (and train) the whole weight."""
    params = {"w": jnp.ones((8, 4)), "bias": jnp.zeros(4)}
    spec = {"w": 2, "bias": lorax.LORA_FULL}
    opt = lorax.wrap_optimizer(optax.adam(1e-3), spec)
    with pytest.raises(ValueError, match="wrap_optimizer: the spec gives 'w' LoRA rank 2"):
        opt.init(params)
    opt.init(lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
