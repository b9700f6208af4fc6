"""The Shakespeare job's nucleus sampler on hand-made distributions (no model needed)."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.shakespeare.llama import sample_token  # noqa: E402

# The most probable token is not first, so a sampler that forgets to sort fails.
PROBS = np.array([0.15, 0.5, 0.05, 0.3])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32)) + 1.7  # softmax ignores the shift
N = 20_000


def draw_frequencies(temperature, top_p, logits=LOGITS, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), N)
    draws = jax.jit(jax.vmap(lambda k: sample_token(logits, k, temperature, top_p)))(keys)
    return np.bincount(np.asarray(draws), minlength=logits.shape[0]) / N


def nucleus(probs, keep):
    out = np.zeros_like(probs)
    out[list(keep)] = probs[list(keep)]
    return out / out.sum()


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.49])
def test_small_p_draws_only_the_argmax(top_p):
    assert draw_frequencies(1.0, top_p).tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("top_p, keep", [
    (0.51, {1, 3}),      # 0.5 is short of p: the next token is needed to reach it
    (0.79, {1, 3}),
    (0.81, {1, 3, 0}),   # 0.5 + 0.3 = 0.8 is short of 0.81
    (0.96, {1, 3, 0, 2}),
])
def test_nucleus_is_the_smallest_set_reaching_p_renormalised(top_p, keep):
    freq = draw_frequencies(1.0, top_p)
    expected = nucleus(PROBS, keep)
    assert set(np.flatnonzero(freq)) == keep
    np.testing.assert_allclose(freq, expected, atol=0.015)  # >4 standard errors at N=20k


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("top_p", [1.0, 0.999])  # the unsorted shortcut and the sorted path
def test_full_nucleus_matches_tempered_softmax(temperature, top_p):
    expected = np.asarray(jax.nn.softmax(LOGITS / temperature))
    np.testing.assert_allclose(draw_frequencies(temperature, top_p), expected, atol=0.015)


def test_temperature_zero_is_greedy_whatever_the_key():
    assert draw_frequencies(0.0, 0.95, seed=3).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_same_key_same_token_with_or_without_the_cut():
    # Draws are made in vocabulary order, so the cut only moves draws of cut tokens.
    logits = jax.random.normal(jax.random.PRNGKey(1), (1000,)) * 3
    keys = jax.random.split(jax.random.PRNGKey(2), 500)
    full = jax.vmap(lambda k: sample_token(logits, k, 1.0, 1.0))(keys)
    cut = jax.vmap(lambda k: sample_token(logits, k, 1.0, 0.9))(keys)
    probs = np.asarray(jax.nn.softmax(logits))
    kept = np.argsort(-probs)[: np.searchsorted(np.cumsum(np.sort(probs)[::-1]), 0.9) + 1]
    in_nucleus = np.isin(np.asarray(full), kept)
    assert in_nucleus.mean() > 0.8
    np.testing.assert_array_equal(np.asarray(cut)[in_nucleus], np.asarray(full)[in_nucleus])
    assert np.isin(np.asarray(cut), kept).all()


def test_rejects_p_outside_unit_interval():
    with pytest.raises(ValueError):
        sample_token(LOGITS, jax.random.PRNGKey(0), 1.0, 0.0)
