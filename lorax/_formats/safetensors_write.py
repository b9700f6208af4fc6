"""Writing a Hugging Face checkpoint: `save_safetensors(directory, tensors, config)`.

The counterpart of `load_safetensors`: a merged model (LoRA folded in, a quantized base
dequantized) as transformers reads it, shards and `model.safetensors.index.json` included.
Each tensor is made dense and written one at a time, so a model is never whole in host
memory on the way out.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_bool
from .._engine import is_value
from .._params import merge_params
from .._weight import LoraWeight
from ._safetensors_files import DTYPES, INDEX, SINGLE

_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _shard_bytes(size: Any) -> int:
    if isinstance(size, str):
        hit = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)\s*", size.upper())
        if hit:
            return int(float(hit.group(1)) * _UNITS[hit.group(2)])
    elif isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size > 0:
        return int(size)
    raise ValueError(f"save_safetensors: max_shard_size must be a number of bytes > 0 or a "
                     f"size such as '5GB' or '500MiB'; got {size!r}.")


def _dense(name: str, x: Any, dtype: Any, transpose: bool) -> np.ndarray:
    """`x` as the array written: LoRA merged, quantized codes dequantized, floating point
    cast to `dtype`, `(in, out)` back to `(out, in)` with `transpose`."""
    if isinstance(x, LoraWeight):
        x = merge_params({"w": x})["w"]
    if is_value(x):
        x = x.dequantize(dtype)
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(dtype)
    if transpose and x.ndim >= 2:
        x = jnp.swapaxes(x, -1, -2)
    return np.ascontiguousarray(jax.device_get(x))


def _plan(tensors: Mapping[str, Any], limit: int, dtype: Any) -> list[list[str]]:
    """Names per shard, in order, each shard at most `limit` bytes (or one tensor)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, x in tensors.items():
        kind, shape = _planned(name, x, dtype, False)
        n = int(np.prod(shape)) * kind.itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _planned(name: str, x: Any, dtype: Any,
             transpose: bool) -> tuple[np.dtype, tuple[int, ...]]:
    """The dtype and shape `_dense` will give `x`, without computing it."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise ValueError(f"save_safetensors: tensor {name!r} is a {type(x).__name__}, not an "
                         "array.")
    shape = tuple(x.shape)
    if transpose and len(shape) >= 2:
        shape = (*shape[:-2], shape[-1], shape[-2])
    floating = is_value(x) or isinstance(x, LoraWeight) or jnp.issubdtype(x.dtype, jnp.floating)
    kind = np.dtype(dtype if floating else x.dtype)
    if kind not in _NAMES:
        raise ValueError(f"save_safetensors: tensor {name!r} has dtype {kind}, which "
                         f"safetensors does not store.")
    return kind, shape


def _write_shard(path: str, names: list[str], tensors: Mapping[str, Any], dtype: Any,
                 transpose: bool) -> int:
    """One safetensors file: its header, then each tensor made dense in turn (one at a
    time in memory); its data's byte count."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        kind, shape = _planned(name, tensors[name], dtype, transpose)
        n = int(np.prod(shape)) * kind.itemsize
        header[name] = {"dtype": _NAMES[kind], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in names:
            a = _dense(name, tensors[name], dtype, transpose)
            assert [_NAMES[a.dtype], list(a.shape)] == [header[name]["dtype"], header[name]["shape"]]
            f.write(a.tobytes())
    return offset


def save_safetensors(directory: str | os.PathLike, tensors: Mapping[str, Any],
                     config: Mapping[str, Any] | None = None, *, transpose: bool = False,
                     dtype: Any = jnp.bfloat16, max_shard_size: int | str = "5GB") -> None:
    """Write a model as a Hugging Face checkpoint transformers loads.

    The counterpart of [`lorax.load_safetensors`][]: `tensors` maps each weight's
    Hugging Face name to an array, a [`lorax.QuantizedArray`][] (dequantized) or a
    [`lorax.LoraWeight`][] (merged, `w + (alpha / k) * b @ a`, as
    [`lorax.merge_params`][] does); every floating-point tensor is written as `dtype`.
    Shards of at most `max_shard_size` are named as transformers names them, with
    `model.safetensors.index.json` (one shard: `model.safetensors`). `config` (the one
    `load_safetensors` returned) is written as `config.json` without its
    `quantization_config` and with `torch_dtype` / `dtype` set to `dtype`.

    **Arguments:**

    - `directory`: where to write (created if missing).
    - `tensors`: name -> tensor, in the order to write.
    - `config`: the model's `config.json` content, or `None` to write none.
    - `transpose`: the tensors are `(in, out)` (as `load_safetensors(transpose=True)`
      gives them): swap the last two axes of each back to torch's `(out, in)`.
    - `dtype`: the floating-point dtype written (default bfloat16).
    - `max_shard_size`: bytes, or a size such as `"5GB"` or `"500MiB"`.

    **Returns:**

    `None`.

    !!! Example

        ```python
        import os, tempfile
        import jax, jax.numpy as jnp
        import lorax

        w = jax.random.normal(jax.random.PRNGKey(0), (64, 32))
        lw = lorax.LoraWeight(w, a=jnp.ones((2, 32)), b=jnp.ones((64, 2)), alpha=2.0)
        d = tempfile.mkdtemp()
        lorax.save_safetensors(d, {"model.layers.0.mlp.up_proj.weight": lw},
                               {"model_type": "llama"}, transpose=True, dtype=jnp.float32)
        back, config = lorax.load_safetensors(d, transpose=True)
        merged = lorax.merge_params({"w": lw})["w"]
        assert jnp.allclose(back["model.layers.0.mlp.up_proj.weight"], merged)
        assert config["dtype"] == "float32"
        ```
    """
    transpose = check_bool("save_safetensors", "transpose", transpose)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"save_safetensors: dtype must be a floating-point dtype; got {dtype}.")
    limit = _shard_bytes(max_shard_size)
    if not isinstance(tensors, Mapping) or not all(isinstance(k, str) for k in tensors):
        raise TypeError("save_safetensors: tensors must map names (strings) to tensors.")
    shards = _plan(tensors, limit, dtype)  # every tensor checked before anything is written
    os.makedirs(directory, exist_ok=True)
    files = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(_write_shard(os.path.join(directory, f), names, tensors, dtype, transpose)
                for f, names in zip(files, shards))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump(index, f, indent=2)
    if config is not None:
        _write_config(directory, config, dtype)


def _write_config(directory: str | os.PathLike, config: Mapping[str, Any], dtype: Any) -> None:
    out = {k: v for k, v in dict(config).items() if k != "quantization_config"}
    name = jnp.dtype(dtype).name
    if "torch_dtype" in out:  # transformers 4's name for it
        out["torch_dtype"] = name
    out["dtype"] = name
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(out, f, indent=2)
