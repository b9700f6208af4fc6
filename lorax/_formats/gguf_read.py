"""Reading a GGUF model file (llama.cpp's format): `load_gguf(path) -> (tensors, metadata)`.

The file (gguf-py's `gguf_reader.py`, llama.cpp's `ggml/src/gguf.cpp`), little-endian:

- `"GGUF"`, version (u32, 2 or 3), tensor count (u64), metadata count (u64);
- metadata: key (u64 length + UTF-8 bytes), value type (u32), value (scalars, strings,
  arrays of either: u32 element type, u64 count, elements);
- tensor infos: name, number of dims (u32), dims (u64 each, ggml order: the first is the
  row length, which quantization blocks run along), ggml type (u32), offset (u64) from
  the data section, which starts at the next multiple of `general.alignment` (32);
- the tensors' bytes: rows of blocks.

The parsing is lorax's own (no `gguf` import), so a cut-short file or a tensor whose bytes
do not fit its shape is reported with the file's and the tensor's names. The tensors are
read from a memory map: dense ones are views of it, quantized ones are copied once into
their `QuantizedArray`'s leaves.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

# ggml's tensor types (ggml.h `enum ggml_type`), by id: name.
_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# Tensors that load as plain arrays: ggml type name -> numpy dtype.
_DENSE = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}

# Metadata value types (gguf.h `enum gguf_type`): struct code, or the two variable ones.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _quant_types() -> dict[str, Any]:
    """GGUF type name -> lorax's `Format`, for the block types `QuantizedArray` holds."""
    from .._quant import _formats as F

    return {f.name.upper(): f for f in F.FORMATS.values() if f.record is not None}


def supported_types() -> list[str]:
    return [*_DENSE, *_quant_types()]


class _Cursor:
    """Reads the header, naming the file and the field when the bytes run out."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf, self.path, self.pos, self.what = buf, path, 0, "the header"

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise ValueError(
                f"load_gguf: {self.path} ends at byte {len(self.buf)}, inside {self.what} "
                f"(byte {self.pos} + {n}): the file is truncated or not a GGUF file.")

    def scalar(self, code: str) -> Any:
        n = struct.calcsize(code)
        self._need(n)
        (v,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str | bytes:
        n = self.scalar("<Q")
        self._need(n)
        raw = self.buf[self.pos:self.pos + n].tobytes()
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw  # kept as the bytes it is (a vocabulary's odd token)

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"load_gguf: {self.path}: {self.what} has an unknown value "
                             f"type {vtype}.")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALARS and etype != 7:  # numbers: one numpy array
            dtype = np.dtype(_SCALARS[etype])
            self._need(count * dtype.itemsize)
            out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
            self.pos += count * dtype.itemsize
            return out
        return [self.value(etype) for _ in range(count)]


def _header(cur: _Cursor) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]]]:
    if cur.buf[:4].tobytes() != b"GGUF":
        raise ValueError(f"load_gguf: {cur.path} is not a GGUF file (it does not start "
                         "with 'GGUF').")
    cur.pos = 4
    version = cur.scalar("<I")
    if version & 0xFFFF == 0:
        raise ValueError(f"load_gguf: {cur.path} is a big-endian GGUF file; only "
                         "little-endian ones are read.")
    if version not in (2, 3):
        raise ValueError(f"load_gguf: {cur.path} is GGUF version {version}; versions 2 "
                         "and 3 are read.")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        cur.what = f"metadata entry {i}"
        key = cur.string()
        cur.what = f"metadata {key!r}"
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for i in range(n_tensors):
        cur.what = f"tensor info {i}"
        name = cur.string()
        cur.what = f"the info of tensor {name!r}"
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    return metadata, infos


def _tensor_bytes(path: str, name: str, dims: tuple[int, ...], type_name: str) -> int:
    """Bytes of a tensor of ggml `dims`: whole blocks along its rows, or a `ValueError`."""
    if type_name in _DENSE:
        return math.prod(dims) * np.dtype(_DENSE[type_name]).itemsize
    rec, block = _quant_types()[type_name].record, _quant_types()[type_name].block_size
    if not dims or dims[0] % block:
        raise ValueError(
            f"load_gguf: {path}: tensor {name!r} ({type_name}, ggml dims {list(dims)}) has "
            f"rows of {dims[0] if dims else 0} values, not a whole number of {type_name} "
            f"blocks of {block}: its byte count does not match its shape.")
    return math.prod(dims) // block * rec.size


def _check_extents(path: str, size: int, spans: list[tuple[int, int, str, str]]) -> None:
    """Every tensor's bytes lie in the file and end before the next tensor's begin."""
    spans = sorted(spans)
    for i, (start, n, name, desc) in enumerate(spans):
        if start + n > size:
            raise ValueError(
                f"load_gguf: {path}: tensor {name!r} ({desc}) needs bytes {start} to "
                f"{start + n}, but the file ends at byte {size}: the file is truncated.")
        if i + 1 < len(spans) and start + n > spans[i + 1][0]:
            raise ValueError(
                f"load_gguf: {path}: tensor {name!r} ({desc}) needs {n} bytes from byte "
                f"{start}, but tensor {spans[i + 1][2]!r} starts at byte {spans[i + 1][0]}: "
                "its byte count does not match its shape.")


def _unsupported(path: str, name: str, type_id: int) -> ValueError:
    type_name = _TYPE_NAMES.get(type_id, f"ggml type id {type_id}")
    return ValueError(
        f"load_gguf: {path}: tensor {name!r} has type {type_name}, which lorax does not "
        f"read; supported types: {', '.join(supported_types())}.")


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

    `ValueError` naming the file (and the tensor) for a file that is not GGUF or ends
    early, a tensor whose bytes do not fit its shape or the file, or a tensor type
    lorax does not read (listing the supported ones).

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
    path = os.fspath(path)
    try:
        buf = np.memmap(path, mode="r")
    except ValueError:  # numpy cannot map an empty file
        raise ValueError(f"load_gguf: {path} is empty, not a GGUF file.") from None
    cur = _Cursor(buf, path)
    metadata, infos = _header(cur)
    align = int(metadata.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"load_gguf: {path}: general.alignment is {align}, not a power of two.")
    base = -(-cur.pos // align) * align
    quant = _quant_types()
    spans = []
    for name, dims, type_id, offset in infos:
        type_name = _TYPE_NAMES.get(type_id)
        if type_name not in _DENSE and type_name not in quant:
            raise _unsupported(path, name, type_id)
        n = _tensor_bytes(path, name, dims, type_name)
        spans.append((base + offset, n, name, f"{type_name}, ggml dims {list(dims)}"))
    _check_extents(path, len(buf), spans)
    tensors = {}
    for (name, dims, type_id, _), (start, n, _, _) in zip(infos, spans):
        tensors[name] = _tensor(buf[start:start + n], dims, _TYPE_NAMES[type_id], transpose)
    return tensors, metadata


def _tensor(raw: np.ndarray, dims: tuple[int, ...], type_name: str, transpose: bool) -> Any:
    shape = tuple(reversed(dims))
    if type_name in _DENSE:
        x = np.asarray(raw).view(_DENSE[type_name]).reshape(shape)
        return np.swapaxes(x, -1, -2) if transpose and x.ndim >= 2 else x
    from .._quant._array import QuantizedArray

    fmt = _quant_types()[type_name]
    rows = raw.reshape(*shape[:-1], shape[-1] // fmt.block_size * fmt.record.size)
    if len(shape) < 2:  # QuantizedArray needs two axes
        return np.asarray(QuantizedArray.from_gguf(rows[None], fmt.name, transpose=False).dequantize()[0])
    return QuantizedArray.from_gguf(rows, fmt.name, transpose=transpose)
