"""Many adapters over one base: stacked factors, a different adapter per example, and
adapters trained side by side.

A *stack* of `N` adapters is an ordinary LoRA tree whose `LoraWeight`s carry a leading
adapter axis on `a` and `b` only: `w` is held once. It is a batch of `N` LoRA trees in
JAX's batched-pytree convention (what `jax.vmap` of a function returning a LoRA tree
would give, with `w` left unbatched), so it goes through `jax.vmap` with
`in_axes=lorax.adapter_axes(stack)`:

- *side-by-side training*: `vmap` a training step over the adapter axis, each adapter
  with its own optimizer state, data and hyper-parameters; the base matmul of every
  adapter's batch is one matmul against the one `w`;
- *mixed batches*: `lorax.mixed_batch` puts the `N` adapters' factors side by side on
  the rank axis and gives each example a gate over it (`_variants/mixed.py`), so
  under `vmap` over the examples the base matmul and both low-rank matmuls are each
  one product for the whole batch. `select_adapters(stack, ids)` is the other way,
  a gather of each example's factors (a copy per example, then one matrix-vector
  product each: slower on every shape measured, see docs/adapters.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from . import _engine
from ._spec import path_str
from ._transform import lora
from ._variants.dora import DoraWeight
from ._variants.mixed import MixedWeight
from ._weight import LoraWeight, factor_structure


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def _same_base(x: Any, y: Any) -> bool:
    if x is y:
        return True
    lx, tx = jax.tree_util.tree_flatten(x)
    ly, ty = jax.tree_util.tree_flatten(y)
    if tx != ty:
        return False
    for u, v in zip(lx, ly):
        if u is v:
            continue
        if jnp.shape(u) != jnp.shape(v) or jnp.result_type(u) != jnp.result_type(v):
            return False
        if isinstance(u, jax.core.Tracer) or isinstance(v, jax.core.Tracer):
            continue  # traced (under jit): values unknown, shapes and dtypes checked
        if not bool(jnp.array_equal(u, v)):
            return False
    return True


def stack_adapters(adapters: Sequence[Any]) -> Any:
    """Stack `N` LoRA trees over the same base into one tree with an adapter axis.

    Every `LoraWeight` of the result has `a: (N, *a.shape)` and `b: (N, *b.shape)` and
    the one shared `w`; every other leaf is the adapters' common leaf. Ranks may differ
    (zero-padded to the largest, as Punica does: the padded directions add nothing and,
    with both factors zero, never train). So may scales (`alpha / rank`): they are then
    folded into each `b` and the stack's scale is 1 — the same functions, but for an
    optimizer a different parametrization, so adapters trained side by side should share
    one scale (they then keep it). Use the stack under `jax.vmap` with
    `in_axes=lorax.adapter_axes(stack)` (training side by side), or through
    [`lorax.select_adapters`][] / [`lorax.mixed_batch`][] (a different adapter per example).

    **Arguments:**

    - `adapters`: LoRA parameter trees ([`lorax.init_lora`][], training,
      [`lorax.load_adapter`][], [`lorax.load_peft`][]) over the same base: the same
      structure, `LoraWeight`s at the same key paths with the same factorisation,
      equal frozen weights (the same arrays, or arrays with equal values).

    **Returns:**

    The stacked tree.

    **Raises:**

    `ValueError` naming the key path where two adapters differ in structure, targets,
    factorisation or base, where an adapter is already a stack, or for a
    [`lorax.DoraWeight`][] (its magnitude is per adapter and its norm per adapter: not
    stacked yet); `TypeError` when `adapters` is not a sequence of trees (a dict is one
    adapter: wrap it as `[adapter]`).

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = {"w": jnp.ones((8, 4))}
        adapters = [lorax.init_lora(params, {"w": r}, jax.random.PRNGKey(r)) for r in (2, 4)]
        stack = lorax.stack_adapters(adapters)
        assert stack["w"].a.shape == (2, 4, 4) and stack["w"].w is params["w"]
        ```
    """
    adapters = _adapter_list("stack_adapters", adapters)
    flats, treedef = _same_structure(adapters)
    if not any(_is_lora(leaf) for _, leaf in flats[0]):  # the result would have no stack axis
        raise ValueError("stack_adapters: the adapters have no LoraWeight: nothing to stack "
                         "(pass LoRA parameter trees, from lorax.init_lora).")
    out = []
    for j, (path, leaf0) in enumerate(flats[0]):
        where = path_str(path)
        leaves = [flat[j][1] for flat in flats]
        if _is_lora(leaf0):
            _check_stackable(where, leaves)
            out.append(_stack_weights(leaves))
        else:
            _check_shared(where, leaves)
            out.append(leaf0)
    return jax.tree_util.tree_unflatten(treedef, out)


def _adapter_list(who: str, adapters: Any) -> list[Any]:
    """`adapters` as a non-empty list of adapter trees. A dict or a LoraWeight is itself
    a tree (a single adapter, or a stack), which iterating would take apart into keys or
    fields."""
    if isinstance(adapters, (Mapping, LoraWeight)) or hasattr(adapters, "shape") or not \
            isinstance(adapters, Iterable) or isinstance(adapters, (str, bytes)):
        raise TypeError(f"{who}: adapters must be a sequence (a list) of LoRA parameter "
                        f"trees, got a {type(adapters).__name__}; wrap one adapter as "
                        "[adapter].")
    adapters = list(adapters)
    if not adapters:
        raise ValueError(f"{who}: no adapters given.")
    return adapters


def _fits(lw: LoraWeight, lead: int) -> bool:
    """Whether `lw`'s factors fit its `w` after `lead` leading axes: `0`, one adapter;
    `1`, a stack (factors with one more leading axis than `w`'s own batch axes)."""
    a, b = tuple(jnp.shape(lw.a)), tuple(jnp.shape(lw.b))
    if lead and (not a or not b or a[0] != b[0]):
        return False
    if lw.w is None:  # the trainable half of lorax.partition: `w` is not there to compare
        return True
    try:
        factor_structure(tuple(lw.w.shape), a[lead:], b[lead:], lw.m_axes)
    except ValueError:
        return False
    return True


def _factor_shapes(lw: LoraWeight) -> tuple[str, str]:
    """`("a: ..., b: ...", "w: ...")` for messages."""
    w = "None" if lw.w is None else tuple(lw.w.shape)
    return f"a: {tuple(jnp.shape(lw.a))}, b: {tuple(jnp.shape(lw.b))}", f"w: {w}"


def _check_one_adapter(who: str, where: str, i: int, lw: LoraWeight) -> None:
    """A LoraWeight of adapter `i` is one adapter's, not a stack's (whose factors would
    be read with the adapter axis as a batch axis)."""
    if _fits(lw, 0):
        return
    factors, w = _factor_shapes(lw)
    what = (f"is a stack of {jnp.shape(lw.a)[0]} adapters (its factors {factors} have an "
            f"adapter axis before those of {w})" if _fits(lw, 1)
            else f"has factors {factors} that fit {w} neither as one adapter nor as a stack")
    raise ValueError(f"{who}: {where!r} in adapter {i} {what}; pass single adapters "
                     "(lorax.unstack_adapters splits a stack).")


def _adapter_count(who: str, where: str, lw: LoraWeight) -> int:
    """The size of a stacked LoraWeight's adapter axis; a plain one's leading axis is
    its rank (or a batch axis of `w`), which must not be read as adapters."""
    if _fits(lw, 1):
        return int(jnp.shape(lw.a)[0])
    factors, w = _factor_shapes(lw)
    fits = "as one adapter" if _fits(lw, 0) else "neither as one adapter nor as a stack"
    raise ValueError(f"{who}: {where!r} has no adapter axis (its factors {factors} fit {w} "
                     f"{fits}); pass a tree from lorax.stack_adapters.")


def _same_structure(adapters: list[Any]) -> tuple[list[Any], Any]:
    """Each adapter's flattened `(path, leaf)`s, checked to have adapter 0's structure
    and LoraWeights at the same key paths."""
    flat0, treedef = jax.tree_util.tree_flatten_with_path(adapters[0], is_leaf=_is_lora)
    flats = [flat0]
    for i, tree in enumerate(adapters[1:], 1):
        flat, td = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_lora)
        paths0 = [path_str(p) for p, _ in flat0]
        paths = [path_str(p) for p, _ in flat]
        diff = sorted(set(paths0) ^ set(paths))
        if td == treedef and not diff:
            diff = [f"{path_str(p)} ({type(x).__name__} vs {type(y).__name__})"
                    for (p, x), (_, y) in zip(flat0, flat) if _is_lora(x) != _is_lora(y)]
        if td != treedef or diff:
            raise ValueError(
                f"stack_adapters: adapter {i} has a different structure or different targets "
                f"than adapter 0: {diff[:5] or 'the tree structures differ'}. Stacked "
                "adapters need the same targets (init them from one spec).")
        flats.append(flat)
    return flats, treedef


def _check_shared(where: str, leaves: list[Any]) -> None:
    """A leaf that is not a LoraWeight is the same in every adapter."""
    for i, leaf in enumerate(leaves[1:], 1):
        if not _same_base(leaves[0], leaf):
            raise ValueError(f"stack_adapters: {where!r} differs between adapter 0 and "
                             f"adapter {i}; stacked adapters share everything but their "
                             "factors.")


def _check_stackable(where: str, leaves: list[LoraWeight]) -> None:
    """The adapters' LoraWeights at one key path: plain LoRA, factored alike, one base."""
    leaf0 = leaves[0]
    for i, lw in enumerate(leaves):
        _check_one_adapter("stack_adapters", where, i, lw)
        if isinstance(lw, DoraWeight):
            raise ValueError(
                f"stack_adapters: {where!r} in adapter {i} is a DoraWeight; DoRA's "
                "magnitude and norm are per adapter, which stacks do not carry yet. "
                "Merge it (lorax.merge_params) or use plain LoRA adapters.")
        if ((lw.structure[:2], lw.m_axes) != (leaf0.structure[:2], leaf0.m_axes)
                or lw.shape != leaf0.shape):
            raise ValueError(
                f"stack_adapters: {where!r} is factored differently in adapter {i} "
                f"(shape {lw.shape}, structure {lw.structure}) than in adapter 0 "
                f"(shape {leaf0.shape}, structure {leaf0.structure}).")
        if not _same_base(leaf0.w, lw.w):
            raise ValueError(f"stack_adapters: the frozen weight of {where!r} differs between "
                             f"adapter 0 and adapter {i}: not the same base.")


def _stack_weights(leaves: list[LoraWeight]) -> LoraWeight:
    """One LoraWeight with the adapters' factors stacked on a leading axis, ranks
    zero-padded to the largest; differing scales are folded into each `b`."""
    leaf0 = leaves[0]
    nb = leaf0.structure[0]
    k = max(lw.rank for lw in leaves)
    dtype = jnp.result_type(*(lw.a for lw in leaves))

    def padded(x: Array, axis: int) -> Array:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, k - x.shape[axis])
        return jnp.pad(x.astype(dtype), pad)

    a = [padded(lw.a, nb) for lw in leaves]
    scales = {lw.scale for lw in leaves}
    if len(scales) == 1:  # one scale: kept, so an optimizer sees each adapter's own factors
        scale = scales.pop()
        b = [padded(lw.b, lw.b.ndim - 1) for lw in leaves]
    else:  # the stack's scale is 1: each adapter's own scale goes into its b
        scale = 1.0
        b = [padded(lw.b * jnp.asarray(lw.scale, lw.b.dtype), lw.b.ndim - 1) for lw in leaves]
    one = LoraWeight(leaf0.w, a[0], b[0], alpha=scale * k,  # checks the factorisation
                     m_axes=leaf0.m_axes)
    return eqx.tree_at(lambda l: (l.a, l.b), one, (jnp.stack(a), jnp.stack(b)))


def _adapter_sizes(who: str, tree: Any) -> set[int]:
    """The adapter-axis sizes of `tree`'s LoraWeights, each checked to have one."""
    sizes = set()
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_lora)[0]:
        if _is_lora(x) and x.a is not None and x.b is not None:  # not a frozen half
            sizes.add(_adapter_count(who, path_str(path), x))
    return sizes


def _stacked_count(tree: Any, who: str) -> int:
    ns = _adapter_sizes(who, tree)
    if len(ns) != 1:
        got = (f"its LoraWeights have adapter axes of sizes {sorted(ns)}" if ns
               else "it has no LoraWeight")
        raise ValueError(f"{who}: expected a stack of adapters (lorax.stack_adapters); {got}.")
    return ns.pop()


def adapter_axes(stack: Any) -> Any:
    """`jax.vmap`'s `in_axes` / `out_axes` for a stack of adapters: `0` for every
    `LoraWeight`'s `a` and `b` (and its other trainable fields), `None` for `w` and every
    other leaf (the base, held once).

    **Arguments:**

    - `stack`: a tree from [`lorax.stack_adapters`][] or [`lorax.select_adapters`][], or
      either half of [`lorax.partition`][] of one.

    **Returns:**

    A tree of `0` / `None` with the structure `jax.vmap` expects as a prefix of `stack`.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = {"w": jnp.ones((8, 4))}
        stack = lorax.stack_adapters(
            [lorax.init_lora(params, {"w": 2}, jax.random.PRNGKey(i)) for i in range(3)])
        x = jnp.ones((3, 5, 8))  # one batch per adapter
        y = jax.vmap(lorax.lora(lambda p, x: x @ p["w"]),
                     in_axes=(lorax.adapter_axes(stack), 0))(stack, x)
        assert y.shape == (3, 5, 4)
        ```
    """
    def axes(x: Any) -> Any:
        if _is_lora(x):
            fields = ("w", *type(x).trainable_fields)
            values = tuple(None if (f == "w" or getattr(x, f) is None) else 0 for f in fields)
            return eqx.tree_at(lambda l: tuple(getattr(l, f) for f in fields), x, values,
                               is_leaf=lambda v: v is None)
        return None

    _adapter_sizes("adapter_axes", stack)
    return jax.tree.map(axes, stack, is_leaf=lambda x: _is_lora(x) or _engine.is_value(x))


def unstack_adapters(stack: Any) -> list[Any]:
    """The `N` LoRA trees of a stack, each with its own factors and the shared base.

    Factors keep the stack's (largest) rank, zero-padded, and its scale: each is the
    same update as the adapter that went in. Use it to save the adapters
    that [`lorax.stack_adapters`][] trained side by side ([`lorax.save_adapter`][],
    [`lorax.save_peft`][]).

    **Arguments:**

    - `stack`: a tree from [`lorax.stack_adapters`][] (after training).

    **Returns:**

    A list of `N` LoRA trees.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = {"w": jnp.ones((8, 4))}
        adapters = [lorax.init_lora(params, {"w": 2}, jax.random.PRNGKey(i)) for i in range(3)]
        back = lorax.unstack_adapters(lorax.stack_adapters(adapters))
        assert len(back) == 3 and (back[1]["w"].a == adapters[1]["w"].a).all()
        ```
    """
    n = _stacked_count(stack, "unstack_adapters")

    def take(i: int) -> Any:
        def one(x: Any) -> Any:
            if not _is_lora(x):
                return x
            fields = [f for f in type(x).trainable_fields if getattr(x, f) is not None]
            return eqx.tree_at(lambda l: tuple(getattr(l, f) for f in fields), x,
                               tuple(getattr(x, f)[i] for f in fields))
        return jax.tree.map(one, stack, is_leaf=_is_lora)

    return [take(i) for i in range(n)]


def _checked_ids(adapter_ids: Any, n: int, who: str) -> Array:
    ids = jnp.asarray(adapter_ids)
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{who}: adapter_ids must be a 1-D integer array, got "
                         f"{ids.dtype}{tuple(ids.shape)}.")
    if not isinstance(ids, jax.core.Tracer):
        bad = np.asarray(ids)[(np.asarray(ids) < -1) | (np.asarray(ids) >= n)]
        if bad.size:
            raise ValueError(f"{who}: adapter id {int(bad[0])} is out of range for "
                             f"{n} stacked adapters (ids are 0..{n - 1}, or -1 for none).")
    return ids


def select_adapters(stack: Any, adapter_ids: Any) -> Any:
    """Each example's factors: a stack indexed by `adapter_ids`, `-1` for no adapter.

    The result has one set of factors per example (`a: (batch, ...)`), zero for `-1`, and
    the shared `w`: a per-example tree (to save, inspect, or run with
    `jax.vmap(lorax.lora(fn), in_axes=(lorax.adapter_axes(sel), 0))`). Gathering costs
    `batch` copies of the factors, not of `w`, and the `vmap` then runs one
    matrix-vector product per example: to run a mixed batch, [`lorax.mixed_batch`][]
    is faster on every shape measured (it copies nothing per example).

    **Arguments:**

    - `stack`: a tree from [`lorax.stack_adapters`][].
    - `adapter_ids`: `(batch,)` integers in `[-1, N)`.

    **Returns:**

    The per-example tree.

    **Raises:**

    `ValueError` for an id outside `[-1, N)` when `adapter_ids` is concrete (under
    `jit` the ids are not known: an out-of-range id fills that example's factors with
    NaN, so its outputs are NaN rather than silently another adapter's), or naming the
    key path of a `LoraWeight` without an adapter axis (`stack` is not a stack).

    !!! Example

        See [`lorax.mixed_batch`][].
    """
    n = _stacked_count(stack, "select_adapters")
    ids = _checked_ids(adapter_ids, n, "select_adapters")
    # Row n of the extended factors is "no adapter"; an id outside [-1, n) goes past the
    # end, where the gather fills NaN.
    index = jnp.where(ids == -1, n, jnp.where((ids < -1) | (ids >= n), n + 1, ids))

    def gather(x: Array) -> Array:
        extended = jnp.concatenate([x, jnp.zeros_like(x[:1])])  # row n: no adapter
        return extended.at[index].get(mode="fill", fill_value=jnp.nan)

    def one(x: Any) -> Any:
        if not _is_lora(x):
            return x
        fields = [f for f in type(x).trainable_fields if getattr(x, f) is not None]
        return eqx.tree_at(lambda l: tuple(getattr(l, f) for f in fields), x,
                           tuple(gather(getattr(x, f)) for f in fields))

    return jax.tree.map(one, stack, is_leaf=_is_lora)


def mixed_batch(fn: Callable[..., Any], *, in_axes: Any = 0, out_axes: Any = 0,
                **lora_kwargs: Any) -> Callable[..., Any]:
    """`fn` over a batch in which each example uses its own adapter (or none).

    Returns `g(stack, adapter_ids, *args)`: [`lorax.lora`][]`(fn)` vmapped over the
    examples, example `i` seeing the adapter `adapter_ids[i]` of `stack` (`-1`: the base
    model). Every example's output equals running it alone with its adapter.

    Nothing is copied per example: the `N` adapters' factors are put side by side on
    the rank axis (`b: (..., M, N*k)`, `a: (..., N*k, N)`, once per call) and each
    example gets a gate over that axis, one on its adapter's `k` directions and zero
    elsewhere. Under `vmap` the base matmul and both low-rank matmuls are then each
    one product for the whole batch, and the gate an elementwise product on the
    rank-`N*k` intermediate: the low-rank work is `N` times one adapter's, in
    matrix products that read each factor once (cheap while `N*k` is small against
    the layer's width; see docs/adapters.md for the measured costs).
    [`lorax.select_adapters`][] is the per-example gather instead. Gradients reach
    the stack's factors (each example's only through its own adapter's), so a batch
    can also train several adapters at once.

    `fn` sees one example: `in_axes` says where the example axis of each of `args` is,
    as in `jax.vmap` (a model that wants a batch axis can be given `x[:, None]`).

    **Arguments:**

    - `fn`: the model function, `fn(params, *args)`.
    - `in_axes`, `out_axes`: `jax.vmap`'s, for `args` and the output.
    - `lora_kwargs`: passed to [`lorax.lora`][] (`on_materialize=...`).

    The returned function takes `stack` (from [`lorax.stack_adapters`][]),
    `adapter_ids` (`(batch,)` integers in `[-1, N)`) and `fn`'s other arguments.
    An id out of range is a `ValueError` when the ids are concrete; under `jit` that
    example's output is NaN.

    **Returns:**

    The batched function.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 4))}
        adapters = [lorax.init_lora(params, {"w": 2}, jax.random.PRNGKey(i), stddev=1.0)
                    for i in range(3)]
        adapters = [jax.tree.map(lambda l: lorax.LoraWeight(l.w, l.a, l.b + 1.0, l.alpha)
                                 if isinstance(l, lorax.LoraWeight) else l, a,
                                 is_leaf=lambda l: isinstance(l, lorax.LoraWeight))
                    for a in adapters]
        stack = lorax.stack_adapters(adapters)
        x = jnp.ones((4, 8))
        ids = jnp.array([2, 0, -1, 2])
        y = lorax.mixed_batch(lambda p, x: x @ p["w"])(stack, ids, x)
        alone = lorax.lora(lambda p, x: x @ p["w"])(adapters[0], x[1])
        assert jnp.allclose(y[1], alone, atol=1e-5)
        assert jnp.allclose(y[2], x[2] @ params["w"], atol=1e-5)  # -1: the base model
        ```
    """
    lfn = lora(fn, **lora_kwargs)

    def wrapped(stack: Any, adapter_ids: Any, *args: Any) -> Any:
        n = _stacked_count(stack, "mixed_batch")
        ids = _checked_ids(adapter_ids, n, "mixed_batch")
        choice = (ids[:, None] == jnp.arange(n)).astype(jnp.float32)  # (batch, n); -1: all 0
        bad = (ids < -1) | (ids >= n)
        choice = jnp.where(bad[:, None], jnp.nan, choice)  # out of range under jit: NaN
        params = jax.tree.map(lambda x: _side_by_side(x, choice) if _is_lora(x) else x,
                              stack, is_leaf=_is_lora)

        def axes(x: Any) -> Any:
            if isinstance(x, MixedWeight):
                none = jax.tree.map(lambda _: None, x.weight)
                return MixedWeight(none, 0)
            return None

        param_axes = jax.tree.map(axes, params, is_leaf=lambda x: isinstance(x, MixedWeight))
        arg_axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        return jax.vmap(lfn, in_axes=(param_axes, *arg_axes), out_axes=out_axes)(params, *args)

    return wrapped


def _side_by_side(lw: LoraWeight, choice: Array) -> MixedWeight:
    """A stacked `LoraWeight` (`a: (n, *batch, k, ...)`) as one weight of rank `n*k` with
    a gate per example (`choice: (examples, n)`, one-hot)."""
    n = lw.a.shape[0]
    nb = factor_structure(lw.w.shape, lw.a.shape[1:], lw.b.shape[1:], lw.m_axes)[0]
    k = lw.a.shape[nb + 1]
    batch = lw.a.shape[1 : nb + 1]
    a = jnp.moveaxis(lw.a, 0, nb)
    a = a.reshape(*batch, n * k, *a.shape[nb + 2 :])
    b = jnp.moveaxis(lw.b, 0, -2)
    b = b.reshape(*b.shape[:-2], n * k)
    one = LoraWeight(lw.w, a, b, alpha=lw.scale * n * k, m_axes=lw.m_axes)
    gate = jnp.repeat(choice, k, axis=1).astype(jnp.result_type(lw.a))     # (examples, n*k)
    gate = jnp.broadcast_to(gate.reshape(gate.shape[0], *(1,) * nb, n * k),
                            (gate.shape[0], *batch, n * k))
    return MixedWeight(one, gate)
