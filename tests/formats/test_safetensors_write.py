"""`lorax.save_safetensors`: a merged model written as a Hugging Face checkpoint (shards,
index, config without its quantization_config), read back by `lorax.load_safetensors` as
the values written. transformers itself loads what it writes in
tests/examples/test_hf_models_real.py (scripts/test-checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "checkpoints"


def test_a_quantized_checkpoint_goes_back_out_dense_and_sharded(tmp_path):
    tensors, config = lorax.load_safetensors(FIXTURES / "bnb_nf4_dq")
    lorax.save_safetensors(tmp_path, tensors, config, dtype=jnp.float32, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((tmp_path / s).exists() for s in shards)
    assert list(index["weight_map"]) == list(tensors)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in written and written["dtype"] == "float32"
    assert {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in config.items() if k not in ("dtype", "torch_dtype", "quantization_config")}
    back, _ = lorax.load_safetensors(tmp_path)
    for name, x in tensors.items():
        want = x.dequantize(jnp.float32) if isinstance(x, lorax.QuantizedArray) else x
        np.testing.assert_array_equal(back[name], np.asarray(want, np.float32), err_msg=name)


def test_lora_weights_are_merged_and_kernels_transposed_back(tmp_path):
    tensors, config = lorax.load_safetensors(FIXTURES / "bf16_sharded", transpose=True)
    name = "model.layers.0.mlp.up_proj.weight"
    w = tensors[name]
    k = jax.random.PRNGKey(0)
    lw = lorax.LoraWeight(w, a=jax.random.normal(k, (4, w.shape[1]), w.dtype),
                          b=jnp.full((w.shape[0], 4), 0.1, w.dtype), alpha=8.0)
    lorax.save_safetensors(tmp_path, {**tensors, name: lw}, config, transpose=True)
    back, _ = lorax.load_safetensors(tmp_path)  # torch's (out, in), as stored
    assert (tmp_path / "model.safetensors").exists()  # one shard: no index
    np.testing.assert_array_equal(back[name], lorax.merge_params({"w": lw})["w"].T)
    other = "model.layers.0.self_attn.q_proj.weight"
    assert back[other].dtype == jnp.bfloat16
    np.testing.assert_array_equal(back[other], tensors[other].T)


def test_an_act_order_weight_is_written_in_row_order(tmp_path):
    tensors, config = lorax.load_safetensors(FIXTURES / "gptq_desc_act")
    lorax.save_safetensors(tmp_path, tensors, config, dtype=jnp.float32)
    back, _ = lorax.load_safetensors(tmp_path)
    name = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_array_equal(back[name], tensors[name].dequantize(jnp.float32))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_shard_size": "lots"}, "max_shard_size"), ({"max_shard_size": 0}, "max_shard_size"),
    ({"dtype": jnp.int8}, "floating-point"), ({"transpose": "yes"}, "transpose"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        lorax.save_safetensors(tmp_path / "out", {"w": jnp.ones((2, 2))}, **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_value_that_is_not_an_array_names_its_key(tmp_path):
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' is a str"):
        lorax.save_safetensors(tmp_path, {"model.norm.weight": "ones"})
