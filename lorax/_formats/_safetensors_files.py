"""Hugging Face checkpoint containers, from strangers: a `.safetensors` file, or a directory
of shards named by `model.safetensors.index.json`, plus `config.json`.

Every shard is opened once by the `safetensors` package, which validates its header
(offsets inside the file, no overlaps or gaps, sizes that match dtype and shape) before
anything is read; lorax then reads the same header for the offsets and reads each tensor
(or a range of its rows) with `readinto` into an array of its own. Nothing is memory-mapped
while tensors are read, so a tensor's pages leave the process with it: loading a checkpoint
tensor by tensor holds one tensor at a time, not the shards.

A shard name that leaves the directory (`..`, an absolute path, a symlink pointing out) is
refused, and so is an index whose fields are not what Hugging Face writes. The one place
outside a directory its files may point to is the Hugging Face cache's own: a snapshot's
files are symlinks into its repository's `blobs/`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from safetensors import SafetensorError, safe_open

from .._files import checked, field, read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"

# safetensors' dtype names -> NumPy (ml_dtypes for the float types NumPy lacks).
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored tensor: its file, dtype, shape and byte range in the file."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's tensors (in index, then file, order) and its `config.json`."""

    path: str
    entries: dict[str, Entry]
    config: dict[str, Any]

    def where(self, name: str) -> str:
        """`file 'x.safetensors': tensor 'name'`, for errors."""
        return f"{self.entries[name].file!r}: tensor {name!r}"

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor `name` as a new array, or rows `[start, stop)` of it seen as
        `(rows, last axis)`."""
        e = self.entries[name]
        shape, begin = e.shape, e.begin
        if rows is not None:
            begin += rows[0] * e.shape[-1] * e.dtype.itemsize
            shape = (rows[1] - rows[0], e.shape[-1])
        out = np.empty(shape, e.dtype)
        with open(e.file, "rb") as f:
            f.seek(begin)
            got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != out.nbytes:  # the file changed since its header was checked
            raise ValueError(f"load_safetensors: {self.where(name)} ends early.")
        return out


def open_checkpoint(path: str | os.PathLike, who: str) -> Checkpoint:
    """The checkpoint at `path` (a file or a directory), every header validated."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files, names, config = _directory(path, who)
    elif os.path.isfile(path):
        files, names, config = [path], None, {}
    else:
        raise ValueError(f"{who}: {path!r} is neither a .safetensors file nor a checkpoint "
                         "directory.")
    entries: dict[str, Entry] = {}
    for file in files:
        for name, entry in _header(file, who).items():
            if name in entries:
                raise ValueError(f"{who}: tensor {name!r} is stored twice: in "
                                 f"{entries[name].file!r} and {file!r}.")
            entries[name] = entry
    if names is not None:
        entries = _as_indexed(entries, names, path, who)
    return Checkpoint(path, entries, config)


def _directory(path: str, who: str) -> tuple[list[str], dict[str, str] | None, dict]:
    config_path = os.path.join(path, CONFIG)
    config = read_json(config_path, who) if os.path.isfile(config_path) else {}
    if not isinstance(config, dict):
        raise ValueError(f"{who}: {config_path!r} must hold a JSON object, got "
                         f"{type(config).__name__}.")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        names = _weight_map(index, who)
        files = [_inside(path, shard, index, who) for shard in dict.fromkeys(names.values())]
        return files, {n: _inside(path, s, index, who) for n, s in names.items()}, config
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return [_inside(path, SINGLE, path, who)], None, config
    raise ValueError(f"{who}: {path!r} has neither {INDEX} nor {SINGLE}.")


def _weight_map(index: str, who: str) -> dict[str, str]:
    data = read_json(index, who)
    weight_map = field(data, "weight_map", "dict", who, repr(index))
    for name, shard in weight_map.items():
        checked(shard, "str", who, f"{index!r}: weight_map: {name}")
    return weight_map


def _roots(directory: str) -> list[str]:
    """Where a checkpoint's files may really be: its directory, and for a snapshot in the
    Hugging Face cache (`models--org--name/snapshots/<revision>/`, whose files are
    symlinks to `../../blobs/<hash>`) that repository's `blobs/`."""
    root = os.path.realpath(directory)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    return roots


def _inside(directory: str, shard: str, index: str, who: str) -> str:
    """The real path of `shard`, a file of `directory` (see `_roots`)."""
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(root, shard))
    if os.path.isabs(shard) or real == root or not any(
            os.path.commonpath([r, real]) == r for r in _roots(directory)):
        raise ValueError(f"{who}: {index!r} names the shard {shard!r}, which is not inside "
                         f"{directory!r}; shards must be files of the checkpoint's directory.")
    if not os.path.isfile(real):
        raise ValueError(f"{who}: {index!r} names the shard {shard!r}, which does not exist.")
    return real


def _as_indexed(entries: dict[str, Entry], names: dict[str, str], path: str,
                who: str) -> dict[str, Entry]:
    """The tensors the index names, in its order, each found in the shard it names."""
    out = {}
    for name, file in names.items():
        if name not in entries or entries[name].file != file:
            raise ValueError(f"{who}: {os.path.join(path, INDEX)!r} puts tensor {name!r} in "
                             f"{os.path.basename(file)!r}, which does not hold it.")
        out[name] = entries[name]
    return out


def _header(file: str, who: str) -> dict[str, Entry]:
    """A shard's tensors: the header validated by `safetensors`, then read for offsets."""
    try:
        with safe_open(file, framework="numpy"):
            pass
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        raise ValueError(f"{who}: {file!r} is not a readable safetensors file "
                         f"({type(err).__name__}: {err}).") from None
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {name: _entry(file, name, info, 8 + n, who)
            for name, info in header.items() if name != "__metadata__"}


def _entry(file: str, name: str, info: dict, base: int, who: str) -> Entry:
    if info["dtype"] not in DTYPES:
        raise ValueError(f"{who}: {file!r}: tensor {name!r} has dtype {info['dtype']}, which "
                         f"lorax does not read ({', '.join(DTYPES)}).")
    dtype = np.dtype(DTYPES[info["dtype"]])
    shape = tuple(int(d) for d in info["shape"])
    begin, end = (int(x) for x in info["data_offsets"])
    if end - begin != math.prod(shape) * dtype.itemsize:  # safetensors checks it too
        raise ValueError(f"{who}: {file!r}: tensor {name!r}'s bytes do not fit its shape.")
    return Entry(file, dtype, shape, base + begin, end - begin)
