"""Other programs' formats: PEFT adapters (in and out), llama.cpp's GGUF LoRA (out) and
GGUF model files (in)."""

from .gguf import save_gguf_lora as save_gguf_lora
from .gguf_read import load_gguf as load_gguf
from .peft import load_peft as load_peft, save_peft as save_peft
