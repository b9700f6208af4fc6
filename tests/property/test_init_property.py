"""Property test: every initialisation leaves the effective weight `w + s * b @ a` equal
to the original weight (up to rounding), over random batch / M / N axes, ranks, alphas
and input sides."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

import lorax


@given(
    nb=st.integers(0, 1), nm=st.integers(1, 2), nn=st.integers(1, 2),
    sizes=st.lists(st.integers(1, 6), min_size=5, max_size=5),
    k=st.integers(1, 4), alpha=st.sampled_from([1.0, 8.0]),
    input_factor=st.sampled_from(["a", "b"]),
    method=st.sampled_from(["gaussian", "pissa", "pissa_niter_2", "olora"]),
    seed=st.integers(0, 2**16),
)
def test_initialisations_keep_the_weight(nb, nm, nn, sizes, k, alpha, input_factor, method, seed):
    shape = tuple(sizes[: nb + nm + nn])
    m, n = int(np.prod(shape[nb:nb + nm])), int(np.prod(shape[nb + nm:]))
    if method != "gaussian":
        k = min(k, m, n)  # larger ranks are an error (tests/variants/test_init.py)
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
    ls = lorax.LoraSpec(k, alpha, batch_ndim=nb, m_ndim=nm, input_factor=input_factor)
    with warnings.catch_warnings():  # rank >= min(M, N) on tiny shapes: valid, warned
        warnings.simplefilter("ignore", UserWarning)
        lp = lorax.init_lora({"w": w}, {"w": ls}, jax.random.PRNGKey(seed), init=method)
    lw = lp["w"]
    assert lw.w.shape == shape and lw.rank == k
    assert_close(lw.materialize(), w, rtol=1e-5, atol=1e-5)
