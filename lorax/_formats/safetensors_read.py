"""Reading a Hugging Face checkpoint: `load_safetensors(path) -> (tensors, config)`.

The container (one file, or shards named by `model.safetensors.index.json`) is opened and
checked by `_safetensors_files.py`; a quantized checkpoint's companion tensors are folded
into `QuantizedArray`s by the table in `hf_quant.py`; a dense checkpoint can be quantized
as it is read, tensor by tensor and rows at a time, so it never sits in memory whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import check_bool
from .._files import field
from .._quant import _formats as F
from .._quant._array import QuantizedArray, check_options, check_quantizable, resolve_block_size
from .._quant._permuted import RowOrdered
from . import hf_quant
from ._safetensors_files import Checkpoint, open_checkpoint

# Rows are quantized this many float32 bytes at a time: the temporaries of one chunk,
# not of a whole tensor, are what quantizing on load adds to the codes.
CHUNK_BYTES = 32 << 20

_OPTIONS = ("block_size", "double_quant", "scale_dtype")


def default_filter(name: str, shape: tuple[int, ...]) -> bool:
    """What `quantize=` quantizes unless told otherwise: 2-D `.weight` tensors other than
    the embeddings and `lm_head` (bitsandbytes' choice: the linear layers' kernels)."""
    return (len(shape) == 2 and name.endswith(".weight")
            and "embed" not in name and "lm_head" not in name)


def load_safetensors(
    path: str | os.PathLike, *, transpose: bool = False, quantize: str | None = None,
    quantize_filter: Callable[[str, tuple[int, ...]], bool] | None = None,
    quantize_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a Hugging Face checkpoint: dense tensors as stored, quantized ones as their
    codes, and its `config.json`.

    `path` is one `.safetensors` file or a checkpoint directory (`model.safetensors`, or
    the shards that `model.safetensors.index.json` names, and `config.json`). A weight
    stored quantized comes as one [`lorax.QuantizedArray`][] holding the file's codes and
    scales, its companion tensors folded in and its name the weight's own
    (`model.layers.0.self_attn.q_proj.weight`); its `dequantize(jnp.float32)` equals the
    writing library's own dequantization bit for bit. The formats read, by
    `quantization_config.quant_method` (docs/checkpoints.md has each one's layout):

    - `bitsandbytes`: NF4 and FP4, with and without double quantization (qtypes
      `"bnb_nf4"`, `"bnb_fp4"`: Unsloth's `*-bnb-4bit` repos), and LLM.int8 (`"bnb_int8"`);
    - `fp8`: float8 e4m3 weights with a `weight_scale_inv` per 128x128 block
      (DeepSeek-V3, Qwen3 `-FP8`; `"fp8_e4m3"`);
    - `gptq` (4-bit, symmetric or with zero points; act-order's rows stored sorted by
      group, their order kept in a `RowOrdered` around the `QuantizedArray`) and `awq`
      (GEMM, 4-bit): `"int4_zp"`, the zero points in `mins`;
    - `compressed-tensors`: `pack-quantized` int4 (`"int4"`, or `"int4_zp"` with zero
      points) and int8 (`"int8"`), `int-quantized` int8 (`"int8"`), and `float-quantized`
      FP8 per tensor, channel, group or block (`"fp8_e4m3"`).

    Shapes are torch's `(out, in)`, as stored; `transpose=True` swaps the last two axes
    of every tensor of two or more axes, the `(in, out)` kernels `x @ w` models use
    (quantized ones are the same bytes either way).

    **Arguments:**

    - `path`: the file or directory.
    - `transpose`: swap the last two axes of every tensor of two or more axes.
    - `quantize`: a lorax qtype (`"nf4"`, `"int8"`, `"bnb_nf4"`, ...) to quantize the
      dense tensors `quantize_filter` picks as they are read: each is read and
      quantized rows at a time, so a checkpoint larger than host memory loads as its codes.
    - `quantize_filter`: `(name, shape) -> bool`; default: 2-D `.weight` tensors other
      than embeddings and `lm_head`.
    - `quantize_options`: `block_size`, `double_quant`, `scale_dtype`, as
      [`lorax.quantize`][] takes them.

    **Returns:**

    `(tensors, config)`: `tensors` maps each weight's name to a `jax.Array` (in its stored
    dtype) or a `QuantizedArray` (a GPTQ act-order weight: a `RowOrdered` holding one),
    in the checkpoint's order; `config` is `config.json`'s
    content (`{}` for a bare file).

    **Raises:**

    `ValueError` naming the file, the tensor and the field for a file that is not
    safetensors, a shard the index names outside the directory or without the tensor, a
    `quantization_config` or `quant_state` of the wrong type, a format lorax does not read,
    or codes, scales and zero points whose shapes or dtypes disagree with each other or
    with the weight's shape.

    !!! Example

        ```python
        import os, tempfile
        import numpy as np, ml_dtypes
        from safetensors.numpy import save_file
        import lorax

        d = tempfile.mkdtemp()
        w = np.random.default_rng(0).standard_normal((128, 256)).astype(ml_dtypes.bfloat16)
        save_file({"model.layers.0.mlp.up_proj.weight": w}, os.path.join(d, "model.safetensors"))

        tensors, config = lorax.load_safetensors(d)
        assert tensors["model.layers.0.mlp.up_proj.weight"].shape == (128, 256) and config == {}
        codes, _ = lorax.load_safetensors(d, transpose=True, quantize="nf4")
        up = codes["model.layers.0.mlp.up_proj.weight"]
        assert up.qtype == "nf4" and up.shape == (256, 128) and up.dtype == w.dtype
        ```
    """
    transpose = check_bool("load_safetensors", "transpose", transpose)
    quantizer = _quantizer(quantize, quantize_filter, quantize_options)
    ckpt = open_checkpoint(path, "load_safetensors")
    method, qconfig = hf_quant.quant_method(ckpt)
    dense_dtype = _dense_dtype(ckpt)
    found, used = hf_quant.fold(ckpt, method, qconfig, dense_dtype) if method else ({}, set())
    order = {name: i for i, name in enumerate(ckpt.entries)}
    first = {min(parts.names.values(), key=order.__getitem__): name  # where it goes
             for name, (parts, _) in found.items()}
    tensors: dict[str, Any] = {}
    for name in ckpt.entries:
        if name in first:
            parts, m = found[first[name]]
            tensors[first[name]] = _placed(m.fold(parts), transpose)
        elif name not in used:
            tensors[name] = _placed(_dense(ckpt, name, quantizer), transpose)
    return tensors, ckpt.config


def _dense_dtype(ckpt: Checkpoint) -> Any:
    """The model's dtype (`torch_dtype`, or transformers 5's `dtype`) for quantized
    weights whose format does not say it; float32 when the config does not either."""
    for key in ("dtype", "torch_dtype"):
        name = field(ckpt.config, key, "str", "load_safetensors",
                     f"{ckpt.path!r}: config.json", None)
        if name in ("float32", "float16", "bfloat16"):
            return jnp.dtype(name)
    return jnp.dtype(jnp.float32)


def _placed(x: Any, transpose: bool) -> Any:
    if isinstance(x, QuantizedArray):
        return x.with_leaves(x.leaves(), axis=-2) if transpose else x
    if isinstance(x, RowOrdered):
        return RowOrdered(_placed(x.inner, transpose), x.perm, x.order, -2) if transpose else x
    x = jnp.asarray(x)
    return jnp.swapaxes(x, -1, -2) if transpose and x.ndim >= 2 else x


# -- quantizing on load -----------------------------------------------------------------------


def _quantizer(qtype: Any, keep: Any, options: Any) -> tuple | None:
    if qtype is None:
        if keep is not None or options is not None:
            raise ValueError("load_safetensors: quantize_filter and quantize_options need "
                             "quantize= (a qtype such as 'nf4').")
        return None
    fmt = F.get_format(qtype, "load_safetensors")
    if keep is not None and not callable(keep):
        raise TypeError(f"load_safetensors: quantize_filter must be a function (name, shape) "
                        f"-> bool, got {keep!r}.")
    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"load_safetensors: quantize_options takes {', '.join(_OPTIONS)}; "
                         f"got {', '.join(map(repr, unknown))}.")
    check_options(options.get("block_size"), None, "load_safetensors")
    double = check_bool("load_safetensors", "quantize_options['double_quant']",
                        options.get("double_quant", False))
    return fmt, keep or default_filter, options.get("block_size"), double, options.get("scale_dtype")


def _dense(ckpt: Checkpoint, name: str, quantizer: tuple | None) -> Any:
    e = ckpt.entries[name]
    if quantizer is None or not quantizer[1](name, e.shape):
        return ckpt.read(name)
    fmt, _, block_size, double, scale_dtype = quantizer
    where = ckpt.where(name)
    check_quantizable(fmt, e.shape, e.dtype, -1, block_size, double, where, scale_dtype)
    return _quantize_rows(ckpt, name, fmt, resolve_block_size(fmt, e.shape[-1], block_size),
                          double, scale_dtype)


def _quantize_rows(ckpt: Checkpoint, name: str, fmt: F.Format, block: int, double: bool,
                   scale_dtype: Any) -> QuantizedArray:
    """`name` quantized along its last axis, `CHUNK_BYTES` of rows at a time: blocks lie
    inside rows, so the chunks' codes are the whole tensor's. Double quantization (its
    offset is the mean of every block's scale) runs once on all the scales at the end."""
    e = ckpt.entries[name]
    rows, k = int(np.prod(e.shape[:-1])), e.shape[-1]
    step = max(1, CHUNK_BYTES // (4 * k))
    parts = []
    for start in range(0, rows, step):
        chunk = ckpt.read(name, (start, min(rows, start + step))).reshape(-1, k)
        qa = QuantizedArray.from_dense(chunk, fmt.name, block_size=block, axis=-1,
                                       scale_dtype=scale_dtype)
        parts.append(jax.tree.map(np.asarray, qa.leaves()[:3]))
    codes, scales, mins = (None if parts[0][i] is None else
                           np.concatenate([p[i] for p in parts]).reshape(*e.shape[:-1], -1, *(
                               parts[0][i].shape[2:])) for i in range(3))
    ss = so = None
    if double:
        scales, ss, so = F.double_quantize(jnp.asarray(scales, jnp.float32), fmt.double_code)
    return QuantizedArray(jnp.asarray(codes), jnp.asarray(scales),
                          None if mins is None else jnp.asarray(mins), qtype=fmt.name,
                          block_size=block, axis=-1, dense_dtype=e.dtype,
                          scale_scales=ss, scale_offset=so)
