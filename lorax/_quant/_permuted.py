"""`RowOrdered`: a frozen weight whose positions along one axis are stored in another order.

GPTQ's act-order checkpoints (`desc_act=true`) quantize a weight's input rows in order of
importance, so the rows of one scale group lie far apart (`g_idx`). Stored with its rows
sorted by group, the weight is an ordinary `QuantizedArray` with consecutive blocks; this
value puts the rows back where they belong:

    dense[..., i, ...] = inner[..., perm[i], ...]      (along `axis`)

and `order = argsort(perm)` says where each stored row belongs. A product that contracts
that axis reorders the activation instead (`x[order] @ inner`: a gather of activations,
as GPTQ's GPU kernels do), so the codes are read as stored; the rules are in
`lorax/_rules/permuted.py`.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import Array

from .. import _engine
from ._array import AbstractDequantized


class RowOrdered(AbstractDequantized, metaclass=_engine.FastPytreeMeta):
    """`inner` (a `QuantizedArray`) with its positions along `axis` (< 0) permuted.

    - `perm`: int32 `(n,)`: logical position `i` is stored at `perm[i]`;
    - `order`: int32 `(n,)`: its inverse, stored position `j` holds logical `order[j]`.
    """

    inner: Any
    perm: Array
    order: Array
    axis: int = eqx.field(static=True)

    def aval(self) -> jax.core.ShapedArray:
        return self.inner.aval()

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.perm.size * 4 + self.order.size * 4

    @property
    def qtype(self) -> str:
        return self.inner.qtype

    def dequantize(self, dtype: Any = None) -> Array:
        """The dense array (`QuantizedArray.dequantize`'s, rows in their logical order)."""
        return jnp.take(self.inner.dequantize(dtype), self.perm, axis=self.axis)

    def __repr__(self) -> str:
        return f"RowOrdered({self.inner!r}, rows reordered along axis {self.axis})"
