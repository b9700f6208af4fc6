"""lorax 0.3's parameter helpers keep their names and semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lorax
from conftest import assert_close


def _params():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "dense": {"kernel": jax.random.normal(k1, (6, 5)), "bias": jnp.zeros(5)},
        "out": {"kernel": jax.random.normal(k2, (5, 3))},
        "conv": jax.random.normal(k3, (3, 3, 2, 4)),
    }


def test_constants_match_lorax_03():
    assert lorax.LORA_FREEZE == 0 and lorax.LORA_FULL == -1


def test_simple_spec_paths_and_vectors():
    seen = []
    spec = lorax.simple_spec(
        _params(), decision_fn=lambda path, w: seen.append(path) or 2, tune_vectors=True
    )
    assert spec["dense"]["bias"] == lorax.LORA_FULL
    assert spec["dense"]["kernel"] == 2 and spec["conv"] == 2
    assert sorted(seen) == ["conv", "dense/kernel", "out/kernel"]
    frozen = lorax.simple_spec(_params())
    assert set(jax.tree.leaves(frozen)) == {lorax.LORA_FREEZE}


def test_init_lora_shapes_and_identity_at_init():
    params = _params()
    spec = {"dense": {"kernel": 3, "bias": lorax.LORA_FULL}, "out": {"kernel": 0}, "conv": 2}
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1), alpha=4.0)
    lw = lp["dense"]["kernel"]
    assert isinstance(lw, lorax.LoraWeight)
    assert lw.b.shape == (6, 3) and lw.a.shape == (3, 5) and lw.alpha == 4.0
    assert (lw.b == 0).all() and lw.a.std() > 0
    assert lp["dense"]["bias"] is params["dense"]["bias"]
    assert lp["out"]["kernel"] is params["out"]["kernel"]
    assert lp["conv"].b.shape == (3, 3, 2, 2) and lp["conv"].a.shape == (2, 4)
    # Exact: b == 0, so the merge adds exact zeros to w.
    np.testing.assert_array_equal(lorax.merge_params(lp)["dense"]["kernel"], params["dense"]["kernel"])


@pytest.mark.parametrize("bad", [-3, 1.5, "4"])
def test_init_lora_bad_spec_names_path(bad):
    with pytest.raises(ValueError, match="dense/kernel"):
        lorax.init_lora(_params(), {"dense": {"kernel": bad, "bias": 0}, "out": {"kernel": 0}, "conv": 0},
                        jax.random.PRNGKey(0))


def test_init_lora_vector_rank_names_path():
    with pytest.raises(ValueError, match="dense/bias"):
        lorax.init_lora(_params(), {"dense": {"kernel": 0, "bias": 2}, "out": {"kernel": 0}, "conv": 0},
                        jax.random.PRNGKey(0))


def test_wrap_optimizer_freezes_w_and_keeps_no_state_for_it():
    params = _params()
    spec = {"dense": {"kernel": 3, "bias": lorax.LORA_FULL}, "out": {"kernel": 0}, "conv": 0}
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    opt = lorax.wrap_optimizer(optax.adam(1e-1), spec)
    state = opt.init(lp)
    moment_sizes = sorted(x.size for x in jax.tree.leaves(state) if x.ndim > 0)
    # Adam moments (mu, nu) for a (3x5), b (6x3) and the bias (5,) only.
    assert moment_sizes == sorted([15, 18, 5] * 2)

    def loss(p, x):
        h = x @ p["dense"]["kernel"] + p["dense"]["bias"]
        return jnp.sum(jnp.tanh(h) @ p["out"]["kernel"]) + jnp.sum(p["conv"])

    f = lorax.lora(loss, on_materialize="allow")
    x = jnp.ones((2, 6))
    for _ in range(3):
        g = jax.grad(f)(lp, x)
        updates, state = opt.update(g, state, lp)
        lp = optax.apply_updates(lp, updates)
    np.testing.assert_array_equal(lp["dense"]["kernel"].w, params["dense"]["kernel"])
    np.testing.assert_array_equal(lp["out"]["kernel"], params["out"]["kernel"])
    assert not (lp["dense"]["kernel"].b == 0).all()
    assert not (lp["dense"]["bias"] == 0).all()


def test_merge_params_is_non_destructive_by_default():
    params = _params()
    lp = lorax.init_lora(params, {"dense": {"kernel": 3, "bias": 0}, "out": {"kernel": 0}, "conv": 0},
                         jax.random.PRNGKey(1))
    lw = lp["dense"]["kernel"]
    lp["dense"]["kernel"] = lorax.LoraWeight(lw.w, lw.a, lw.b + 1.0, alpha=2.0)
    merged = lorax.merge_params(lp)
    expected = params["dense"]["kernel"] + (2.0 / 3) * (lw.b + 1.0) @ lw.a
    assert_close(merged["dense"]["kernel"], expected, rtol=1e-6)  # jitted merge vs eager ops
    assert merged["dense"]["kernel"].dtype == params["dense"]["kernel"].dtype
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    assert not lp["dense"]["kernel"].w.is_deleted()
    merged2 = lorax.merge_params(lp, destructive=True)
    # Exact: the same jitted merge, only w's donation differs.
    np.testing.assert_array_equal(merged2["dense"]["kernel"], merged["dense"]["kernel"])
    assert lp["dense"]["kernel"].w.is_deleted()
    assert not lp["dense"]["kernel"].a.is_deleted()


def test_split_lora_params_keeps_only_trainable():
    params = _params()
    spec = {"dense": {"kernel": 3, "bias": lorax.LORA_FULL}, "out": {"kernel": 0}, "conv": 0}
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    tr = lorax.split_lora_params(lp, spec)
    assert tr["out"]["kernel"] is None and tr["conv"] is None
    assert tr["dense"]["kernel"].w is None
    assert tr["dense"]["kernel"].a is lp["dense"]["kernel"].a
    assert tr["dense"]["bias"] is lp["dense"]["bias"]
