"""Other programs' formats: PEFT adapters (in and out), llama.cpp's GGUF LoRA (out), GGUF
model files (in) and Hugging Face checkpoints (in: safetensors, dense or quantized)."""

from .gguf import save_gguf_lora as save_gguf_lora
from .gguf_read import load_gguf as load_gguf
from .peft import load_peft as load_peft, save_peft as save_peft
from .safetensors_read import load_safetensors as load_safetensors
from .safetensors_write import save_safetensors as save_safetensors
