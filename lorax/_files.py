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
from typing import Any

import numpy as np


def read_safetensors(path: str | os.PathLike, who: str,
                     finite: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`(tensors, metadata)` of a safetensors file, validated (see the module docstring)."""
    from safetensors import SafetensorError, safe_open

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
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{who}: {os.fspath(path)!r} is not valid JSON ({err}).") from None


def parse_json(text: Any, who: str, where: str) -> Any:
    """`json.loads(text)` for a string field of a file (`where` names the file and field)."""
    if not isinstance(text, str):
        raise ValueError(f"{who}: {where} must be a JSON string, got {type(text).__name__}.")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{who}: {where} is not valid JSON ({err}).") from None


def field(obj: Any, key: str, kind: str, who: str, where: str, default: Any = ...) -> Any:
    """`obj[key]`, checked to be a `kind` (`"str"`, `"int"` (>= 0), `"pos_int"`,
    `"number"` (finite), `"bool"`, `"ints"` (list of ints >= 0), `"dict"`, `"list"`)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{who}: {where} must be a JSON object, got {type(obj).__name__}.")
    if key not in obj:
        if default is ...:
            raise ValueError(f"{who}: {where} has no {key!r} field.")
        return default
    value = obj[key]
    if value is None and default is None:
        return None
    if not _is_kind(value, kind):
        raise ValueError(f"{who}: {where}: {key!r} must be {_KINDS[kind][0]}, got {value!r}.")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KINDS = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "pos_int": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "number": ("a finite number", lambda v: (_is_int(v) or isinstance(v, float))
               and math.isfinite(v)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "ints": ("a list of integers >= 0", lambda v: isinstance(v, list)
             and all(_is_int(i) and i >= 0 for i in v)),
    "dict": ("a JSON object", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, list)),
}


def _is_kind(value: Any, kind: str) -> bool:
    return _KINDS[kind][1](value)


class GGUFHeader:
    """What lorax reads of a GGUF file: its metadata values and tensors' ggml shapes and
    types, read through gguf-py and checked (see `read_gguf_header`)."""

    def __init__(self, path: str, metadata: dict[str, Any], tensors: dict[str, tuple]):
        self.path = path
        self.metadata = metadata  # key -> value (str, number, bool or list)
        self.tensors = tensors    # name -> (ggml shape, type name, the reader's tensor)

    def value(self, key: str, kind: str, who: str) -> Any:
        """A metadata value, checked (`field`'s kinds), or a `ValueError` naming file and key."""
        return field(self.metadata, key, kind, who, f"GGUF {self.path!r}")


def read_gguf_header(path: str | os.PathLike, who: str) -> GGUFHeader:
    """A GGUF file's header through gguf-py, with every failure of a damaged or lying
    file (truncation, offsets past the end, unknown types, byte counts that do not fit a
    tensor's shape) a `ValueError` naming the file (and the tensor)."""
    import gguf

    path = os.fspath(path)
    try:
        reader = gguf.GGUFReader(path)
        metadata = {name: f.contents() for name, f in reader.fields.items()}
        tensors = {}
        for t in reader.tensors:
            shape = tuple(int(n) for n in t.shape)
            block, type_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
            expected = math.prod(shape) // block * type_bytes
            if any(n < 0 for n in shape) or shape and shape[0] % block or t.data.nbytes != expected:
                raise ValueError(f"tensor {t.name!r} has {t.data.nbytes} bytes where its shape "
                                 f"{list(shape)} and type {t.tensor_type.name} need {expected}")
            tensors[t.name] = (shape, t.tensor_type.name, t)
    except Exception as err:  # gguf-py raises many kinds on damaged input  # noqa: BLE001
        raise ValueError(f"{who}: {path!r} is not a readable GGUF file "
                         f"({type(err).__name__}: {err}).") from None
    return GGUFHeader(path, metadata, tensors)
