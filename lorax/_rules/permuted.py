"""`RowOrdered` operands (GPTQ act-order weights): the activation is reordered, the codes
are read as stored.

`x @ W` with `W[i] = inner[perm[i]]` along the contracted axis is `x[order] @ inner`
(`order = argsort(perm)`): one gather of the activation, then the inner value's own rule
(`_engine.call`: a `QuantizedArray` goes to the quantized product). Along a free axis the
product's result is reordered instead. Its transpose (the backward pass) is JAX's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from .. import _engine
from .._quant._permuted import RowOrdered


def _free_position(w_ndim: int, x_ndim: int, w_first: bool, dn: Any, axis: int) -> int:
    """Where `W`'s free axis `axis` lands in `dot_general`'s output (batch axes, then the
    left operand's free axes, then the right's)."""
    (lc, rc), (lb, rb) = dn
    wc, wb = (lc, lb) if w_first else (rc, rb)
    xc, xb = (rc, rb) if w_first else (lc, lb)
    w_free = [d for d in range(w_ndim) if d not in (*wc, *wb)]
    x_free = x_ndim - len(xc) - len(xb)
    return len(wb) + (0 if w_first else x_free) + w_free.index(axis)


def _dot(w: RowOrdered, x: ArrayLike, w_first: bool, dimension_numbers: Any,
         params: dict) -> Any:
    axis = w.axis % w.ndim
    (lc, rc), (lb, rb) = dimension_numbers
    wc, xc = (lc, rc) if w_first else (rc, lc)
    args = dict(dimension_numbers=dimension_numbers, **params)
    if axis in (lb if w_first else rb) or _engine.is_value(x):
        return _engine.materialize_fallback(
            lax.dot_general_p, [w, x] if w_first else [x, w], args,
            None if _engine.is_value(x) else "the reordered axis is a batch axis")
    if axis in wc:  # reorder the activation's matching axis: x[order] @ inner
        x = jnp.take(jnp.asarray(x), w.order, axis=xc[list(wc).index(axis)])
        ops = (w.inner, x) if w_first else (x, w.inner)
        return _engine.call(lax.dot_general_p.bind, *ops, **args)
    ops = (w.inner, x) if w_first else (jnp.asarray(x), w.inner)
    y = _engine.call(lax.dot_general_p.bind, *ops, **args)
    return jnp.take(y, w.perm, axis=_free_position(w.ndim, jnp.ndim(x), w_first,
                                                   dimension_numbers, axis))


@_engine.register(lax.dot_general_p)
def _(lhs: RowOrdered, rhs: ArrayLike, *, dimension_numbers: Any, **params: Any) -> Any:
    return _dot(lhs, rhs, True, dimension_numbers, params)


@_engine.register(lax.dot_general_p)
def _(lhs: ArrayLike, rhs: RowOrdered, *, dimension_numbers: Any, **params: Any) -> Any:
    return _dot(rhs, lhs, False, dimension_numbers, params)


@_engine.register(lax.transpose_p)
def _(w: RowOrdered, *, permutation: Sequence[int]) -> Any:
    perm = tuple(permutation)
    inner = _engine.call(lax.transpose, w.inner, perm)
    return RowOrdered(inner, w.perm, w.order, perm.index(w.axis % w.ndim) - w.ndim)


@_engine.register(lax.convert_element_type_p)
def _(w: RowOrdered, *, new_dtype: Any, **params: Any) -> Any:
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return _engine.materialize_fallback(
            lax.convert_element_type_p, [w], dict(new_dtype=new_dtype, **params))
    inner = _engine.call(lax.convert_element_type_p.bind, w.inner, new_dtype=new_dtype, **params)
    return RowOrdered(inner, w.perm, w.order, w.axis)


@_engine.register(lax.copy_p)
def _(w: RowOrdered) -> Any:
    return w
