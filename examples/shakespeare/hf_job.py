"""The main job on Hugging Face checkpoints.

- `--checkpoint DIR`: any directory `hf_loader` reads (Llama 3.x, Qwen 3, Qwen 2.5,
  Mistral, SmolLM2 through `llama.py`; Gemma 3 through `gemma3.py`; bf16, bitsandbytes,
  FP8, GPTQ, AWQ, compressed-tensors), with its `tokenizer.json`. Windows start with the
  BOS token where the tokenizer puts one before a text (Llama 3, Gemma 3), as the model
  was trained;
- `--model smollm2-bnb`: SmolLM2-135M-Instruct as a bitsandbytes NF4 checkpoint (double
  quantization, Unsloth's `*-bnb-4bit` layout), made once from the GGUF the job installs
  and cached: lorax writes the GGUF's weights as a bf16 Hugging Face checkpoint
  (`write_smollm2`, with its tokenizer), bitsandbytes quantizes that on CPU
  (`scripts/quantize_bnb.py`, run by `scripts/run` in the env with torch), and lorax trains
  on the codes bitsandbytes wrote.

    python -m examples.shakespeare.hf_job path            # the cached checkpoint's directory
    python -m examples.shakespeare.hf_job write-bf16 DIR  # SmolLM2's bf16 checkpoint
    python -m examples.shakespeare.hf_job windows DIR OUT.npy  # the job's held-out windows,
                                                               # DIR's tokenizer (for PEFT)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

import lorax

from . import data, gemma3, gguf_loader, hf_gemma3, hf_loader, llama, models

SMOLLM2_HF = "HuggingFaceTB/SmolLM2-135M-Instruct"


def smollm2_bnb_dir() -> Path:
    """Where `--model smollm2-bnb`'s checkpoint is cached."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lorax" / "smollm2-135m-instruct-bnb-4bit"


def _smollm2_config(cfg: dict, tok: Any) -> dict:
    eos = tok.token_to_id("<|endoftext|>")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg["dim"], "intermediate_size": cfg["hidden"],
            "num_hidden_layers": cfg["n_layers"], "num_attention_heads": cfg["n_heads"],
            "num_key_value_heads": cfg["n_kv_heads"], "rope_theta": cfg["rope_theta"],
            "rms_norm_eps": cfg["norm_eps"], "vocab_size": cfg["vocab"], "hidden_act": "silu",
            "max_position_embeddings": 8192, "tie_word_embeddings": True,
            "bos_token_id": eos, "eos_token_id": eos}


def write_smollm2(out: str | os.PathLike) -> Path:
    """SmolLM2-135M-Instruct's GGUF (Q4_1, dequantized) as a bf16 Hugging Face checkpoint
    with its tokenizer: what transformers and bitsandbytes read."""
    params, cfg, tok = gguf_loader.load(quantized=False)
    out = Path(out)
    lorax.save_safetensors(out, hf_loader.hf_tensors(params), _smollm2_config(cfg, tok),
                           transpose=True, dtype=jnp.bfloat16)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


def _eos(path: Path, tok: Any, hf: dict) -> str:
    config = path / "tokenizer_config.json"
    eos = json.loads(config.read_text()).get("eos_token") if config.exists() else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    ids = hf.get("eos_token_id")
    if eos is None and isinstance(ids, list) and ids:  # Llama 3.x Instruct: several
        ids = ids[0]
    if eos is None and isinstance(ids, int):
        eos = tok.id_to_token(ids)
    if eos is None:
        raise ValueError(f"{path}: no end-of-text token (tokenizer_config.json's eos_token, "
                         "or config.json's eos_token_id).")
    return eos


class CheckpointTokenizer:
    """A checkpoint's `tokenizer.json` as the job uses a tokenizer: texts encoded without
    the special tokens its post-processor adds (the job adds its own separators), `bos` the
    token it puts before a text (None where it puts none)."""

    def __init__(self, path: Path):
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path}: no tokenizer.json (the job tokenizes its corpus "
                                    "with the checkpoint's own tokenizer).")
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a").ids
        self.bos = full[0] if len(full) > len(plain) and full[1:] == plain else None

    def encode(self, text: str) -> Any:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[Any]:
        return self._tok.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)


def _loader(path: Path, stack: bool):
    def load(quantized: bool = True) -> tuple[dict, dict, Any]:
        tok = CheckpointTokenizer(path)
        # float32 on the CPU: quantized weights dequantize to it, dense ones are cast.
        cfg, params, _ = hf_loader.load(path, stack=stack, dtype=jnp.float32)
        return params, cfg._asdict(), tok
    return load


def model_for(path: str | os.PathLike, name: str = "checkpoint",
              hf_model: str | None = None) -> models.Model:
    """The job's `models.Model` for a Hugging Face checkpoint directory: `llama.py` (stacked
    layers under `lax.scan`) or, for Gemma 3, `gemma3.py` (a list of layers)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint "
                                "directory).")
    hf = json.loads((path / "config.json").read_text())
    tok = CheckpointTokenizer(path)
    method = (hf.get("quantization_config") or {}).get("quant_method", "dense")
    gemma = hf.get("model_type") in hf_gemma3.MODEL_TYPES
    module, layer_path, modules = ((gemma3, r"layers/\d+", models.gemma_module) if gemma
                                   else (llama, "layers", hf_loader.peft_module))
    return models.Model(
        name, path.name, module, _loader(path, stack=not gemma), None, path.name,
        hf_model or str(path), modules, None if gemma else "hf", layer_path, method,
        f"{method} weights as stored", _eos(path, tok, hf), bos=tok.bos is not None,
        compare_dense=False, stored_as="from the Hugging Face checkpoint")


def held_out_windows(path: Path, n: int = 32, seq: int = 128) -> np.ndarray:
    """The job's held-out windows (its defaults), tokenized by the checkpoint's tokenizer."""
    tok = CheckpointTokenizer(path)
    hf = json.loads((path / "config.json").read_text())
    _, held_text = data.load_plays()
    held = data.tokenize(tok, held_text, tok.token_to_id(_eos(path, tok, hf)))
    windows = data.eval_windows(held, n, seq)
    return np.asarray(data.with_bos(windows, tok.bos) if tok.bos is not None else windows)


def resolve(model: str, checkpoint: str | None) -> models.Model:
    """`--checkpoint DIR`, `--model smollm2-bnb` (its cached checkpoint), or a GGUF model."""
    if checkpoint:
        return model_for(checkpoint)
    if model == "smollm2-bnb":
        path = smollm2_bnb_dir()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}: not made yet; `bash scripts/run --model "
                                    "smollm2-bnb` makes it (bitsandbytes, in the env with torch).")
        return model_for(path, "smollm2-bnb", SMOLLM2_HF)
    return models.MODELS[model]


def main(argv: list[str]) -> None:
    if argv[:1] == ["path"]:
        print(smollm2_bnb_dir())
    elif argv[:1] == ["write-bf16"] and len(argv) == 2:
        print(write_smollm2(argv[1]))
    elif argv[:1] == ["windows"] and len(argv) == 3:
        np.save(argv[2], held_out_windows(Path(argv[1])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
