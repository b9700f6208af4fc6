"""The quantization formats, as data: how each `qtype` blocks, packs and dequantizes.

Every format quantizes a weight in blocks of `block_size` consecutive values along one
axis (the *block axis*: a kernel's input axis, so a block is part of one output
channel's dot product). Storage puts that axis last and splits it into blocks, so for
a weight whose other axes are `other`:

- `codes`: `(*other, n_blocks, code_bytes)`, `uint8` for 4-bit formats (two codes per
  byte), `int8` for 8-bit ones; `s4`'s are JAX's `int4` dtype, one code per element
  (`(*other, n_blocks, block)`; XLA packs them two per byte on accelerators);
- `scales`: `(*other, n_blocks)`, one per block (`float16` for GGUF's types, as on
  disk, `float32` otherwise; `uint8` codes when NF4's absmax values are
  double-quantized, with `scale_scales` / `scale_offset` beside them);
- `mins`: `(*other, n_blocks)`, the per-block offset of Q4_1 / Q5_1 (`dmin` of the
  K-quants Q2_K, Q4_K, Q5_K; `None` elsewhere).

Dequantization is `value(code) * scale (+ min)`, computed in float32. Two GGUF families
store more than one code per value and byte:

- Q5_0 / Q5_1 (blocks of 32): `codes` are the block's 20 bytes after its scale (and
  min), `qh` (the 32 fifth bits) then `qs` (nibbles, as Q4_0's);
- the K-quants Q2_K .. Q6_K (super-blocks of 256): `codes` are every byte of a block
  but its float16 `d` (and `dmin`), in file order (sub-block scales, high bits, low
  bits); `decode` turns them into values, sub-block scales included.

So a GGUF tensor's bytes split into `codes` / `scales` / `mins` without changing a byte,
and `nbytes` is the size on disk. The GGUF types reproduce `gguf.quants` (ggml's
reference code) bit for bit, in the same float32 operations (the products of a float16
scale and small integer codes are exact; Q6_K's three-way product is rounded as
gguf-py rounds it, `(d * scale) * q`). Byte layouts: llama.cpp's `ggml-common.h`,
gguf-py's `quants.py`.
"""

from __future__ import annotations

import dataclasses
import math
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

# bitsandbytes' FP4 code book (`get_4bit_type("fp4")`): 1 sign, 2 exponent and 1
# mantissa bits, in bit-pattern order (not sorted), scaled to [-1, 1]. Code 8 is +0:
# bitsandbytes writes it as the integer `-0`.
FP4_CODE = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3],
                    np.float32) / np.float32(12)

# Double quantization stores NF4's absmax values as 8-bit codes of absmax - mean, in
# groups of 256 with one float32 scale each. lorax's own second level is linear int8
# (`code - 128`); bitsandbytes' (its `*-bnb-4bit` checkpoints) looks the code up in its
# 8-bit dynamic map: the same bytes, another code book.
DOUBLE_QUANT_BLOCK = 256

# bitsandbytes' `create_dynamic_map(signed=True)` as stored in its checkpoints
# (`nested_quant_map`): 256 little-endian float32s. Kept as its bits, not recomputed:
# torch's float32 `linspace` rounds differently from NumPy's. Checked against
# bitsandbytes itself (scripts/test-checkpoints) and the fixtures' maps (tests/formats).
BNB_DYNAMIC_CODE = np.frombuffer(bytes.fromhex(
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf"
    "000053bf66664fbfcdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbf"
    'cdcc27bf343324bf9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf'
    '3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabe'
    'cccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327be'
    'cdcc18be66660abe0000f8bd3433dbbd85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd'
    '0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bd'
    'a3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc'
    '643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb'
    '5c8f42bb2db21dbbfca9f1ba9defa7baff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b9'
    '4b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000b7a31335941a5a36ff0502370642b237'
    '34803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a9defa73a'
    'fca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033c'
    'cdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d'
    '6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3d'
    'eb51903d7b14963d0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d'
    '0000f83d66660a3ecdcc183e3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e'
    '6666943e9a999b3ecccca23e0000aa3e3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33e'
    'ccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f3433123fcdcc153f6666193f00001d3f'
    '9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f9a99443f3333483f'
    'cdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f'
    '0000773f9a997a3f33337e3f0000803f'
), "<f4").astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Format:
    """One quantization type.

    - `block_size`: the default block length; `None` means one block spanning the axis.
    - `fixed_block`: the block length is part of the format (GGUF) and cannot change.
    - `bits`: bits per code (4 codes are packed two per byte).
    - `packing`: for 4-bit codes, how a block's codes share bytes: `"halves"` (GGUF:
      byte `j` holds code `j` in its low nibble and code `j + block/2` in its high one)
      or `"pairs"` (bitsandbytes: byte `j` holds codes `2j` (high) and `2j + 1` (low)).
      `"q5"` is Q5_0 / Q5_1's: 4 bytes of fifth bits, then nibbles as `"halves"`;
      `"k"`: a K-quant super-block, read by `decode`; `"int4"`: JAX's `int4` dtype, one
      signed code per element (XLA packs them; its GPU GEMMs read them as they are).
    - `scale_dtype`: the dtype scales (and mins) are stored in (lorax's own types may
      store theirs in another: `quantize(..., scale_dtype=)`).
    - `quantize`: `blocks (..., n_blocks, block) f32 -> (codes, scales, mins)` with
      codes unpacked (`uint8` in `[0, 2**bits)` for packed codes, `int8` for 8-bit and
      for `s4`'s signed 4-bit ones);
      `None` when lorax has no quantizer for the type (the K-quants: wrap GGUF blocks).
      lorax's own types (`native`) take a second argument, `stored`: the scales as they
      will be stored (rounded to another dtype), which their codes are computed against.
    - `value`: `(codes as f32, scales f32, mins f32 or None) -> values f32`, for
      formats with one code per value (`None` for the K-quants).
    - `has_mins`: the format stores `mins`.
    - `decode`: `(codes uint8 (..., n_blocks, code_bytes), scales f32, mins f32 or None)
      -> values (..., n_blocks, block)` for the K-quants, whose codes are read together
      with per-sub-block scales.
    - `record`: where `d`, `m` and the codes sit in one GGUF block (GGUF types only).
    - `code_type`: the codes' dtype where it is not the one `bits` implies (FP8's
      bytes, `uint8`).
    - `double_code`: the second level of double quantization: `None` for lorax's linear
      int8 (`code - 128`), else a 256-entry table (bitsandbytes' dynamic map).
    """

    name: str
    block_size: int | None
    fixed_block: bool
    bits: int
    packing: str | None
    scale_dtype: Any
    quantize: Callable[..., tuple[Array, Array, Array | None]] | None
    value: Callable[[Array, Array, Array | None], Array] | None
    has_mins: bool = False
    decode: Callable[[Array, Array, Array | None], Array] | None = None
    record: "Record | None" = None
    code_type: Any = None
    double_code: np.ndarray | None = None

    def code_bytes(self, block_size: int) -> int:
        """The codes' last axis per block: bytes, or `int4` elements (`element_codes`)."""
        if self.record is not None and self.packing in ("q5", "k"):
            return self.record.code_bytes
        return block_size if self.element_codes else block_size // 2

    @property
    def code_dtype(self) -> Any:
        if self.code_type is not None:
            return self.code_type
        if self.packing == "int4":
            return jnp.int4
        return jnp.int8 if self.bits == 8 else jnp.uint8

    @property
    def element_codes(self) -> bool:
        """One code per element of `codes` (8-bit codes, `int4` ones)."""
        return self.bits == 8 or self.packing == "int4"

    @property
    def double_quantizable(self) -> bool:
        """Its scales may be double-quantized (NF4's absmax values, bitsandbytes' 4-bit)."""
        return self.name == "nf4" or self.double_code is not None

    @property
    def native(self) -> bool:
        """lorax's own type (not GGUF's): its scales may be stored in another dtype."""
        return self.record is None


@dataclasses.dataclass(frozen=True)
class Record:
    """One GGUF block's bytes: `size` in all; the float16 `d` at byte `d`, the float16
    `m` (min / dmin) at byte `m` (or `None`), then `code_bytes` bytes of codes from
    byte `codes`. Every format here keeps its codes contiguous."""

    size: int
    d: int
    m: int | None
    codes: int

    @property
    def code_bytes(self) -> int:
        return self.size - 2 - (0 if self.m is None else 2)


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


def _stored(d: Array) -> Array:
    return d


def _q_int8(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, None]:
    d = stored(_absmax(blocks) / 127.0)
    q = jnp.clip(jnp.round(blocks * _safe_inverse(d)[..., None]), -127, 127)
    return q.astype(jnp.int8), d, None


def _signed_extreme(blocks: Array) -> Array:
    """Each block's value of largest magnitude, with its sign."""
    i = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]
    return jnp.take_along_axis(blocks, i, axis=-1)[..., 0]


def _symmetric4(blocks: Array, stored: Callable[[Array], Array]) -> tuple[Array, Array]:
    # The extreme goes to -8 (the scale takes its sign), as ggml's Q4_0 does, so all 16
    # codes are used: absmax / 7 leaves -8 empty and costs ~13% more RMS error on
    # normal weights (rounding steps of absmax / 7 instead of / 8).
    d = stored(_signed_extreme(blocks) / -8.0)
    return jnp.clip(jnp.round(blocks * _safe_inverse(d)[..., None]), -8, 7), d


def _q_int4(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, None]:
    q, d = _symmetric4(blocks, stored)
    return (q + 8).astype(jnp.uint8), d, None


def _q_s4(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, None]:
    q, d = _symmetric4(blocks, stored)
    return q.astype(jnp.int8), d, None


def _q_nf4(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, None]:
    absmax = stored(_absmax(blocks))
    normed = blocks * _safe_inverse(absmax)[..., None]
    # Nearest code: the code book is sorted, so compare against the midpoints.
    mid = jnp.asarray((NF4_CODE[1:] + NF4_CODE[:-1]) / 2)
    q = jnp.sum(normed[..., None] > mid, axis=-1)
    return q.astype(jnp.uint8), absmax, None


def _nearest(table: np.ndarray, normed: Array) -> Array:
    """The index into `table` (any order) of the entry nearest each of `normed`."""
    order = np.argsort(table, kind="stable")
    ranked = table[order]
    rank = jnp.sum(normed[..., None] > jnp.asarray((ranked[1:] + ranked[:-1]) / 2), axis=-1)
    return jnp.asarray(order.astype(np.uint8))[rank]


def _q_table(table: np.ndarray) -> Callable[..., tuple[Array, Array, None]]:
    """Absmax scaling onto a 4-bit code book (bitsandbytes' NF4 and FP4)."""
    def quantize(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, None]:
        absmax = stored(_absmax(blocks))
        return _nearest(table, blocks * _safe_inverse(absmax)[..., None]), absmax, None
    return quantize


def _q_bnb_int8(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, None]:
    # LLM.int8's row-wise absmax (`SCB`) is the stored scale; the value is `q * SCB / 127`.
    scb = stored(_absmax(blocks))
    q = jnp.clip(jnp.round(blocks * (127.0 * _safe_inverse(scb))[..., None]), -127, 127)
    return q.astype(jnp.int8), scb, None


FP8_E4M3_MAX = 448.0


def _q_fp8(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, None]:
    d = stored(_absmax(blocks) / FP8_E4M3_MAX)
    q = jnp.clip(blocks * _safe_inverse(d)[..., None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8), d, None


def _q_int4_zp(blocks: Array, stored: Callable[[Array], Array] = _stored) -> tuple[Array, Array, Array]:
    # Asymmetric, as GPTQ and AWQ store it: codes 0..15 and an integer zero point per
    # block, so 0.0 is exact when the range holds it.
    hi = jnp.maximum(jnp.max(blocks, axis=-1), 0.0)
    lo = jnp.minimum(jnp.min(blocks, axis=-1), 0.0)
    d = stored((hi - lo) / 15.0)
    inv = _safe_inverse(d)
    z = jnp.clip(jnp.round(-lo * inv), 0, 15)
    q = jnp.clip(jnp.round(blocks * inv[..., None]) + z[..., None], 0, 15)
    return q.astype(jnp.uint8), d, z.astype(jnp.uint8)


def _q_q4_0(blocks: Array) -> tuple[Array, Array, None]:
    d = _signed_extreme(blocks) / -8.0  # ggml's choice
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


def _q_q5_0(blocks: Array) -> tuple[Array, Array, None]:
    d = _signed_extreme(blocks) / -16.0  # as Q4_0, on 32 levels
    q = jnp.clip(jnp.trunc(blocks * _safe_inverse(d)[..., None] + 16.5), 0, 31)
    return q.astype(jnp.uint8), d, None


def _q_q5_1(blocks: Array) -> tuple[Array, Array, Array]:
    hi, lo = jnp.max(blocks, axis=-1), jnp.min(blocks, axis=-1)
    d = (hi - lo) / 31.0
    q = jnp.clip(jnp.trunc((blocks - lo[..., None]) * _safe_inverse(d)[..., None] + 0.5), 0, 31)
    return q.astype(jnp.uint8), d, lo


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


def _v_table(table: np.ndarray) -> Callable[[Array, Array, Array | None], Array]:
    def value(q: Array, d: Array, m: Array | None) -> Array:
        return jnp.take(jnp.asarray(table), q.astype(jnp.int32), mode="clip") * d[..., None]
    return value


# bitsandbytes multiplies by this float32 rather than dividing by 127, after the scale:
# `A * SCB * 7.874015718698502e-3` (its `int8_vectorwise_dequant`), two roundings.
_BNB_INT8_STEP = np.float32(7.874015718698502e-3)


def _v_bnb_int8(q: Array, d: Array, m: Array | None) -> Array:
    return (q * d[..., None]) * _BNB_INT8_STEP


def _e4m3(codes: Array) -> Array:
    """float8_e4m3fn codes, held as their bytes (uint8), -> float32, exactly. (Held as
    `float8_e4m3fn`, XLA:CPU widens the array whole to float16 before a loop that slices
    it: a scanned stack of FP8 weights then held two bytes per weight at once.)"""
    b = codes.astype(jnp.uint32)
    e, m = (b >> 3) & 0xF, b & 0x7
    sign = (b >> 7) << 31
    normal = lax.bitcast_convert_type(sign | ((e + 120) << 23) | (m << 20), jnp.float32)
    tiny = lax.bitcast_convert_type(sign | lax.bitcast_convert_type(
        m.astype(jnp.float32) * np.float32(2.0**-9), jnp.uint32), jnp.float32)
    nan = (e == 15) & (m == 7)  # e4m3fn has no infinities; S.1111.111 is NaN
    return jnp.where(e == 0, tiny, jnp.where(nan, jnp.nan, normal))


def _d_fp8(codes: Array, d: Array, m: Array | None) -> Array:
    return _e4m3(codes) * d[..., None]


def _v_zero_point(q: Array, d: Array, m: Array | None) -> Array:
    # `(q - z) * s` as GPTQ, AWQ and compressed-tensors compute it: the difference of
    # two small integers is exact, so one rounding, of the product.
    return (q - m[..., None]) * d[..., None]


def _v_q4_1(q: Array, d: Array, m: Array | None) -> Array:
    return q * d[..., None] + m[..., None]


def _v_offset16(q: Array, d: Array, m: Array | None) -> Array:
    return (q - 16.0) * d[..., None]


# -- K-quant super-blocks: codes (..., n_blocks, code_bytes) uint8 -> values ---------------
# Each follows gguf-py's `dequantize_blocks` step for step (same reshapes, same float32
# products), so the results agree bit for bit.


def _shifts(*s: int) -> np.ndarray:
    return np.array(s, np.uint8).reshape(-1, 1)


def _rows(x: Array, *shape: int) -> Array:
    """`x (..., n_blocks, bytes)` regrouped as `(..., n_blocks, *shape)`."""
    return x.reshape(*x.shape[:-1], *shape)


def _flat(x: Array) -> Array:
    """`(..., a, b)` -> `(..., a * b)`."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])  # not -1: zero blocks


def _bits(x: Array, groups: int, shifts: np.ndarray, mask: int, rows: int, cols: int) -> Array:
    """Fields `(x >> shift) & mask` of `x`'s bytes in `groups` runs, as `(..., rows, cols)`.

    One shift per field, stacked: the same values as broadcasting the shifts against the
    bytes, but XLA:CPU's loop for a broadcast shift ran ~8x slower (a K-quant step was
    2.8x a dense one's on the QLoRA benchmark's MLP)."""
    runs = _rows(x, groups, x.shape[-1] // groups)
    f = jnp.stack([(runs >> s) & np.uint8(mask) for s in shifts.ravel().tolist()], axis=-2)
    return _rows(f.reshape(*f.shape[:-3], math.prod(f.shape[-3:])), rows, cols)


def _scale_min_k4(sc: Array) -> tuple[Array, Array]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (`get_scale_min_k4`)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale.astype(jnp.float32), mn.astype(jnp.float32)


def _k_q2_k(codes: Array, d: Array, m: Array | None) -> Array:
    sc, qs = codes[..., :16], codes[..., 16:80]
    dl = (d[..., None] * (sc & 0x0F).astype(jnp.float32))[..., None]
    ml = (m[..., None] * (sc >> 4).astype(jnp.float32))[..., None]
    q = _bits(qs, 2, _shifts(0, 2, 4, 6), 3, 16, 16).astype(jnp.float32)
    return _flat(dl * q - ml)


def _k_q3_k(codes: Array, d: Array, m: Array | None) -> Array:
    hmask, qs, sc = codes[..., :32], codes[..., 32:96], codes[..., 96:108]
    lo = _bits(sc[..., :8], 1, _shifts(0, 4), 0x0F, 1, 16)[..., 0, :]
    hi = _bits(sc[..., 8:], 1, _shifts(0, 2, 4, 6), 0x03, 1, 16)[..., 0, :]
    scale = ((lo | (hi << 4)).astype(jnp.int8) - jnp.int8(32)).astype(jnp.float32)
    dl = (d[..., None] * scale)[..., None]
    ql = _bits(qs, 2, _shifts(0, 2, 4, 6), 3, 16, 16)
    # A set high bit means no offset; a clear one, -4.
    qh = _bits(hmask, 1, _shifts(*range(8)), 1, 16, 16) ^ np.uint8(1)
    q = ql.astype(jnp.float32) - (qh << 2).astype(jnp.float32)  # exact, as in q6_k
    return _flat(dl * q)


def _k_q45_k(codes: Array, d: Array, m: Array | None, qh: Array | None) -> Array:
    scale, mn = _scale_min_k4(codes[..., :12])
    dl = (d[..., None] * scale)[..., None]
    ml = (m[..., None] * mn)[..., None]
    q = _bits(codes[..., -128:], 4, _shifts(0, 4), 0x0F, 8, 32)
    if qh is not None:
        q = q | (_bits(qh, 1, _shifts(*range(8)), 1, 8, 32) << 4)
    return _flat(dl * q.astype(jnp.float32) - ml)


def _k_q4_k(codes: Array, d: Array, m: Array | None) -> Array:
    return _k_q45_k(codes, d, m, None)


def _k_q5_k(codes: Array, d: Array, m: Array | None) -> Array:
    return _k_q45_k(codes, d, m, codes[..., 12:44])


def _k_q6_k(codes: Array, d: Array, m: Array | None) -> Array:
    ql, qh, sc = codes[..., :128], codes[..., 128:192], codes[..., 192:208]
    scale = lax.bitcast_convert_type(sc, jnp.int8).astype(jnp.float32)
    dl = (d[..., None] * scale)[..., None]
    lo = _bits(ql, 2, _shifts(0, 4), 0x0F, 8, 32)
    hi = _bits(qh, 2, _shifts(0, 2, 4, 6), 0x03, 8, 32)
    # Six bits less 32, in float32 (exact: |q| <= 32); XLA:CPU's int8 arithmetic then
    # conversion ran ~6x slower than this.
    q = (lo | (hi << 4)).astype(jnp.float32) - 32.0
    return _flat(dl * q.reshape(*q.shape[:-2], 16, 16))


def _gguf(name: str, block: int, bits: int, packing: str | None, quantize: Any, value: Any,
          record: Record, decode: Any = None) -> Format:
    return Format(name, block, True, bits, packing, jnp.float16, quantize, value,
                  has_mins=record.m is not None, decode=decode, record=record)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("int8", None, False, 8, None, jnp.float32, _q_int8, _v_scaled),
        Format("int4", 32, False, 4, "pairs", jnp.float32, _q_int4, _v_offset8),
        Format("nf4", 64, False, 4, "pairs", jnp.float32, _q_nf4, _v_nf4),
        Format("s4", 64, False, 4, "int4", jnp.float32, _q_s4, _v_scaled),
        # GGUF's types. Record(size, d at, m at, codes from): bytes per block as on disk.
        _gguf("q4_0", 32, 4, "halves", _q_q4_0, _v_offset8, Record(18, 0, None, 2)),
        _gguf("q4_1", 32, 4, "halves", _q_q4_1, _v_q4_1, Record(20, 0, 2, 4)),
        _gguf("q5_0", 32, 5, "q5", _q_q5_0, _v_offset16, Record(22, 0, None, 2)),
        _gguf("q5_1", 32, 5, "q5", _q_q5_1, _v_q4_1, Record(24, 0, 2, 4)),
        _gguf("q8_0", 32, 8, None, _q_q8_0, _v_scaled, Record(34, 0, None, 2)),
        _gguf("q2_k", 256, 2, "k", None, None, Record(84, 80, 82, 0), _k_q2_k),
        _gguf("q3_k", 256, 3, "k", None, None, Record(110, 108, None, 0), _k_q3_k),
        _gguf("q4_k", 256, 4, "k", None, None, Record(144, 0, 2, 4), _k_q4_k),
        _gguf("q5_k", 256, 5, "k", None, None, Record(176, 0, 2, 4), _k_q5_k),
        _gguf("q6_k", 256, 6, "k", None, None, Record(210, 208, None, 0), _k_q6_k),
        # Hugging Face checkpoints' types (lorax/_formats/hf_quant.py reads them as stored).
        # bitsandbytes: NF4 / FP4 with its dynamic map as the double quantization's
        # second level, and LLM.int8 (row-wise `SCB`).
        Format("bnb_nf4", 64, False, 4, "pairs", jnp.float32, _q_table(NF4_CODE), _v_nf4,
               double_code=BNB_DYNAMIC_CODE),
        Format("bnb_fp4", 64, False, 4, "pairs", jnp.float32, _q_table(FP4_CODE),
               _v_table(FP4_CODE), double_code=BNB_DYNAMIC_CODE),
        Format("bnb_int8", None, False, 8, None, jnp.float32, _q_bnb_int8, _v_bnb_int8),
        # FP8 e4m3 codes (their bytes, as uint8) times a scale per block (DeepSeek-V3's
        # 128x128 blocks come as blocks along the input axis, their scale repeated for
        # each row of the block).
        Format("fp8_e4m3", 128, False, 8, None, jnp.float32, _q_fp8, _v_scaled,
               decode=_d_fp8, code_type=jnp.uint8),
        # Unsigned 4-bit codes with an integer zero point per block in `mins` (GPTQ, AWQ,
        # compressed-tensors' asymmetric int4).
        Format("int4_zp", 128, False, 4, "pairs", jnp.float16, _q_int4_zp, _v_zero_point,
               has_mins=True),
    )
}


def get_format(qtype: str, where: str = "QuantizedArray") -> Format:
    if not isinstance(qtype, str):  # `in FORMATS` would fail on an unhashable one
        raise TypeError(f"{where}: qtype must be a string such as 'nf4', got {qtype!r}.")
    if qtype not in FORMATS:
        raise ValueError(f"{where}: unknown qtype {qtype!r}; the known ones are "
                         f"{', '.join(FORMATS)}.")
    return FORMATS[qtype]


# -- packing ------------------------------------------------------------------------------


def pack(fmt: Format, q: Array) -> Array:
    """Unpacked codes `(..., block)` -> stored codes `(..., code_bytes)`."""
    if fmt.element_codes:
        return q
    q = q.astype(jnp.uint8)
    half = q.shape[-1] // 2
    if fmt.packing == "q5":  # qh: bit i of the little-endian u32 = the fifth bit of code i
        fifth = _rows((q >> 4) & 1, q.shape[-1] // 8, 8) << np.arange(8, dtype=np.uint8)
        qh = jnp.sum(fifth, axis=-1, dtype=jnp.uint8)
        return jnp.concatenate([qh, (q[..., :half] & 0x0F) | (q[..., half:] << 4)], axis=-1)
    if fmt.packing == "halves":
        return q[..., :half] | (q[..., half:] << 4)
    pairs = q.reshape(*q.shape[:-1], half, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack(fmt: Format, codes: Array) -> Array:
    """Stored codes `(..., code_bytes)` -> float32 codes `(..., block)`."""
    if fmt.decode is _d_fp8:
        return _e4m3(codes)
    if fmt.element_codes:
        return codes.astype(jnp.float32)
    if fmt.packing == "q5":
        qh, qs = codes[..., :4], codes[..., 4:]
        fifth = ((qh[..., None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(*qh.shape[:-1], 32)
        return (jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (fifth << 4)).astype(jnp.float32)
    lo = (codes & 0xF).astype(jnp.float32)
    hi = (codes >> 4).astype(jnp.float32)
    if fmt.packing == "halves":
        return jnp.concatenate([lo, hi], axis=-1)
    return jnp.stack([hi, lo], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


# -- double quantization of NF4's absmax values --------------------------------------------


def _dq_groups(n: int) -> int:
    return -(-n // DOUBLE_QUANT_BLOCK)


def double_quantize(absmax: Array, table: np.ndarray | None = None) -> tuple[Array, Array, Array]:
    """`absmax (*lead, R, n_blocks)` -> `(codes uint8 (*lead, R, n_blocks), scales
    (*lead, G), offset (*lead, 1))`: 8-bit codes of `absmax - mean` in groups of 256
    along the flattened last two axes: int8 stored +128, or (`table`) the index of the
    nearest entry of a code book in [-1, 1] (bitsandbytes' dynamic map)."""
    lead, tail = absmax.shape[:-2], absmax.shape[-2:]
    flat = absmax.reshape(*lead, -1)
    n = flat.shape[-1]
    offset = jnp.mean(flat, axis=-1, keepdims=True)
    centred = flat - offset
    g = _dq_groups(n)
    padded = jnp.pad(centred, [(0, 0)] * len(lead) + [(0, g * DOUBLE_QUANT_BLOCK - n)])
    groups = padded.reshape(*lead, g, DOUBLE_QUANT_BLOCK)
    if table is None:
        s = jnp.max(jnp.abs(groups), axis=-1) / 127.0
        q = jnp.clip(jnp.round(groups * _safe_inverse(s)[..., None]), -127, 127) + 128
    else:
        s = jnp.max(jnp.abs(groups), axis=-1)
        q = _nearest(table, groups * _safe_inverse(s)[..., None])
    codes = q.reshape(*lead, -1)[..., :n].reshape(*lead, *tail)
    return codes.astype(jnp.uint8), s, offset


def second_level(fmt: Format, codes: Array) -> Array:
    """Double quantization's 8-bit codes as float32 values before their group's scale."""
    if fmt.double_code is None:
        return codes.astype(jnp.float32) - 128.0
    return jnp.take(jnp.asarray(fmt.double_code), codes.astype(jnp.int32), mode="clip")


def double_dequantize(fmt: Format, codes: Array, scales: Array, offset: Array) -> Array:
    """The absmax values of `double_quantize`'s `(codes, scales, offset)`, float32:
    `value(code) * scale + offset`, in that order (bitsandbytes' too)."""
    lead, tail = codes.shape[:-2], codes.shape[-2:]
    flat = second_level(fmt, codes.reshape(*lead, -1))
    n = flat.shape[-1]
    g = scales.shape[-1]
    padded = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, g * DOUBLE_QUANT_BLOCK - n)])
    values = padded.reshape(*lead, g, DOUBLE_QUANT_BLOCK) * scales[..., None]
    return (values.reshape(*lead, -1)[..., :n] + offset).reshape(*lead, *tail)


def scales_in_dense_dtype(fmt: Format, scale_dtype: Any, dense_dtype: Any) -> bool:
    """Whether the dense value is `codes * scales` computed in `dense_dtype`, equal bit for
    bit to the float32 product rounded to it: 8-bit or `int4` codes (exact in a 16-bit
    float) times scales stored in that float make at most 8 + 11 significant bits, exact
    in float32, so both forms round the same exact product once.

    It is the form XLA's GPU compiler fuses into the matrix product that reads the weight
    (with `xla_gpu_experimental_enable_subchannel_dequantisation_fusion`): the product
    then reads the int8 or int4 codes and no dense weight is written. A float32 product cast
    afterwards, or any further operation on the codes, is not fused."""
    dense = jnp.dtype(dense_dtype)
    return (fmt.value is _v_scaled and fmt.element_codes and fmt.decode is None
            and jnp.issubdtype(dense, jnp.floating) and dense.itemsize == 2
            and jnp.dtype(scale_dtype) == dense)


def scaled_blocks(codes: Array, scales: Array) -> Array:
    """`(*other, n_blocks, block)` int8 or int4 codes times `(*other, n_blocks)` scales, in the
    scales' dtype (see `scales_in_dense_dtype`) -> `(*other, n_blocks * block)`."""
    v = codes.astype(scales.dtype) * scales[..., None]
    return lax.collapse(v, v.ndim - 2)


def decode_blocks(fmt: Format, codes: Array, scales: Array, mins: Array | None) -> Array:
    """`(..., n_blocks, code_bytes)` codes -> float32 values `(..., n_blocks, block)`."""
    scales = scales.astype(jnp.float32)
    mins = None if mins is None else mins.astype(jnp.float32)
    if fmt.decode is not None:
        return fmt.decode(codes, scales, mins)
    return fmt.value(unpack(fmt, codes), scales, mins)


def dequantize_blocks(fmt: Format, codes: Array, scales: Array, mins: Array | None) -> Array:
    """`(*other, n_blocks, code_bytes)` codes -> float32 values `(*other, n_blocks * block)`."""
    v = decode_blocks(fmt, codes, scales, mins)
    return lax.collapse(v, v.ndim - 2)


def value_at(fmt: Format, codes: Array, scales: Array, mins: Array | None, pos: Array,
             block_size: int) -> Array:
    """The value at position `pos` of one block per row: `codes (..., code_bytes)`,
    `scales` / `mins` `(...)` -> float32 `(...)`."""
    if fmt.packing in ("q5", "k"):  # codes shared across the block: decode it, pick one
        v = decode_blocks(fmt, codes[..., None, :], scales[..., None],
                          None if mins is None else mins[..., None])[..., 0, :]
        return lax.dynamic_index_in_dim(v, pos, v.ndim - 1, keepdims=False)
    q = _code_at(fmt, codes, pos, block_size)[..., None]
    return fmt.value(q, scales.astype(jnp.float32),
                     None if mins is None else mins.astype(jnp.float32))[..., 0]


def _code_at(fmt: Format, codes: Array, pos: Array, block_size: int) -> Array:
    if fmt.element_codes:
        code = lax.dynamic_index_in_dim(codes, pos, codes.ndim - 1, keepdims=False)
        return _e4m3(code) if fmt.decode is _d_fp8 else code.astype(jnp.float32)
    if fmt.packing == "halves":
        byte, high = pos % (block_size // 2), pos >= block_size // 2
    else:
        byte, high = pos // 2, pos % 2 == 0
    b = lax.dynamic_index_in_dim(codes, byte, codes.ndim - 1, keepdims=False)
    return jnp.where(high, b >> 4, b & 0xF).astype(jnp.float32)
