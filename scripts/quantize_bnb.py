"""Quantize a Hugging Face checkpoint to bitsandbytes NF4 with double quantization on CPU,
as Unsloth's `*-bnb-4bit` repos are made, and save it beside its tokenizer.

    .tools/ckpt-ref/bin/python scripts/quantize_bnb.py SRC DST

Run by `scripts/run --model smollm2-bnb` (in the env `scripts/ref-env.sh` builds: torch
CPU, transformers 5, bitsandbytes) on the bf16 checkpoint lorax writes from SmolLM2's
GGUF (`python -m examples.shakespeare.hf_job write-bf16`).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import transformers


def quantize(src: Path, dst: Path) -> None:
    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, quantization_config=config, device_map="cpu", dtype=torch.bfloat16)
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the job's own tokenizer
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


if __name__ == "__main__":
    quantize(Path(sys.argv[1]), Path(sys.argv[2]))
