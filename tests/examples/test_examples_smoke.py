"""Smoke tests of the per-framework examples in examples/: each runs 3 steps and checks itself.

Every example asserts its own correctness at the end (held-out loss went down, frozen
weights bit-identical, adapter round trip bit-exact, merged output == LoRA output);
here we also check what it printed and returned.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# example -> number of LoRA weights its summary line must report
CASES = {"flax_linen": 7, "flax_nnx": 7, "haiku_example": 3, "equinox_example": 8, "hf_flax": 9,
         "keras_example": 8, "keras_hub_example": 9, "penzai_example": 8}
# GPT-2 initialises small (near-uniform logits): 3 steps are within the batch noise.
STEPS = {"keras_hub_example": 10}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"lorax_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(CASES))
def test_example_runs(name, capsys):
    if name == "hf_flax":
        transformers = pytest.importorskip("transformers", reason="needs the optional `hf` group")
        if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
            pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    result = _load(name).main(["--steps", str(STEPS.get(name, 3)), "--seed", "1"])
    out = capsys.readouterr().out

    assert f"LoRA on {CASES[name]} weights" in out, out
    assert "step    2  loss" in out, out
    assert "adapter reloaded bit-exact" in out and "frozen weights unchanged: True" in out, out
    assert result["loss_after"] < result["loss_before"]
    assert result["merge_diff"] < 1e-4


def test_hf_flax_without_transformers_exits_cleanly(monkeypatch, capsys):
    module = _load("hf_flax")
    monkeypatch.setattr(module, "transformers", None)
    assert module.main(["--steps", "3"]) is None
    assert "pip install 'transformers~=4.57'" in capsys.readouterr().out
