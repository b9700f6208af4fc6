"""`init_lora`: turn the spec'd leaves of a parameter tree into `LoraWeight`s."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _engine
from ._checks import check_bool, check_finite
from ._spec import LoraSpec, check_spec_structure, check_weight_spec, path_str, spec_axes
from ._sharding import place_factors
from ._variants import init as _variant_init
from ._variants.dora import DoraWeight
from ._weight import LoraWeight


# One compiled program draws every factor: drawn eagerly, each distinct shape was its own
# XLA compile (seconds each on CPU for a model with a few weight shapes).
@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw_factors(rng: jax.Array, shapes: tuple, dtype: Any, stddev: Any) -> list:
    keys = jax.random.split(rng, max(1, len(shapes)))
    return [
        (jax.random.normal(key, a_shape, dtype) * jnp.asarray(stddev, dtype),
         jnp.zeros(b_shape, dtype))
        for key, (a_shape, b_shape) in zip(keys, shapes)
    ]


def _factor_shapes(shape: tuple[int, ...], ls: LoraSpec) -> tuple[tuple, tuple]:
    """`(a_shape, b_shape)` for a weight of `shape` factored as the checked `ls`."""
    batch, m, n = spec_axes(shape, ls)
    pick = lambda axes: tuple(shape[i] for i in axes)  # noqa: E731
    return (*pick(batch), ls.rank, *pick(n)), (*pick(batch), *pick(m), ls.rank)


def _warn_full_rank(leaves: list, checked: list) -> None:
    """One warning for every weight whose rank reaches min(M, N) (valid, not cheaper)."""
    full = []
    for (path, x), ls in zip(leaves, checked):
        if ls is None:
            continue
        shape = tuple(x.shape)
        _, m_axes, n_axes = spec_axes(shape, ls)
        m, n = math.prod(shape[i] for i in m_axes), math.prod(shape[i] for i in n_axes)
        if ls.rank >= min(m, n):
            full.append(f"{path_str(path)} (shape {shape}, M={m}, N={n}, rank {ls.rank})")
    if full:
        warnings.warn(
            "init_lora: rank >= min(M, N) on " + "; ".join(full) + ". This trains "
            "correctly, but the factors hold at least as many numbers as the weight: "
            "LoRA saves nothing there (consider LORA_FULL or LORA_FREEZE for it).",
            UserWarning, stacklevel=3,
        )


def init_lora(
    param_tree: Any,
    spec: Any,
    rng: jax.Array,
    stddev: float = 0.01,
    dtype: Any = jnp.float32,
    alpha: float = 1.0,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    rslora: bool = False,
    rank_axis: str | None = None,
    init: Any = "default",
    dora: bool = False,
) -> Any:
    """Replace each leaf with a LoRA spec value by a `LoraWeight` of that rank.

    `b` starts at zero and `a` at `N(0, stddev^2)`, so the model's output is
    unchanged at initialisation (lorax 0.3's convention). A weight is factored as
    `(*batch, *M, *N)` with `b: (*batch, *M, k)` and `a: (*batch, k, *N)`. By
    default there are no batch axes and `N` is the last axis, which fits `(in, out)`
    dense kernels, `(heads, head_dim, embed)` attention-output kernels and
    `(*window, in, out)` conv kernels; for anything else (a DenseGeneral query
    kernel, stacked scanned layers) run [`lorax.infer_layout`][] on the spec first,
    or give a [`lorax.LoraSpec`][] with `batch_ndim`/`m_ndim`.

    **Arguments:**

    - `param_tree`: the model's parameters.
    - `spec`: a pytree of spec values with `param_tree`'s structure (see
      [`lorax.simple_spec`][]).
    - `rng`: a `jax.random` key.
    - `stddev`: standard deviation of `a`'s initialisation.
    - `dtype`: dtype of the factors (the frozen weight keeps its own).
    - `alpha`: LoRA scaling numerator; the update is scaled by `alpha / k`. A
      `LoraSpec.alpha` overrides it per weight.
    - `is_leaf`: passed to `jax.tree_util`.
    - `rslora`: rank-stabilised LoRA: scale by `alpha / sqrt(k)` instead (stored as
      `LoraWeight.alpha = alpha * sqrt(k)`, so merging and saving need nothing else).
    - `rank_axis`: for weights sharded with a `NamedSharding`, the factors follow
      `w`'s sharding (`b` on its batch and `M` axes, `a` on its batch and `N` axes)
      and the rank axis is replicated; name a mesh axis `w` does not use here to
      shard it instead.
    - `init`: how the factors start (see docs/variants.md): `"default"` (above),
      `"gaussian"` (PEFT's: the input-side factor `N(0, 1/k^2)`, the output side
      zero), `"pissa"` / `"pissa_niter_<n>"` (the top-`k` singular directions of `w`
      go into the factors and `w` keeps the residual; `_niter_<n>` uses a randomised
      SVD with `n` power iterations), `"olora"` (the first `k` columns of `w`'s QR
      decomposition, `w` keeps the residual) or `"loftq"` / [`lorax.LoftQ`][] (a
      quantized `w` and factors that make up its quantization error). Every choice
      leaves the model's output unchanged at initialisation, up to LoftQ's
      remaining quantization error.
    - `dora`: make every LoRA weight a [`lorax.DoraWeight`][] (DoRA), with its
      magnitude initialised to the per-output-feature norms of the initial weight;
      `LoraSpec(dora=True)` does it per weight.

    **Returns:**

    `param_tree` with `LoraWeight`s in place of the LoRA'd leaves; other leaves are
    the same arrays (not copies).

    **Raises:**

    `ValueError` naming the key path for a rank that is not an integer `>= 1`, a
    rank on a vector or a non-float leaf, a spec whose tree doesn't match the params', or a
    `rank_axis` the weight's sharding already uses.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = {"w": jnp.ones((8, 4)), "bias": jnp.zeros(4)}
        lp = lorax.init_lora(params, {"w": 2, "bias": lorax.LORA_FULL}, jax.random.PRNGKey(0))
        assert lp["w"].a.shape == (2, 4) and lp["w"].b.shape == (8, 2)
        ```
    """
    check_spec_structure(spec, param_tree, "init_lora", is_leaf)
    alpha, stddev, rslora, dora = _checked_options(alpha, stddev, dtype, rslora, dora)
    # A quantized weight is one leaf (it becomes a LoraWeight's `w`).
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        param_tree, is_leaf=lambda x: _engine.is_value(x) or (is_leaf is not None and is_leaf(x)))
    spec_leaves = treedef.flatten_up_to(spec)
    checked = [check_weight_spec("init_lora", path_str(p), s, x)
               for (p, x), s in zip(leaves, spec_leaves)]
    _warn_full_rank(leaves, checked)
    method = _variant_init.parse(init)
    shapes = tuple(_factor_shapes(tuple(x.shape), c)
                   for (_, x), c in zip(leaves, checked) if c is not None
                   ) if method is None else ()
    factors = iter(_draw_factors(rng, shapes, jnp.dtype(dtype), stddev))

    out = []
    for i, ((path, param), ls) in enumerate(zip(leaves, checked)):
        if ls is None:
            out.append(param)
            continue
        a_ = alpha if ls.alpha is None else ls.alpha
        a_ = a_ * math.sqrt(ls.rank) if rslora else a_
        where = path_str(path)
        if method is None:
            a, b = next(factors)
        elif ls.m_axes is not None:
            raise ValueError(
                f"init_lora: init={init!r} at {where!r} needs the weight's M and N axes as "
                f"two contiguous groups; this one has m_axes={ls.m_axes} (shape "
                f"{tuple(param.shape)}). Use the default init for it.")
        else:
            param, a, b = _variant_init.init_factors(
                method, param, ls, a_ / ls.rank, jax.random.fold_in(rng, i), jnp.dtype(dtype),
                where)
        out.append(_lora_weight(where, param, a, b, a_, ls, rank_axis, dora or ls.dora))
    return jax.tree_util.tree_unflatten(treedef, out)


def _checked_options(alpha: Any, stddev: Any, dtype: Any, rslora: Any,
                     dora: Any) -> tuple[float, float, bool, bool]:
    """`init_lora`'s numbers and flags, each checked (a `nan` scale, a flag `"no"`)."""
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"init_lora: dtype is the factors' and must be a floating-point "
                         f"dtype; got {jnp.dtype(dtype)}.")
    return (check_finite("init_lora", "alpha", alpha), check_finite("init_lora", "stddev", stddev),
            check_bool("init_lora", "rslora", rslora), check_bool("init_lora", "dora", dora))


def _lora_weight(where: str, param: Any, a: Any, b: Any, alpha: float, ls: LoraSpec,
                 rank_axis: str | None, dora: bool) -> LoraWeight:
    """One weight's `LoraWeight` (a `DoraWeight` with `dora`), its factors placed as the
    weight's sharding and `rank_axis` say."""
    try:
        a, b = place_factors(param, a, b, ls.batch_ndim, ls.m_axes or ls.m_ndim, rank_axis)
    except ValueError as err:
        raise ValueError(f"init_lora: {where!r}: {err}") from None
    lw = LoraWeight(param, a=a, b=b, alpha=alpha, m_axes=ls.m_axes)
    return DoraWeight.from_lora(lw, input_factor=ls.input_factor or "b") if dora else lw
