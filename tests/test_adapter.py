"""Adapters on disk: bit-exact round trips and errors that name the path."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import lorax


def _trained(dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {
        "blocks": {"q": jax.random.normal(keys[0], (3, 16, 2, 8)).astype(dtype),
                   "bias": jnp.zeros((3, 16), dtype)},
        "head": jax.random.normal(keys[1], (16, 10)).astype(dtype),
        "norm": jnp.ones(16, dtype),
    }
    spec = {"blocks": {"q": lorax.LoraSpec(4, alpha=8.0, batch_ndim=1, m_ndim=1), "bias": 0},
            "head": 2, "norm": lorax.LORA_FULL}
    lp = lorax.init_lora(params, spec, keys[2], dtype=dtype)
    # Pretend training moved every trainable array.
    noise = lambda x, k: x + jax.random.normal(k, x.shape, x.dtype)  # noqa: E731
    q, h = lp["blocks"]["q"], lp["head"]
    lp["blocks"]["q"] = lorax.LoraWeight(q.w, noise(q.a, keys[3]), noise(q.b, keys[4]), alpha=q.alpha)
    lp["head"] = lorax.LoraWeight(h.w, h.a, noise(h.b, keys[3]), alpha=h.alpha)
    lp["norm"] = noise(lp["norm"], keys[4])
    return params, spec, lp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    params, spec, lp = _trained(dtype)
    path = tmp_path / "adapter.safetensors"
    lorax.save_adapter(path, lp, spec, metadata={"base_model": "toy"})
    loaded, loaded_spec = lorax.load_adapter(path, params)
    assert jax.tree.structure(loaded) == jax.tree.structure(lp)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(lp)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert loaded["blocks"]["q"].alpha == 8.0 and loaded["blocks"]["q"].structure == (1, 1, 2)
    assert loaded["blocks"]["bias"] is params["blocks"]["bias"]  # frozen leaves are the base's
    assert loaded_spec["blocks"]["q"] == lorax.LoraSpec(4, 8.0, 1, 1)
    assert loaded_spec["norm"] == lorax.LORA_FULL and loaded_spec["blocks"]["bias"] == 0
    # A standard safetensors reader sees exactly the trainable tensors and our metadata.
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    assert meta["base_model"] == "toy" and meta["lorax_version"] == lorax.__version__
    if dtype == jnp.float32:
        tensors = safetensors.numpy.load_file(str(path))
        assert sorted(tensors) == sorted(["['blocks']['q'].a", "['blocks']['q'].b", "['head'].a",
                                          "['head'].b", "['norm']"])
        np.testing.assert_array_equal(tensors["['head'].b"], np.asarray(lp["head"].b))
    # The file holds only trainable bytes, not the frozen weights.
    trainable = sum(x.nbytes for x in jax.tree.leaves(lorax.split_lora_params(lp, spec)))
    assert path.stat().st_size < trainable + 4096


def test_wrong_base_errors_name_the_path(tmp_path):
    params, spec, lp = _trained()
    path = tmp_path / "adapter.safetensors"
    lorax.save_adapter(path, lp, spec)

    missing = dict(params)
    del missing["head"]
    with pytest.raises(ValueError, match=r"\['head'\].*base parameters do not"):
        lorax.load_adapter(path, missing)

    wrong_shape = dict(params, head=jnp.zeros((16, 12)))
    with pytest.raises(ValueError, match=r"\['head'\] has shape \(16, 12\)"):
        lorax.load_adapter(path, wrong_shape)

    other_rank = lorax.init_lora(params, dict(spec, head=3), jax.random.PRNGKey(9))
    with pytest.raises(ValueError, match=r"\['head'\] has rank 3.*rank 2"):
        lorax.load_adapter(path, other_rank)

    full_shape = dict(params, norm=jnp.ones(17))
    with pytest.raises(ValueError, match=r"\['norm'\] has shape \(17,\)"):
        lorax.load_adapter(path, full_shape)

    plain = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"x": np.ones(3, np.float32)}, str(plain))
    with pytest.raises(ValueError, match="not a lorax adapter"):
        lorax.load_adapter(plain, params)


def test_load_onto_lora_params_of_same_rank_replaces_factors(tmp_path):
    params, spec, lp = _trained()
    path = tmp_path / "adapter.safetensors"
    lorax.save_adapter(path, lp, spec)
    fresh = lorax.init_lora(params, spec, jax.random.PRNGKey(7))
    loaded, _ = lorax.load_adapter(path, fresh)
    np.testing.assert_array_equal(loaded["head"].b, lp["head"].b)
    assert loaded["head"].w is fresh["head"].w


@pytest.mark.parametrize("metadata, error, match", [
    ({"n": 3}, TypeError, r"metadata\['n'\] must be a str"),          # was an unreadable file
    ({3: "x"}, TypeError, r"metadata keys must be str, got 3"),
    ({"entries": "[]"}, ValueError, r"metadata key 'entries' is lorax's own"),  # loaded empty
    ({"format": "x"}, ValueError, r"metadata key 'format' is lorax's own"),     # unloadable
    ({"lorax_version": "0"}, ValueError, r"metadata key 'lorax_version' is lorax's own"),
    ([("base", "x")], TypeError, r"metadata must be a dict of str to str, got list"),
])
def test_metadata_is_str_to_str_and_leaves_lorax_keys_alone(tmp_path, metadata, error, match):
    params, spec, lp = _trained()
    path = tmp_path / "adapter.safetensors"
    with pytest.raises(error, match=r"save_adapter: " + match):
        lorax.save_adapter(path, lp, spec, metadata=metadata)
    assert not path.exists()
    lorax.save_adapter(path, lp, spec, metadata={"base_model": "tiny"})
    with safetensors.safe_open(str(path), "numpy") as f:
        assert f.metadata()["base_model"] == "tiny"
    loaded, _ = lorax.load_adapter(path, params)
    np.testing.assert_array_equal(loaded["head"].b, lp["head"].b)
