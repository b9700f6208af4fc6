"""`infer_layout`: read how a function uses each weight, to factor it along those axes.

A shape alone cannot tell a `(embed, heads, head_dim)` query kernel from a
`(heads, head_dim, embed)` output kernel or a `(layers, in, out)` stack, but the
function that uses them can: one abstract trace with probe values records, for
every weight, which axes each primitive contracts (or looks up), which it keeps,
and which are batch axes (dot batch dimensions, or leading axes that `lax.scan`
slices off). No FLOPs are spent: the trace runs under `jax.eval_shape`.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax import lax
from jax import Array
from jax.typing import ArrayLike

from . import _engine
from ._spec import as_lora_spec, check_spec_structure, path_str

# One trace's observations: tag -> list of (batch axes, first group, second group,
# what was seen), axes numbered as in the original weight.
_Obs = tuple[frozenset, frozenset, frozenset, str]
_observations: contextvars.ContextVar[dict[int, list[_Obs]] | None] = contextvars.ContextVar(
    "lorax_layout_observations", default=None
)


class _Probe(_engine.ArrayValue):
    w: Array
    tag: int = eqx.field(static=True)
    axes: tuple[int, ...] = eqx.field(static=True)  # original axis of each current axis

    def aval(self) -> jax.core.ShapedArray:
        return jax.core.ShapedArray(self.w.shape, self.w.dtype)

    def current(self) -> tuple[tuple[int, ...], frozenset]:
        # `lax.scan` slices leaves but keeps static fields: the missing leading
        # axes were scanned over, so they are batch axes.
        dropped = len(self.axes) - self.w.ndim
        return self.axes[dropped:], frozenset(self.axes[:dropped])

    def materialise(self) -> Array:
        return self.w

    @staticmethod
    def default(primitive: Any, values: Any, params: dict[str, Any]) -> Any:
        arrays = [v.w if isinstance(v, _Probe) else v for v in values]
        return primitive.bind(*arrays, **params)


def _record(p: _Probe, batch: set[int], group: set[int], what: str) -> None:
    axes, dropped = p.current()
    b = frozenset(axes[i] for i in batch) | dropped
    g = frozenset(axes[i] for i in group)
    rest = frozenset(axes) - b - g
    obs = _observations.get()
    if obs is not None:
        obs.setdefault(p.tag, []).append((b, g, rest, what))


def _dot_roles(p_is_lhs: bool, ndim: int, dimension_numbers: Any) -> tuple[set[int], set[int]]:
    (lc, rc), (lb, rb) = dimension_numbers
    contract, batch = (lc, lb) if p_is_lhs else (rc, rb)
    return set(batch), set(contract)


@_engine.register(lax.dot_general_p)
def _(lhs: _Probe, rhs: ArrayLike, *, dimension_numbers: Any, **params: Any) -> Any:
    batch, contract = _dot_roles(True, lhs.ndim, dimension_numbers)
    _record(lhs, batch, contract, "dot_general")
    return lax.dot_general_p.bind(lhs.w, rhs, dimension_numbers=dimension_numbers, **params)


@_engine.register(lax.dot_general_p)
def _(lhs: ArrayLike, rhs: _Probe, *, dimension_numbers: Any, **params: Any) -> Any:
    batch, contract = _dot_roles(False, rhs.ndim, dimension_numbers)
    _record(rhs, batch, contract, "dot_general")
    return lax.dot_general_p.bind(lhs, rhs.w, dimension_numbers=dimension_numbers, **params)


@_engine.register(lax.dot_general_p)
def _(lhs: _Probe, rhs: _Probe, *, dimension_numbers: Any, **params: Any) -> Any:
    for p, is_lhs in ((lhs, True), (rhs, False)):
        batch, contract = _dot_roles(is_lhs, p.ndim, dimension_numbers)
        _record(p, batch, contract, "dot_general")
    return lax.dot_general_p.bind(lhs.w, rhs.w, dimension_numbers=dimension_numbers, **params)


if _engine.ragged_dot_general_p is not None:
    @_engine.register(_engine.ragged_dot_general_p)
    def _(lhs: ArrayLike, rhs: _Probe, group_sizes: ArrayLike, *rest: ArrayLike,
          **params: Any) -> Any:
        # A MoE expert weight: its group axes (experts) are batch axes, one set of
        # factors per expert.
        dn = params["ragged_dot_dimension_numbers"]
        (_, rc), (_, rb) = dn.dot_dimension_numbers
        _record(rhs, {*rb, *dn.rhs_group_dimensions}, set(rc), "ragged_dot_general")
        return _engine.ragged_dot_general_p.bind(lhs, rhs.w, group_sizes, *rest, **params)


@_engine.register(lax.conv_general_dilated_p)
def _(lhs: ArrayLike, rhs: _Probe, *, dimension_numbers: Any, **params: Any) -> Any:
    out_axis = dimension_numbers.rhs_spec[0]
    _record(rhs, set(), set(range(rhs.ndim)) - {out_axis}, "conv_general_dilated")
    return lax.conv_general_dilated_p.bind(lhs, rhs.w, dimension_numbers=dimension_numbers, **params)


@_engine.register(lax.gather_p)
def _(operand: _Probe, indices: ArrayLike, *, dimension_numbers: Any, slice_sizes: Any,
      **params: Any) -> Any:
    dn = dimension_numbers
    # An index into an axis the gather takes whole (vmapped `w[i]` indexes every
    # axis, starting the columns at 0) looks nothing up there.
    shape = operand.w.shape
    looked_up = {d for d in dn.start_index_map if slice_sizes[d] != shape[d]}
    looked_up |= set(dn.collapsed_slice_dims)
    _record(operand, set(dn.operand_batching_dims), looked_up, "gather")
    return lax.gather_p.bind(operand.w, indices, dimension_numbers=dn, slice_sizes=slice_sizes, **params)


def _follow(p: _Probe, w: Array, axes: tuple[int, ...]) -> _Probe:
    return _Probe(w, tag=p.tag, axes=axes)


@_engine.register(lax.transpose_p)
def _(p: _Probe, *, permutation: Any) -> Any:
    axes, _ = p.current()
    return _follow(p, lax.transpose(p.w, permutation), tuple(axes[i] for i in permutation))


@_engine.register(lax.convert_element_type_p)
def _(p: _Probe, **params: Any) -> Any:
    return _follow(p, lax.convert_element_type_p.bind(p.w, **params), p.current()[0])


@_engine.register(lax.squeeze_p)
def _(p: _Probe, *, dimensions: Any) -> Any:
    axes, _ = p.current()
    gone = {d % len(axes) for d in dimensions}
    _record(p, gone, set(), "squeeze")  # squeezing a unit slice = picking a layer
    kept = tuple(a for i, a in enumerate(axes) if i not in gone)
    return _follow(p, lax.squeeze(p.w, tuple(dimensions)), kept)


@_engine.register(lax.dynamic_slice_p)
def _(p: _Probe, *indices: Any, slice_sizes: Any) -> Any:
    return _follow(p, lax.dynamic_slice(p.w, indices, slice_sizes), p.current()[0])


@_engine.register(lax.slice_p)
def _(p: _Probe, **params: Any) -> Any:
    return _follow(p, lax.slice_p.bind(p.w, **params), p.current()[0])


def _layout_of(obs: list[_Obs], ndim: int) -> tuple[int, tuple[int, ...], str | None] | str:
    """`(batch_ndim, m_axes, input_factor)` agreed by every use that splits the axes, or
    a reason why not.

    Axes a use picks one slice of (`w[i]`, then a dot on the slice) are batch axes: a
    stack of separately used weights (layers, or a fused gate/up pair) gets factors
    per slice. Otherwise the `M` (`b`) side is the group of lower axes when the two
    groups are contiguous (lorax 0.3's layout, `input_factor="a"` when the input
    contracts the upper group), else the contracted group: PEFT's factorisation of a
    `(heads, embed, head_dim)` query kernel, `b: (embed, k)`, `a: (k, heads, head_dim)`.
    """
    picked = frozenset().union(*(b for b, g, r, what in obs if what == "squeeze"))
    picked -= frozenset().union(*(g | r for b, g, r, what in obs if g and r))  # used whole too
    layouts = {}
    input_sides = set()
    for batch, group, rest, what in obs:
        if not group or not rest:
            continue  # e.g. squeeze: says which axes are batch, not how to split
        batch, rest = batch | picked, rest - picked
        nb = len(batch)
        if batch != frozenset(range(nb)):
            return f"{what} uses axes {sorted(batch)} as batch axes, which are not leading"
        first, second = sorted([sorted(group), sorted(rest)])
        if first == list(range(nb, nb + len(first))) and second == list(
                range(nb + len(first), ndim)):
            m, side = tuple(first), ("b" if sorted(group) == first else "a")
        else:
            m, side = tuple(sorted(group)), "b"
        layouts[(nb, m)] = what
        input_sides.add(side)
    if not layouts:
        return "it never reaches a dot_general, conv or gather"
    if len(layouts) > 1:
        return f"its uses disagree on the factorisation: {layouts}"
    nb, m = next(iter(layouts))
    # The input meets `a` first (an `(out, in)` weight used as `w @ x`) only if every use
    # says so; a table used both ways (a tied embedding) keeps the default.
    return nb, m, ("a" if input_sides == {"a"} else None)


def infer_layout(fn: Callable[..., Any], params: Any, spec: Any, *args: Any, **kwargs: Any) -> Any:
    """Fill in each LoRA spec value's factorisation from how `fn` uses the weight.

    Traces `fn(params, *args, **kwargs)` once, abstractly (no FLOPs), and returns
    `spec` with every LoRA entry turned into a [`lorax.LoraSpec`][] whose
    `batch_ndim` and `m_ndim` say how [`lorax.init_lora`][] should factor that
    weight: a Flax `DenseGeneral` query kernel `(embed, heads, head_dim)` as
    embed -> k -> heads x head_dim, an output kernel `(heads, head_dim, embed)` as
    heads x head_dim -> k -> embed, a conv kernel as window x in -> k -> out, a
    stacked `(layers, in, out)` kernel of scanned layers with per-layer factors.
    A weight whose every use contracts its trailing axes with the input (an
    `(out, in)` weight used as `w @ x`) gets `input_factor="a"` (see
    [`lorax.LoraSpec`][]). Values already given explicitly in a `LoraSpec` are kept.

    **Arguments:**

    - `fn`: the function the LoRA weights will be used in, called as
      `fn(params, *args, **kwargs)`.
    - `params`: the parameters (plain arrays or `jax.ShapeDtypeStruct`s).
    - `spec`: a spec for `params` (see [`lorax.simple_spec`][]).
    - `*args`, `**kwargs`: example inputs (arrays or `jax.ShapeDtypeStruct`s).

    **Returns:**

    The spec, with `LoraSpec` values for its LoRA entries.

    **Raises:**

    `ValueError` naming the key path of a LoRA weight whose uses don't split its
    axes into (batch, b-side, a-side) groups, or that `fn` never uses.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        def attention_out(params, h):  # h: (batch, heads, head_dim)
            return jnp.einsum("bhd,hde->be", h, params["out"])

        params = {"out": jnp.zeros((4, 16, 64))}
        spec = lorax.infer_layout(attention_out, params, {"out": 8}, jnp.zeros((2, 4, 16)))
        assert spec["out"] == lorax.LoraSpec(rank=8, batch_ndim=0, m_ndim=2)
        ```
    """
    check_spec_structure(spec, params, "infer_layout")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_engine.is_value)
    spec_leaves = treedef.flatten_up_to(spec)
    probes = []
    for tag, ((path, leaf), spec_val) in enumerate(zip(leaves, spec_leaves)):
        if as_lora_spec(spec_val) is None:
            probes.append(leaf)
        else:
            w = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            probes.append(_Probe(w, tag=tag, axes=tuple(range(len(leaf.shape)))))
    probe_tree = jax.tree_util.tree_unflatten(treedef, probes)

    obs: dict[int, list[_Obs]] = {}
    token = _observations.set(obs)
    try:
        # Uncached: a nested jit body traced before (by `lora` or another
        # `infer_layout`) would otherwise be reused without recording anything.
        with _engine.materialize_policy("allow"), _engine.trace_uncached():
            jax.eval_shape(_engine.transform(fn), probe_tree, *args, **kwargs)
    finally:
        _observations.reset(token)

    out = []
    for tag, ((path, leaf), spec_val) in enumerate(zip(leaves, spec_leaves)):
        ls = as_lora_spec(spec_val)
        if ls is None:
            out.append(spec_val)
            continue
        if ls.batch_ndim is not None and ls.m_ndim is not None and (
                ls.input_factor is not None or not ls.dora):
            out.append(ls)
            continue
        layout = _layout_of(obs.get(tag, []), len(leaf.shape))
        if isinstance(layout, str):
            raise ValueError(
                f"infer_layout: cannot factor {path_str(path)!r} (shape {tuple(leaf.shape)}): "
                f"{layout}. Give its factorisation explicitly with "
                "lorax.LoraSpec(rank, batch_ndim=..., m_ndim=...)."
            )
        nb, m, input_factor = layout
        contiguous = m == tuple(range(nb, nb + len(m)))
        known = (ls.batch_ndim in (None, nb)) and (ls.m_ndim in (None, len(m)))
        out.append(dataclasses.replace(
            ls,
            batch_ndim=nb if ls.batch_ndim is None else ls.batch_ndim,
            m_ndim=len(m) if ls.m_ndim is None else ls.m_ndim,
            input_factor=ls.input_factor or (input_factor if known else None),
            m_axes=ls.m_axes if ls.m_axes is not None or not known or contiguous else m,
        ))
    return jax.tree_util.tree_unflatten(treedef, out)
