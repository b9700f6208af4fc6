"""Initialisations beyond lorax's default: gaussian, PiSSA, OLoRA, LoftQ (PEFT's semantics).

Each works on the weight as a matrix: `w: (*batch, *M, *N)` flattened to
`(*batch, prod M, prod N)`, oriented as PEFT's torch weight `(out, in)` (so that the
factors land where PEFT puts `lora_B` (output side) and `lora_A` (input side)), with the
batch axes (stacked layers, experts) decomposed slice by slice.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from .. import _engine
from .._checks import is_int
from .._quant import _formats as F
from .._quant._array import QuantizedArray
from .._quant._quantize import _block_axis
from .._spec import LoraSpec

_METHODS = ("default", "gaussian", "pissa", "pissa_niter_<n>", "olora", "loftq")


@dataclasses.dataclass(frozen=True)
class LoftQ:
    """`init_lora(..., init=lorax.LoftQ(...))`: LoftQ (Li et al., 2023) on a quantized base.

    The dense weight `W` is replaced by a quantized `Q` and the factors start at the
    best rank-`k` correction of its quantization error, alternating `iters` times
    `Q = quantize(W - s·B·A)` and `B, A = top-k SVD of (W - dequantize(Q)) / s`, so
    that `Q + s·B·A ≈ W` better than `Q` alone. `init="loftq"` is `LoftQ()`.
    Directions the error does not need (a weight exactly representable in `qtype`,
    e.g. one that was already quantized in that format) start as the default
    initialisation (random input side, zero output side), so they still train.

    **Arguments:**

    - `qtype`: the quantized format of `Q` (see [`lorax.quantize`][]).
    - `iters`: alternations (PEFT's `loftq_iter`, default 1).
    - `block_size`: the format's block size (`None`: its default).

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        w = jax.random.normal(jax.random.PRNGKey(0), (128, 64))
        lp = lorax.init_lora({"w": w}, {"w": 8}, jax.random.PRNGKey(1),
                             init=lorax.LoftQ("nf4", iters=2))
        assert isinstance(lp["w"].w, lorax.QuantizedArray)
        ```
    """

    qtype: str = "nf4"
    iters: int = 1
    block_size: int | None = None

    def __post_init__(self) -> None:
        # Which formats exist is checked at init_lora, where the error can name the weight.
        if not isinstance(self.qtype, str):
            raise TypeError(f"LoftQ: qtype must be a string such as 'nf4', got {self.qtype!r}.")
        if not is_int(self.iters) or self.iters < 1:
            raise ValueError(f"LoftQ: iters must be an int >= 1, got {self.iters!r}.")
        if self.block_size is not None and (not is_int(self.block_size) or self.block_size < 1):
            raise ValueError(f"LoftQ: block_size must be a positive int (or None for the "
                             f"format's own), got {self.block_size!r}.")


@dataclasses.dataclass(frozen=True)
class _Method:
    name: str  # gaussian, pissa, olora, loftq
    niter: int | None = None  # pissa's randomised SVD
    loftq: LoftQ | None = None


def parse(init: Any) -> _Method | None:
    """`None` for lorax's default initialisation, else the method."""
    if isinstance(init, LoftQ):  # its fields are checked when it is built
        return _Method("loftq", loftq=init)
    if isinstance(init, str):
        if init == "default":
            return None
        if init in ("gaussian", "pissa", "olora"):
            return _Method(init)
        if init == "loftq":
            return _Method("loftq", loftq=LoftQ())
        m = re.fullmatch(r"pissa_niter_(\d+)", init)
        if m:
            return _Method("pissa", niter=int(m.group(1)))
    raise ValueError(
        f"init_lora: init={init!r} is not an initialisation lorax knows; choose one of "
        f"{', '.join(repr(x) for x in _METHODS)} or a lorax.LoftQ(...)."
    )


def _as_matrix(x: Array, nb: int, nm: int) -> Array:
    """`(*batch, prod M, prod N)`."""
    batch = x.shape[:nb]
    return x.reshape(*batch, math.prod(x.shape[nb:nb + nm]), math.prod(x.shape[nb + nm:]))


def _from_factors(bm: Array, am: Array, shape: tuple, nb: int, nm: int) -> tuple[Array, Array]:
    """Matrix factors `(*batch, M, k)`, `(*batch, k, N)` back to lorax's shapes."""
    k = bm.shape[-1]
    batch, m, n = shape[:nb], shape[nb:nb + nm], shape[nb + nm:]
    return am.reshape(*batch, k, *n), bm.reshape(*batch, *m, k)


def _torch_oriented(mat: Array, input_factor: str) -> Array:
    """PEFT's `(out, in)` weight from lorax's `(M, N)` matrix."""
    return jnp.swapaxes(mat, -1, -2) if input_factor == "b" else mat


def _split(out_side: Array, in_side: Array, input_factor: str) -> tuple[Array, Array]:
    """`(b_mat, a_mat)` from PEFT's `lora_B (out, k)` and `lora_A (k, in)`."""
    if input_factor == "b":  # out = N: a = lora_B^T, b = lora_A^T
        return jnp.swapaxes(in_side, -1, -2), jnp.swapaxes(out_side, -1, -2)
    return out_side, in_side  # out = M: b = lora_B, a = lora_A


def _top_k(mat: Array, k: int, niter: int | None, key: Array) -> tuple[Array, Array, Array]:
    """`U_k, S_k, Vh_k` of a batch of matrices, exact or randomised (Halko et al.)."""
    if niter is None:
        u, s, vh = jnp.linalg.svd(mat, full_matrices=False)
        return u[..., :k], s[..., :k], vh[..., :k, :]
    n = mat.shape[-1]
    omega = jax.random.normal(key, (*mat.shape[:-2], n, k), mat.dtype)
    q, _ = jnp.linalg.qr(mat @ omega)
    mt = jnp.swapaxes(mat, -1, -2)
    for _ in range(niter):
        q, _ = jnp.linalg.qr(mt @ q)
        q, _ = jnp.linalg.qr(mat @ q)
    small = jnp.swapaxes(q, -1, -2) @ mat  # (k, n)
    u, s, vh = jnp.linalg.svd(small, full_matrices=False)
    return q @ u, s, vh


def init_factors(method: _Method, w: Any, ls: LoraSpec, scale: float, key: jax.Array,
                 dtype: Any, where: str) -> tuple[Any, Array, Array]:
    """`(w, a, b)` for one weight: possibly a new frozen `w` (PiSSA/OLoRA residual,
    LoftQ's quantized weight) and its factors. `scale` is the LoRA scale `alpha / k`."""
    nb, nm, k = ls.batch_ndim, ls.m_ndim, ls.rank
    input_factor = ls.input_factor or "b"
    shape = tuple(w.shape)
    batch = shape[:nb]
    m_size, n_size = math.prod(shape[nb:nb + nm]), math.prod(shape[nb + nm:])

    if method.name == "gaussian":
        if input_factor == "b":  # b is the input side
            b_mat = jax.random.normal(key, (*batch, m_size, k), dtype) / k
            a_mat = jnp.zeros((*batch, k, n_size), dtype)
        else:
            a_mat = jax.random.normal(key, (*batch, k, n_size), dtype) / k
            b_mat = jnp.zeros((*batch, m_size, k), dtype)
        a, b = _from_factors(b_mat, a_mat, shape, nb, nm)
        return w, a, b

    if _engine.is_value(w):
        if method.name == "loftq":
            raise ValueError(
                f"init_lora: {where!r} is already quantized; LoftQ needs the dense weight "
                "and quantizes it itself (pass the dense parameters).")
        raise ValueError(
            f"init_lora: {where!r} is quantized; init={method.name!r} needs the dense weight "
            "(its top singular directions / QR factors). Initialise on the dense weights and "
            "quantize the residual afterwards (QPiSSA), or use init='loftq'.")

    if k > min(m_size, n_size):
        raise ValueError(
            f"init_lora: {where!r} (shape {shape}) has rank {k} > min(M, N) = "
            f"{min(m_size, n_size)}; init={method.name!r} takes k singular directions (or QR "
            "columns) of the weight, and it has fewer.")
    w32 = _as_matrix(jnp.asarray(w, jnp.float32), nb, nm)
    torch_w = _torch_oriented(w32, input_factor)  # (*batch, out, in)

    if method.name == "pissa":
        u, s, vh = _top_k(torch_w, k, method.niter, key)
        s = s / scale
        root = jnp.sqrt(s)
        out_side = u * root[..., None, :]  # lora_B (out, k)
        in_side = root[..., :, None] * vh  # lora_A (k, in)
    elif method.name == "olora":
        q, r = jnp.linalg.qr(torch_w)
        out_side, in_side = q[..., :, :k], r[..., :k, :]
    elif method.name == "loftq":
        return _loftq(method.loftq, w, w32, ls, scale, key, dtype, where)
    else:  # parse() only makes the names above
        raise AssertionError(method)

    b_mat, a_mat = _split(out_side, in_side, input_factor)
    update = scale * (b_mat @ a_mat)  # (*batch, M, N)
    residual = (w32 - update).reshape(shape).astype(w.dtype)
    a, b = _from_factors(b_mat.astype(dtype), a_mat.astype(dtype), shape, nb, nm)
    return residual, a, b


def _loftq(cfg: LoftQ, w: Any, w32: Array, ls: LoraSpec, scale: float, key: Array,
           dtype: Any, where: str) -> tuple[Any, Array, Array]:
    if cfg.qtype not in F.FORMATS:
        raise ValueError(
            f"init_lora: LoftQ qtype {cfg.qtype!r} at {where!r} is not a known format; "
            f"choose one of {sorted(F.FORMATS)}.")
    nb, nm, k = ls.batch_ndim, ls.m_ndim, ls.rank
    input_factor = ls.input_factor or "b"
    shape = tuple(w.shape)
    axis = _block_axis(ls, len(shape))

    def quantize(x: Array) -> Any:
        try:
            return QuantizedArray.from_dense(x.reshape(shape).astype(w.dtype), cfg.qtype,
                                             block_size=cfg.block_size, axis=axis)
        except ValueError as err:
            raise ValueError(f"init_lora: LoftQ at {where!r}: {err}") from None

    b_mat = jnp.zeros((*shape[:nb], w32.shape[-2], k), jnp.float32)
    a_mat = jnp.zeros((*shape[:nb], k, w32.shape[-1]), jnp.float32)
    q = None
    for _ in range(cfg.iters):
        q = quantize(w32 - scale * (b_mat @ a_mat))
        err = (w32 - _as_matrix(q.dequantize(jnp.float32), nb, nm)) / scale
        u, s, vh = _top_k(_torch_oriented(err, input_factor), k, None, key)
        root = jnp.sqrt(s)
        out_side, in_side = u * root[..., None, :], root[..., :, None] * vh
        b_mat, a_mat = _split(out_side, in_side, input_factor)
    # A direction the error does not need (s = 0: W is exactly representable in qtype,
    # e.g. it was already quantized in it, or the error has rank < k) would start with
    # both factors zero, and a product of two zeros never gets a gradient. Such a
    # direction starts as LoRA's default instead: a random input side, a zero output side
    # (Q + s·B·A is unchanged).
    dead = s * scale <= 1e-6 * jnp.max(jnp.abs(w32), axis=(-2, -1))[..., None]  # (*batch, k)
    fresh = jax.random.normal(jax.random.fold_in(key, 1), in_side.shape) / math.sqrt(in_side.shape[-1])
    in_side = jnp.where(dead[..., :, None], fresh, in_side)
    b_mat, a_mat = _split(out_side, in_side, input_factor)
    a, b = _from_factors(b_mat.astype(dtype), a_mat.astype(dtype), shape, nb, nm)
    return q, a, b
