"""Reading a GGUF model file (llama.cpp's format): `load_gguf(path) -> (tensors, metadata)`.

The container is parsed by `lorax/_files.py` (checked, memory-mapped, no gguf-py
import); this module turns its tensors into arrays: dense ones are views of the map,
quantized ones are copied once into their `QuantizedArray`'s leaves.
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np

from .._checks import check_bool
from .._files import read_gguf_header
from .._quant import _formats as F
from .._quant._array import QuantizedArray

# Tensors that load as plain arrays: ggml type name -> numpy dtype.
_DENSE = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _quant_types() -> dict[str, Any]:
    """GGUF type name -> lorax's `Format`, for the block types `QuantizedArray` holds."""
    return {f.name.upper(): f for f in F.FORMATS.values() if f.record is not None}


def supported_types() -> list[str]:
    return [*_DENSE, *_quant_types()]


def load_gguf(path: str | os.PathLike, *, transpose: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a GGUF model file: its tensors, quantized ones as they are on disk, and its
    metadata.

    Shapes are numpy's order, which is GGUF's dims reversed (GGUF lists the row length
    first): a linear layer stored as ggml `[in, out]` comes as `(out, in)`, the token
    embedding `[dim, vocab]` as `(vocab, dim)`, a stack of experts `[in, out, n]` as
    `(n, out, in)`. Quantization blocks run along the rows, the **last** axis (`in`,
    `dim`): each quantized tensor is a [`lorax.QuantizedArray`][] with block axis `-1`
    whose bytes are the file's (`nbytes` is the size on disk) and whose `dequantize()`
    equals `gguf.quants.dequantize` bit for bit. With `transpose=True` every tensor of
    two or more axes comes with its last two axes swapped: `(in, out)` kernels for
    `x @ w`, quantized ones with block axis `-2` (the same bytes either way). Inside
    [`lorax.lora`][] a transpose (`w.T`) keeps a `QuantizedArray` quantized too.

    Block types read: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; dense
    F32, F16, BF16 (and F64, I8-I64) tensors come as read-only numpy arrays viewing the
    memory-mapped file, in their own dtype. A one-axis tensor in a block type (llama.cpp
    does not write them) comes dequantized, as float32.

    The model itself stays yours: names are GGUF's (`blk.0.attn_q.weight`, ...), and
    converters' conventions (llama.cpp permutes Llama's q/k rows; Gemma stores its
    norm weights as `1 + w`) are left as they are in the file.

    **Arguments:**

    - `path`: the `.gguf` file.
    - `transpose`: swap the last two axes of every tensor of two or more axes.

    **Returns:**

    `(tensors, metadata)`: `tensors` maps each tensor's GGUF name to a
    `QuantizedArray` (block types) or a numpy array, in file order; `metadata` maps
    each key to its value: Python scalars and strings, numeric arrays as numpy
    arrays, string arrays as lists (a string that is not valid UTF-8 stays `bytes`).

    **Raises:**

    `ValueError` naming the file (and the field or tensor) for a file that is not GGUF or
    ends early, a count, length, dimension or offset in the header that the file cannot
    hold (checked before anything is allocated), a tensor whose bytes do not fit its shape
    or the file, or a tensor type lorax does not read (listing the supported ones).

    !!! Example

        ```python
        import os, tempfile
        import gguf, numpy as np
        import lorax

        w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
        path = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
        writer = gguf.GGUFWriter(path, "llama")
        q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
        writer.add_tensor("blk.0.ffn_up.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q5_0)
        writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
        for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                     writer.write_tensors_to_file, writer.close):
            step()

        tensors, meta = lorax.load_gguf(path)
        up = tensors["blk.0.ffn_up.weight"]
        assert up.qtype == "q5_0" and up.shape == (64, 256) and up.nbytes == q.nbytes
        assert (np.asarray(up.dequantize()) == gguf.quants.dequantize(
            q, gguf.GGMLQuantizationType.Q5_0)).all()
        assert meta["general.architecture"] == "llama"
        ```
    """
    transpose = check_bool("load_gguf", "transpose", transpose)
    header = read_gguf_header(path, "load_gguf")
    supported = supported_types()
    for name, t in header.tensors.items():
        if t.type not in supported:
            raise ValueError(
                f"load_gguf: GGUF {header.path!r}: tensor {name!r} has type {t.type}, which "
                f"lorax does not read; supported types: {', '.join(supported)}.")
    tensors = {name: _tensor(header.raw(name), t.dims, t.type, transpose)
               for name, t in header.tensors.items()}
    return tensors, header.metadata


def _tensor(raw: np.ndarray, dims: tuple[int, ...], type_name: str, transpose: bool) -> Any:
    shape = tuple(reversed(dims))
    if type_name in _DENSE:
        x = np.asarray(raw).view(_DENSE[type_name]).reshape(shape)
        return np.swapaxes(x, -1, -2) if transpose and x.ndim >= 2 else x
    fmt = _quant_types()[type_name]
    rows = raw.reshape(*shape[:-1], shape[-1] // fmt.block_size * fmt.record.size)
    if len(shape) < 2:  # QuantizedArray needs two axes
        return np.asarray(QuantizedArray.from_gguf(rows[None], fmt.name, transpose=False).dequantize()[0])
    return QuantizedArray.from_gguf(rows, fmt.name, transpose=transpose)
