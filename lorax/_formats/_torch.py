"""torch's view of a lorax factorisation: which side is the input, and module names.

PEFT and llama.cpp both store an adapter the way torch stores a `Linear`: the
update of a `(out, in)` weight is `lora_B @ lora_A` with `lora_A: (r, in)` and
`lora_B: (out, r)`. A lorax `LoraWeight` says nothing about which of its sides is
the input — `w + s·b@a` reads the same for a Flax `(in, out)` kernel and a torch
`(out, in)` weight — so the *layout* of the weight decides it. This module is the
one table of layouts, the conversions both ways, and the default module names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

Layout = Literal["in_out", "out_in", "embedding", "conv_in_out", "conv_out_in"]

# What each layout means, for error messages and docs.
LAYOUTS: dict[str, str] = {
    "in_out": "x @ w: input axes first (Flax/Haiku/NNX dense kernels, plain jnp)",
    "out_in": "w @ x: output axes first (torch / Equinox Linear weights)",
    "embedding": "a (num_embeddings, features) lookup table (Flax Embed, eqx Embedding)",
    "conv_in_out": "(*window, in, out) conv kernel (Flax / Haiku Conv)",
    "conv_out_in": "(out, in, *window) conv weight (torch / Equinox Conv)",
}

# Trailing key-path parts that name the array, not the module: nnx's `.value`, then
# the framework's name for the weight.
_LEAF_NAMES = ("kernel", "weight", "embedding", "embeddings", "w")


def key_parts(path: tuple[Any, ...]) -> list[str]:
    """A pytree key path as its plain parts (`DictKey('a')` -> `'a'`, index -> `'0'`)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return parts


def _strip(parts: list[str]) -> list[str]:
    parts = list(parts)
    if parts and parts[-1] == "value":
        parts.pop()
    return parts


def leaf_name(parts: list[str]) -> str:
    """The framework's name for the array (`kernel`, `weight`, ...), or `''`."""
    parts = _strip(parts)
    return parts[-1] if parts else ""


def default_module_name(parts: list[str]) -> str:
    """Key path -> torch-style module name: `params/model/q_proj/kernel` -> `model.q_proj`.

    A leading `params` collection and a trailing `value` (NNX) / `kernel` / `weight` /
    `embedding(s)` / `w` are dropped, so Hugging Face Flax trees map onto their torch
    module names.
    """
    parts = _strip(parts)
    if parts and parts[0] == "params":
        parts = parts[1:]
    if len(parts) > 1 and parts[-1] in _LEAF_NAMES:
        parts = parts[:-1]
    return ".".join(parts)


NameFn = Callable[[str, Any], str] | Mapping[str, str] | None


def as_names(value: Any) -> tuple[Any, ...]:
    """A name, or several for a weight used by several modules (a tied embedding)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def module_name_for(fn_name: str, module_name: NameFn, path: str, parts: list[str],
                    layer: Any, n_batch: int, shape: tuple[int, ...]) -> tuple[str, ...]:
    """The module name(s) of one (per-layer slice of a) weight.

    `module_name` is `None` (default names), a callable `(path, layer) -> name`, or a
    dict from key path (`'layers/q'`) to a name, where `{layer}` stands for the
    layer index of a stacked weight. A stacked weight has no default name: how its
    layers are numbered in torch's module tree cannot be known from the path. A
    tuple of names is a weight used by several torch modules (a tied embedding is
    torch's input embedding and its output layer).
    """
    if layer is not None and len(layer) == 1:
        layer = layer[0]
    if callable(module_name):
        names = as_names(module_name(path, layer))
    elif isinstance(module_name, Mapping) and path in module_name:
        names = as_names(module_name[path])
        if n_batch:
            for name in names:
                if "{layer}" not in str(name):
                    raise ValueError(
                        f"{fn_name}: {path!r} (shape {shape}) stacks {n_batch} batch axis(es) "
                        f"of per-layer weights, but its module name {name!r} has no '{{layer}}'.")
            names = tuple(name.format(layer=layer) for name in names)
    elif n_batch:
        raise ValueError(
            f"{fn_name}: {path!r} (shape {shape}) is a stack of per-layer weights; each layer "
            "is its own module, and their names cannot be known from the key path. Pass "
            "module_name={" f"{path!r}: 'model.layers.{{layer}}.<module>'" "} or a callable "
            "module_name(path, layer) -> str.")
    else:
        names = (default_module_name(parts),)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{fn_name}: module_name gave {name!r} for {path!r}; expected a "
                             "non-empty string (or a tuple of them).")
    return names


def given_layout(layout: Any, path: str, parts: list[str]) -> str | None:
    """The layout the caller gave for one weight: one string for all, a dict by key path
    (`'params/conv/kernel'`) or by default module name (`'conv'`), or a callable of the
    key path; `None` if not given."""
    if isinstance(layout, str):
        return layout
    if isinstance(layout, Mapping):
        given = layout.get(path)
        return layout.get(default_module_name(parts)) if given is None else given
    if callable(layout):
        return layout(path)
    return None


def layout_for(fn_name: str, layout: Any, path: str, parts: list[str], n_m: int,
               n_n: int, shape: tuple[int, ...]) -> str:
    """The layout of one weight: given (see `given_layout`), or known from the
    framework's name for it where that is unambiguous."""
    given = given_layout(layout, path, parts)
    if given is not None:
        if given not in LAYOUTS:
            raise ValueError(f"{fn_name}: layout {given!r} for {path!r} is not one of "
                             f"{sorted(LAYOUTS)}.")
        return given
    name = leaf_name(parts)
    if name in ("embedding", "embeddings") and n_m == 1 and n_n == 1:
        return "embedding"
    # A Flax/Haiku kernel is (in..., out...). Several M axes and one N axis could be
    # a DenseGeneral output kernel or a conv kernel: torch stores those differently.
    if name in ("kernel", "w") and not (n_m > 1 and n_n == 1):
        return "in_out"
    # A torch/Equinox weight is (out, in...); one axis each could be a Linear or
    # an Embedding, several input axes only a conv.
    if name == "weight" and n_m == 1 and n_n > 1:
        return "conv_out_in"
    choices = ", ".join(f"'{k}' ({v})" for k, v in LAYOUTS.items())
    raise ValueError(
        f"{fn_name}: cannot tell which side of {path!r} (shape {shape}, factored as "
        f"{n_m} b-side axis(es) x {n_n} a-side axis(es)) is the input. Say it with "
        f"layout={{{path!r}: ...}}, one of: {choices}.")


def check_layout(fn_name: str, where: str, layout: str, n_m: int, n_n: int,
                 shape: tuple[int, ...]) -> None:
    need = {"embedding": (n_m == 1 and n_n == 1, "one b-side and one a-side axis"),
            "conv_in_out": (n_n == 1 and n_m >= 2, "a-side = the single out axis"),
            "conv_out_in": (n_m == 1 and n_n >= 2, "b-side = the single out axis")}
    ok, what = need.get(layout, (True, ""))
    if not ok:
        raise ValueError(f"{fn_name}: {where} has layout {layout!r} but is factored as "
                         f"{n_m} b-side x {n_n} a-side axes (shape {shape}); {layout!r} "
                         f"needs {what}.")


def to_torch(layout: str, a: np.ndarray, b: np.ndarray) -> tuple[str, np.ndarray, np.ndarray]:
    """One weight's lorax factors (no batch axes) as torch's `(kind, lora_A, lora_B)`.

    `kind` is `'linear'` (`A: (r, in)`, `B: (out, r)`), `'embedding'` (`A: (r, num)`,
    `B: (dim, r)`) or `'conv'` (`A: (r, in, *window)`, `B: (out, r, 1, ...)`).
    """
    k = a.shape[0]
    if layout == "in_out":
        return "linear", b.reshape(-1, k).T, a.reshape(k, -1).T
    if layout == "out_in":
        return "linear", a.reshape(k, -1), b.reshape(-1, k)
    if layout == "embedding":
        return "embedding", b.T, a.T
    if layout == "conv_in_out":  # b: (*window, in, k), a: (k, out)
        nw = b.ndim - 2
        lora_a = np.transpose(b, (nw + 1, nw, *range(nw)))
        return "conv", lora_a, a.T.reshape(a.shape[1], k, *([1] * nw))
    if layout == "conv_out_in":  # b: (out, k), a: (k, in, *window)
        nw = a.ndim - 2
        return "conv", a, b.reshape(*b.shape, *([1] * nw))
    raise AssertionError(layout)


def fixed_split(layout: str, shape: tuple[int, ...]) -> list[int]:
    """The `m_ndim` an embedding or conv layout gives an unbatched weight `shape`."""
    if layout == "embedding":
        return [1] if len(shape) == 2 else []
    if layout == "conv_in_out":
        return [len(shape) - 1] if len(shape) >= 3 else []
    if layout == "conv_out_in":
        return [1] if len(shape) >= 3 else []
    raise AssertionError(layout)


def from_torch(layout: str, kind: str, lora_a: np.ndarray, lora_b: np.ndarray,
               shape: tuple[int, ...], m_ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's `(lora_A, lora_B)` as lorax's `(a, b)` for an unbatched weight `shape`."""
    r = lora_a.shape[0]
    m_shape, n_shape = shape[:m_ndim], shape[m_ndim:]
    if layout == "in_out":
        return lora_b.T.reshape(r, *n_shape), lora_a.T.reshape(*m_shape, r)
    if layout == "out_in":
        return lora_a.reshape(r, *n_shape), lora_b.reshape(*m_shape, r)
    if layout == "embedding":
        return lora_b.T, lora_a.T
    if layout == "conv_in_out":  # lora_A: (r, in, *window) -> b: (*window, in, r)
        nw = lora_a.ndim - 2
        b = np.transpose(lora_a, (*range(2, 2 + nw), 1, 0))
        return lora_b.reshape(lora_b.shape[0], r).T, b
    if layout == "conv_out_in":
        return lora_a, lora_b.reshape(lora_b.shape[0], r)
    raise AssertionError(layout)


def torch_shapes(kind: str, layout: str, shape: tuple[int, ...], m_ndim: int,
                 r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The `(lora_A, lora_B)` shapes torch has for an unbatched weight `shape` at rank `r`."""
    m, n = math.prod(shape[:m_ndim]), math.prod(shape[m_ndim:])
    if layout == "in_out":
        return (r, m), (n, r)
    if layout == "out_in":
        return (r, n), (m, r)
    if layout == "embedding":
        return (r, shape[0]), (shape[1], r)
    if layout == "conv_in_out":
        return (r, shape[-2], *shape[:-2]), (shape[-1], r, *([1] * (len(shape) - 2)))
    if layout == "conv_out_in":
        return (r, *shape[1:]), (shape[0], r, *([1] * (len(shape) - 2)))
    raise AssertionError(layout)


def kind_of(layout: str) -> str:
    return {"in_out": "linear", "out_in": "linear", "embedding": "embedding",
            "conv_in_out": "conv", "conv_out_in": "conv"}[layout]


def pattern_matches(pattern: str, name: str) -> bool:
    """PEFT's `get_pattern_key` rule: `pattern` (a regex) matches `name` or a dotted suffix."""
    return re.match(rf"(.*\.)?({pattern})$", name) is not None


def output_side(layout: str) -> str:
    """The lorax factor on the output side of a weight in `layout` (DoRA's magnitude side)."""
    return "a" if layout in ("in_out", "embedding", "conv_in_out") else "b"


def magnitude_to_torch(layout: str, m: np.ndarray) -> np.ndarray:
    """A DoRA magnitude (lorax's keepdims `m`, no batch axes) as PEFT's
    `lora_magnitude_vector`: `(out,)` for Linear and Embedding (`(dim,)`), `(1, out, 1, ...)`
    for Conv (PEFT keeps it broadcastable against the `(N, C, ...)` output)."""
    vec = np.ascontiguousarray(m.reshape(-1))
    if kind_of(layout) == "conv":
        return vec.reshape(1, -1, *([1] * (m.ndim - 2)))
    return vec


def magnitude_from_torch(layout: str, vec: np.ndarray, shape: tuple[int, ...],
                         m_ndim: int) -> np.ndarray | None:
    """PEFT's `lora_magnitude_vector` as lorax's keepdims `m` for an unbatched weight
    `shape` split at `m_ndim`; `None` if its shape does not fit."""
    if tuple(vec.shape) != magnitude_torch_shape(layout, shape, m_ndim):
        return None
    if output_side(layout) == "a":
        return vec.reshape(*([1] * m_ndim), *shape[m_ndim:])
    return vec.reshape(*shape[:m_ndim], *([1] * (len(shape) - m_ndim)))


def magnitude_torch_shape(layout: str, shape: tuple[int, ...], m_ndim: int) -> tuple[int, ...]:
    """The `lora_magnitude_vector` shape PEFT has for an unbatched weight `shape`."""
    out = math.prod(shape[m_ndim:] if output_side(layout) == "a" else shape[:m_ndim])
    return (1, out, *([1] * (len(shape) - 2))) if kind_of(layout) == "conv" else (out,)
