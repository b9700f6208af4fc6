"""The quantization formats, as data: how each `qtype` blocks, packs and dequantizes.

Every format quantizes a weight in blocks of `block_size` consecutive values along one
axis (the *block axis*: a kernel's input axis, so a block is part of one output
channel's dot product). Storage puts that axis last and splits it into blocks, so for
a weight whose other axes are `other`:

- `codes`: `(*other, n_blocks, code_bytes)`, `uint8` for 4-bit formats (two codes per
  byte), `int8` for 8-bit ones;
- `scales`: `(*other, n_blocks)`, one per block (`float16` for GGUF's types, as on
  disk, `float32` otherwise; `uint8` codes when NF4's absmax values are
  double-quantized, with `scale_scales` / `scale_offset` beside them);
- `mins`: `(*other, n_blocks)`, Q4_1's per-block offset (`None` elsewhere).

Dequantization is `value(code) * scale (+ min)`, computed in float32. The GGUF types
reproduce `gguf.quants` (ggml's reference quantizer) bit for bit; see
`../shared/reference/formats.md` in the lorax repository for the byte layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import Array, lax

# QLoRA's NormalFloat4 code book (bitsandbytes `functional.py`): quantiles of N(0, 1)
# scaled to [-1, 1], with an exact zero.
NF4_CODE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    np.float32,
)

# bitsandbytes double-quantizes NF4's absmax values in blocks of 256 (8-bit codes of
# absmax - mean). lorax's second level is linear int8 per 256 values rather than
# bitsandbytes' 8-bit dynamic map: the same bytes, a simpler code book.
DOUBLE_QUANT_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class Format:
    """One quantization type.

    - `block_size`: the default block length; `None` means one block spanning the axis.
    - `fixed_block`: the block length is part of the format (GGUF) and cannot change.
    - `bits`: bits per code (4 codes are packed two per byte).
    - `packing`: for 4-bit codes, how a block's codes share bytes: `"halves"` (GGUF:
      byte `j` holds code `j` in its low nibble and code `j + block/2` in its high one)
      or `"pairs"` (bitsandbytes: byte `j` holds codes `2j` (high) and `2j + 1` (low)).
    - `scale_dtype`: the dtype scales (and mins) are stored in.
    - `quantize`: `blocks (..., n_blocks, block) f32 -> (codes, scales, mins)` with
      codes unpacked (`uint8` in `[0, 15]` for 4-bit, `int8` for 8-bit).
    - `value`: `(codes as f32, scales f32, mins f32 or None) -> values f32`.
    """

    name: str
    block_size: int | None
    fixed_block: bool
    bits: int
    packing: str | None
    scale_dtype: Any
    quantize: Callable[[Array], tuple[Array, Array, Array | None]]
    value: Callable[[Array, Array, Array | None], Array]

    @property
    def has_mins(self) -> bool:
        return self.name == "q4_1"

    def code_bytes(self, block_size: int) -> int:
        return block_size // 2 if self.bits == 4 else block_size

    @property
    def code_dtype(self) -> Any:
        return jnp.uint8 if self.bits == 4 else jnp.int8


def _safe_inverse(d: Array) -> Array:
    return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def _absmax(blocks: Array) -> Array:
    return jnp.max(jnp.abs(blocks), axis=-1)


def _round_half_away(x: Array) -> Array:
    # ggml's `roundf` as gguf's `np_roundf` writes it (`floor(|x| + 0.5)` differs
    # where `|x| + 0.5` rounds up in float32), not numpy's round-half-to-even.
    a = jnp.abs(x)
    whole = jnp.floor(a)
    return jnp.sign(x) * (whole + jnp.floor(2.0 * (a - whole)))


# -- quantizers: blocks (..., n_blocks, block) float32 -> codes, scales, mins ----------


def _q_int8(blocks: Array) -> tuple[Array, Array, None]:
    d = _absmax(blocks) / 127.0
    q = jnp.clip(jnp.round(blocks * _safe_inverse(d)[..., None]), -127, 127)
    return q.astype(jnp.int8), d, None


def _q_int4(blocks: Array) -> tuple[Array, Array, None]:
    d = _absmax(blocks) / 7.0
    q = jnp.clip(jnp.round(blocks * _safe_inverse(d)[..., None]), -8, 7) + 8
    return q.astype(jnp.uint8), d, None


def _q_nf4(blocks: Array) -> tuple[Array, Array, None]:
    absmax = _absmax(blocks)
    normed = blocks * _safe_inverse(absmax)[..., None]
    # Nearest code: the code book is sorted, so compare against the midpoints.
    mid = jnp.asarray((NF4_CODE[1:] + NF4_CODE[:-1]) / 2)
    q = jnp.sum(normed[..., None] > mid, axis=-1)
    return q.astype(jnp.uint8), absmax, None


def _q_q4_0(blocks: Array) -> tuple[Array, Array, None]:
    # ggml: d = (the value of largest magnitude, with its sign) / -8.
    i = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]
    d = jnp.take_along_axis(blocks, i, axis=-1)[..., 0] / -8.0
    q = jnp.clip(jnp.trunc(blocks * _safe_inverse(d)[..., None] + 8.5), 0, 15)
    return q.astype(jnp.uint8), d, None


def _q_q4_1(blocks: Array) -> tuple[Array, Array, Array]:
    hi, lo = jnp.max(blocks, axis=-1), jnp.min(blocks, axis=-1)
    d = (hi - lo) / 15.0
    q = jnp.clip(jnp.trunc((blocks - lo[..., None]) * _safe_inverse(d)[..., None] + 0.5), 0, 15)
    return q.astype(jnp.uint8), d, lo


def _q_q8_0(blocks: Array) -> tuple[Array, Array, None]:
    d = _absmax(blocks) / 127.0
    q = _round_half_away(blocks * _safe_inverse(d)[..., None])
    return q.astype(jnp.int8), d, None


def _v_scaled(q: Array, d: Array, m: Array | None) -> Array:
    return q * d[..., None]


def _v_offset8(q: Array, d: Array, m: Array | None) -> Array:
    return (q - 8.0) * d[..., None]


def _v_nf4(q: Array, d: Array, m: Array | None) -> Array:
    # A 16-entry table lookup. (A select chain against constants builds weight-sized
    # constant arrays, which `lax.scan`'s partial evaluation hoists out of the loop
    # and keeps: 16 dense weights' worth.)
    code = jnp.take(jnp.asarray(NF4_CODE), q.astype(jnp.int32), mode="clip")
    return code * d[..., None]


def _v_q4_1(q: Array, d: Array, m: Array | None) -> Array:
    return q * d[..., None] + m[..., None]


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("int8", None, False, 8, None, jnp.float32, _q_int8, _v_scaled),
        Format("int4", 32, False, 4, "pairs", jnp.float32, _q_int4, _v_offset8),
        Format("nf4", 64, False, 4, "pairs", jnp.float32, _q_nf4, _v_nf4),
        Format("q4_0", 32, True, 4, "halves", jnp.float16, _q_q4_0, _v_offset8),
        Format("q4_1", 32, True, 4, "halves", jnp.float16, _q_q4_1, _v_q4_1),
        Format("q8_0", 32, True, 8, None, jnp.float16, _q_q8_0, _v_scaled),
    )
}


def get_format(qtype: str) -> Format:
    if qtype not in FORMATS:
        raise ValueError(f"unknown qtype {qtype!r}; the known ones are {', '.join(FORMATS)}.")
    return FORMATS[qtype]


# -- packing ------------------------------------------------------------------------------


def pack(fmt: Format, q: Array) -> Array:
    """Unpacked codes `(..., block)` -> stored codes `(..., code_bytes)`."""
    if fmt.bits == 8:
        return q
    q = q.astype(jnp.uint8)
    half = q.shape[-1] // 2
    if fmt.packing == "halves":
        return q[..., :half] | (q[..., half:] << 4)
    pairs = q.reshape(*q.shape[:-1], half, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack(fmt: Format, codes: Array) -> Array:
    """Stored codes `(..., code_bytes)` -> float32 codes `(..., block)`."""
    if fmt.bits == 8:
        return codes.astype(jnp.float32)
    lo = (codes & 0xF).astype(jnp.float32)
    hi = (codes >> 4).astype(jnp.float32)
    if fmt.packing == "halves":
        return jnp.concatenate([lo, hi], axis=-1)
    return jnp.stack([hi, lo], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


# -- double quantization of NF4's absmax values --------------------------------------------


def _dq_groups(n: int) -> int:
    return -(-n // DOUBLE_QUANT_BLOCK)


def double_quantize(absmax: Array) -> tuple[Array, Array, Array]:
    """`absmax (*lead, R, n_blocks)` -> `(codes uint8 (*lead, R, n_blocks), scales
    (*lead, G), offset (*lead, 1))`: int8 codes of `absmax - mean` (stored +128) in
    groups of 256 along the flattened last two axes."""
    lead, tail = absmax.shape[:-2], absmax.shape[-2:]
    flat = absmax.reshape(*lead, -1)
    n = flat.shape[-1]
    offset = jnp.mean(flat, axis=-1, keepdims=True)
    centred = flat - offset
    g = _dq_groups(n)
    padded = jnp.pad(centred, [(0, 0)] * len(lead) + [(0, g * DOUBLE_QUANT_BLOCK - n)])
    groups = padded.reshape(*lead, g, DOUBLE_QUANT_BLOCK)
    s = jnp.max(jnp.abs(groups), axis=-1) / 127.0
    q = jnp.clip(jnp.round(groups * _safe_inverse(s)[..., None]), -127, 127) + 128
    codes = q.reshape(*lead, -1)[..., :n].reshape(*lead, *tail)
    return codes.astype(jnp.uint8), s, offset


def double_dequantize(codes: Array, scales: Array, offset: Array) -> Array:
    lead, tail = codes.shape[:-2], codes.shape[-2:]
    flat = codes.reshape(*lead, -1).astype(jnp.float32) - 128.0
    n = flat.shape[-1]
    g = scales.shape[-1]
    padded = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, g * DOUBLE_QUANT_BLOCK - n)])
    values = padded.reshape(*lead, g, DOUBLE_QUANT_BLOCK) * scales[..., None]
    return (values.reshape(*lead, -1)[..., :n] + offset).reshape(*lead, *tail)


def dequantize_blocks(fmt: Format, codes: Array, scales: Array, mins: Array | None) -> Array:
    """`(*other, n_blocks, code_bytes)` codes -> float32 values `(*other, n_blocks * block)`."""
    q = unpack(fmt, codes)
    v = fmt.value(q, scales.astype(jnp.float32), None if mins is None else mins.astype(jnp.float32))
    return lax.collapse(v, v.ndim - 2)
