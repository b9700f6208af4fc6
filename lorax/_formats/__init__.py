"""Adapters in other programs' formats: PEFT (in and out) and llama.cpp's GGUF LoRA (out)."""

from .gguf import save_gguf_lora as save_gguf_lora
from .peft import load_peft as load_peft, save_peft as save_peft
