"""transformers' logits on the model fixtures (tests/data/models) under the RoPE that
google-tunix 0.1.7's Qwen3 and Llama3 compute, for tests/frameworks/test_tunix.py.

    .tools/ckpt-ref/bin/python scripts/make_tunix_references.py [OUT_DIR]

tunix 0.1.7's `apply_rope` is called without the config's `rope_theta` (both families):
it always rotates with base 1e6, and its Llama3 has no `llama3` frequency rule. The
fixtures' own `reference.npz` are transformers' logits under their configs' RoPE (base
1e4 for qwen3, 5e5 with the `llama3` rule for llama3), which tunix does not compute. Each
file here is transformers on the same checkpoint, with the same `input_ids`, its config's
`rope_parameters` set to `{"rope_type": "default", "rope_theta": 1e6}`: float32, eager
attention; for `llama3_bnb4`, each NF4 layer's product on bitsandbytes' own float32
dequantization of its codes (make_model_fixtures.exact_linear4bit, as the fixture's
own reference is).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import transformers as T

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "data" / "models"
DEFAULT_OUT = ROOT / "tests" / "data" / "tunix"
CASES = ("qwen3", "llama3", "llama3_bnb4")
TUNIX_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


def _fixtures_script():
    spec = importlib.util.spec_from_file_location("make_model_fixtures",
                                                  ROOT / "scripts" / "make_model_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def logits(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, transformers' float32 logits) of fixture `name` under tunix's RoPE."""
    ids = np.load(MODELS / name / "reference.npz")["input_ids"]
    config = T.AutoConfig.from_pretrained(MODELS / name)
    config.rope_parameters = dict(TUNIX_ROPE)
    config._attn_implementation = "eager"
    model = T.AutoModelForCausalLM.from_pretrained(
        MODELS / name, config=config, dtype=torch.float32, device_map="cpu").eval()
    with torch.no_grad():
        if name.endswith("_bnb4"):
            with _fixtures_script().exact_linear4bit():
                out = model(torch.from_numpy(ids)).logits
        else:
            out = model(torch.from_numpy(ids)).logits
    return ids, out.float().numpy()


def make(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in CASES:
        ids, got = logits(name)
        np.savez(out_dir / f"{name}.npz", input_ids=ids, logits=got)
        print(name, got.shape, f"{T.__version__=}", f"{torch.__version__=}")


if __name__ == "__main__":
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
