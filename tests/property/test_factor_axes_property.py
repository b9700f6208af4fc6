"""Property test: a weight factored over any split of its axes (`m_axes` not contiguous),
contracted by `dot_general` with random dimension numbers and reached through random
transposes, equals its merged weight in values and factor gradients."""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

import lorax


@st.composite
def cases(draw):
    nb = draw(st.integers(0, 1))
    n_rest = draw(st.integers(2, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=nb + n_rest, max_size=nb + n_rest)))
    rest = list(range(nb, nb + n_rest))
    m = sorted(draw(st.lists(st.sampled_from(rest), min_size=1, max_size=n_rest - 1, unique=True)))
    contracted = sorted(draw(st.lists(st.sampled_from(rest), min_size=1, unique=True)))
    perm = draw(st.permutations(rest))
    rank = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    return nb, shape, tuple(m), tuple(contracted), (*range(nb), *perm), rank, seed


@given(cases())
def test_any_split_through_transpose_and_dot_general(case):
    nb, shape, m, contracted, perm, rank, seed = case
    rng = np.random.default_rng(seed)
    n = [i for i in range(nb, len(shape)) if i not in m]
    pick = lambda axes: [shape[i] for i in axes]  # noqa: E731
    lw = lorax.LoraWeight(
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        a=jnp.asarray(rng.standard_normal((*shape[:nb], rank, *pick(n))), jnp.float32),
        b=jnp.asarray(rng.standard_normal((*shape[:nb], *pick(m), rank)), jnp.float32),
        alpha=1.5, m_axes=m)
    # An input carrying the contracted axes (after the transpose) plus the batch axes.
    letters = string.ascii_lowercase
    w_labels = "".join(letters[perm[i]] for i in range(len(shape)))
    x_axes = [*range(nb), *contracted]
    x_labels = "".join(letters[i] for i in x_axes) + "y"
    out = "".join(letters[i] for i in range(nb)) + "y" + "".join(
        letters[perm[i]] for i in range(nb, len(shape)) if perm[i] not in contracted)
    eq = f"{x_labels},{w_labels}->{out}"
    x = jnp.asarray(rng.standard_normal([shape[i] for i in x_axes] + [2]), jnp.float32)
    f = lambda w, x: jnp.einsum(eq, x, jnp.transpose(w, perm))  # noqa: E731
    run = lorax.lora(f, on_materialize="error")
    assert_close(run(lw, x), f(lw.materialize(), x))

    def loss(a, b, low_rank):
        l2 = lorax.LoraWeight(lw.w, a, b, alpha=lw.alpha, m_axes=lw.m_axes)
        return jnp.sum(jnp.sin(run(l2, x) if low_rank else f(l2.materialize(), x)))

    for got, want in zip(jax.grad(loss, (0, 1))(lw.a, lw.b, True),
                         jax.grad(loss, (0, 1))(lw.a, lw.b, False)):
        assert_close(got, want)
