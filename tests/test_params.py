"""partition/combine: gradients and optimizer state cost exactly the trainable bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lorax
from conftest import assert_close


def _model(n_layers=3, d=64):
    keys = jax.random.split(jax.random.PRNGKey(0), n_layers)
    params = {f"layer{i}": {"kernel": jax.random.normal(k, (d, d)) / d**0.5, "bias": jnp.zeros(d),
                            "scale": jnp.ones(d)} for i, k in enumerate(keys)}
    spec = {name: {"kernel": 4, "bias": lorax.LORA_FULL, "scale": lorax.LORA_FREEZE}
            for name in params}

    def loss(p, x):
        for i in range(n_layers):
            layer = p[f"layer{i}"]
            x = jnp.tanh(x @ layer["kernel"] + layer["bias"]) * layer["scale"]
        return jnp.mean(x**2)

    return params, spec, loss


def _bytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_gradient_bytes_equal_trainable_bytes():
    params, spec, loss = _model()
    trainable, frozen = lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(1)), spec)
    lloss = lorax.lora(loss, on_materialize="error")
    x = jnp.ones((4, 64))
    grads = jax.grad(lambda t: lloss(lorax.combine(t, frozen), x))(trainable)
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    assert _bytes(grads) == _bytes(trainable) == 3 * 4 * (4 * (64 + 64) + 64)
    # The whole-tree path pays a W-sized zero gradient per LoRA weight.
    lp = lorax.combine(trainable, frozen)
    whole = jax.grad(lloss)(lp, x)
    assert _bytes(whole) - _bytes(grads) == 3 * 4 * (64 * 64 + 64)
    # Same factor gradients either way (at init b = 0, so a's are exactly 0: b's matter).
    for name in params:
        got, want = grads[name]["kernel"], whole[name]["kernel"]
        assert_close(got.a, want.a, rtol=1e-6)
        assert_close(got.b, want.b, rtol=1e-6)
    state = optax.adam(1e-3).init(trainable)
    assert _bytes(state) - 4 == 2 * _bytes(trainable)  # mu + nu (+ the int32 count)


def test_partition_halves_and_combine_roundtrip():
    params, spec, _ = _model()
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    trainable, frozen = lorax.partition(lp, spec)
    assert trainable["layer0"]["kernel"].w is None and trainable["layer0"]["scale"] is None
    assert frozen["layer0"]["kernel"].a is None and frozen["layer0"]["bias"] is None
    assert frozen["layer0"]["kernel"].w is lp["layer0"]["kernel"].w
    again = lorax.combine(trainable, frozen)
    assert jax.tree.structure(again) == jax.tree.structure(lp)
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(lp)):
        assert x is y


def test_combine_structure_mismatch_is_an_error():
    params, spec, _ = _model()
    trainable, frozen = lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(1)), spec)
    del frozen["layer2"]
    with pytest.raises(ValueError, match="different structures"):
        lorax.combine(trainable, frozen)


def test_jitted_partition_step_returns_no_frozen_weight():
    params, spec, loss = _model()
    trainable, frozen = lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(1)), spec)
    opt = optax.adam(1e-3)
    state = opt.init(trainable)
    lloss = lorax.lora(loss, on_materialize="error")

    def step(trainable, frozen, state, x):
        g = jax.grad(lambda t: lloss(lorax.combine(t, frozen), x))(trainable)
        u, state = opt.update(g, state, trainable)
        return optax.apply_updates(trainable, u), state

    x = jnp.ones((4, 64))
    out_shapes = jax.eval_shape(step, trainable, frozen, state, x)
    assert all(s.shape != (64, 64) for s in jax.tree.leaves(out_shapes))
    mem = jax.jit(step).lower(trainable, frozen, state, x).compile().memory_analysis()
    # Outputs are the trainable leaves and Adam state, plus XLA's 8-byte-per-output
    # tuple table: not one frozen (64 x 64) weight.
    n_out = len(jax.tree.leaves(out_shapes))
    assert mem.output_size_in_bytes == _bytes(trainable) + _bytes(state) + 8 * n_out


def test_merge_params_keeps_structure_and_dtypes():
    params = {"w": jnp.ones((8, 8), jnp.bfloat16), "v": jnp.ones(3)}
    spec = {"w": 2, "v": 0}
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))  # f32 factors on a bf16 weight
    merged = lorax.merge_params(lp)
    assert merged["w"].dtype == jnp.bfloat16 and merged["v"] is params["v"]
    assert jax.tree.structure(merged) == jax.tree.structure(params)


def _lora_tree():
    k = jax.random.PRNGKey(0)
    params = {"w": jax.random.normal(k, (8, 4)), "bias": jnp.zeros(4)}
    spec = {"w": 2, "bias": lorax.LORA_FULL}
    lp = lorax.init_lora(params, spec, k)
    lp["w"] = lorax.LoraWeight(lp["w"].w, lp["w"].a, jnp.full((8, 2), 0.5), alpha=2.0)
    return params, spec, lp


@pytest.mark.parametrize("name", ["partition", "split_lora_params", "save_adapter"])
def test_a_rank_over_a_plain_array_is_refused_with_its_path(name, tmp_path):
    """The base tree (init_lora forgotten) would be split, saved or optimised with its whole
    weight as the trainable part; a dropout tree would lose its adapter."""
    params, spec, lp = _lora_tree()
    call = {"partition": lambda t: lorax.partition(t, spec),
            "split_lora_params": lambda t: lorax.split_lora_params(t, spec),
            "save_adapter": lambda t: lorax.save_adapter(tmp_path / "a.safetensors", t, spec)}[name]
    with pytest.raises(ValueError, match=rf"{name}: the spec gives 'w' LoRA rank 2.*float32\[8, 4\]"):
        call(params)
    with pytest.raises(ValueError, match="LoraDropout"):
        call(lorax.dropout(lp, jax.random.PRNGKey(1), 0.1))
    assert not (tmp_path / "a.safetensors").exists()
    call(lp)  # the LoRA tree itself


def test_merge_params_checks_its_flags_and_keeps_the_weights():
    _, _, lp = _lora_tree()
    for flag in ("destructive", "requantize"):
        with pytest.raises(TypeError, match=f"merge_params: {flag} must be True or False, got 'no'"):
            lorax.merge_params(lp, **{flag: "no"})
    assert not lp["w"].w.is_deleted()  # a truthy string once meant "delete them"
    with pytest.raises(ValueError, match="'w' is a LoraDropout"):
        lorax.merge_params(lorax.dropout(lp, jax.random.PRNGKey(1), 0.1))


def test_merge_params_of_a_weight_in_host_memory_merges_it_there():
    _, _, lp = _lora_tree()
    offloaded = lorax.offload_frozen(lp)
    merged = lorax.merge_params(offloaded)
    assert merged["w"].sharding.memory_kind == "pinned_host"
    assert_close(np.asarray(merged["w"]), np.asarray(lorax.merge_params(lp)["w"]))
    assert not offloaded["w"].w.is_deleted()
