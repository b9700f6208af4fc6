"""Adapter arithmetic: several adapters over one base combined into one (PEFT's
`add_weighted_adapter`), without forming a weight-sized array.

The update of an adapter is `s·b@a`. For `combination_type`:

- `"cat"`: `b = [b_1 … b_n]`, `a = [w_1 s_1 a_1; …; w_n s_n a_n]`, so `b@a = Σ w_i s_i b_i a_i`
  exactly; the ranks add.
- `"linear"`: `b = Σ √|w_i s_i| b_i`, `a = Σ sign(w_i s_i) √|w_i s_i| a_i` (equal ranks).
  PEFT's definition: `b@a` has the cross terms `b_i a_j`, so it is *not* the weighted sum
  of the updates (use `"cat"` or `"svd"` for that).
- `"svd"`: the best rank-`r` approximation of `Σ w_i s_i b_i a_i`. PEFT forms that
  `M×N` sum and takes its SVD; here it is `B A` with `B = [b_i]` and `A = [w_i s_i a_i]`,
  so `B = Q_b R_b`, `Aᵀ = Q_a R_a` and the SVD of the small `R_b R_aᵀ` give the same
  singular vectors at `O((M + N)·R²)` cost, `R = Σ r_i`.

The result's scale is 1 (`alpha = rank`), as PEFT's is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import Array

from ._checks import check_finite, is_int
from ._spec import path_str
from ._stack import _adapter_list, _check_one_adapter, _same_base
from ._variants.dora import DoraWeight
from ._weight import LoraWeight

CombinationType = Literal["linear", "cat", "svd"]


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def _matrices(lw: LoraWeight) -> tuple[Array, Array]:
    """`(b: (*batch, M, k), a: (*batch, k, N))` with `M`, `N` flattened, in float32."""
    nb, nm, _ = lw.structure
    batch = lw.shape[:nb]
    b = lw.b.reshape(*batch, -1, lw.rank).astype(jnp.float32)
    a = lw.a.reshape(*batch, lw.rank, -1).astype(jnp.float32)
    return b, a


def _combine(where: str, lws: list[LoraWeight], weights: list[float], how: str,
             svd_rank: int | None) -> LoraWeight:
    lw0 = lws[0]
    nb = lw0.structure[0]
    # jnp, not math: a weight may be traced (mixing weights learned under jit or grad).
    ws = [w * lw.scale for w, lw in zip(weights, lws)]
    mats = [_matrices(lw) for lw in lws]
    if how == "linear":
        ranks = {lw.rank for lw in lws}
        if len(ranks) > 1:
            raise ValueError(f"add_weighted_adapter: combination_type='linear' needs equal ranks; "
                             f"{where!r} has ranks {sorted(ranks)} (use 'cat' or 'svd').")
        roots = [jnp.sqrt(jnp.abs(jnp.asarray(w, jnp.float32))) for w in ws]
        b = sum(r * bm for r, (bm, _) in zip(roots, mats))
        a = sum(jnp.sign(w) * r * am for w, r, (_, am) in zip(ws, roots, mats))
    else:
        b = jnp.concatenate([bm for bm, _ in mats], axis=-1)           # (*batch, M, R)
        a = jnp.concatenate([w * am for w, (_, am) in zip(ws, mats)], axis=-2)  # (*batch, R, N)
        if how == "svd":
            r = svd_rank if svd_rank is not None else max(lw.rank for lw in lws)
            qb, rb = jnp.linalg.qr(b)                                    # M×R', R'×R
            qa, ra = jnp.linalg.qr(jnp.swapaxes(a, -1, -2))              # N×R', R'×R
            u, s, vh = jnp.linalg.svd(rb @ jnp.swapaxes(ra, -1, -2), full_matrices=False)
            r = min(r, s.shape[-1])
            b = (qb @ u[..., :, :r]) * s[..., None, :r]
            a = jnp.swapaxes(qa @ jnp.swapaxes(vh[..., :r, :], -1, -2), -1, -2)
    k = b.shape[-1]
    dtype = lw0.a.dtype
    a = a.reshape(*lw0.a.shape[:nb], k, *lw0.a.shape[nb + 1:]).astype(dtype)
    b = b.reshape(*lw0.b.shape[:-1], k).astype(dtype)
    return LoraWeight(lw0.w, a, b, alpha=float(k), m_axes=lw0.m_axes)


def _checked_args(adapters: Any, weights: Any, combination_type: Any,
                  svd_rank: Any) -> tuple[list[Any], list[float]]:
    """The adapters as a list and the weights as floats, every argument checked."""
    who = "add_weighted_adapter"
    adapters = _adapter_list(who, adapters)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable) \
            or getattr(weights, "ndim", 1) == 0:
        raise TypeError(f"{who}: weights must be a sequence of numbers, one per adapter; "
                        f"got {weights!r}.")
    weights = [check_finite(who, f"weights[{i}]", w) for i, w in enumerate(weights)]
    if len(adapters) != len(weights):
        raise ValueError(f"{who}: {len(adapters)} adapters and {len(weights)} "
                         "weights; give one weight per adapter (at least one).")
    if combination_type not in ("linear", "cat", "svd"):
        raise ValueError(f"{who}: combination_type must be 'linear', 'cat' or "
                         f"'svd', got {combination_type!r}.")
    if svd_rank is not None and not is_int(svd_rank):
        raise TypeError(f"{who}: svd_rank must be an int or None, got {svd_rank!r}.")
    if svd_rank is not None and (combination_type != "svd" or svd_rank < 1):
        raise ValueError(f"{who}: svd_rank={svd_rank!r} needs "
                         "combination_type='svd' and a rank >= 1.")
    return adapters, weights


def add_weighted_adapter(
    adapters: Sequence[Any],
    weights: Sequence[float],
    combination_type: CombinationType = "svd",
    svd_rank: int | None = None,
) -> Any:
    """Combine adapters over one base into one, as PEFT's `add_weighted_adapter` does.

    `"cat"` gives exactly `Σ weights[i] · update_i` (the ranks add); `"svd"` its best
    rank-`svd_rank` approximation, computed from the factors (no `M×N` array is formed,
    unlike PEFT); `"linear"` PEFT's linear combination of the factors (equal ranks; it
    has cross terms, so it is not the weighted sum of the updates). A weight adapted by
    only some of the adapters combines those (the others add nothing there). The
    result has scale 1 (`alpha` = its rank) and the adapters' base.

    **Arguments:**

    - `adapters`: LoRA parameter trees over the same base (the same structure; equal
      frozen weights).
    - `weights`: one number per adapter (negative weights subtract). They may be
      traced: under `jax.jit`, or differentiated to learn how to mix the adapters.
    - `combination_type`: `"svd"` (default, as PEFT), `"cat"` or `"linear"`.
    - `svd_rank`: the rank of an `"svd"` combination (default: the largest input rank).

    **Returns:**

    The combined LoRA tree.

    **Raises:**

    `ValueError` naming the key path for adapters that do not share a base or
    factorisation, an adapter that is a stack ([`lorax.stack_adapters`][]), unequal
    ranks under `"linear"`, or a [`lorax.DoraWeight`][]; naming the argument for a
    weight that is `nan` or infinite (`TypeError`: not a number) or a bad `svd_rank`.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = {"w": jax.random.normal(jax.random.PRNGKey(0), (16, 8))}
        a1, a2 = (lorax.init_lora(params, {"w": 2}, jax.random.PRNGKey(i), stddev=1.0)
                  for i in (1, 2))
        a1, a2 = (jax.tree.map(lambda l: lorax.LoraWeight(l.w, l.a, l.b + 0.5, l.alpha)
                               if isinstance(l, lorax.LoraWeight) else l, a,
                               is_leaf=lambda l: isinstance(l, lorax.LoraWeight)) for a in (a1, a2))
        cat = lorax.add_weighted_adapter([a1, a2], [0.7, 0.3], "cat")
        update = lambda t: t["w"].materialize() - params["w"]
        assert cat["w"].rank == 4
        assert jnp.allclose(update(cat), 0.7 * update(a1) + 0.3 * update(a2), atol=1e-5)
        ```
    """
    adapters, weights = _checked_args(adapters, weights, combination_type, svd_rank)
    flats = [jax.tree_util.tree_flatten_with_path(t, is_leaf=_is_lora) for t in adapters]
    treedef = flats[0][1]
    paths0 = [path_str(p) for p, _ in flats[0][0]]
    for i, (flat, td) in enumerate(flats[1:], 1):
        if td != treedef or [path_str(p) for p, _ in flat] != paths0:
            raise ValueError(f"add_weighted_adapter: adapter {i}'s tree differs from adapter 0's "
                             "(adapters over one base have the same parameter structure).")
    out = []
    for j, where in enumerate(paths0):
        leaves = [flat[0][j][1] for flat in flats]
        lora = [(lw, w) for lw, w in zip(leaves, weights) if _is_lora(lw)]
        bases = [lw.w if _is_lora(lw) else lw for lw in leaves]
        for i, base in enumerate(bases[1:], 1):
            if not _same_base(bases[0], base):
                raise ValueError(f"add_weighted_adapter: the frozen weight of {where!r} differs "
                                 f"between adapter 0 and adapter {i}: not the same base.")
        if not lora:
            out.append(leaves[0])
            continue
        for i, lw in enumerate(leaves):
            if _is_lora(lw):  # a stack's factors would be read as batched ones
                _check_one_adapter("add_weighted_adapter", where, i, lw)
        for lw, _ in lora:
            if isinstance(lw, DoraWeight):
                raise ValueError(f"add_weighted_adapter: {where!r} is a DoraWeight; combining "
                                 "DoRA magnitudes is not defined here (merge them first).")
            if (lw.structure[:2], lw.m_axes) != (lora[0][0].structure[:2], lora[0][0].m_axes):
                raise ValueError(f"add_weighted_adapter: {where!r} is factored differently in "
                                 f"the adapters ({lw.structure} vs {lora[0][0].structure}).")
        out.append(_combine(where, [lw for lw, _ in lora], [w for _, w in lora],
                            combination_type, svd_rank))
    return jax.tree_util.tree_unflatten(treedef, out)
