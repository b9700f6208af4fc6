"""Hugging Face tensor names -> an example model's parameter names: the walk `hf_loader`
(the Llama family) and `hf_gemma3` (Gemma 3) share, each with its own name tables."""

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
