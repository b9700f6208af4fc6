"""A LoRA tree's factors as torch-style modules, one per weight (per layer if stacked)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import numpy as np

from .. import _engine
from .._adapter import _to_host
from .._variants.dora import DoraWeight, magnitude_side
from .._weight import LoraWeight
from . import _torch


@dataclasses.dataclass(frozen=True)
class Module:
    """One torch module's adapter: torch-oriented factors and the update's scale."""

    path: str                 # lorax key path, 'a/b/c'
    layer: tuple[int, ...] | None
    name: str                 # torch module name
    kind: str                 # 'linear' | 'embedding' | 'conv'
    lora_a: np.ndarray        # (r, in) | (r, num) | (r, in, *window)
    lora_b: np.ndarray        # (out, r) | (dim, r) | (out, r, 1, ...)
    alpha: float              # the update is (alpha / r) * lora_B @ lora_A
    magnitude: np.ndarray | None = None  # DoRA: PEFT's lora_magnitude_vector

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])


def check_dtype(fn_name: str, dtype: Any, allowed: tuple[str, ...], why: str) -> np.dtype:
    """`dtype` as a NumPy dtype if it is one of `allowed` (dtype names), else a
    `ValueError`: casting factors to an integer dtype would round them to zeros."""
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in allowed:
        raise ValueError(f"{fn_name}: dtype must be one of {', '.join(allowed)} ({why}); "
                         f"got {repr(dtype) if dt is None else dt.name}.")
    return dt


def lora_leaves(lora_params: Any) -> list[tuple[str, list[str], LoraWeight]]:
    flat = jax.tree_util.tree_flatten_with_path(lora_params, is_leaf=_engine.is_value)[0]
    out = []
    for path, leaf in flat:
        if isinstance(leaf, LoraWeight):
            parts = _torch.key_parts(path)
            out.append(("/".join(parts), parts, leaf))
    return out


def _magnitude(fn_name: str, path: str, lw: DoraWeight, lays: list[str]) -> np.ndarray:
    """A DoRA magnitude on the host, checked to be on the output side torch's layout has."""
    if len(lays) > 1:
        # Each module normalises over its own input axes (a tied lm_head over the
        # features, the embedding over the vocabulary): one m cannot be both.
        raise ValueError(
            f"{fn_name}: {path!r} is a DoraWeight used by {len(lays)} torch modules; PEFT's "
            "DoRA normalises each module over its own input axes, which one magnitude cannot "
            "express. Merge it (lorax.merge_params) or save it with lorax.save_adapter.")
    side = magnitude_side(tuple(lw.w.shape), tuple(lw.m.shape), lw.axes)
    if side != _torch.output_side(lays[0]):
        raise ValueError(
            f"{fn_name}: {path!r} is a DoraWeight with its magnitude on {side!r}'s side, but "
            f"layout {lays[0]!r} has the output on {_torch.output_side(lays[0])!r}'s side: "
            "PEFT's magnitude is per output feature. Give the layout the weight is used with, "
            "or build the DoraWeight with the matching LoraSpec(input_factor=...).")
    return np.asarray(_to_host(lw.m))


def export_modules(fn_name: str, lora_params: Any, module_name: Any, layout: Any,
                   dtype: Any = None) -> list[Module]:
    """Every `LoraWeight` in `lora_params` as torch modules (stacked weights: one per layer)."""
    modules: list[Module] = []
    seen: dict[str, str] = {}
    leaves = lora_leaves(lora_params)
    if not leaves:
        raise ValueError(f"{fn_name}: lora_params has no LoraWeight leaves: nothing to export.")
    for path, parts, lw in leaves:
        n_b, n_m, n_n = lw.structure
        # Torch's 2-D weight flattens M then N: read a non-contiguous weight in that order.
        order = (*lw.axes.batch, *lw.axes.m, *lw.axes.n)
        shape = tuple(lw.shape[d] for d in order)
        given = _torch.given_layout(layout, path, parts)
        if isinstance(given, (tuple, list)):  # one layout per module of a tied weight
            lays = list(given)
            for lay in lays:
                if lay not in _torch.LAYOUTS:
                    raise ValueError(f"{fn_name}: layout {lay!r} for {path!r} is not one of "
                                     f"{sorted(_torch.LAYOUTS)}.")
        else:
            lays = [_torch.layout_for(fn_name, layout, path, parts, n_m, n_n, shape[n_b:])]
        for lay in lays:
            _torch.check_layout(fn_name, repr(path), lay, n_m, n_n, shape)
        a, b = _to_host(lw.a), _to_host(lw.b)
        mag = _magnitude(fn_name, path, lw, lays) if isinstance(lw, DoraWeight) else None
        mag = None if mag is None else np.transpose(mag, order)
        if dtype is not None:
            a, b = a.astype(dtype), b.astype(dtype)
            mag = None if mag is None else mag.astype(dtype)
        for layer in itertools.product(*map(range, shape[:n_b])) if n_b else [None]:
            names = _torch.module_name_for(fn_name, module_name, path, parts, layer, n_b, shape)
            if len(lays) == 1:
                lays = lays * len(names)
            if len(lays) != len(names):
                raise ValueError(f"{fn_name}: {path!r} maps to {len(names)} modules {names} "
                                 f"but has {len(lays)} layouts {tuple(lays)}.")
            la, lb = (a, b) if layer is None else (a[layer], b[layer])
            for name, lay in zip(names, lays):
                if name in seen:
                    raise ValueError(f"{fn_name}: {path!r}{'' if layer is None else list(layer)} "
                                     f"and {seen[name]} both map to module {name!r}.")
                seen[name] = repr(path) + ("" if layer is None else str(list(layer)))
                kind, ta, tb = _torch.to_torch(lay, np.asarray(la), np.asarray(lb))
                tm = None
                if mag is not None:
                    tm = _torch.magnitude_to_torch(lay, mag if layer is None else mag[layer])
                modules.append(Module(path, layer, name, kind, np.ascontiguousarray(ta),
                                      np.ascontiguousarray(tb), float(lw.alpha), tm))
    return modules
