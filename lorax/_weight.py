"""`LoraWeight`: a frozen weight plus a trainable low-rank update, as one array-ish value."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.typing import ArrayLike

from . import _engine
from ._checks import check_finite
from ._placement import on_device
from ._sharding import weight_aval


class FactorAxes(NamedTuple):
    """Which of a weight's axes are batch axes, `b`'s (`M`) axes and `a`'s (`N`) axes.

    Each is a tuple of axes of `w`, in increasing order: `b` is
    `(*batch, *(w.shape[i] for i in m), k)` and `a` is `(*batch, k, *(w.shape[i] for i in n))`.
    """

    batch: tuple[int, ...]
    m: tuple[int, ...]
    n: tuple[int, ...]


def factor_structure(
    w_shape: tuple[int, ...], a_shape: tuple[int, ...], b_shape: tuple[int, ...],
    m_axes: tuple[int, ...] | None = None,
) -> tuple[int, int, int]:
    """Split a weight's axes into `(n_batch, n_in, n_out)` groups from factor shapes.

    `w` is `(*batch, *M, *N)`, `b` is `(*batch, *M, k)` and `a` is `(*batch, k, *N)`,
    so the three ranks determine the groups: no metadata needs to travel with the
    pytree, and slicing a stacked weight inside `lax.scan` keeps it consistent.
    With `m_axes` (negative axes of `w`, see `LoraWeight`) the `M` axes are those,
    wherever they sit after the batch axes, and `N` the other non-batch axes.
    """
    structure = _structure(tuple(w_shape), tuple(a_shape), tuple(b_shape), m_axes)
    if structure is None:
        where = ("w: (*batch, *M, *N)" if m_axes is None
                 else f"w: (*batch, ...) with M at axes {m_axes} and N the others")
        raise ValueError(
            f"LoraWeight factor shapes do not fit the weight: expected {where}, "
            f"b: (*batch, *M, k), a: (*batch, k, *N), got w: {tuple(w_shape)}, "
            f"b: {tuple(b_shape)}, a: {tuple(a_shape)}."
        )
    return structure


def factor_axes(w_shape: tuple[int, ...], structure: tuple[int, int, int],
                m_axes: tuple[int, ...] | None) -> FactorAxes:
    """The `FactorAxes` of a weight of `w_shape` (absolute, increasing axes)."""
    nb, nm, _ = structure
    ndim = len(w_shape)
    m = tuple(range(nb, nb + nm)) if m_axes is None else tuple(ndim + i for i in m_axes)
    n = tuple(i for i in range(nb, ndim) if i not in m)
    return FactorAxes(tuple(range(nb)), m, n)


def normalize_m_axes(ndim: int, n_batch: int, m_axes: Any) -> tuple[int, ...] | None:
    """`m_axes` as stored: sorted negative axes, or `None` for the contiguous default."""
    if m_axes is None:
        return None
    axes = sorted({int(i) % ndim if -ndim <= int(i) < ndim else ndim for i in m_axes})
    if len(axes) != len(tuple(m_axes)) or not axes or axes[0] < n_batch or axes[-1] >= ndim \
            or len(axes) == ndim - n_batch:
        raise ValueError(
            f"LoraWeight m_axes must be distinct axes of w after its {n_batch} batch "
            f"axes, leaving at least one for a's side; got {tuple(m_axes)} for a "
            f"{ndim}-d weight.")
    if axes == list(range(n_batch, n_batch + len(axes))):
        return None  # contiguous: lorax 0.3's layout, stored as such
    return tuple(i - ndim for i in axes)


@functools.lru_cache(maxsize=4096)
def _structure(w_shape: tuple[int, ...], a_shape: tuple[int, ...],
               b_shape: tuple[int, ...],
               m_axes: tuple[int, ...] | None = None) -> tuple[int, int, int] | None:
    n_batch = len(b_shape) + len(a_shape) - len(w_shape) - 2
    n_m = len(b_shape) - n_batch - 1
    n_n = len(a_shape) - n_batch - 1
    if n_batch < 0 or n_m < 1 or n_n < 1:
        return None
    if m_axes is not None and (len(m_axes) != n_m or min(m_axes) < n_batch - len(w_shape)):
        return None
    batch = w_shape[:n_batch]
    _, m, n = factor_axes(w_shape, (n_batch, n_m, n_n), m_axes)
    ok = (
        b_shape[:n_batch] == batch
        and a_shape[:n_batch] == batch
        and b_shape[n_batch:-1] == tuple(w_shape[i] for i in m)
        and a_shape[n_batch + 1 :] == tuple(w_shape[i] for i in n)
        and a_shape[n_batch] == b_shape[-1]
    )
    return (n_batch, n_m, n_n) if ok else None


def lorax03_conv_a(w_shape: tuple[int, ...], a_shape: tuple[int, ...],
                   b_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The current shape of `a` if the factors are in lorax 0.3's conv layout, else `None`.

    lorax 0.3 factored a `(*window, in, out)` kernel as `b: (*window, in, k)` and
    `a: (1, ..., 1, k, out)`, meaning `w + s * b @ a` with `a` broadcast over the
    window: exactly today's `M = (*window, in)`, `N = (out,)` factorisation with
    `a: (k, out)`. Only shapes that fit no current layout are read this way.
    """
    if len(w_shape) < 3 or len(a_shape) != len(w_shape) or len(b_shape) != len(w_shape):
        return None
    k = b_shape[-1]
    if (a_shape[:-2] == (1,) * (len(w_shape) - 2) and a_shape[-2:] == (k, w_shape[-1])
            and b_shape[:-1] == w_shape[:-1]):
        return (k, w_shape[-1])
    return None


class LoraWeight(_engine.ArrayValue, metaclass=_engine.FastPytreeMeta):
    """A frozen weight `w` plus a trainable low-rank update, `w + (alpha / k) * b @ a`.

    Shapes follow lorax 0.3: `w: (..., M, N)`, `b: (..., M, k)`, `a: (..., k, N)`.
    More generally `w` may have several axes on either side of the factorisation
    and leading batch axes (stacked per-layer or per-expert weights):
    `w: (*batch, *M, *N)`, `b: (*batch, *M, k)`, `a: (*batch, k, *N)`.

    Inside a function wrapped by [`lorax.lora`][], a `LoraWeight` behaves like the
    array `w + (alpha / k) * b @ a` without that array ever being formed.

    The `M` and `N` axes need not be contiguous: with `m_axes`, `b` holds the
    axes of `w` listed there and `a` the other non-batch axes, each in `w`'s order.
    A Gemma query kernel `w: (heads, embed, head_dim)` used as `btd,ndh->btnh` has
    PEFT's `q_proj` factorisation with `m_axes=(1,)`: `b: (embed, k)`,
    `a: (k, heads, head_dim)`.

    lorax 0.3's conv layout, `w: (*window, in, out)`, `b: (*window, in, k)`,
    `a: (1, ..., 1, k, out)`, is accepted and stored as `a: (k, out)`: the same
    values and the same effective weight.

    `LoraWeight` is an immutable pytree (an `equinox.Module`) whose leaves are
    `w`, `a` and `b`; `alpha` is static metadata. To replace a factor, build a new
    one: `dataclasses.replace(lw, a=new_a)` or `equinox.tree_at(lambda l: l.a, lw, new_a)`.

    **Arguments:**

    - `w`: the frozen weight.
    - `a`: the factor on `w`'s output (`N`) side, `(*batch, k, *N)`.
    - `b`: the factor on `w`'s input (`M`) side, `(*batch, *M, k)`.
    - `alpha`: the LoRA scaling numerator; the update is scaled by `alpha / k`.
    - `m_axes`: the axes of `w` on `b`'s side, when they are not the ones right
      after the batch axes (`None`, the default: `w: (*batch, *M, *N)`). Kept as
      negative axes, so slicing leading batch axes (as `lax.scan` does) keeps it.

    !!! Example

        ```python
        import jax.numpy as jnp
        import lorax

        w = jnp.ones((4, 3))
        lw = lorax.LoraWeight(w, a=jnp.ones((2, 3)), b=jnp.zeros((4, 2)), alpha=1.0)
        assert lw.shape == (4, 3) and lw.rank == 2
        assert (lw.materialize() == w).all()
        ```
    """

    w: Array
    a: Array
    b: Array
    alpha: float = eqx.field(static=True, default=1.0)
    m_axes: tuple[int, ...] | None = eqx.field(static=True, default=None)

    # The leaves training updates (`w` is the frozen one): partition, optimizers and
    # adapters read this rather than naming fields.
    trainable_fields = ("a", "b")

    def __init__(self, w: ArrayLike, a: ArrayLike, b: ArrayLike, alpha: float = 1.0, *,
                 m_axes: tuple[int, ...] | None = None):
        if isinstance(alpha, jax.core.Tracer) or jnp.ndim(alpha) != 0:
            raise TypeError(
                f"LoraWeight.alpha must be a Python number (it is static), got {alpha!r}."
            )
        alpha = check_finite(type(self).__name__, "alpha", alpha)  # a nan scale trains on nans
        w_shape, a_shape, b_shape = _shape(w), _shape(a), _shape(b)
        if m_axes is not None:
            n_batch = len(b_shape) + len(a_shape) - len(w_shape) - 2
            m_axes = normalize_m_axes(len(w_shape), max(n_batch, 0), m_axes)
        if m_axes is not None:
            factor_structure(w_shape, a_shape, b_shape, m_axes)  # raises, saying what fits
        elif _structure(w_shape, a_shape, b_shape) is None:
            a_shape03 = lorax03_conv_a(w_shape, a_shape, b_shape)
            if a_shape03 is not None:
                a = a.reshape(a_shape03) if hasattr(a, "reshape") else jnp.reshape(a, a_shape03)
            else:
                factor_structure(w_shape, a_shape, b_shape)  # raises, saying what fits
        _check_weight(type(self).__name__, w, b_shape)
        self.w = w
        self.a = a
        self.b = b
        self.alpha = float(alpha)
        self.m_axes = m_axes

    # -- array-ish interface -------------------------------------------------
    def aval(self) -> jax.core.ShapedArray:
        w = self.w
        if _engine.is_value(w):  # quantized: shape and dtype from it, variance from its codes
            return weight_aval(w, (jax.tree.leaves(w)[0], self.a, self.b))
        return weight_aval(w, (w, self.a, self.b))

    @property
    def rank(self) -> int:
        """The rank `k` of the update."""
        return self.b.shape[-1]

    @property
    def scale(self) -> float:
        """The update's scale, `alpha / k`."""
        return self.alpha / self.rank

    @property
    def structure(self) -> tuple[int, int, int]:
        """`(n_batch, n_in, n_out)`: how many of `w`'s axes are batch, `M` and `N` axes."""
        return factor_structure(self.w.shape, self.a.shape, self.b.shape, self.m_axes)

    @property
    def axes(self) -> FactorAxes:
        """Which axes of `w` are batch, `M` (`b`'s) and `N` (`a`'s) axes."""
        return factor_axes(tuple(self.w.shape), self.structure, self.m_axes)

    @property
    def contiguous(self) -> bool:
        """Whether `w` is laid out `(*batch, *M, *N)` (lorax 0.3's layout)."""
        return self.m_axes is None

    def delta(self) -> Array:
        """The update `(alpha / k) * b @ a`, in `w`'s dtype and shape."""
        batch, m, n = self.axes
        nb = len(batch)
        ba = lax.dot_general(
            self.b, self.a, (((self.b.ndim - 1,), (nb,)), (batch, batch))
        )  # (*batch, *M, *N): put each axis back where `w` has it
        ba = lax.transpose(ba, tuple(int(i) for i in np.argsort((*batch, *m, *n))))
        return (self.scale * ba).astype(self.w.dtype)

    def materialize(self) -> Array:
        """`w + (alpha / k) * b @ a` as a plain array (the merged weight).

        **Returns:**

        An array with `w`'s shape and dtype.
        """
        return _dense(self.w) + self.delta()

    materialized_as = "materialized as w + (alpha/k) * b @ a"

    def materialise(self) -> Array:
        # Quax's fallback hook. Inside `lora` the frozen weight only ever enters
        # through `stop_gradient`, the fallback included.
        return _dense(lax.stop_gradient(self.w)) + self.delta()

    @staticmethod
    def default(primitive: Any, values: Any, params: dict[str, Any]) -> Any:
        return _engine.materialize_fallback(primitive, values, params)

    def __repr__(self) -> str:
        extra = "" if self.m_axes is None else f", m_axes={self.axes.m}"
        return (
            f"LoraWeight(w={_short(self.w)}, a={_short(self.a)}, b={_short(self.b)}, "
            f"alpha={self.alpha}{extra})"
        )


def _check_weight(cls: str, w: Any, b_shape: tuple[int, ...]) -> None:
    """The checks the factor shapes cannot make: `w`'s dtype and a rank of at least 1.

    Like the shape check, this runs in the constructor only: pytree operations rebuild
    a `LoraWeight` around `None`, labels or statistics without calling it."""
    # An integer `w` would round the update away (`delta` casts to `w`'s dtype).
    dtype = None if _engine.is_value(w) else getattr(w, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{cls}: w has dtype {jnp.dtype(dtype).name}; LoRA needs a floating-point "
            "weight (a quantized base is a lorax.QuantizedArray).")
    if b_shape and b_shape[-1] == 0:  # the scale alpha / k would divide by zero
        raise ValueError(
            f"{cls}: the factors have rank 0 (b's last axis, got b: {b_shape}); a LoRA "
            "update needs rank >= 1 (leave a weight without one dense, or LORA_FREEZE it).")


def _shape(x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else tuple(jnp.shape(x))


def _short(x: Any) -> str:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None:
        return repr(x)
    return f"{jnp.dtype(dtype).name}{list(shape)}"


def unchecked_replace(lw: LoraWeight, **fields: Any) -> LoraWeight:
    """`lw` with some of `w`, `a`, `b` swapped for arbitrary values (None, labels, specs).

    Goes through pytree unflattening, as JAX itself does, so no shape check runs:
    for trees that mirror a LoRA tree's structure, not for computing with.
    """
    # A quantized `w` is one field: stop at it.
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        lw, is_leaf=lambda x: x is None or (x is not lw and _engine.is_value(x)))
    new = [fields.get(path[-1].name, leaf) for path, leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, new)


def _dense(w: Any) -> Any:
    """`w` as a plain array in device memory: a quantized `w` is dequantized."""
    return w.materialise() if _engine.is_value(w) else on_device(w)
