"""Property tests: save_peft / load_peft over random layouts, shapes, ranks, alphas, stacks.

For every layout, the files hold PEFT's update of torch's view of the weight
(`W_torch + s·B@A`, embeddings `+ s·(B@A).T`, convs `+ s·B ⋆ A`) equal to lorax's
`w + (alpha / k)·b@a` seen the same way, and loading them back gives the factors bit
for bit. Host numpy only: no XLA program per example.
"""

from __future__ import annotations

import json
import tempfile

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

import lorax

P = "base_model.model."
dims = st.integers(1, 5)


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(["in_out", "out_in", "embedding", "conv_in_out", "conv_out_in"]))
    if layout in ("in_out", "out_in"):
        m_shape = tuple(draw(st.lists(dims, min_size=1, max_size=2)))
        n_shape = tuple(draw(st.lists(dims, min_size=1, max_size=2)))
    elif layout == "embedding":
        m_shape, n_shape = (draw(dims),), (draw(dims),)
    else:
        window = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
        cin, cout = draw(dims), draw(dims)
        m_shape, n_shape = ((*window, cin), (cout,)) if layout == "conv_in_out" else ((cout,), (cin, *window))
    layers = draw(st.sampled_from([None, 1, 3]))
    rank = draw(st.integers(1, 4))
    alpha = draw(st.sampled_from([1.0, 2.0, 16.0, 0.5]))
    seed = draw(st.integers(0, 2**16))
    return layout, m_shape, n_shape, layers, rank, alpha, seed


def torch_view(layout, w, n_m):
    """The base weight as torch stores it."""
    m = int(np.prod(w.shape[:n_m]))
    return {"in_out": lambda: w.reshape(m, -1).T, "out_in": lambda: w.reshape(m, -1),
            "embedding": lambda: w, "conv_in_out": lambda: np.moveaxis(np.moveaxis(w, -1, 0), -1, 1),
            "conv_out_in": lambda: w}[layout]()


def peft_update(layout, a, b, s):
    if layout in ("in_out", "out_in"):
        return s * b @ a
    if layout == "embedding":
        return s * (b @ a).T
    return s * np.einsum("or,ri...->oi...", b.reshape(b.shape[:2]), a)


@given(cases())
def test_save_load_round_trip_and_peft_update(case):
    layout, m_shape, n_shape, layers, rank, alpha, seed = case
    rng = np.random.default_rng(seed)
    batch = () if layers is None else (layers,)
    w = rng.standard_normal((*batch, *m_shape, *n_shape)).astype(np.float32)
    a = rng.standard_normal((*batch, rank, *n_shape)).astype(np.float32)
    b = rng.standard_normal((*batch, *m_shape, rank)).astype(np.float32)
    lw = lorax.LoraWeight(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), alpha=alpha)
    names = {"layers/x": "layers.{layer}.x" if layers else "x"}
    with tempfile.TemporaryDirectory() as d:
        lorax.save_peft(d, {"layers": {"x": lw}}, module_name=names, layout=layout)
        config = json.load(open(f"{d}/adapter_config.json"))
        tensors = safetensors.numpy.load_file(f"{d}/adapter_model.safetensors")
        # A weight whose axes split into torch's (out, in) two ways (size-1 axes) is
        # loaded onto a LoRA tree that says which; any other onto the plain array.
        n_in_out = (int(np.prod(m_shape)), int(np.prod(n_shape)))
        unbatched = (*m_shape, *n_shape)
        splits = [m for m in range(1, len(unbatched))
                  if (int(np.prod(unbatched[:m])), int(np.prod(unbatched[m:]))) == n_in_out]
        target = jnp.asarray(w)
        if layout in ("in_out", "out_in") and len(splits) > 1:
            target = lorax.LoraWeight(target, jnp.zeros_like(a), jnp.zeros_like(b))
        loaded, spec = lorax.load_peft(d, {"layers": {"x": target}},
                                       module_name=names, layout=layout)

    assert config["r"] == rank and config["lora_alpha"] == alpha
    s = alpha / rank
    effective = w + s * np.einsum("...ik,...kj->...ij", b.reshape(*batch, -1, rank),
                                  a.reshape(*batch, rank, -1)).reshape(w.shape)
    suffix = ("lora_embedding_A", "lora_embedding_B") if layout == "embedding" else (
        "lora_A.weight", "lora_B.weight")
    for layer in range(layers or 1):
        module = f"layers.{layer}.x" if layers else "x"
        ta, tb = tensors[f"{P}{module}.{suffix[0]}"], tensors[f"{P}{module}.{suffix[1]}"]
        pick = (lambda x: x[layer]) if layers else (lambda x: x)
        base = torch_view(layout, pick(w), len(m_shape))
        assert_close(base + peft_update(layout, ta, tb, s), torch_view(layout, pick(effective), len(m_shape)))

    got = loaded["layers"]["x"]
    np.testing.assert_array_equal(got.a, a)
    np.testing.assert_array_equal(got.b, b)
    assert got.alpha == alpha and spec["layers"]["x"].batch_ndim == len(batch)
