"""`examples/shakespeare/llama.py` on Hugging Face checkpoints of the Llama family, through
`hf_loader` (`lorax.load_safetensors`): logits equal transformers' on tiny random
checkpoints transformers wrote (tests/data/models, made by scripts/make_model_fixtures.py;
kept equal to transformers by scripts/test-checkpoints), one per architecture's
distinguishing part: Llama 3.1's RoPE rule and untied head, Qwen 3's per-head q/k norm and
head size, Qwen 2.5's q/k/v biases, Mistral's sliding window; and a bitsandbytes NF4
checkpoint (Unsloth's `*-bnb-4bit` layout) trained as its codes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax
from examples.shakespeare import gemma3, hf_loader, llama
from tests.conftest import assert_close

MODELS = Path(__file__).resolve().parent.parent / "data" / "models"
ARCHS = ["llama3", "qwen3", "qwen2", "mistral"]


def _logits(name: str, stack: bool) -> tuple[np.ndarray, dict]:
    cfg, params, _ = hf_loader.load(MODELS / name, stack=stack, dtype=jnp.float32)
    ref = np.load(MODELS / name / "reference.npz")
    f = jax.jit(lorax.lora(lambda p, x: llama.logits(cfg._replace(attention="xla"), p, x),
                           on_materialize="error"))
    return np.asarray(f(params, jnp.asarray(ref["input_ids"]))), ref


@pytest.mark.parametrize("stack", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", ARCHS)
def test_logits_equal_transformers(name, stack):
    got, ref = _logits(name, stack)
    assert np.abs(got - ref["logits"]).max() <= 1e-4


def test_gemma3_logits_equal_transformers():
    """Gemma 3 stays its own model (gemma3.py): sliding and global layers with their RoPE
    bases, norms around attention and MLP stored without Gemma's `1 +`."""
    cfg, params, _ = hf_loader.load(MODELS / "gemma3", dtype=jnp.float32)
    assert isinstance(cfg, gemma3.Config) and cfg.sliding == (True, True, False)
    assert (cfg.rope_theta, cfg.rope_theta_local, cfg.window) == (1e6, 1e4, 5)
    ref = np.load(MODELS / "gemma3" / "reference.npz")
    f = jax.jit(lorax.lora(lambda p, x: gemma3.logits(cfg._replace(attention="xla"), p, x),
                           on_materialize="error"))
    got = np.asarray(f(params, jnp.asarray(ref["input_ids"])))
    assert np.abs(got - ref["logits"]).max() <= 1e-4
    # Negative control: the norms as stored (without `1 +`) are another model.
    raw = jax.tree.map(lambda x: x, params)
    raw["final_norm"] = raw["final_norm"] - 1.0
    assert np.abs(np.asarray(f(raw, jnp.asarray(ref["input_ids"]))) - ref["logits"]).max() > 1e-2


def test_each_architecture_is_its_own_configuration():
    cfgs = {a: hf_loader.load(MODELS / a)[0] for a in ARCHS}
    assert cfgs["llama3"].rope_scaling == (8.0, 1.0, 4.0, 32)
    assert cfgs["qwen3"].hd == 32 != cfgs["qwen3"].dim // cfgs["qwen3"].n_heads
    assert cfgs["mistral"].window == 5 and cfgs["qwen2"].window is None
    layers = {a: hf_loader.load(MODELS / a)[1]["layers"][0] for a in ARCHS}
    assert {"q_norm", "k_norm"} <= set(layers["qwen3"]) and "q_bias" not in layers["qwen3"]
    assert {"q_bias", "k_bias", "v_bias"} <= set(layers["qwen2"])


def test_the_checks_can_fail():
    """Negative control: without its RoPE rule, Llama 3's logits are off."""
    cfg, params, _ = hf_loader.load(MODELS / "llama3", dtype=jnp.float32)
    ref = np.load(MODELS / "llama3" / "reference.npz")
    got = llama.logits(cfg._replace(rope_scaling=None, attention="xla"), params,
                       jnp.asarray(ref["input_ids"]))
    assert np.abs(np.asarray(got) - ref["logits"]).max() > 1e-3


def test_a_bnb_4bit_checkpoint_runs_on_its_codes():
    """The NF4 codes bitsandbytes saved, read as stored: the logits of transformers on
    bitsandbytes' own float32 dequantization (1e-3), and within bitsandbytes' CPU product,
    which rounds to bfloat16 on the way (its logits are 0.057 from the exact ones)."""
    got, ref = _logits("llama3_bnb4", stack=False)
    assert np.abs(got - ref["logits"]).max() <= 1e-3
    assert np.abs(got - ref["bnb_logits"]).max() <= 0.1
    _, params, _ = hf_loader.load(MODELS / "llama3_bnb4")
    assert all(isinstance(params["layers"][0][k], lorax.QuantizedArray) and
               params["layers"][0][k].qtype == "bnb_nf4" for k in ("q", "up", "down"))


def test_qlora_on_the_bnb_checkpoint_matches_its_dequantized_weights():
    cfg, params, _ = hf_loader.load(MODELS / "llama3_bnb4", stack=True, dtype=jnp.float32)
    windows = jnp.asarray(np.load(MODELS / "llama3_bnb4" / "reference.npz")["input_ids"])
    cfg = cfg._replace(attention="xla")
    spec = lorax.simple_spec(params, targets=r"^layers/(q|k|v|o|gate|up|down)$", rank=4)
    spec = lorax.infer_layout(lambda p, w: llama.loss(cfg, p, w), params, spec, windows)
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    lp = jax.tree.map(lambda w: dataclasses.replace(w, b=jnp.full_like(w.b, 0.05))
                      if isinstance(w, lorax.LoraWeight) else w, lp,
                      is_leaf=lambda w: isinstance(w, lorax.LoraWeight))
    dense = jax.tree.map(lambda w: dataclasses.replace(w, w=w.w.dequantize())
                         if isinstance(w, lorax.LoraWeight) else w, lp,
                         is_leaf=lambda w: isinstance(w, lorax.LoraWeight))
    loss = lorax.lora(lambda p, w: llama.loss(cfg, p, w), on_materialize="error")

    def step(p):
        t, f = lorax.partition(p, spec)
        return jax.jit(jax.value_and_grad(lambda t: loss(lorax.combine(t, f), windows)))(t)

    (v, g), (v_d, g_d) = step(lp), step(dense)
    assert_close(v, v_d)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_d), strict=True):
        assert_close(a, b)


def _edited(tmp_path: Path, name: str, **changes) -> Path:
    d = tmp_path / name
    shutil.copytree(MODELS / name, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    if "layer_types" in cfg and "num_hidden_layers" in changes:  # Gemma 3: one per layer
        cfg["layer_types"] = (cfg["layer_types"] * 2)[:changes["num_hidden_layers"]]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, says", [
    ({"num_attention_heads": 8}, "num_attention_heads"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"intermediate_size": 96}, "intermediate_size"),
    ({"num_hidden_layers": 3}, "layer 2 has no"),
    ({"num_hidden_layers": 1}, "num_hidden_layers = 1"),
    ({"vocab_size": 64}, "vocab_size"),
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
])
@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_a_config_that_disagrees_with_the_tensors_names_the_field(tmp_path, changes, says, name):
    if name == "gemma3" and "rope_parameters" in changes:  # Gemma's: per layer kind
        changes = {"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}
    if name == "gemma3" and changes.get("num_hidden_layers") == 3:  # it has 3; llama3 has 2
        changes, says = {"num_hidden_layers": 4}, "layer 3 has no"
    d = _edited(tmp_path, name, **changes)
    with pytest.raises(ValueError, match=says) as err:
        hf_loader.load(d)
    assert str(d) in str(err.value)


@pytest.mark.parametrize("name, bos", [("gemma3", True), ("llama3", True), ("qwen3", False)])
def test_the_job_takes_each_architecture_with_its_tokenizer(tmp_path, name, bos):
    """`--checkpoint DIR`'s model: Gemma 3 runs gemma3.py (a list of layers), the Llama
    family llama.py (stacked under scan); windows start with a BOS exactly where the
    checkpoint's tokenizer puts one before a text; PEFT's module names are the checkpoint's."""
    from examples.shakespeare import hf_job
    from tests.examples import char_tokenizer

    d = tmp_path / name
    shutil.copytree(MODELS / name, d)
    char_tokenizer.write(d, json.loads((d / "config.json").read_text())["vocab_size"], bos)
    model = hf_job.model_for(d)
    params, config, tok = model.load()
    cfg = model.module.Config(**config)
    gemma = name == "gemma3"
    assert model.module is (gemma3 if gemma else llama) and model.bos is bos
    assert isinstance(params["layers"], list) is gemma
    assert tok.bos == (2 if bos else None) and tok.encode("ab").ids == tok.encode_batch(["ab"])[0].ids
    assert model.eos == "<eos>" and tok.token_to_id(model.eos) == 1
    assert model.hf_modules("layers/2/down" if gemma else "layers/down", 2) == (
        "model.layers.2.mlp.down_proj")
    windows = hf_job.held_out_windows(d, n=2, seq=16)
    assert windows.shape == (2, 17) and ((windows[:, 0] == 2).all() if bos else (windows != 2).all())
    logits = model.module.logits(cfg._replace(attention="xla"), params, jnp.asarray(windows))
    assert logits.shape == (2, 17, cfg.vocab) and np.isfinite(np.asarray(logits)).all()


def test_a_directory_without_its_files_says_what_is_missing(tmp_path):
    from examples.shakespeare import hf_job

    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_job.model_for(tmp_path)
    shutil.copytree(MODELS / "qwen3", tmp_path / "q")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        hf_job.model_for(tmp_path / "q")
