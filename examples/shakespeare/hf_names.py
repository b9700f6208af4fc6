"""Hugging Face tensor names -> an example model's parameter names: the walk `hf_loader`
(the Llama family) and `hf_gemma3` (Gemma 3) share, each with its own name tables, and
the shape each parameter must have by the config."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def mapped(tensors: dict[str, Any], layer_names: dict[str, str], top_names: dict[str, str],
           n_layers: int, where: str,
           convert: Callable[[str, str, Any], Any]) -> tuple[list[dict], dict]:
    """`(layers, top)`: each tensor under its model name (`layer_names` after
    `model.layers.<i>.`, `top_names` for the rest; others are left out), as
    `convert(hf name, model name, tensor)` gives it. A layer index past `n_layers` is a
    `ValueError` naming the tensor and `num_hidden_layers`."""
    layers: list[dict] = [{} for _ in range(n_layers)]
    top: dict[str, Any] = {}
    for name, x in tensors.items():
        hit = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if hit and hit.group(2) in layer_names:
            i, ours = int(hit.group(1)), layer_names[hit.group(2)]
            if i >= n_layers:
                raise ValueError(f"{where}: tensor {name!r} is of layer {i}, but config.json "
                                 f"says num_hidden_layers = {n_layers}.")
            layers[i][ours] = convert(name, ours, x)
        elif name in top_names:
            top[top_names[name]] = convert(name, top_names[name], x)
    return layers, top


# Which config fields a parameter's shape comes from, for the error that names them.
_FIELDS = {"q": "num_attention_heads, head_dim", "k": "num_key_value_heads, head_dim",
           "v": "num_key_value_heads, head_dim", "o": "num_attention_heads, head_dim",
           "q_bias": "num_attention_heads, head_dim", "k_bias": "num_key_value_heads, head_dim",
           "v_bias": "num_key_value_heads, head_dim", "q_norm": "head_dim",
           "k_norm": "head_dim", "gate": "intermediate_size", "up": "intermediate_size",
           "down": "intermediate_size", "embed": "vocab_size", "lm_head": "vocab_size"}


def expected(dim: int, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int,
             vocab: int) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape as the example models hold it (kernels `(in, out)`, the
    embedding `(vocab, dim)`, norms and biases 1-D)."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    norms = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "final_norm")
    return {**dict.fromkeys(norms, (dim,)), "q": (dim, q), "k": (dim, kv), "v": (dim, kv),
            "o": (q, dim), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
            "q_norm": (head_dim,), "k_norm": (head_dim,), "gate": (dim, hidden),
            "up": (dim, hidden), "down": (hidden, dim), "embed": (vocab, dim),
            "lm_head": (dim, vocab)}


def checked(name: str, ours: str, x: Any, shapes: dict[str, tuple[int, ...]],
            where: str) -> Any:
    """`x`, if its shape is `shapes[ours]`; else a `ValueError` naming the tensor and the
    config fields its shape comes from."""
    want = shapes[ours]
    if tuple(x.shape) != want:
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(x.shape)} (as the model "
                         f"holds it), but config.json says {want} (hidden_size, "
                         f"{_FIELDS.get(ours, 'hidden_size')}).")
    return x
