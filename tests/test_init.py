"""init_lora: defaults, rsLoRA, explicit factorisations, and bad-input errors naming the path."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax


def test_defaults_match_lorax_03():
    w = jax.random.normal(jax.random.PRNGKey(0), (32, 16))
    lw = lorax.init_lora({"w": w}, {"w": 4}, jax.random.PRNGKey(1))["w"]
    assert lw.alpha == 1.0 and lw.a.dtype == jnp.float32
    assert (lw.b == 0).all()
    assert abs(float(lw.a.std()) - 0.01) < 0.004
    np.testing.assert_array_equal(lw.materialize(), w)  # exact: b == 0 adds exact zeros


def test_rslora_scales_by_sqrt_rank():
    lw = lorax.init_lora({"w": jnp.ones((32, 16))}, {"w": 4}, jax.random.PRNGKey(1),
                         alpha=8.0, rslora=True)["w"]
    assert math.isclose(lw.scale, 8.0 / math.sqrt(4))


def test_explicit_factorisations():
    params = {"q": jnp.zeros((2, 16, 4, 8)), "o": jnp.zeros((4, 8, 16))}
    spec = {"q": lorax.LoraSpec(3, batch_ndim=1, m_ndim=1), "o": lorax.LoraSpec(3, m_ndim=2)}
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
    assert lp["q"].b.shape == (2, 16, 3) and lp["q"].a.shape == (2, 3, 4, 8)
    assert lp["o"].b.shape == (4, 8, 3) and lp["o"].a.shape == (3, 16)
    assert lp["q"].structure == (1, 1, 2) and lp["q"].a.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "spec_val, match",
    [(-2, "int rank > 0"), (lorax.LoraSpec(0), "integer >= 1"),
     (lorax.LoraSpec(2.5), "integer >= 1"), (lorax.LoraSpec(True), "integer >= 1"),
     (lorax.LoraSpec(2, m_ndim=2), "each side"), (2.0, "int rank")],
)
def test_bad_ranks_name_the_path(spec_val, match):
    params = {"block": {"kernel": jnp.zeros((8, 16))}}
    with pytest.raises(ValueError, match=match) as info:
        lorax.init_lora(params, {"block": {"kernel": spec_val}}, jax.random.PRNGKey(0))
    assert "block/kernel" in str(info.value)


def test_rank_on_vector_or_int_leaf_names_the_path():
    with pytest.raises(ValueError, match="norm/scale"):
        lorax.init_lora({"norm": {"scale": jnp.ones(8)}}, {"norm": {"scale": 2}}, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="'ids'.*floating"):
        lorax.init_lora({"ids": jnp.zeros((8, 8), jnp.int32)}, {"ids": 2}, jax.random.PRNGKey(0))


def test_frozen_and_full_leaves_are_the_same_objects():
    params = {"a": jnp.ones((4, 4)), "b": jnp.ones(4)}
    lp = lorax.init_lora(params, {"a": 0, "b": -1}, jax.random.PRNGKey(0))
    assert lp["a"] is params["a"] and lp["b"] is params["b"]


def test_an_integer_factor_dtype_is_an_error():
    with pytest.raises(ValueError, match="init_lora: dtype is the factors'.*int8"):
        lorax.init_lora({"w": jnp.ones((8, 4))}, {"w": 2}, jax.random.PRNGKey(0), dtype=jnp.int8)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(alpha=float("nan")), ValueError, "init_lora: alpha must be a finite number"),
    (dict(alpha=None), TypeError, "init_lora: alpha must be a real number, got None"),
    (dict(stddev="0.1"), TypeError, "init_lora: stddev must be a real number"),
    (dict(rslora="no"), TypeError, "init_lora: rslora must be True or False"),
    (dict(dora="no"), TypeError, "init_lora: dora must be True or False"),
])
def test_init_lora_checks_its_numbers_and_flags(kwargs, error, match):
    with pytest.raises(error, match=match):
        lorax.init_lora({"w": jnp.ones((8, 4))}, {"w": 2}, jax.random.PRNGKey(0), **kwargs)


@pytest.mark.parametrize("spec_val, match", [
    (lorax.LoraSpec(2, alpha=float("inf")), "alpha at 'block/kernel' must be a finite"),
    (lorax.LoraSpec(2, alpha="x"), "alpha at 'block/kernel' must be a real number"),
    (lorax.LoraSpec(2, batch_ndim=-1), "batch_ndim at 'block/kernel' must be None or an int >= 0"),
    (lorax.LoraSpec(2, m_ndim=1.0), "m_ndim at 'block/kernel' must be None or an int >= 0"),
    (lorax.LoraSpec(2, dora="no"), "dora at 'block/kernel' must be True or False"),
])
def test_a_lora_specs_fields_are_checked_at_their_path(spec_val, match):
    with pytest.raises((ValueError, TypeError), match=match):
        lorax.init_lora({"block": {"kernel": jnp.zeros((8, 16))}}, {"block": {"kernel": spec_val}},
                        jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="LoraSpec.m_axes must be None or a tuple of ints"):
        lorax.LoraSpec(2, m_axes=1)


def test_init_lora_refuses_a_tree_that_already_has_its_factors():
    lp = lorax.init_lora({"w": jnp.ones((8, 4))}, {"w": 2}, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="init_lora: 'w' is already a LoraWeight"):
        lorax.init_lora(lp, {"w": 4}, jax.random.PRNGKey(1))
    assert lorax.init_lora(lp, {"w": 0}, jax.random.PRNGKey(1))["w"] is lp["w"]  # kept frozen
