"""DoRA: a LoRA weight whose output features are rescaled to a trainable magnitude.

`W' = m * V / ||V||` with `V = w + s * b @ a`, the norm taken per output feature over
the input axes and treated as a constant in the backward pass (Liu et al. 2024, §4.3;
PEFT's `use_dora`). The norm never forms `V`:

    ||w_n + s (B A)_n||^2 = ||w_n||^2 + 2 s (B^T w)_n . a_n + s^2 a_n^T (B^T B) a_n

for the output feature `n` on `a`'s side (and the mirror image on `b`'s side): one
`(k x M) . (M x N)` product, a weight-sized sum of squares and rank-`k` work.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import ArrayLike

from .. import _engine
from .._sharding import out_sharding_of, whole_where_one
from .._weight import FactorAxes, LoraWeight, _dense, _shape

Side = Literal["a", "b"]


def magnitude_shape(w_shape: tuple[int, ...], axes: FactorAxes,
                    side: Side) -> tuple[int, ...]:
    """`m`'s shape: `w`'s, with the input axes (the ones the norm sums over) set to 1.

    `side` is the factor on the *output* side: `"a"` keeps `w`'s `N` axes, `"b"` its
    `M` axes; batch axes are always kept.
    """
    summed = axes.m if side == "a" else axes.n
    return tuple(1 if i in summed else d for i, d in enumerate(w_shape))


def magnitude_side(w_shape: tuple[int, ...], m_shape: tuple[int, ...],
                   axes: FactorAxes) -> Side | None:
    """Which factor is on the output side, read from `m`'s shape (`None`: fits neither)."""
    for side in ("a", "b"):
        if tuple(m_shape) == magnitude_shape(tuple(w_shape), axes, side):
            return side  # type: ignore[return-value]
    return None


class DoraWeight(LoraWeight):
    """A [`lorax.LoraWeight`][] with DoRA's trainable magnitude `m`.

    Inside [`lorax.lora`][] it behaves like the array `m * V / ||V||`, where
    `V = w + (alpha / k) * b @ a` and `||V||` is the norm of each output feature's
    weights (over the input axes), held constant in the backward pass as in the
    DoRA paper and PEFT. Neither `V` nor the norm's `W`-sized intermediate is formed:
    the layer computes `(x @ w + s * (x @ b) @ a) * (m / ||V||)`, and `||V||` comes
    from `||w||`, `b^T w` and rank-`k` products.

    `m` has `w`'s shape with the input axes set to 1, so it broadcasts against `w`
    and says by itself which side is the output: `(1, out)` for an `(in, out)`
    kernel used as `x @ w`, `(out, 1)` for an `(out, in)` weight used as `w @ x`,
    `(1, ..., 1, out)` for a conv kernel, `(1, dim)` for a `(vocab, dim)`
    embedding, with leading batch axes for stacked weights. Build one with
    `lorax.init_lora(..., dora=True)` or [`DoraWeight.from_lora`][lorax.DoraWeight.from_lora].

    **Arguments:**

    - `w`, `a`, `b`, `alpha`: as for [`lorax.LoraWeight`][].
    - `m`: the magnitude, `w`'s shape with the input axes set to 1.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        lw = lorax.init_lora({"w": jnp.ones((8, 4))}, {"w": 2}, jax.random.PRNGKey(0))["w"]
        dw = lorax.DoraWeight.from_lora(lw)
        assert dw.m.shape == (1, 4)  # one magnitude per output feature
        assert jnp.allclose(dw.materialize(), lw.materialize())  # unchanged at init
        ```
    """

    m: Array

    trainable_fields = ("a", "b", "m")

    def __init__(self, w: ArrayLike, a: ArrayLike, b: ArrayLike, m: ArrayLike,
                 alpha: float = 1.0, *, m_axes: tuple[int, ...] | None = None):
        super().__init__(w, a, b, alpha, m_axes=m_axes)
        axes = self.axes
        if magnitude_side(_shape(self.w), _shape(m), axes) is None:
            raise ValueError(
                "DoraWeight.m must have w's shape with the input axes set to 1: "
                f"{magnitude_shape(_shape(self.w), axes, 'a')} (output on a's side) or "
                f"{magnitude_shape(_shape(self.w), axes, 'b')} (output on b's side); "
                f"got {_shape(m)} for w of shape {_shape(self.w)}."
            )
        self.m = m

    @classmethod
    def from_lora(cls, lw: LoraWeight, input_factor: Side = "b") -> DoraWeight:
        """A `DoraWeight` with `lw`'s factors and `m` set to the norms of `lw`'s weight.

        **Arguments:**

        - `lw`: a `LoraWeight`.
        - `input_factor`: the factor the layer's input meets first (`"b"` for
          `x @ w`, `"a"` for `w @ x`); the magnitude is on the other side.

        **Returns:**

        A `DoraWeight` equal to `lw` as an array (`m = ||V||`).
        """
        if not isinstance(lw, LoraWeight):
            raise TypeError(f"DoraWeight.from_lora: lw must be a lorax.LoraWeight, got "
                            f"{type(lw).__name__}.")
        if input_factor not in ("a", "b"):
            raise ValueError(f"DoraWeight.from_lora: input_factor must be 'a' or 'b', got "
                             f"{input_factor!r}.")
        out_side: Side = "a" if input_factor == "b" else "b"
        norm = _norm(lw.w, lw.a, lw.b, scale=lw.scale, side=out_side, axes=lw.axes)
        return cls(lw.w, lw.a, lw.b, norm.astype(lw.a.dtype), lw.alpha, m_axes=lw.m_axes)

    @property
    def output_factor(self) -> Side:
        """`"a"` or `"b"`: the factor on the output side (the side `m` runs along)."""
        side = magnitude_side(self.w.shape, self.m.shape, self.axes)
        assert side is not None
        return side

    def weight_norm(self) -> Array:
        """`||V||` per output feature, in `m`'s shape (computed without forming `V`)."""
        return weight_norm(self.as_lora(), self.output_factor)

    def as_lora(self) -> LoraWeight:
        """The underlying `LoraWeight` (no magnitude)."""
        return LoraWeight(self.w, self.a, self.b, self.alpha, m_axes=self.m_axes)

    def materialize(self) -> Array:
        """`m * V / ||V||` as a plain array (the merged weight), `||V||` held constant
        under differentiation as inside `lora`.

        **Returns:**

        An array with `w`'s shape and dtype.
        """
        v = super().materialize()
        norm = lax.stop_gradient(_direct_norm(v, self.axes, self.output_factor))
        return (v * (self.m / norm).astype(v.dtype)).astype(self.w.dtype)

    materialized_as = "materialized as m * V / ||V||, V = w + (alpha/k) * b @ a"

    def materialise(self) -> Array:
        w = lax.stop_gradient(self.w)
        v = _dense(w) + self.delta()
        norm = lax.stop_gradient(_direct_norm(v, self.axes, self.output_factor))
        return v * (self.m / norm).astype(v.dtype)

    def __repr__(self) -> str:
        return super().__repr__()[:-1].replace("LoraWeight(", "DoraWeight(") + (
            f", m={self.m.dtype.name}{list(self.m.shape)})")


def _wide(*dtypes: Any) -> Any:
    # Norms accumulate in float32, or in the operands' own dtype where it is wider
    # (float64): never below the precision the user's weights carry.
    return jnp.result_type(jnp.float32, *dtypes)


def _direct_norm(v: Array, axes: FactorAxes, side: Side) -> Array:
    """The reference: `||V||` over the input axes of a materialised `V` (keepdims)."""
    axes = axes.m if side == "a" else axes.n
    vw = v.astype(_wide(v.dtype))
    return jnp.sqrt(jnp.sum(vw * vw, axis=axes, keepdims=True))


def weight_norm(lw: LoraWeight, side: Side) -> Array:
    """`||w + s * b @ a||` per output feature (output on `side`), keepdims, in float32
    (float64 for float64 operands).

    No gradient flows through it (DoRA treats it as a constant). A stacked quantized
    `w` is dequantized one batch slice at a time.
    """
    return _norm(lax.stop_gradient(lw.w), lax.stop_gradient(lw.a),
                 lax.stop_gradient(lw.b), scale=lw.scale, side=side, axes=lw.axes)


def _norm(w: Any, a: Array, b: Array, *, scale: float, side: Side, axes: FactorAxes) -> Array:
    """`_norm_impl`, compiled. Under Explicit mesh axes it runs as on an Auto mesh: its
    contractions over a split input axis have no one result type there, and the norm
    lands split as `w`'s output axes are (what propagation gives on an Auto mesh)."""
    spec = out_sharding_of(w.aval() if _engine.is_value(w) else w)
    if spec is None:
        return _norm_jit(w, a, b, scale=scale, side=side, axes=axes)
    out = whole_where_one(spec, magnitude_shape(w.shape, axes, side))
    return jax.sharding.auto_axes(
        lambda w, a, b: _norm_jit(w, a, b, scale=scale, side=side, axes=axes),
        out_sharding=out)(w, a, b)


def _norm_impl(w: Any, a: Array, b: Array, *, scale: float, side: Side,
               axes: FactorAxes) -> Array:
    nb, nm, nn = len(axes.batch), len(axes.m), len(axes.n)
    if nb and _engine.is_value(w):
        # A stacked quantized weight: one layer at a time, or the contraction below would
        # dequantize the whole stack at once.
        inner = FactorAxes(tuple(range(nb - 1)), *(tuple(i - 1 for i in g) for g in axes[1:]))
        return lax.map(lambda wab: _norm_impl(*wab, scale=scale, side=side, axes=inner),
                       (w, a, b))
    acc = _wide(w.dtype, a.dtype, b.dtype)
    batch = tuple(range(nb))
    a = a.astype(acc)
    b = b.astype(acc)
    m_axes, n_axes = axes.m, axes.n
    if side == "a":
        # Output features on a's (N) side; sum over M.
        sq = _sum_squares(w, m_axes, acc)  # (*B, *N)
        # b^T w: (*B, k, *N), contracting M.
        # b^T rank-major first when the rank is large: a dot contracting b's leading M
        # axes ran ~1.6x slower on XLA:CPU at k = 64 (d 2048: 5.8 vs 3.7 ms), and XLA
        # folds a bare transpose back in. At k = 8 the copy costs more than it saves
        # (2.5 vs 1.2 ms).
        b_m = tuple(range(nb, nb + nm))
        if b.shape[-1] >= _RANK_MAJOR_MIN_RANK:
            bt = lax.optimization_barrier(jnp.moveaxis(b, -1, nb))  # (*B, k, *M)
            bt_m = tuple(range(nb + 1, nb + 1 + nm))
        else:
            bt, bt_m = b, b_m
        # (*B, k, *N) either way: batch, then bt's free (rank) axis, then w's N axes.
        btw = _engine.call(lambda w_: lax.dot_general(
            bt, w_, ((bt_m, m_axes), (batch, batch)), preferred_element_type=acc), w)
        cross = jnp.sum(a * btw, axis=nb)
        gram = lax.dot_general(b, b, ((b_m, b_m), (batch, batch)))  # (*B, k, k)
        ga = lax.dot_general(gram, a, (((nb + 1,), (nb,)), (batch, batch)))  # (*B, k, *N)
        quad = jnp.sum(a * ga, axis=nb)
        n2 = sq + 2.0 * scale * cross + scale * scale * quad
        n2 = n2.reshape(magnitude_shape(w.shape, axes, "a"))
    else:
        sq = _sum_squares(w, n_axes, acc)  # (*B, *M)
        a_n = tuple(range(nb + 1, nb + 1 + nn))
        wat = _engine.call(lambda w_: lax.dot_general(
            w_, a, ((n_axes, a_n), (batch, batch)), preferred_element_type=acc), w)  # (*B,*M,k)
        cross = jnp.sum(b * wat, axis=-1)
        gram = lax.dot_general(a, a, ((a_n, a_n), (batch, batch)))  # (*B, k, k)
        bg = lax.dot_general(b, gram, (((b.ndim - 1,), (nb,)), (batch, batch)))  # (*B,*M,k)
        quad = jnp.sum(b * bg, axis=-1)
        n2 = sq + 2.0 * scale * cross + scale * scale * quad
        n2 = n2.reshape(magnitude_shape(w.shape, axes, "b"))
    # Rounding can take an exactly-cancelled column a hair below zero.
    return jnp.sqrt(jnp.maximum(n2, 0.0))


def _sum_squares(w: Any, axes: tuple[int, ...], dtype: Any) -> Array:
    if _engine.is_value(w):  # quantized (never stacked here: see `_norm_impl`)
        w = w.dequantize(dtype)
    ww = w.astype(dtype)
    return jnp.sum(ww * ww, axis=axes)


_RANK_MAJOR_MIN_RANK = 32

_norm_jit = _engine.rule_jit(_norm_impl, static_argnames=("scale", "side", "axes"))

