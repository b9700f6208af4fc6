"""Hugging Face quantized checkpoints, read as stored: each format's companion tensors
folded into one `QuantizedArray`.

A table keyed by `quantization_config.quant_method` (`METHODS`): for each method, the
name suffixes that mark a stored quantized weight and a `fold` that checks the weight's
tensors against each other and against the logical shape, then lays the codes out as
lorax's formats hold them (`lorax/_quant/_formats.py`), every code and scale unchanged:

| method | stored as | lorax qtype |
|---|---|---|
| bitsandbytes 4-bit | `weight` (uint8 pairs), `absmax` (+ `nested_*`), `quant_state` JSON | `bnb_nf4`, `bnb_fp4` |
| bitsandbytes 8-bit | `weight` int8, `SCB` | `bnb_int8` |
| fp8 | `weight` e4m3, `weight_scale_inv` per 128x128 block | `fp8_e4m3` |
| gptq | `qweight` (along the input), `qzeros`, `scales`, `g_idx` | `int4_zp` (act-order: in a `RowOrdered`) |
| awq | `qweight` (along the output, AWQ's nibble order), `qzeros`, `scales` | `int4_zp` |
| compressed-tensors | `weight_packed`, `weight_scale`, `weight_zero_point`, `weight_shape`; or `weight` + `weight_scale` | `int4`, `int4_zp`, `int8`, `fp8_e4m3` |

Every fold returns the weight in torch's `(out, in)` layout with its blocks along `in`
(block axis `-1`). Int32 words hold 4-bit codes in other orders than lorax's (low nibble
first; AWQ's interleave): they are re-laid as bytes of two codes, high nibble first, the
same codes. GPTQ's act-order rows (`g_idx` not `i // group`) are stored sorted by group,
their order kept beside them (`lorax/_quant/_permuted.py`). FP8's 2-D block scales become one scale per block of `gcd(in, 128)` values
along each row, the block's scale repeated over its rows (1/32 byte per weight).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._files import checked, field
from .._quant import _formats as F
from .._quant._array import QuantizedArray
from .._quant._permuted import RowOrdered
from ._safetensors_files import Checkpoint

_FLOAT_NAMES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Parts:
    """One stored quantized weight: its tensors by suffix, read on demand."""

    ckpt: Checkpoint
    prefix: str
    names: dict[str, str]
    qconfig: dict[str, Any]
    dense_dtype: Any

    @property
    def name(self) -> str:
        """The logical weight's name (`...q_proj.weight`)."""
        return self.prefix + "weight"

    def has(self, suffix: str) -> bool:
        return suffix in self.names

    def error(self, suffix: str, what: str) -> ValueError:
        """A `ValueError` naming the file, the tensor and the field."""
        name = self.names.get(suffix, self.prefix + suffix)
        file = self.ckpt.entries[name].file if name in self.ckpt.entries else self.ckpt.path
        return ValueError(f"load_safetensors: {file!r}: tensor {name!r} ({suffix}): {what}")

    def read(self, suffix: str, dtype: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `suffix`, checked to have `dtype` and (if given) `shape`."""
        if suffix not in self.names:
            raise self.error(suffix, "is missing; the format stores it beside the weight.")
        e = self.ckpt.entries[self.names[suffix]]
        if e.dtype != np.dtype(dtype):
            raise self.error(suffix, f"expected dtype {np.dtype(dtype).name}, got {e.dtype.name}.")
        if shape is not None and e.shape != tuple(shape):
            raise self.error(suffix, f"expected shape {tuple(shape)}, got {e.shape}.")
        return self.ckpt.read(self.names[suffix])

    def shape(self, suffix: str) -> tuple[int, ...]:
        return self._entry(suffix).shape

    def dtype(self, suffix: str) -> np.dtype:
        return self._entry(suffix).dtype

    def _entry(self, suffix: str) -> Any:
        if suffix not in self.names:
            raise self.error(suffix, "is missing; the format stores it beside the weight.")
        return self.ckpt.entries[self.names[suffix]]


@dataclasses.dataclass(frozen=True)
class Method:
    """A format: `anchor` (a regex on a tensor name's suffix after the module's prefix)
    marks a stored quantized weight; `suffixes` are the tensors it is made of."""

    anchor: str
    suffixes: tuple[str, ...]
    fold: Callable[[Parts], QuantizedArray]


def _qarray(codes: np.ndarray, scales: np.ndarray, qtype: str, block: int, dense: Any,
            mins: np.ndarray | None = None, ss: np.ndarray | None = None,
            so: np.ndarray | None = None) -> QuantizedArray:
    return QuantizedArray(jnp.asarray(codes), jnp.asarray(scales),
                          None if mins is None else jnp.asarray(mins), qtype=qtype,
                          block_size=block, axis=-1, dense_dtype=dense,
                          scale_scales=None if ss is None else jnp.asarray(ss),
                          scale_offset=None if so is None else jnp.asarray(so))


def _pairs(q: np.ndarray) -> np.ndarray:
    """4-bit codes `(..., n)` (uint8, even n) -> bytes `(..., n/2)`, high nibble first."""
    return (q[..., 0::2] << 4) | q[..., 1::2]


def _nibbles(words: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 words `(..., w)` -> their 4-bit fields `(..., 8 w)` uint8: field `i` (bits
    `4i..4i+3`) is value `8j + order[i]` of word `j`."""
    u = words.astype(np.uint32)
    fields = np.stack([(u >> np.uint32(4 * i)) & np.uint32(0xF) for i in range(8)], axis=-1)
    out = np.empty_like(fields)
    out[..., list(order)] = fields
    return out.reshape(*words.shape[:-1], 8 * words.shape[-1]).astype(np.uint8)


# -- bitsandbytes ------------------------------------------------------------------------------


def _quant_state(p: Parts, kind: str) -> dict[str, Any]:
    suffix = f"weight.quant_state.bitsandbytes__{kind}"
    raw = p.read(suffix, np.uint8)
    where = f"{p.ckpt.where(p.names[suffix])}: quant_state"
    try:
        qs = json.loads(bytes(raw.reshape(-1)).decode("utf-8"))
    except (ValueError, RecursionError) as err:
        raise p.error(suffix, f"is not JSON ({err}).") from None
    for key, kind_ in (("quant_type", "str"), ("blocksize", "pos_int"), ("dtype", "str"),
                       ("shape", "ints")):
        field(qs, key, kind_, "load_safetensors", where)
    if qs["quant_type"] != kind:
        raise p.error(suffix, f"quant_type is {qs['quant_type']!r}; the tensor's name says {kind!r}.")
    if qs["dtype"] not in _FLOAT_NAMES or len(qs["shape"]) != 2 or 0 in qs["shape"]:
        raise p.error(suffix, f"expected a float dtype ({', '.join(_FLOAT_NAMES)}) and a "
                              f"2-D shape, got dtype {qs['dtype']!r}, shape {qs['shape']}.")
    if p.has("weight.nested_absmax"):
        field(qs, "nested_blocksize", "pos_int", "load_safetensors", where)
        field(qs, "nested_offset", "number", "load_safetensors", where)
        if qs["nested_blocksize"] != F.DOUBLE_QUANT_BLOCK:
            raise p.error(suffix, f"nested_blocksize is {qs['nested_blocksize']}; bitsandbytes "
                                  f"double-quantizes in blocks of {F.DOUBLE_QUANT_BLOCK}.")
    return qs


def _same_table(p: Parts, suffix: str, table: np.ndarray, what: str) -> None:
    got = p.read(suffix, np.float32, table.shape)
    if got.view(np.uint32).tolist() != table.view(np.uint32).tolist():
        raise p.error(suffix, f"is not {what}; lorax reads bitsandbytes' own code books only.")


def _fold_bnb4(p: Parts) -> QuantizedArray:
    kind = "nf4" if p.has("weight.quant_state.bitsandbytes__nf4") else "fp4"
    qs = _quant_state(p, kind)
    (out, k), bs = qs["shape"], qs["blocksize"]
    if k % bs or bs % 2:
        raise p.error("weight", f"in_features {k} is not a multiple of the blocksize {bs}: "
                                "bitsandbytes' blocks then cross rows, and lorax's run along them.")
    n_blocks = out * k // bs
    codes = p.read("weight", np.uint8)
    if codes.size * 2 != out * k:
        raise p.error("weight", f"holds {codes.size} bytes; shape {qs['shape']} needs {out * k // 2}.")
    _same_table(p, "weight.quant_map", F.NF4_CODE if kind == "nf4" else F.FP4_CODE,
                f"bitsandbytes' {kind} code book")
    codes = codes.reshape(out, k // bs, bs // 2)
    if not p.has("weight.nested_absmax"):
        absmax = p.read("weight.absmax", np.float32, (n_blocks,))
        return _qarray(codes, absmax.reshape(out, k // bs), f"bnb_{kind}", bs,
                       _FLOAT_NAMES[qs["dtype"]])
    absmax = p.read("weight.absmax", np.uint8, (n_blocks,))
    nested = p.read("weight.nested_absmax", np.float32, (-(-n_blocks // F.DOUBLE_QUANT_BLOCK),))
    _same_table(p, "weight.nested_quant_map", F.BNB_DYNAMIC_CODE, "bitsandbytes' dynamic map")
    offset = np.float32(qs["nested_offset"]).reshape(1)
    return _qarray(codes, absmax.reshape(out, k // bs), f"bnb_{kind}", bs,
                   _FLOAT_NAMES[qs["dtype"]], ss=nested, so=offset)


def _fold_bnb8(p: Parts) -> QuantizedArray:
    out, k = _two_axes(p, "weight")
    codes = p.read("weight", np.int8)
    scb = p.read("SCB", np.float32, (out,))
    if p.has("weight_format"):
        fmt = p.read("weight_format", p.dtype("weight_format"))
        if fmt.size != 1 or fmt.dtype.kind not in "iu" or int(fmt.reshape(-1)[0]) != 0:
            raise p.error("weight_format", f"is {fmt.tolist()}; lorax reads the row-major "
                                           "int8 layout (0) only.")
    return _qarray(codes.reshape(out, 1, k), scb.reshape(out, 1), "bnb_int8", k, p.dense_dtype)


def _two_axes(p: Parts, suffix: str) -> tuple[int, int]:
    shape = p.shape(suffix)
    if len(shape) != 2 or 0 in shape:
        raise p.error(suffix, f"expected a 2-D (out, in) weight, got shape {shape}.")
    return shape


# -- FP8 block scales ----------------------------------------------------------------------------


def _block_scales(p: Parts, suffix: str, scale: np.ndarray, out: int, k: int,
                  block: tuple[int, int]) -> tuple[np.ndarray, int]:
    """2-D block scales `(ceil(out/bo), ceil(k/bi))` -> `(out, k/b)` per-row scales of
    blocks of `b = gcd(k, bi)` values (every block boundary of the file is one of them)."""
    bo, bi = block
    want = (-(-out // bo), -(-k // bi))
    if scale.shape != want:
        raise p.error(suffix, f"expected shape {want} for ({out}, {k}) in blocks of "
                              f"{bo}x{bi}, got {scale.shape}.")
    b = math.gcd(k, bi)
    rows = np.repeat(scale, bo, axis=0)[:out]
    return np.ascontiguousarray(rows[:, (np.arange(k // b) * b) // bi]), b


def _fp8_codes(p: Parts, suffix: str) -> tuple[np.ndarray, int, int]:
    out, k = _two_axes(p, suffix)
    if p.dtype(suffix) != np.dtype(ml_dtypes.float8_e4m3fn):
        raise p.error(suffix, f"expected dtype float8_e4m3fn, got {p.dtype(suffix).name}; "
                              "lorax reads FP8 e4m3 weights.")
    return p.read(suffix, ml_dtypes.float8_e4m3fn).view(np.uint8), out, k


def _fold_fp8(p: Parts) -> QuantizedArray:
    codes, out, k = _fp8_codes(p, "weight")
    where = f"{p.ckpt.path!r}: config.json: quantization_config"
    size = field(p.qconfig, "weight_block_size", "ints", "load_safetensors", where, None) or [128, 128]
    if len(size) != 2 or 0 in size:
        raise ValueError(f"load_safetensors: {where}: weight_block_size: expected two "
                         f"integers >= 1, got {size}.")
    fmt = field(p.qconfig, "fmt", "str", "load_safetensors", where, None) or "e4m3"
    if fmt != "e4m3":
        raise ValueError(f"load_safetensors: {where}: fmt is {fmt!r}; lorax reads e4m3.")
    scale = p.read("weight_scale_inv", p.dtype("weight_scale_inv"))
    if not np.issubdtype(scale.dtype, np.floating) and scale.dtype.name != "bfloat16":
        raise p.error("weight_scale_inv", f"expected a float dtype, got {scale.dtype.name}.")
    scales, b = _block_scales(p, "weight_scale_inv", scale, out, k, tuple(size))
    return _qarray(codes.reshape(out, k // b, b), scales, "fp8_e4m3", b, p.dense_dtype)


# -- GPTQ and AWQ ----------------------------------------------------------------------------------

# AWQ's GEMM packing puts output column `8j + AWQ_ORDER[i]` in bits `4i` of word `j`.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _int4_config(p: Parts, method: str) -> int:
    where = f"{p.ckpt.path!r}: config.json: quantization_config"
    bits = field(p.qconfig, "bits", "pos_int", "load_safetensors", where, None) or 4
    if bits != 4:
        raise ValueError(f"load_safetensors: {where}: bits is {bits}; lorax reads {method} "
                         "4-bit checkpoints.")
    group = p.qconfig.get("group_size", 128)
    if group == -1:
        return -1
    return checked(group, "pos_int", "load_safetensors", f"{where}: group_size")


def _zero_point_array(p: Parts, q: np.ndarray, zeros: np.ndarray,
                      scales: np.ndarray) -> QuantizedArray:
    """`q (out, k)`, `zeros` and `scales` `(out, groups)` -> an `int4_zp` weight."""
    out, k = q.shape
    g = k // scales.shape[1]
    return _qarray(_pairs(q).reshape(out, k // g, g // 2), scales, "int4_zp", g,
                   p.dense_dtype, mins=zeros)


def _groups(p: Parts, k: int, group: int) -> int:
    g = k if group == -1 else group
    if k % g or g % 2:
        raise p.error("qweight", f"in_features {k} is not a multiple of group_size {g}.")
    return k // g


def _fold_gptq(p: Parts) -> QuantizedArray:
    group = _int4_config(p, "GPTQ")
    shape = p.shape("qweight")
    if len(shape) != 2 or 0 in shape or shape[1] % 8:
        raise p.error("qweight", f"expected int32 (in/8, out) with out a multiple of 8, got "
                                 f"{shape}.")
    k, out = 8 * shape[0], shape[1]
    n = _groups(p, k, group)
    q = _nibbles(p.read("qweight", np.int32).T)  # (out, in)
    zeros = _nibbles(p.read("qzeros", np.int32, (n, out // 8)))  # (groups, out)
    if p.qconfig.get("checkpoint_format", "gptq") == "gptq":  # v1 stores zero - 1
        zeros = zeros + np.uint8(1)
    scales = p.read("scales", p.dtype("scales"), (n, out))
    zeros, scales = np.ascontiguousarray(zeros.T), np.ascontiguousarray(scales.T)
    g_idx = p.read("g_idx", np.int32, (k,)) if p.has("g_idx") else np.arange(k) // (k // n)
    if np.array_equal(g_idx, np.arange(k) // (k // n)):
        return _zero_point_array(p, q, zeros, scales)
    return _act_order(p, q, zeros, scales, g_idx)


def _act_order(p: Parts, q: np.ndarray, zeros: np.ndarray, scales: np.ndarray,
               g_idx: np.ndarray) -> RowOrdered:
    """An act-order weight (`desc_act=true`: a group's input rows anywhere): its rows
    stored sorted by group, consecutive blocks as any other, and the order put back
    around them (`RowOrdered`)."""
    k, n = q.shape[1], scales.shape[1]
    if g_idx.min() < 0 or g_idx.max() >= n or (np.bincount(g_idx, minlength=n) != k // n).any():
        raise p.error("g_idx", f"expected each of the {n} groups {k // n} times (act-order "
                               "puts a group's rows anywhere, but every group is whole).")
    order = np.argsort(g_idx, kind="stable").astype(np.int32)
    inner = _zero_point_array(p, np.ascontiguousarray(q[:, order]), zeros, scales)
    perm = np.argsort(order).astype(np.int32)
    return RowOrdered(inner, jnp.asarray(perm), jnp.asarray(order), -1)


def _fold_awq(p: Parts) -> QuantizedArray:
    group = _int4_config(p, "AWQ")
    shape = p.shape("qweight")
    if len(shape) != 2 or 0 in shape:
        raise p.error("qweight", f"expected int32 (in, out/8), got {shape}.")
    k, out = shape[0], 8 * shape[1]
    n = _groups(p, k, group)
    q = _nibbles(p.read("qweight", np.int32), AWQ_ORDER)  # (in, out)
    zeros = _nibbles(p.read("qzeros", np.int32, (n, out // 8)), AWQ_ORDER)
    scales = p.read("scales", p.dtype("scales"), (n, out))
    return _zero_point_array(p, np.ascontiguousarray(q.T), np.ascontiguousarray(zeros.T),
                             np.ascontiguousarray(scales.T))


# -- compressed-tensors ----------------------------------------------------------------------------


def _ct_scale(p: Parts, out: int, k: int) -> tuple[np.ndarray, int]:
    """`weight_scale` as per-row block scales `(out, k/b)` and the block length `b`."""
    scale = p.read("weight_scale", p.dtype("weight_scale"))
    if scale.dtype.kind != "f" and scale.dtype.name != "bfloat16":
        raise p.error("weight_scale", f"expected a float dtype, got {scale.dtype.name}.")
    if scale.size == 1:  # per tensor
        return np.broadcast_to(scale.reshape(1, 1), (out, 1)).copy(), k
    if p.qconfig.get("_block"):  # the `block` strategy: DeepSeek's 2-D blocks
        return _block_scales(p, "weight_scale", scale, out, k, p.qconfig["_block"])
    if scale.ndim == 2 and scale.shape[0] == out and scale.shape[1] and k % scale.shape[1] == 0:
        return scale, k // scale.shape[1]  # per channel (out, 1) or per group (out, groups)
    raise p.error("weight_scale", f"expected one scale, ({out}, 1) per channel or ({out}, "
                                  f"groups) with groups dividing {k}; got {scale.shape}.")


def _ct_shape(p: Parts) -> tuple[int, int]:
    shape = p.read("weight_shape", p.dtype("weight_shape")).reshape(-1).tolist()
    if len(shape) != 2 or min(shape) < 1:
        raise p.error("weight_shape", f"expected [out, in], got {shape}.")
    return int(shape[0]), int(shape[1])


def _fold_ct_packed(p: Parts) -> QuantizedArray:
    out, k = _ct_shape(p)
    words = p.shape("weight_packed")
    bits = {(out, -(-k // 8)): 4, (out, -(-k // 4)): 8}.get(tuple(words))
    if bits is None or k % 2:
        raise p.error("weight_packed", f"expected int32 (out, in/8) (4-bit) or (out, in/4) "
                                       f"(8-bit) for weight_shape ({out}, {k}), got {words}.")
    raw = p.read("weight_packed", np.int32).view(np.uint8).reshape(out, -1)  # little-endian words
    scales, b = _ct_scale(p, out, k)
    if bits == 8:
        if p.has("weight_zero_point"):
            raise p.error("weight_zero_point", "8-bit codes with zero points are not read; "
                                               "lorax reads symmetric 8-bit pack-quantized weights.")
        codes = (raw[:, :k] ^ np.uint8(0x80)).view(np.int8)  # stored as code + 128
        return _qarray(codes.reshape(out, k // b, b), scales, "int8", b, p.dense_dtype)
    q = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(out, -1)[:, :k]  # code + 8
    if b % 2:
        raise p.error("weight_scale", f"groups of {b} values split a byte of two 4-bit codes.")
    if not p.has("weight_zero_point"):  # symmetric: lorax's int4, `(code - 8) * scale`
        return _qarray(_pairs(q).reshape(out, k // b, b // 2), scales, "int4", b, p.dense_dtype)
    n = scales.shape[1]
    zp = p.read("weight_zero_point", np.int32, (-(-out // 8), n))  # packed along `out`
    zeros = np.ascontiguousarray(_nibbles(np.ascontiguousarray(zp.T))[:, :out].T)  # zero + 8
    return _zero_point_array(p, q, zeros, scales)


def _fold_ct_plain(p: Parts) -> QuantizedArray:
    out, k = _two_axes(p, "weight")
    if p.has("weight_zero_point"):
        raise p.error("weight_zero_point", "zero points of unpacked weights are not read.")
    scales, b = _ct_scale(p, out, k)
    if p.dtype("weight") == np.dtype(np.int8):
        codes = p.read("weight", np.int8)
        return _qarray(codes.reshape(out, k // b, b), scales, "int8", b, p.dense_dtype)
    codes, _, _ = _fp8_codes(p, "weight")
    return _qarray(codes.reshape(out, k // b, b), scales, "fp8_e4m3", b, p.dense_dtype)


_BNB4 = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
         "weight.nested_quant_map", "weight.quant_state.bitsandbytes__nf4",
         "weight.quant_state.bitsandbytes__fp4")

METHODS: dict[str, tuple[Method, ...]] = {
    "bitsandbytes": (
        Method(r"weight\.quant_state\.bitsandbytes__(nf4|fp4)", _BNB4, _fold_bnb4),
        Method(r"SCB", ("weight", "SCB", "weight_format"), _fold_bnb8),
    ),
    "fp8": (Method(r"weight_scale_inv", ("weight", "weight_scale_inv"), _fold_fp8),),
    "gptq": (Method(r"qweight", ("qweight", "qzeros", "scales", "g_idx"), _fold_gptq),),
    "awq": (Method(r"qweight", ("qweight", "qzeros", "scales"), _fold_awq),),
    "compressed-tensors": (
        Method(r"weight_packed", ("weight_packed", "weight_scale", "weight_zero_point",
                                  "weight_shape"), _fold_ct_packed),
        Method(r"weight_scale", ("weight", "weight_scale", "weight_zero_point"), _fold_ct_plain),
    ),
}


def quant_method(ckpt: Checkpoint) -> tuple[str | None, dict[str, Any]]:
    """The checkpoint's method and `quantization_config` (`None` for a dense one). A bare
    file has no config: bitsandbytes' tensors describe themselves, FP8's block scales
    are taken as 128x128."""
    where = f"{ckpt.path!r}: config.json"
    qc = field(ckpt.config, "quantization_config", "dict", "load_safetensors", where, None)
    if qc is None:
        names = list(ckpt.entries)
        if any(n.endswith(("SCB", ".quant_state.bitsandbytes__nf4",
                           ".quant_state.bitsandbytes__fp4")) for n in names):
            return "bitsandbytes", {}
        if any(n.endswith(".weight_scale_inv") for n in names):
            return "fp8", {}
        return None, {}
    method = field(qc, "quant_method", "str", "load_safetensors", f"{where}: quantization_config")
    if method not in METHODS:
        raise ValueError(f"load_safetensors: {where}: quantization_config: quant_method "
                         f"{method!r} is not read by lorax; it reads {', '.join(METHODS)}.")
    return method, {**qc, "_block": _ct_block(qc)} if method == "compressed-tensors" else qc


def _ct_block(qc: dict[str, Any]) -> tuple[int, int] | None:
    """A compressed-tensors config's block structure for block-scaled weights, if any."""
    groups = qc.get("config_groups")
    for group in groups.values() if isinstance(groups, dict) else ():
        weights = group.get("weights") if isinstance(group, dict) else None
        block = weights.get("block_structure") if isinstance(weights, dict) else None
        if isinstance(block, list) and len(block) == 2 and all(
                isinstance(b, int) and b > 0 for b in block):
            return tuple(block)
    return None


def fold(ckpt: Checkpoint, method: str, qconfig: dict[str, Any],
         dense_dtype: Any) -> tuple[dict[str, tuple[Parts, Method]], set[str]]:
    """The stored quantized weights: logical name -> (its parts, its method), and the
    names of every tensor they consume."""
    found: dict[str, tuple[Parts, Method]] = {}
    used: set[str] = set()
    for m in METHODS[method]:
        anchor = re.compile(rf"((?:.*\.)?)(?:{m.anchor})")
        for name in ckpt.entries:
            hit = anchor.fullmatch(name)
            if not hit or name in used or hit.group(1) + "weight" in found:
                continue
            prefix = hit.group(1)
            names = {s: prefix + s for s in m.suffixes if prefix + s in ckpt.entries}
            found[prefix + "weight"] = (Parts(ckpt, prefix, names, qconfig, dense_dtype), m)
            used.update(names.values())
    return found, used
