"""Adapters on disk: the trainable part of a LoRA tree in one safetensors file.

The file is plain safetensors (8-byte little-endian header length, a JSON header,
raw little-endian tensor bytes), written here directly so the round trip is
bit-exact for every dtype JAX has, bf16 included. Reading goes through the
`safetensors` package and `_files`' checks: the file may come from anyone.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from . import _engine
from ._files import field, parse_json, read_safetensors
from ._spec import LORA_FREEZE, LORA_FULL, LoraSpec, check_lora_leaves, check_spec_structure
from ._sharding import factor_shardings, place_host_array
from ._variants.dora import DoraWeight
from ._version import __version__
from ._weight import LoraWeight, factor_structure, normalize_m_axes

_FORMAT = "lorax-adapter/1"
# The metadata keys save_adapter writes itself, which load_adapter reads.
_RESERVED_METADATA = ("format", "lorax_version", "entries")
_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def _write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                       metadata: dict[str, str]) -> None:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    blobs = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _DTYPES[arr.dtype.name], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def _read_safetensors(path: str | os.PathLike,
                      who: str = "load_adapter") -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return read_safetensors(path, who)


def _entries(meta: dict[str, str], tensors: dict[str, np.ndarray], path: str) -> list[dict]:
    """The adapter's entries, each field checked, each tensor it names present."""
    who = "load_adapter"
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{who}: {path!r} is not a lorax adapter file.")
    entries = parse_json(meta.get("entries"), who, f"{path!r}'s 'entries' metadata")
    if not isinstance(entries, list):
        raise ValueError(f"{who}: {path!r}'s 'entries' metadata must be a list.")
    seen: set[str] = set()
    for i, e in enumerate(entries):
        where = f"{path!r}, entry {i}"
        key = field(e, "path", "str", who, where)
        kind = field(e, "kind", "str", who, where)
        if kind not in ("lora", "dora", "full") or key in seen:
            raise ValueError(f"{who}: {where} ({key!r}): kind {kind!r} is not one of "
                             "'lora', 'dora', 'full', or the path comes twice.")
        seen.add(key)
        if kind != "full":
            for name, what in (("rank", "pos_int"), ("alpha", "number"), ("batch_ndim", "int"),
                               ("m_ndim", "pos_int"), ("w_shape", "ints")):
                field(e, name, what, who, f"{where} ({key!r})")
            field(e, "m_axes", "ints", who, f"{where} ({key!r})", default=None)
        suffixes = {"full": [""], "lora": [".a", ".b"], "dora": [".a", ".b", ".m"]}[kind]
        for name in (key + s for s in suffixes):
            if name not in tensors:
                raise ValueError(f"{who}: {path!r} has no tensor {name!r} for {key}.")
            if kind != "full" and not np.issubdtype(np.dtype(tensors[name].dtype), np.floating) \
                    and tensors[name].dtype.name != "bfloat16":
                raise ValueError(f"{who}: tensor {name!r} in {path!r} has dtype "
                                 f"{tensors[name].dtype}; LoRA factors are floating point.")
    return entries


def _to_host(x: Any) -> np.ndarray:
    """The whole of `x` as a host array, on one host or several."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    # Shards live on other processes' devices: gathering them is a collective,
    # so every process must be here (see `save_adapter`).
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _array_sharding(x: Any) -> Any:
    """`x`'s sharding if it spans several devices (one device: JAX's default placement)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding) and len(sharding.device_set) > 1:
        return sharding
    return None


def _check_metadata(metadata: Any) -> None:
    """Extra metadata is str -> str (safetensors' header says so: another value makes the
    file unreadable) and leaves lorax's own keys alone (the file would load as another
    adapter, or not at all)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise TypeError(f"save_adapter: metadata must be a dict of str to str, got "
                        f"{type(metadata).__name__}.")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise TypeError(f"save_adapter: metadata keys must be str, got {key!r}.")
        if not isinstance(value, str):
            raise TypeError(f"save_adapter: metadata[{key!r}] must be a str (safetensors "
                            f"metadata is text), got {value!r}.")
        if key in _RESERVED_METADATA:
            raise ValueError(f"save_adapter: metadata key {key!r} is lorax's own (it writes "
                             f"{', '.join(map(repr, _RESERVED_METADATA))}); use another key.")


def save_adapter(path: str | os.PathLike, lora_params: Any, spec: Any,
                 metadata: dict[str, str] | None = None) -> None:
    """Save the trainable part of `lora_params` (factors + fully-tuned leaves) to one file.

    The file is a safetensors file: tensors are named by their key path
    (`"['layer']['kernel'].a"`), and its metadata records each entry's path, rank,
    alpha, factorisation and dtypes, plus the lorax version. Frozen weights are not
    saved: [`lorax.load_adapter`][] puts the adapter back onto a base parameter tree.

    Sharded factors are gathered to the host first. With several processes
    (`jax.distributed.initialize`) every process must call `save_adapter` (gathering
    shards held by other hosts is a collective) and process 0 alone writes the file.

    **Arguments:**

    - `path`: the file to write.
    - `lora_params`: a LoRA parameter tree (from [`lorax.init_lora`][] and training).
    - `spec`: the spec it was built with.
    - `metadata`: extra string key/values to store (e.g. the base model's name); not
      `"format"`, `"lorax_version"` or `"entries"`, which lorax writes itself.

    **Returns:**

    Nothing.

    **Raises:**

    `TypeError` for `metadata` that is not str -> str, `ValueError` for one of lorax's
    own keys in it (naming the key), before anything is written.

    !!! Example

        ```python
        import tempfile, jax, jax.numpy as jnp
        import lorax

        params = {"w": jnp.ones((8, 4))}
        lp = lorax.init_lora(params, {"w": 2}, jax.random.PRNGKey(0))
        with tempfile.TemporaryDirectory() as d:
            lorax.save_adapter(f"{d}/adapter.safetensors", lp, {"w": 2})
            loaded, spec = lorax.load_adapter(f"{d}/adapter.safetensors", params)
        assert (loaded["w"].a == lp["w"].a).all()
        ```
    """
    _check_metadata(metadata)
    check_spec_structure(spec, lora_params, "save_adapter")
    check_lora_leaves(spec, lora_params, "save_adapter")
    tensors: dict[str, np.ndarray] = {}
    entries = []
    flat, treedef = jax.tree_util.tree_flatten_with_path(lora_params, is_leaf=_engine.is_value)
    for (key_path, leaf), spec_val in zip(flat, treedef.flatten_up_to(spec)):
        key = jax.tree_util.keystr(key_path)
        if _is_lora(leaf):
            nb, nm, _ = leaf.structure
            tensors[key + ".a"] = _to_host(leaf.a)
            tensors[key + ".b"] = _to_host(leaf.b)
            entry = dict(path=key, kind="lora", rank=leaf.rank, alpha=leaf.alpha,
                         batch_ndim=nb, m_ndim=nm, w_shape=list(leaf.w.shape),
                         w_dtype=str(leaf.w.dtype))
            if not leaf.contiguous:
                entry.update(m_axes=list(leaf.axes.m))
            if isinstance(leaf, DoraWeight):
                tensors[key + ".m"] = _to_host(leaf.m)
                entry.update(kind="dora")
            entries.append(entry)
        elif spec_val == LORA_FULL:
            tensors[key] = _to_host(leaf)
            entries.append(dict(path=key, kind="full", shape=list(np.shape(leaf))))
    meta = {"format": _FORMAT, "lorax_version": __version__, "entries": json.dumps(entries)}
    meta.update(metadata or {})
    if jax.process_index() == 0:
        _write_safetensors(path, tensors, meta)


def load_adapter(path: str | os.PathLike, base_params: Any) -> tuple[Any, Any]:
    """Put an adapter saved by [`lorax.save_adapter`][] onto a base parameter tree.

    **Arguments:**

    - `path`: the adapter file.
    - `base_params`: the base model's parameters (plain arrays), or a LoRA tree of the
      same model (its factors are replaced; ranks must match).

    **Returns:**

    `(lora_params, spec)`: the LoRA parameter tree (base arrays are reused, not
    copied) and a spec for it (`LoraSpec` entries, `LORA_FULL`, `LORA_FREEZE`).
    Loaded arrays are placed shard by shard: factors on the shardings
    [`lorax.init_lora`][] derives from a `NamedSharding`-sharded `w` (or, for a
    LoRA tree, on its factors' current shardings), fully-tuned leaves on the base
    leaf's sharding. Each process reads the whole file and keeps its own shards.

    **Raises:**

    `ValueError` naming the key path when the adapter does not fit the base: a path
    missing from the base, a weight-shape mismatch, a rank mismatch, or a file that
    is not a lorax adapter.

    !!! Example

        See [`lorax.save_adapter`][].
    """
    tensors, meta = _read_safetensors(path)
    entries = _entries(meta, tensors, os.fspath(path))
    try:
        return _apply(entries, tensors, base_params)
    except ValueError as err:  # a mismatch the file brought: say which file
        raise ValueError(f"{err} (adapter file {os.fspath(path)!r})") from None


def _apply(entries: list[dict], tensors: dict[str, np.ndarray], base_params: Any) -> tuple[Any, Any]:
    """The checked entries put onto `base_params`: `(lora_params, spec)`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(base_params, is_leaf=_engine.is_value)
    index = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(flat)}
    leaves = [leaf for _, leaf in flat]
    spec = [LORA_FREEZE] * len(leaves)
    for e in entries:
        key = e["path"]
        if key not in index:
            raise ValueError(f"load_adapter: the adapter has {key} but the base parameters do not.")
        i = index[key]
        base = leaves[i]
        if e["kind"] == "full":
            arr = tensors[key]
            if tuple(np.shape(base)) != tuple(arr.shape):
                raise ValueError(f"load_adapter: {key} has shape {tuple(np.shape(base))} in the "
                                 f"base but {tuple(arr.shape)} in the adapter.")
            leaves[i], spec[i] = place_host_array(arr, _array_sharding(base)), LORA_FULL
            continue
        w = base.w if _is_lora(base) else base
        if tuple(np.shape(w)) != tuple(e["w_shape"]):
            raise ValueError(f"load_adapter: {key} has shape {tuple(np.shape(w))} in the base "
                             f"but the adapter was trained on shape {tuple(e['w_shape'])}.")
        if _is_lora(base) and base.rank != e["rank"]:
            raise ValueError(f"load_adapter: {key} has rank {base.rank} in the given LoRA "
                             f"parameters but rank {e['rank']} in the adapter.")
        m_axes = None if e.get("m_axes") is None else tuple(e["m_axes"])
        if _is_lora(base):
            a_sharding, b_sharding = _array_sharding(base.a), _array_sharding(base.b)
        else:
            try:
                a_sharding, b_sharding = (
                    factor_shardings(w, e["batch_ndim"], m_axes or e["m_ndim"]) or (None, None))
            except ValueError as err:
                raise ValueError(f"load_adapter: {key}: {err}") from None
        a_arr, b_arr = tensors[key + ".a"], tensors[key + ".b"]
        try:
            # Before placing: factors that do not fit `w` would otherwise fail
            # inside the placement with an error about shards, not shapes.
            factor_structure(tuple(np.shape(w)), a_arr.shape, b_arr.shape,
                             normalize_m_axes(np.ndim(w), e["batch_ndim"], m_axes))
        except ValueError as err:
            raise ValueError(f"load_adapter: {key}: {err}") from None
        a, b = place_host_array(a_arr, a_sharding), place_host_array(b_arr, b_sharding)
        try:
            if e["kind"] == "dora":
                m = place_host_array(tensors[key + ".m"], None)
                leaves[i] = DoraWeight(w, a=a, b=b, m=m, alpha=e["alpha"], m_axes=m_axes)
            else:
                leaves[i] = LoraWeight(w, a=a, b=b, alpha=e["alpha"], m_axes=m_axes)
        except ValueError as err:
            raise ValueError(f"load_adapter: {key}: {err}") from None
        input_factor = None
        if e["kind"] == "dora":
            input_factor = "b" if leaves[i].output_factor == "a" else "a"
        spec[i] = LoraSpec(e["rank"], e["alpha"], e["batch_ndim"], e["m_ndim"],
                           dora=e["kind"] == "dora", input_factor=input_factor, m_axes=m_axes)
    return jax.tree_util.tree_unflatten(treedef, leaves), jax.tree_util.tree_unflatten(treedef, spec)
