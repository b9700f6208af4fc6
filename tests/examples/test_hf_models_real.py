"""The model fixtures (tests/data/models) against transformers itself (run by
scripts/test-checkpoints, in its env with torch, transformers and bitsandbytes): made
again by scripts/make_model_fixtures.py, each checkpoint and its logits are the committed
ones, so tests/examples/test_hf_models.py compares lorax with what transformers computes."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # scripts/test-checkpoints checks the imports first

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "data" / "models"


def _script():
    spec = importlib.util.spec_from_file_location("make_model_fixtures",
                                                  ROOT / "scripts" / "make_model_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    _script().make(out)
    return out


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen2", "mistral", "gemma3", "llama3_bnb4"])
def test_the_committed_fixtures_are_what_transformers_writes_and_computes(fresh, name):
    for f in sorted((MODELS / name).iterdir()):
        if f.suffix == ".npz":
            new, old = np.load(fresh / name / f.name), np.load(f)
            assert sorted(new.files) == sorted(old.files)
            for key in old.files:
                np.testing.assert_array_equal(new[key], old[key], err_msg=f"{name}/{key}")
        else:
            assert (fresh / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"


def _merged(name: str):
    """lorax's model of a fixture with a LoRA update (b non-zero) merged in, its logits."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    import lorax
    from examples.shakespeare import gemma3, hf_loader, llama

    cfg, p, hf = hf_loader.load(MODELS / name, dtype=jnp.float32)
    model = gemma3 if isinstance(cfg, gemma3.Config) else llama
    spec = lorax.simple_spec(p, targets=r"(q|k|v|o|gate|up|down)$", rank=4)
    lp = lorax.init_lora(p, spec, jax.random.PRNGKey(0))
    lp = jax.tree.map(lambda w: dataclasses.replace(w, b=jnp.full_like(w.b, 0.05))
                      if isinstance(w, lorax.LoraWeight) else w, lp,
                      is_leaf=lambda w: isinstance(w, lorax.LoraWeight))
    ids = jnp.asarray(np.load(MODELS / name / "reference.npz")["input_ids"])
    c = cfg._replace(attention="xla")
    logits = lorax.lora(lambda p, x: model.logits(c, p, x))(lp, ids)
    return lorax.merge_params(lp), hf, np.asarray(ids), np.asarray(logits)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "mistral", "gemma3", "llama3_bnb4"])
def test_a_merged_model_saved_by_lorax_loads_in_transformers(tmp_path, name):
    """`lorax.save_safetensors` of the merged model (a bnb-4bit base dequantized): shards,
    index and config as transformers reads them, and transformers' logits are lorax's."""
    import jax.numpy as jnp
    import torch
    import transformers

    import lorax
    from examples.shakespeare import hf_loader

    merged, hf, ids, logits = _merged(name)
    lorax.save_safetensors(tmp_path, hf_loader.hf_tensors(merged), hf, transpose=True,
                           dtype=jnp.float32, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(theirs - logits).max() <= 1e-4


def test_a_peft_adapter_trained_on_a_bnb_base_gives_lorax_s_perplexity(tmp_path):
    """QLoRA with lorax on the bnb-4bit checkpoint's codes, the adapter written by
    `lorax.save_peft`, loaded by PEFT onto transformers + bitsandbytes on CPU: the same
    perplexity on bitsandbytes' own float32 dequantization (1e-5), and within 1% through
    bitsandbytes' CPU product, which rounds to bfloat16 on the way (measured: 333.19
    against lorax's 333.98 on this random model's high perplexity)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import peft
    import torch
    import transformers

    import lorax
    from examples.shakespeare import hf_loader, llama

    script = _script()  # its exact product: bitsandbytes' float32 dequantization
    cfg, params, _ = hf_loader.load(MODELS / "llama3_bnb4", dtype=jnp.float32)
    spec = lorax.simple_spec(params, targets=r"(q|k|v|o|gate|up|down)$", rank=4)
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0), alpha=8.0)
    lp = jax.tree.map(lambda w: dataclasses.replace(
        w, b=0.05 * jax.random.normal(jax.random.PRNGKey(w.b.size), w.b.shape))
        if isinstance(w, lorax.LoraWeight) else w, lp,
        is_leaf=lambda w: isinstance(w, lorax.LoraWeight))
    ids = np.load(MODELS / "llama3_bnb4" / "reference.npz")["input_ids"]
    c = cfg._replace(attention="xla")
    ours = float(jnp.exp(lorax.lora(lambda p, w: llama.loss(c, p, w))(lp, jnp.asarray(ids))))
    lorax.save_peft(tmp_path, lp, module_name=hf_loader.peft_module, layout="in_out",
                    base_model_name_or_path=str(MODELS / "llama3_bnb4"))

    def theirs(exact: bool) -> float:
        base = transformers.AutoModelForCausalLM.from_pretrained(
            MODELS / "llama3_bnb4", dtype=torch.float32, device_map="cpu",
            attn_implementation="eager")
        model = peft.PeftModel.from_pretrained(base, tmp_path).eval()
        with torch.no_grad(), (script.exact_linear4bit() if exact else contextlib.nullcontext()):
            return float(torch.exp(model(torch.tensor(ids), labels=torch.tensor(ids)).loss))

    assert abs(theirs(True) - ours) <= 1e-5 * ours, (theirs(True), ours)
    assert abs(theirs(False) - ours) <= 1e-2 * ours, (theirs(False), ours)

