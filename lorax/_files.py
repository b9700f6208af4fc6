"""Reading files from strangers: adapters and configs people download.

Everything read from a file is checked before it is used, and every problem is a
`ValueError` that names the file and the field: safetensors go through the
`safetensors` package, which validates the header (sizes, offsets inside the file, no
overlaps, known dtypes) before any tensor is read and maps the file rather than
reading it whole; JSON fields are checked by type; float tensors must be finite.
Nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, NamedTuple

import numpy as np
from safetensors import SafetensorError, safe_open


def read_safetensors(path: str | os.PathLike, who: str,
                     finite: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`(tensors, metadata)` of a safetensors file, validated (see the module docstring)."""
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        raise ValueError(f"{who}: {os.fspath(path)!r} is not a readable safetensors file "
                         f"({type(err).__name__}: {err}).") from None
    if finite:
        for name, arr in tensors.items():
            if np.issubdtype(arr.dtype, np.inexact) or arr.dtype.name == "bfloat16":
                if not np.isfinite(arr.astype(np.float32)).all():
                    raise ValueError(f"{who}: tensor {name!r} in {os.fspath(path)!r} has NaN or "
                                     "infinite values.")
    return tensors, metadata


def read_json(path: str | os.PathLike, who: str) -> Any:
    """The JSON value in a file (a `ValueError` naming the file if it is not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, RecursionError) as err:  # ValueError: bad UTF-8, bad JSON, an
        # integer of more digits than Python converts
        raise ValueError(f"{who}: {os.fspath(path)!r} is not valid JSON ({err}).") from None


def parse_json(text: Any, who: str, where: str) -> Any:
    """`json.loads(text)` for a string field of a file (`where` names the file and field)."""
    if not isinstance(text, str):
        raise ValueError(f"{who}: {where} must be a JSON string, got {type(text).__name__}.")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{who}: {where} is not valid JSON ({err}).") from None


def field(obj: Any, key: str, kind: str, who: str, where: str, default: Any = ...) -> Any:
    """`obj[key]`, checked to be a `kind` (see `checked`); `where` names the file. A
    missing key gives `default` (none: an error), and so does `null` when `default` is
    `None`."""
    if not isinstance(obj, dict):
        raise ValueError(f"{who}: {where} must be a JSON object, got {type(obj).__name__}.")
    if key not in obj:
        if default is ...:
            raise ValueError(f"{who}: {where} has no {key!r} field.")
        return default
    if obj[key] is None and default is None:
        return None
    return checked(obj[key], kind, who, f"{where}: {key}")


def checked(value: Any, kind: str, who: str, where: str) -> Any:
    """`value`, checked to be a `kind`: `"str"`, `"int"` (>= 0), `"pos_int"`, `"number"`
    (finite), `"dropout"` (a number in [0, 1)), `"bool"`, `"ints"` (list of ints >= 0),
    `"dict"`, `"list"`; `where` names the file and the field. JSON's `true` is no number
    and `2.0` no integer."""
    if not _KINDS[kind][1](value):
        raise ValueError(f"{who}: {where}: expected {_KINDS[kind][0]}, got {_shown(value)}.")
    return value


def _shown(value: Any) -> str:
    """A value read from a file as its JSON (`null`, `true`, `"r"`), shortened."""
    if _is_int(value) and value.bit_length() > 64:  # also past str()'s digit limit
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value) if isinstance(value, bytes) else json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # numpy arrays, huge nested ints
        text = f"a value of type {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    """A JSON number (not `true`) that is a finite float: an integer too large for a float
    is not."""
    if not (_is_int(v) or isinstance(v, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


_KINDS = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "pos_int": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "number": ("a finite number", _is_finite),
    "dropout": ("a number in [0, 1)", lambda v: _is_finite(v) and 0 <= v < 1),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "ints": ("a list of integers >= 0", lambda v: isinstance(v, list)
             and all(_is_int(i) and i >= 0 for i in v)),
    "dict": ("a JSON object", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, list)),
}


# -- GGUF containers (llama.cpp's model files) ----------------------------------------------
#
# Little-endian: "GGUF", version (u32, 2 or 3), tensor count (u64), metadata count (u64);
# metadata: key (u64 length + UTF-8), value type (u32), value (scalars, strings, arrays of
# either: u32 element type, u64 count, elements); tensor infos: name, number of dims (u32),
# dims (u64 each, ggml order: the row length first), ggml type (u32), offset (u64) from the
# data section, which starts at the next multiple of `general.alignment` (32). Parsed here
# rather than through gguf-py so that every lie in a stranger's header is a `ValueError`
# naming the file and field, nothing is allocated beyond the file, and reading needs no
# optional package.

# ggml's tensor types (`enum ggml_type`), by id: (name, values per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
# Metadata value types (`enum gguf_type`): struct code, or the two variable-length ones.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# The fewest bytes each header item takes, so that a count or length that the rest of the
# file cannot hold is caught before anything is read or allocated for it: a value of each
# type (a string: its u64 length; an array: element type u32 + count u64), a metadata entry
# (key length, value type, one byte of value), a tensor info (name length, n_dims, one dim,
# type, offset).
_MIN_VALUE_BYTES = {**{t: struct.calcsize(c) for t, c in _GGUF_SCALARS.items()},
                    _GGUF_STRING: 8, _GGUF_ARRAY: 12}
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8
GGML_MAX_DIMS = 4  # ggml's tensors have 1 to 4 axes; llama.cpp reads no others
_MAX_ARRAY_NESTING = 4  # arrays of arrays (llama.cpp reads none): a bound on the recursion
# No ggml type holds more than 8 values in a byte (the densest, Q1_0, has 128 in 18), so a
# dimension, or the values of a tensor's non-empty axes together, beyond 8 per byte of the
# file is a lie; the bound also keeps every shape within what numpy can hold.
_MAX_VALUES_PER_BYTE = 8


class GGUFTensor(NamedTuple):
    """One tensor's entry: ggml `dims` (row length first), ggml `type` name, and where its
    bytes are (`start`, `nbytes`, checked to lie in the file)."""

    dims: tuple[int, ...]
    type: str
    start: int
    nbytes: int


class GGUFHeader:
    """A GGUF file's metadata and tensor entries (see `read_gguf_header`); `buf` is the
    file's read-only memory map."""

    def __init__(self, path: str, metadata: dict[str, Any], tensors: dict[str, GGUFTensor],
                 buf: np.ndarray):
        self.path = path
        self.metadata = metadata  # key -> value (str, number, bool, list or numpy array)
        self.tensors = tensors
        self.buf = buf

    def value(self, key: str, kind: str, who: str) -> Any:
        """A metadata value, checked (`field`'s kinds), or a `ValueError` naming file and key."""
        return field(self.metadata, key, kind, who, f"GGUF {self.path!r}")

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes: a `uint8` view of the memory map."""
        t = self.tensors[name]
        return self.buf[t.start:t.start + t.nbytes]


class _Cursor:
    """Reads a header, naming the file, the caller and the field when the bytes run out or
    a count or length cannot be true."""

    def __init__(self, buf: np.ndarray, path: str, who: str):
        self.buf, self.path, self.who, self.pos, self.what = buf, path, who, 0, "the header"

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.who}: GGUF {self.path!r}: {message}")

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise self.fail(f"the file ends at byte {len(self.buf)}, inside {self.what} "
                            f"(byte {self.pos} + {n}): it is truncated or not a GGUF file.")

    def scalar(self, code: str) -> Any:
        n = struct.calcsize(code)
        self._need(n)
        (v,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += n
        return v

    def count(self, what: str, min_bytes: int) -> int:
        """A u64 count (or length) of items of at least `min_bytes` each, checked to fit
        in the rest of the file before anything is read or allocated for them."""
        n = self.scalar("<Q")
        left = len(self.buf) - self.pos
        if n * min_bytes > left:
            each = f" of at least {min_bytes} bytes each" if min_bytes > 1 else " bytes"
            raise self.fail(f"{what} is {n}, but the {left} bytes left in the file hold at "
                            f"most {left // min_bytes}{each}: the header lies or the file is "
                            "truncated.")
        return n

    def string(self) -> str | bytes:
        n = self.count(f"the string length in {self.what}", 1)
        raw = self.buf[self.pos:self.pos + n].tobytes()
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw  # kept as the bytes it is (a vocabulary's odd token)

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype != _GGUF_ARRAY:
            raise self.fail(f"{self.what} has an unknown value type {vtype}.")
        return self.array(depth)

    def array(self, depth: int) -> Any:
        etype = self.scalar("<I")
        if etype not in _MIN_VALUE_BYTES:
            raise self.fail(f"{self.what} is an array of an unknown value type {etype}.")
        if etype == _GGUF_ARRAY and depth + 1 >= _MAX_ARRAY_NESTING:
            raise self.fail(f"{self.what} nests arrays more than {_MAX_ARRAY_NESTING} deep.")
        count = self.count(f"the array length of {self.what}", _MIN_VALUE_BYTES[etype])
        if etype in _GGUF_SCALARS and etype != 7:  # numbers: one numpy array
            dtype = np.dtype(_GGUF_SCALARS[etype])
            out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
            self.pos += count * dtype.itemsize
            return out
        return [self.value(etype, depth + 1) for _ in range(count)]


def _gguf_entries(cur: _Cursor) -> tuple[dict[str, Any], list[tuple[str, tuple, int, int]]]:
    if cur.buf[:4].tobytes() != b"GGUF":
        raise cur.fail("not a GGUF file (it does not start with 'GGUF').")
    cur.pos = 4
    version = cur.scalar("<I")
    if version & 0xFFFF == 0:
        raise cur.fail("a big-endian GGUF file; only little-endian ones are read.")
    if version not in (2, 3):
        raise cur.fail(f"GGUF version {version}; versions 2 and 3 are read.")
    n_tensors = cur.count("the tensor count", _MIN_TENSOR_INFO_BYTES)
    n_kv = cur.count("the metadata count", _MIN_KV_BYTES)
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        cur.what = f"metadata entry {i}"
        key = cur.string()
        cur.what = f"metadata {key!r}"
        metadata[key] = cur.value(cur.scalar("<I"))
    return metadata, [_tensor_info(cur, i) for i in range(n_tensors)]


def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], int, int]:
    """`(name, dims, type id, offset)` of the `i`-th tensor info, its dims bounded."""
    cur.what = f"tensor info {i}"
    name = cur.string()
    cur.what = f"the info of tensor {name!r}"
    n_dims = cur.scalar("<I")
    if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise cur.fail(f"tensor {name!r}: n_dims is {n_dims}; ggml tensors have 1 to "
                       f"{GGML_MAX_DIMS} dims.")
    dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
    _check_dims(cur, name, dims)
    return name, dims, cur.scalar("<I"), cur.scalar("<Q")


def _check_dims(cur: _Cursor, name: str, dims: tuple[int, ...]) -> None:
    """Each dimension, and the values of the non-empty axes together, within what the file
    could hold (`_MAX_VALUES_PER_BYTE`): an empty tensor cannot claim a shape numpy cannot
    make, and a lying dimension is named before its byte count is worked out."""
    limit, size = _MAX_VALUES_PER_BYTE * len(cur.buf), len(cur.buf)
    for axis, d in enumerate(dims):
        if d > limit:
            raise cur.fail(f"tensor {name!r}: dimension {axis} is {d} (ggml dims {list(dims)}), "
                           f"more values than a file of {size} bytes holds.")
    values = math.prod(d for d in dims if d)
    if values > limit:
        raise cur.fail(f"tensor {name!r}: ggml dims {list(dims)} make {values} values, more "
                       f"than a file of {size} bytes holds.")


def _gguf_tensor_bytes(cur: _Cursor, name: str, dims: tuple[int, ...], type_id: int) -> int:
    if type_id not in GGML_TYPES:
        raise cur.fail(f"tensor {name!r} has ggml type id {type_id}, which is not a known "
                       "ggml type.")
    type_name, block, size = GGML_TYPES[type_id]
    if dims[0] % block:
        raise cur.fail(
            f"tensor {name!r} ({type_name}, ggml dims {list(dims)}) has rows of "
            f"{dims[0]} values, not a whole number of {type_name} blocks of "
            f"{block}: its byte count does not match its shape.")
    return math.prod(dims) // block * size


def _gguf_tensor(cur: _Cursor, base: int, name: str, dims: tuple[int, ...], type_id: int,
                 offset: int) -> GGUFTensor:
    """A tensor's entry: its byte count from its dims and type; its offset within the file."""
    n = _gguf_tensor_bytes(cur, name, dims, type_id)
    if base + offset > len(cur.buf):
        raise cur.fail(f"tensor {name!r}: its offset {offset} (from the data section at byte "
                       f"{base}) points past the end of the file at byte {len(cur.buf)}.")
    return GGUFTensor(dims, GGML_TYPES[type_id][0], base + offset, n)


def _check_extents(cur: _Cursor, tensors: dict[str, GGUFTensor]) -> None:
    """Every tensor's bytes lie in the file and end before the next tensor's begin."""
    spans = sorted((t.start, t.nbytes, name, f"{t.type}, ggml dims {list(t.dims)}")
                   for name, t in tensors.items())
    for i, (start, n, name, desc) in enumerate(spans):
        if start + n > len(cur.buf):
            raise cur.fail(f"tensor {name!r} ({desc}) needs bytes {start} to {start + n}, but "
                           f"the file ends at byte {len(cur.buf)}: the file is truncated.")
        if i + 1 < len(spans) and start + n > spans[i + 1][0]:
            raise cur.fail(
                f"tensor {name!r} ({desc}) needs {n} bytes from byte {start}, but tensor "
                f"{spans[i + 1][2]!r} starts at byte {spans[i + 1][0]}: its byte count "
                "does not match its shape.")


def read_gguf_header(path: str | os.PathLike, who: str) -> GGUFHeader:
    """A GGUF file's metadata and tensor entries, memory-mapped and checked: a file
    that is not GGUF or ends early, a count, length or dimension the file cannot hold
    (checked before anything is allocated for it), unknown value or tensor types, rows
    that are not whole blocks, tensors past the end or overlapping the next are each a
    `ValueError` naming `who`, the file and the field (or tensor)."""
    path = os.fspath(path)
    try:
        buf = np.memmap(path, mode="r")
    except ValueError:  # numpy cannot map an empty file
        raise ValueError(f"{who}: GGUF {path!r} is empty, not a GGUF file.") from None
    cur = _Cursor(buf, path, who)
    metadata, infos = _gguf_entries(cur)
    align = metadata.get("general.alignment", 32)
    if not _is_int(align) or align <= 0 or align & (align - 1):
        raise cur.fail(f"general.alignment is {align!r}, not a power of two.")
    base = -(-cur.pos // align) * align
    tensors = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise cur.fail(f"tensor {name!r} is listed twice.")
        tensors[name] = _gguf_tensor(cur, base, name, dims, type_id, offset)
    _check_extents(cur, tensors)
    return GGUFHeader(path, metadata, tensors, buf)
