"""The model fixtures (tests/data/models) against transformers itself (run by
scripts/test-checkpoints, in its env with torch, transformers and bitsandbytes): made
again by scripts/make_model_fixtures.py, each checkpoint and its logits are the committed
ones, so tests/examples/test_hf_models.py compares lorax with what transformers computes."""

from __future__ import annotations

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


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen2", "mistral", "llama3_bnb4"])
def test_the_committed_fixtures_are_what_transformers_writes_and_computes(fresh, name):
    for f in sorted((MODELS / name).iterdir()):
        if f.suffix == ".npz":
            new, old = np.load(fresh / name / f.name), np.load(f)
            assert sorted(new.files) == sorted(old.files)
            for key in old.files:
                np.testing.assert_array_equal(new[key], old[key], err_msg=f"{name}/{key}")
        else:
            assert (fresh / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"
