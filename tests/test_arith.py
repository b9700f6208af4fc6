"""Adapter arithmetic (lorax/_arith.py) against PEFT's definitions, computed densely here."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax
from conftest import assert_close


def _is_lora(x):
    return isinstance(x, lorax.LoraWeight)


def _adapters():
    """Three adapters over one base: a stacked (layers, in, out) kernel, a multi-axis
    DenseGeneral kernel adapted by two of them, and a frozen leaf."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"layers": jax.random.normal(k[0], (2, 24, 16)), "proj": jax.random.normal(k[1], (16, 2, 8)),
              "norm": jnp.ones(16)}
    out = []
    for i, (rank, alpha, proj) in enumerate([(4, 8.0, True), (2, 3.0, True), (4, 1.0, False)]):
        spec = {"layers": lorax.LoraSpec(rank, alpha, batch_ndim=1), "norm": lorax.LORA_FREEZE,
                "proj": lorax.LoraSpec(rank, alpha, m_ndim=1) if proj else lorax.LORA_FREEZE}
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(10 + i), stddev=0.5)
        keys = iter(jax.random.split(jax.random.PRNGKey(20 + i), 4))
        out.append(jax.tree.map(lambda w: lorax.LoraWeight(w.w, w.a, 0.5 * jax.random.normal(next(keys), w.b.shape),
                                                           w.alpha) if _is_lora(w) else w, lp, is_leaf=_is_lora))
    return params, out


def _update(tree, name, base):
    return np.asarray(tree[name].materialize() - base[name], np.float64) if _is_lora(tree[name]) else 0.0


def _matrix(x, nb, nm):
    return x.reshape(*x.shape[:nb], int(np.prod(x.shape[nb:nb + nm])), -1)


@pytest.mark.parametrize("how", ["cat", "svd"])
def test_cat_and_svd(how):
    params, adapters = _adapters()
    weights = [0.7, -0.4, 1.3]
    got = lorax.add_weighted_adapter(adapters, weights, how, svd_rank=3 if how == "svd" else None)
    assert got["norm"] is params["norm"] and got["layers"].w is params["layers"]
    for name, nb, nm, adapted in (("layers", 1, 1, [0, 1, 2]), ("proj", 0, 1, [0, 1])):
        want = sum(w * _update(t, name, params) for i, (w, t) in enumerate(zip(weights, adapters))
                   if i in adapted)
        lw = got[name]
        assert lw.alpha == lw.rank  # scale 1, as PEFT
        upd = _update(got, name, params)
        if how == "cat":
            assert lw.rank == sum(adapters[i][name].rank for i in adapted)
            assert_close(upd, want, rtol=1e-5, atol=1e-5, err_msg=name)
        else:
            assert lw.rank == 3
            # The best rank-3 approximation of the weighted sum, from a dense SVD (PEFT's way).
            m = _matrix(want, nb, nm)
            u, s, vh = np.linalg.svd(m, full_matrices=False)
            ref = (u[..., :, :3] * s[..., None, :3]) @ vh[..., :3, :]
            assert_close(_matrix(upd, nb, nm), ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_linear_is_peft_s_combination_of_the_factors():
    params, adapters = _adapters()
    same_rank = [adapters[0], adapters[2]]
    weights = [0.5, -2.0]
    got = lorax.add_weighted_adapter(same_rank, weights, "linear")
    ws = [w * t["layers"].scale for w, t in zip(weights, same_rank)]
    b = sum(math.sqrt(abs(w)) * np.asarray(t["layers"].b) for w, t in zip(ws, same_rank))
    a = sum(math.copysign(math.sqrt(abs(w)), w) * np.asarray(t["layers"].a) for w, t in zip(ws, same_rank))
    assert_close(got["layers"].b, b, rtol=1e-5, atol=1e-6)
    assert_close(got["layers"].a, a, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"'linear' needs equal ranks; 'layers' has ranks \[2, 4\]"):
        lorax.add_weighted_adapter(adapters, [1, 1, 1], "linear")


def test_svd_forms_no_weight_sized_array():
    """The svd combination works from the factors: no (M, N) array in its jaxpr."""
    params, adapters = _adapters()
    jaxpr = jax.make_jaxpr(lambda ts: lorax.add_weighted_adapter(ts, [1.0, 1.0, 1.0], "svd"))(adapters)
    shapes = [tuple(v.aval.shape) for e in jaxpr.jaxpr.eqns for v in e.outvars]
    assert (2, 24, 16) not in shapes and (24, 16) not in shapes and (16, 16) not in shapes


def test_errors():
    params, adapters = _adapters()
    with pytest.raises(ValueError, match="one weight per adapter"):
        lorax.add_weighted_adapter(adapters, [1.0])
    with pytest.raises(ValueError, match="combination_type must be"):
        lorax.add_weighted_adapter(adapters, [1, 1, 1], "ties")
    moved = dict(adapters[1], norm=adapters[1]["norm"] + 1)
    with pytest.raises(ValueError, match=r"frozen weight of 'norm' differs between adapter 0 and adapter 1"):
        lorax.add_weighted_adapter([adapters[0], moved], [1, 1])
    dora = lorax.init_lora(params, {"layers": lorax.LoraSpec(2, batch_ndim=1, dora=True), "proj": 0,
                                    "norm": 0}, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"'layers' is a DoraWeight"):
        lorax.add_weighted_adapter([dora, dora], [1, 1], "cat")


def test_errors_in_the_arguments_name_them():
    params, adapters = _adapters()
    with pytest.raises(ValueError, match=r"weights\[1\] must be a finite number, got nan"):
        lorax.add_weighted_adapter(adapters, [1.0, float("nan"), 1.0], "cat")
    with pytest.raises(ValueError, match=r"weights\[0\] must be a finite number, got inf"):
        lorax.add_weighted_adapter(adapters, [np.inf, 1.0, 1.0], "cat")
    with pytest.raises(TypeError, match=r"weights\[2\] must be a real number, got '1'"):
        lorax.add_weighted_adapter(adapters, [1.0, 1.0, "1"], "cat")
    with pytest.raises(TypeError, match=r"weights must be a sequence of numbers.*got 0\.5"):
        lorax.add_weighted_adapter(adapters, 0.5)
    with pytest.raises(TypeError, match=r"svd_rank must be an int or None, got 2\.5"):
        lorax.add_weighted_adapter(adapters, [1, 1, 1], "svd", svd_rank=2.5)
    with pytest.raises(TypeError, match=r"adapters must be a sequence \(a list\) of LoRA "
                                        r"parameter trees, got a dict"):
        lorax.add_weighted_adapter(adapters[0], [1.0])
    out = lorax.add_weighted_adapter(adapters, jnp.array([0.5, 0.25, 1.0]), "cat")
    assert out["layers"].rank == 10


def test_a_stack_is_not_one_adapter():
    """A stack's adapter axis was read as a batch axis: a LoraWeight shape error naming
    no key path."""
    params, adapters = _adapters()
    stack = lorax.stack_adapters(adapters[:2])
    with pytest.raises(ValueError, match=r"add_weighted_adapter: 'layers' in adapter 0 is a stack "
                                         r"of 2 adapters.*lorax\.unstack_adapters"):
        lorax.add_weighted_adapter([stack], [1.0], "cat")


@pytest.mark.parametrize("how", ["cat", "linear", "svd"])
def test_traced_weights_give_the_concrete_result(how):
    """Weights passed through `jax.jit` combine as the same numbers given directly."""
    params, adapters = _adapters()
    ts = adapters if how != "linear" else [adapters[0], adapters[2]]
    weights = [0.7, -0.4, 1.3][: len(ts)]
    got = jax.jit(lambda w: lorax.add_weighted_adapter(ts, w, how))(jnp.asarray(weights))
    want = lorax.add_weighted_adapter(ts, weights, how)
    for name in ("layers", "proj"):
        assert_close(_update(got, name, params), _update(want, name, params), rtol=1e-4, atol=1e-5)


def test_mixing_weights_are_learnable():
    """d/dw of a loss of the "cat" combination is that of Σ w_i update_i, computed densely."""
    params, adapters = _adapters()
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 3, 24))

    def loss(w):
        combined = lorax.add_weighted_adapter(adapters, w, "cat")
        return jnp.sum(jnp.tanh(jnp.einsum("lbm,lmn->lbn", x, combined["layers"].materialize())))

    def dense(w):
        update = sum(wi * (t["layers"].materialize() - params["layers"]) for wi, t in zip(w, adapters))
        return jnp.sum(jnp.tanh(jnp.einsum("lbm,lmn->lbn", x, params["layers"] + update)))

    w = jnp.array([0.7, -0.4, 1.3])
    assert_close(jax.grad(loss)(w), jax.grad(dense)(w), rtol=1e-4, atol=1e-5)
    assert np.all(np.abs(np.asarray(jax.grad(loss)(w))) > 1e-3)  # a gradient that can fail
