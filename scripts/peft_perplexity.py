"""The held-out perplexity of a PEFT adapter on a bitsandbytes checkpoint in transformers +
PEFT + bitsandbytes on CPU, to set beside lorax's (the main job's `ppl_after`).

    python -m examples.shakespeare.hf_job windows CKPT windows.npy        # main env
    .tools/ckpt-ref/bin/python scripts/peft_perplexity.py CKPT ADAPTER windows.npy

Prints two figures: through bitsandbytes' own CPU product (which rounds to bfloat16 on the
way), and on bitsandbytes' float32 dequantization (scripts/make_model_fixtures.py's
`exact_linear4bit`). Every other tensor is computed in float32.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import bitsandbytes as bnb
import numpy as np
import peft
import torch
import transformers


def _fixtures():
    path = Path(__file__).resolve().parent / "make_model_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_model_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def perplexity(ckpt: str, adapter: str, windows: torch.Tensor, exact: bool) -> float:
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                             device_map="cpu")
    for module in base.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.compute_dtype = torch.float32
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    for p in model.parameters():  # the tied embedding stays in the checkpoint's bf16
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    product = _fixtures().exact_linear4bit() if exact else contextlib.nullcontext()
    with torch.no_grad(), product:
        losses = [model(windows[i:i + 8], labels=windows[i:i + 8]).loss
                  for i in range(0, len(windows), 8)]
    return float(torch.exp(torch.stack(losses).mean()))


if __name__ == "__main__":
    ckpt, adapter, path = sys.argv[1:4]
    windows = torch.tensor(np.load(path)).long()
    # The exact product first: bitsandbytes' first CPU product repacks the weights.
    print(json.dumps({"float32_dequantization": perplexity(ckpt, adapter, windows, True),
                      "bitsandbytes_cpu": perplexity(ckpt, adapter, windows, False)}))
