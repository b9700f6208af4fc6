"""Spec values and `simple_spec`: which parameters get LoRA, which are tuned fully, which stay frozen."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

import jax
import jax.numpy as jnp
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ._checks import check_bool, check_finite, is_int
from ._engine import is_value
from ._weight import LoraWeight

LORA_FREEZE = 0
"""Spec value: keep this parameter frozen (no gradient, no optimizer state)."""
LORA_FULL = -1
"""Spec value: train this parameter fully."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A spec value with more than a rank: per-weight alpha and an explicit factorisation.

    A plain int `k > 0` in a spec means `LoraSpec(rank=k)`.

    **Arguments:**

    - `rank`: the rank `k` of the update (`> 0`).
    - `alpha`: scaling numerator for this weight; `None` uses `init_lora`'s `alpha`.
    - `batch_ndim`: how many leading axes of the weight are batch axes (stacked
      layers or experts), each with its own factors. `None`: 0, unless inferred by
      [`lorax.infer_layout`][].
    - `m_ndim`: how many axes after the batch axes belong to `b`'s side; the rest
      belong to `a`'s side. `None`: all but the last axis, unless inferred.
    - `dora`: make this weight a [`lorax.DoraWeight`][] (DoRA: a trainable magnitude
      per output feature on top of the low-rank update).
    - `input_factor`: which factor meets the layer's input first: `"b"` when the
      input contracts `b`'s (`M`) axes, as in `x @ w` with Flax/Haiku kernels,
      embeddings and `(*window, in, out)` conv kernels; `"a"` when it contracts
      `a`'s (`N`) axes, as torch/Equinox `(out, in)` weights used as `w @ x`. It
      decides the side of DoRA's magnitude, which factor LoRA+ speeds up and the
      orientation of the `"gaussian"` and `"olora"` initialisations. `None`: `"b"`,
      unless [`lorax.infer_layout`][] saw otherwise.
    - `m_axes`: the weight's axes on `b`'s side when they are not the `m_ndim` axes
      right after the batch axes (see [`lorax.LoraWeight`][]); `a` gets the other
      non-batch axes. A Gemma `(heads, embed, head_dim)` query kernel takes
      `m_axes=(1,)`: `b: (embed, k)`, `a: (k, heads, head_dim)`, PEFT's `q_proj`
      factorisation. `None`: from `m_ndim`, unless [`lorax.infer_layout`][] saw otherwise.

    !!! Example

        ```python
        import lorax

        # A stacked (layers, embed, heads, head_dim) query kernel:
        # per-layer factors, embed -> k -> heads x head_dim.
        spec_value = lorax.LoraSpec(rank=8, alpha=16.0, batch_ndim=1, m_ndim=1)
        ```
    """

    rank: int
    alpha: float | None = None
    batch_ndim: int | None = None
    m_ndim: int | None = None
    dora: bool = False
    input_factor: Literal["a", "b"] | None = None
    m_axes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # The other fields are checked where the spec meets a weight (`init_lora`), so
        # the error can name the weight's key path.
        if self.m_axes is not None:
            if not isinstance(self.m_axes, Sequence) or not all(map(is_int, self.m_axes)):
                raise ValueError(
                    f"LoraSpec.m_axes must be None or a tuple of ints, got {self.m_axes!r}.")
            object.__setattr__(self, "m_axes", tuple(int(i) for i in self.m_axes))
        if self.input_factor not in (None, "a", "b"):
            raise ValueError(
                f"LoraSpec.input_factor must be 'a', 'b' or None, got {self.input_factor!r}.")


SpecValue = Union[int, LoraSpec]


def spec_axes(shape: tuple[int, ...], ls: LoraSpec) -> tuple[tuple[int, ...], ...]:
    """`(batch, m, n)`: the axes of a weight of `shape` that `ls` puts in each group
    (absolute, increasing; `m` from `m_axes`, else the `m_ndim` axes after the batch)."""
    ndim, nb = len(shape), ls.batch_ndim or 0
    if ls.m_axes is not None:
        m = tuple(sorted(i % ndim if -ndim <= i < ndim else ndim for i in ls.m_axes))
    else:
        m = tuple(range(nb, nb + (ndim - nb - 1 if ls.m_ndim is None else ls.m_ndim)))
    return tuple(range(nb)), m, tuple(i for i in range(nb, ndim) if i not in m)


def as_lora_spec(value: Any) -> LoraSpec | None:
    """`LoraSpec` for a LoRA spec value, `None` for `LORA_FREEZE` / `LORA_FULL`."""
    if isinstance(value, LoraSpec):
        return value
    if is_int(value) and value > 0:
        return LoraSpec(int(value))
    return None


def path_str(path: tuple[Any, ...]) -> str:
    """`'key1/key2/0'`-style string for a pytree key path (lorax 0.3's format)."""
    parts = []
    for key in path:
        if isinstance(key, DictKey):
            parts.append(str(key.key))
        elif isinstance(key, SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts) or "<root>"


def _is_float_array(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _compile(pattern: Any) -> re.Pattern:
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"simple_spec: target {pattern!r} is not a regular expression ({e}).") from e


def _target_fn(
    targets: str | Sequence[str] | Mapping[str, SpecValue], rank: SpecValue | None
) -> tuple[Callable[[str, Any], SpecValue], list[str]]:
    """`(decide, matched)`: the decision function for `targets`, and the list it appends
    each path it matched to (a target matching no weight is a typo, as in PEFT)."""
    if isinstance(targets, Mapping):
        table = [(_compile(p), v) for p, v in targets.items()]
    else:
        if rank is None:
            raise ValueError("simple_spec: `targets` given as patterns needs `rank=`.")
        patterns = [targets] if isinstance(targets, str) else list(targets)
        table = [(_compile(p), rank) for p in patterns]
    for pattern, value in table:
        if not _is_spec_value(value):
            raise ValueError(
                f"simple_spec: the value for target {pattern.pattern!r} must be an int rank > "
                f"0, a LoraSpec, LORA_FULL (-1) or LORA_FREEZE (0); got {value!r}.")
    matched: list[str] = []

    def decide(path: str, arr: Any) -> SpecValue:
        for pattern, value in table:
            if pattern.search(path):
                matched.append(path)
                return value
        return LORA_FREEZE

    return decide, matched


def simple_spec(
    params: Any,
    decision_fn: Callable[[str, Any], SpecValue] | None = None,
    tune_vectors: bool = False,
    is_leaf: Callable[[Any], bool] | None = None,
    *,
    targets: str | Sequence[str] | Mapping[str, SpecValue] | None = None,
    rank: SpecValue | None = None,
) -> Any:
    """Build a LoRA spec for `params`: one spec value per leaf.

    A spec value `k > 0` (or a [`lorax.LoraSpec`][]) means "LoRA of rank k",
    `LORA_FULL` (-1) "train fully" and `LORA_FREEZE` (0) "keep frozen".

    **Arguments:**

    - `params`: the parameter pytree.
    - `decision_fn`: called as `decision_fn(path, array)` for every floating-point
      leaf with two or more axes longer than 1, where `path` is a `'key1/key2/0'`
      string; returns the spec value. Default: freeze everything.
    - `tune_vectors`: train floating-point vectors (biases, norms: leaves with at
      most one axis longer than 1, such as Haiku's `(1, 1, 1, C)` BatchNorm scale)
      fully instead of freezing them.
    - `is_leaf`: passed to `jax.tree_util`, to stop at custom nodes.
    - `targets`: PEFT-style targeting instead of `decision_fn`: a regex (or list of
      regexes) searched in each path, with `rank=` giving the value for matches; or
      a dict `{regex: spec value}` for per-pattern rank and alpha (first match wins).
    - `rank`: the spec value for `targets` given as patterns.

    **Returns:**

    A pytree of spec values with `params`' structure.

    **Raises:**

    `ValueError` when `targets` match no weight matrix (as PEFT does: a typo would
    otherwise freeze the whole model), for `rank=` without `targets=`, and for a
    `decision_fn` value that is not a spec value (naming its path).

    !!! Example

        ```python
        import jax.numpy as jnp
        import lorax

        params = {"attn": {"query": jnp.zeros((8, 8)), "key": jnp.zeros((8, 8)),
                           "value": jnp.zeros((8, 8))},
                  "norm": jnp.ones(8)}
        spec = lorax.simple_spec(params, targets=r"query|value", rank=4, tune_vectors=True)
        assert spec == {"attn": {"query": 4, "key": 0, "value": 4}, "norm": lorax.LORA_FULL}
        ```
    """
    check_bool("simple_spec", "tune_vectors", tune_vectors)
    matched, seen = None, []
    if targets is not None:
        if decision_fn is not None:
            raise ValueError("simple_spec: pass either `decision_fn` or `targets`, not both.")
        decision_fn, matched = _target_fn(targets, rank)
    elif rank is not None:
        raise ValueError("simple_spec: `rank=` is the value for `targets=`; pass both (or "
                         "a `decision_fn`).")
    elif decision_fn is None:
        def decision_fn(path: str, arr: Any) -> SpecValue:
            return LORA_FREEZE

    def leaf_spec(path: tuple[Any, ...], arr: Any) -> SpecValue:
        if not _is_float_array(arr):
            return LORA_FREEZE
        if sum(d > 1 for d in arr.shape) < 2:  # no matrix to factor, even if 4-d
            return LORA_FULL if tune_vectors else LORA_FREEZE
        seen.append(path_str(path))
        value = decision_fn(path_str(path), arr)
        if not _is_spec_value(value):
            raise ValueError(
                f"simple_spec: decision_fn returned {value!r} for {path_str(path)!r}; expected "
                "an int rank > 0, a LoraSpec, LORA_FULL (-1) or LORA_FREEZE (0).")
        return value

    spec = _spec_tree(params, leaf_spec, is_leaf)
    if matched == []:
        raise ValueError(
            f"simple_spec: targets {targets!r} matched no weight matrix; their paths look "
            f"like {seen[:5]} (each target is a regular expression searched in the path).")
    return spec


def _spec_tree(params: Any, leaf_spec: Callable, is_leaf: Callable[[Any], bool] | None) -> Any:
    # A quantized weight is one parameter, whatever its leaves.
    return jax.tree_util.tree_map_with_path(
        leaf_spec, params, is_leaf=lambda x: is_value(x) or (is_leaf is not None and is_leaf(x)))


def _is_spec_value(value: Any) -> bool:
    if isinstance(value, LoraSpec):
        return True
    return is_int(value) and value >= LORA_FULL


def _check_spec_values(spec_leaves: list, where: str) -> None:
    """Raise a `ValueError` naming the first key path (of `spec_leaves`, a spec flattened
    with its paths) whose spec value is not one.

    Every consumer reads a spec value as "LoRA", "full" or "frozen"; anything else
    (a qtype string passed where the spec goes, a float, `True`) would otherwise
    quietly read as one of them: trained by `wrap_optimizer`, left dense by `quantize`.
    """
    for path, value in spec_leaves:
        if not _is_spec_value(value):
            hint = (" (lorax.quantize takes the spec second and the qtype third)"
                    if isinstance(value, str) and where == "quantize" else "")
            raise ValueError(
                f"{where}: spec value at {path_str(path)!r} must be an int rank > 0, a "
                f"LoraSpec, LORA_FULL (-1) or LORA_FREEZE (0); got {value!r}{hint}."
            )


def check_spec_structure(spec: Any, params: Any, where: str, is_leaf: Any = None) -> None:
    """Raise a `ValueError` naming the first key path where `spec` and `params` differ,
    or whose spec value is not one (`_check_spec_values`)."""
    spec_leaves = jax.tree_util.tree_flatten_with_path(spec)[0]
    spec_paths = {path_str(p) for p, _ in spec_leaves}

    # A LoraWeight or QuantizedArray is one parameter, whatever its leaves.
    stop = lambda x: is_value(x) or (is_leaf is not None and is_leaf(x))  # noqa: E731
    param_paths = {
        path_str(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=stop)[0]
    }
    if spec_paths != param_paths:
        missing = sorted(param_paths - spec_paths)
        extra = sorted(spec_paths - param_paths)
        detail = []
        if missing:
            detail.append(f"no spec value for parameter(s) {missing[:5]}")
        if extra:
            detail.append(f"spec value(s) for {extra[:5]} match no parameter")
        raise ValueError(
            f"{where}: the spec's tree does not match the parameters': " + "; ".join(detail)
            + ". Build the spec from the same params (e.g. with lorax.simple_spec)."
        )
    skeleton = jax.tree_util.tree_map(lambda _: "·", params, is_leaf=stop)  # no arrays in `e`
    try:
        jax.tree_util.tree_structure(spec).flatten_up_to(skeleton)
    except (ValueError, TypeError) as e:  # same paths, other containers: a list for a tuple
        raise ValueError(
            f"{where}: the spec's containers do not match the parameters' ({e}). Build "
            "the spec from the same params (e.g. with lorax.simple_spec).") from e
    _check_spec_values(spec_leaves, where)


def check_lora_leaves(spec: Any, lora_params: Any, where: str) -> None:
    """Raise a `ValueError` naming the first key path where `spec` gives a LoRA rank but
    `lora_params` holds no `LoraWeight` (call after `check_spec_structure`).

    Those who split, save or optimise a tree read a rank as "its `a` and `b` train":
    given the base parameters instead (`init_lora` forgotten), the whole weight would
    be trained, or its adapter left out of a checkpoint, without a word."""
    paths = jax.tree_util.tree_flatten_with_path(spec)[0]
    leaves = jax.tree_util.tree_structure(spec).flatten_up_to(lora_params)
    for (path, value), leaf in zip(paths, leaves):
        if as_lora_spec(value) is not None and not isinstance(leaf, LoraWeight):
            raise ValueError(
                f"{where}: the spec gives {path_str(path)!r} LoRA rank {value!r}, but the "
                f"parameter there is {_what(leaf)}; pass the tree lorax.init_lora made with "
                "this spec.")


def _what(leaf: Any) -> str:
    kind = type(leaf).__name__
    if kind == "LoraDropout":
        return "a LoraDropout (lorax.dropout's tree is for one lorax.lora call)"
    if kind == "QuantizedArray":
        return "a QuantizedArray (a quantized base, not yet given its factors)"
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"an array {jnp.dtype(leaf.dtype).name}{list(leaf.shape)}"
    return f"a {kind}"


def check_weight_spec(fn: str, where: str, spec_val: Any, param: Any) -> LoraSpec | None:
    """The `LoraSpec` that `spec_val` gives the weight `param` at `where` (a key path),
    every field checked against it, or `None` for a frozen or fully trained leaf; a
    `ValueError` naming `fn` and `where` if the two do not fit."""
    ls = as_lora_spec(spec_val)  # a spec value: `check_spec_structure` checked each
    if ls is None:
        return None
    if isinstance(param, LoraWeight):  # its `w` would become a LoraWeight in a LoraWeight
        raise ValueError(
            f"{fn}: {where!r} is already a {type(param).__name__}; pass the base "
            "parameters (lorax.merge_params gives them back from a LoRA tree).")
    for name in ("batch_ndim", "m_ndim"):
        value = getattr(ls, name)
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{fn}: LoraSpec.{name} at {where!r} must be None or an "
                             f"int >= 0; got {value!r}.")
    shape = tuple(getattr(param, "shape", ()))
    dtype = getattr(param, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{fn}: {where!r} has dtype {dtype}; LoRA needs a floating-point weight."
        )
    nb = ls.batch_ndim or 0
    _, m, n = spec_axes(shape, ls)
    bad_m_axes = ls.m_axes is not None and (
        len(set(m)) != len(ls.m_axes) or not all(nb <= i < len(shape) for i in m)
        or (ls.m_ndim is not None and ls.m_ndim != len(m)))
    if bad_m_axes or len(shape) - nb < 2 or not m or not n:
        raise ValueError(
            f"{fn}: {where!r} has shape {shape}; a rank-{ls.rank} LoRA with "
            f"batch_ndim={nb}, m_ndim={ls.m_ndim}, m_axes={ls.m_axes} needs at least one "
            "axis on each side of the factorisation (m_axes: distinct axes after the "
            "batch axes, as many as m_ndim)."
        )
    if not is_int(ls.rank) or ls.rank < 1:
        raise ValueError(
            f"{fn}: rank {ls.rank!r} at {where!r} must be an integer >= 1 "
            f"(weight of shape {shape})."
        )
    alpha = None if ls.alpha is None else check_finite(fn, f"alpha at {where!r}", ls.alpha)
    check_bool(fn, f"dora at {where!r}", ls.dora)
    contiguous = m == tuple(range(nb, nb + len(m)))
    return LoraSpec(int(ls.rank), alpha, nb, len(m), ls.dora, ls.input_factor,
                    None if contiguous else m)


@dataclasses.dataclass(frozen=True)
class SpecSummary:
    """Counts from [`lorax.summary`][]; `str()` gives the one-line summary."""

    n_lora: int
    n_full: int
    n_frozen: int
    trainable: int
    total: int
    base_bytes: int = 0
    quantized: int = 0

    def __str__(self) -> str:
        pct = 100.0 * self.trainable / max(self.total, 1)
        quant = f", {self.quantized} of them quantized" if self.quantized else ""
        return (
            f"LoRA on {self.n_lora} weights, {self.n_full} trained fully, {self.n_frozen} "
            f"frozen; trainable parameters: {self.trainable:,} of {self.total:,} ({pct:.2f}%); "
            f"base weights {self.base_bytes / 2**20:,.1f} MiB{quant}"
        )


def summary(params: Any, spec: Any) -> SpecSummary:
    """Count what a spec does to a parameter tree: LoRA / full / frozen, and trainable %.

    **Arguments:**

    - `params`: the base parameters, or a LoRA tree built from them.
    - `spec`: a spec for them.

    **Returns:**

    A [`lorax.SpecSummary`][]; `print(lorax.summary(params, spec))` prints one line.
    The total counts the base model's parameters (a `LoraWeight` counts as its `w`);
    `base_bytes` is what the base weights take in memory (a quantized one counts
    its codes and scales) and `quantized` how many of them are
    [`lorax.QuantizedArray`][]s.

    !!! Example

        ```python
        import jax.numpy as jnp
        import lorax

        params = {"q": jnp.zeros((64, 64)), "norm": jnp.ones(64)}
        s = lorax.summary(params, {"q": 4, "norm": lorax.LORA_FULL})
        assert s.trainable == 4 * (64 + 64) + 64
        print(s)  # LoRA on 1 weights, 1 trained fully, 0 frozen; trainable ...
        ```
    """
    check_spec_structure(spec, params, "summary")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_value)
    n_lora = n_full = n_frozen = trainable = total = base_bytes = quantized = 0

    def weight_bytes(x: Any) -> int:
        nonlocal quantized
        if is_value(x):  # a QuantizedArray: its codes, scales and the rest
            quantized += 1
            return int(x.nbytes)
        return math.prod(getattr(x, "shape", ())) * jnp.dtype(getattr(x, "dtype", jnp.float32)).itemsize

    for (path, leaf), spec_val in zip(flat, treedef.flatten_up_to(spec)):
        if isinstance(leaf, LoraWeight):
            n_lora += 1
            trainable += sum(getattr(leaf, f).size for f in leaf.trainable_fields)
            total += leaf.w.size
            base_bytes += weight_bytes(leaf.w)
            continue
        base_bytes += weight_bytes(leaf)
        shape = tuple(getattr(leaf, "shape", ()))
        size = math.prod(shape)
        total += size
        ls = check_weight_spec("summary", path_str(path), spec_val, leaf)
        if ls is not None:
            batch, m, n = spec_axes(shape, ls)
            n_lora += 1
            trainable += math.prod(shape[i] for i in batch) * ls.rank * (
                math.prod(shape[i] for i in m) + math.prod(shape[i] for i in n)
            )
            if ls.dora:  # one magnitude per output feature
                side = m if ls.input_factor == "a" else n
                trainable += math.prod(shape[i] for i in (*batch, *side))
        elif spec_val == LORA_FULL:
            n_full += 1
            trainable += size
        else:
            n_frozen += 1
    return SpecSummary(n_lora, n_full, n_frozen, trainable, total, base_bytes, quantized)
