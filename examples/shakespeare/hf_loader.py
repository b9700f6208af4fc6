"""A Hugging Face checkpoint for `llama.py`: Llama 3.x, Qwen 3, Qwen 2.5, Mistral and
SmolLM2, from the checkpoint's `config.json` and `lorax.load_safetensors` (any format it
reads: bf16 shards, bitsandbytes, FP8, GPTQ, AWQ, compressed-tensors, codes kept).

    cfg, params, hf_config = hf_loader.load("path/to/Qwen3-0.6B")
    logits = llama.logits(cfg, params, tokens)

The architectures differ by configuration of one model (`llama.Config`, and the optional
parameters a layer has); the Hugging Face names map to `llama.py`'s by the table below.
Kernels come as `(in, out)`; layers as a list (`llama.hidden_states` runs them unrolled),
or stacked along a leading axis with `stack=True` (run under `lax.scan`).

A config that disagrees with the tensors (head counts, sizes, a missing or extra layer)
is a `ValueError` naming the config field and the tensor.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

import lorax

from . import hf_gemma3, hf_names, llama

MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")

# A layer's Hugging Face tensors (after `model.layers.<i>.`) -> llama.py's names.
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}
TOP_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
             "lm_head.weight": "lm_head"}


def _field(hf: dict, key: str, where: str, default: Any = ...) -> Any:
    if key not in hf or hf[key] is None:
        if default is ...:
            raise ValueError(f"{where}: config.json has no {key!r}.")
        return default
    return hf[key]


def _rope(hf: dict, where: str) -> tuple[float, tuple | None]:
    """`(rope_theta, rope_scaling)`: transformers 5's `rope_parameters`, or the older
    `rope_theta` / `rope_scaling` fields."""
    rp = hf.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", hf.get("rope_theta") or 10000.0))
    scaling = hf.get("rope_scaling") or rp
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{where}: config.json: rope type {kind!r} is not implemented "
                         "(llama.py has the default rule and Llama 3.1's 'llama3').")
    return theta, (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                   float(scaling["high_freq_factor"]),
                   int(scaling["original_max_position_embeddings"]))


def config(hf: dict, where: str = "config.json") -> llama.Config:
    """`llama.Config` of a Hugging Face config (a `config.json`'s content)."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type {kind!r} is not one llama.py runs "
                         f"({', '.join(MODEL_TYPES)}) or gemma3.py ("
                         f"{', '.join(hf_gemma3.MODEL_TYPES)}).")
    if _field(hf, "hidden_act", where, "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r}: llama.py's MLP is SwiGLU.")
    theta, scaling = _rope(hf, where)
    dim, n_heads = int(_field(hf, "hidden_size", where)), int(_field(hf, "num_attention_heads", where))
    head_dim = _field(hf, "head_dim", where, None)
    sliding = kind == "mistral" or hf.get("use_sliding_window")
    return llama.Config(
        n_layers=int(_field(hf, "num_hidden_layers", where)), dim=dim,
        hidden=int(_field(hf, "intermediate_size", where)), n_heads=n_heads,
        n_kv_heads=int(_field(hf, "num_key_value_heads", where, n_heads)), rope_theta=theta,
        norm_eps=float(_field(hf, "rms_norm_eps", where, 1e-6)),
        vocab=int(_field(hf, "vocab_size", where)),
        head_dim=None if head_dim in (None, dim // n_heads) else int(head_dim),
        rope_scaling=scaling, window=(hf.get("sliding_window") or None) if sliding else None)


def params(tensors: dict[str, Any], cfg: llama.Config, where: str = "checkpoint") -> dict:
    """llama.py's parameters from `lorax.load_safetensors(..., transpose=True)`'s tensors."""
    def convert(name: str, ours: str, x: Any) -> Any:
        x = x.T if ours == "embed" else x  # loaded transposed: the table is (vocab, dim)
        return hf_names.checked(name, ours, x, shapes, where)

    shapes = hf_names.expected(cfg.dim, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.hd,
                               cfg.vocab)

    layers, out = hf_names.mapped(tensors, LAYER_NAMES, TOP_NAMES, cfg.n_layers, where, convert)
    _complete(layers, out, where)
    return {**out, "layers": layers}


def _complete(layers: list[dict], top: dict, where: str) -> None:
    need = {"attn_norm", "mlp_norm", "q", "k", "v", "o", "gate", "up", "down"}
    for i, layer in enumerate(layers):
        missing = sorted(need - set(layer))
        if missing:
            names = [k for k, v in LAYER_NAMES.items() if v in missing]
            raise ValueError(f"{where}: layer {i} has no {', '.join(names)} (config.json "
                             f"says num_hidden_layers = {len(layers)}).")
    for ours in ("embed", "final_norm"):
        if ours not in top:
            name = next(k for k, v in TOP_NAMES.items() if v == ours)
            raise ValueError(f"{where}: the checkpoint has no {name!r}.")


def stacked(p: dict) -> dict:
    """`p` with its list of layers stacked along a leading axis (for `lax.scan`)."""
    return dict(p, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *p["layers"]))


def load(path: str | os.PathLike, *, stack: bool = False, dtype: Any = None,
         **load_options: Any) -> tuple[Any, dict, dict]:
    """`(cfg, params, hf_config)` of the checkpoint at `path` (`load_options` go to
    `lorax.load_safetensors`: `quantize=`, ...). `dtype`: dense floating-point tensors cast
    to it (quantized ones dequantize to it). A Gemma 3 checkpoint gives `gemma3.py`'s
    `Config` and parameters (`hf_gemma3`; its layers differ, so they are never stacked)."""
    tensors, hf = lorax.load_safetensors(path, transpose=True, **load_options)
    where = os.fspath(path)
    if dtype is not None:
        tensors = {k: _cast(v, dtype) for k, v in tensors.items()}
    if hf.get("model_type") in hf_gemma3.MODEL_TYPES:
        cfg = hf_gemma3.config(hf, os.path.join(where, "config.json"))
        return cfg, hf_gemma3.params(tensors, cfg, where), hf
    cfg = config(hf, os.path.join(where, "config.json"))
    p = params(tensors, cfg, where)
    tied = hf.get("tie_word_embeddings", "lm_head" not in p)
    if tied:
        p.pop("lm_head", None)
    return cfg, stacked(p) if stack else p, hf


def _cast(x: Any, dtype: Any) -> Any:
    if isinstance(x, jax.Array):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    q = getattr(x, "inner", x)  # a quantized weight (an act-order one's codes): it
    q = q.with_leaves(q.leaves(), dense_dtype=jnp.dtype(dtype))  # dequantizes to `dtype`
    return dataclasses.replace(x, inner=q) if hasattr(x, "inner") else q


def peft_module(path: str, layer: int | None = None) -> str:
    """`lorax.save_peft`'s `module_name`: the torch module of a llama.py parameter path,
    stacked (`layers/q`, `layer` 3) or not (`layers/3/q`) -> `model.layers.3.self_attn.q_proj`."""
    parts = path.split("/")
    if parts[0] == "layers":
        i, ours = (layer, parts[1]) if layer is not None else (parts[1], parts[2])
        name = {v: k for k, v in LAYER_NAMES.items()}[ours]
        return f"model.layers.{i}.{name.rsplit('.', 1)[0]}"
    return {v: k for k, v in TOP_NAMES.items()}[parts[0]].rsplit(".", 1)[0]


def hf_tensors(p: dict) -> dict[str, Any]:
    """llama.py's parameters (merged, or any tree `lorax.save_safetensors` takes) under
    their Hugging Face names, kernels `(in, out)`: write them with
    `lorax.save_safetensors(dir, hf_tensors(p), hf_config, transpose=True)`. Gemma 3's
    (its layers have `post_attn_norm`) go through `hf_gemma3.hf_tensors`."""
    if isinstance(p["layers"], list) and "post_attn_norm" in p["layers"][0]:
        return hf_gemma3.hf_tensors(p)
    p = llama.unstack_layers(p)
    layer_names = {v: k for k, v in LAYER_NAMES.items()}
    out = {}
    for name, ours in TOP_NAMES.items():
        if ours in p:  # the table is (vocab, dim): as transposed as the kernels
            out[name] = p[ours].T if ours == "embed" else p[ours]
    for i, layer in enumerate(p["layers"]):
        out.update({f"model.layers.{i}.{layer_names[k]}": v for k, v in layer.items()})
    return out

