"""PEFT's LoRA adapter format: `adapter_config.json` + `adapter_model.safetensors`.

What PEFT writes for `LoraConfig` modules (peft/tuners/lora/layer.py), keyed
`base_model.model.<module>.<tensor>`:

| torch module | tensors | update of the base weight |
|---|---|---|
| `Linear` `(out, in)` | `lora_A.weight (r, in)`, `lora_B.weight (out, r)` | `s · B @ A` |
| `Embedding` `(num, dim)` | `lora_embedding_A (r, num)`, `lora_embedding_B (dim, r)` | `s · (B @ A).T` |
| `Conv` `(out, in, *window)` | `lora_A.weight (r, in, *window)`, `lora_B.weight (out, r, 1, ...)` | `s · B ⋆ A` |

with `s = lora_alpha / r`, or `lora_alpha / sqrt(r)` under `use_rslora`, per module
through `rank_pattern` / `alpha_pattern` (regexes matched against the module name or
a dotted suffix of it, first match wins).
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _engine
from .._adapter import _array_sharding, _read_safetensors, _write_safetensors
from .._files import checked, field, read_json
from .._sharding import factor_shardings, place_host_array
from .._spec import LORA_FREEZE, LoraSpec
from .._variants.dora import DoraWeight
from .._weight import LoraWeight
from . import _torch
from ._export import Module, check_dtype, export_modules

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# What save_peft may cast factors to: safetensors' floating dtypes (an integer one would
# round the factors to zeros).
_DTYPES = ("float32", "float16", "bfloat16", "float64")
_BASE_LAYER = ".base_layer.weight"
_SUFFIXES = {
    ".lora_A.weight": ("A", None), ".lora_B.weight": ("B", None),
    ".lora_embedding_A": ("A", "embedding"), ".lora_embedding_B": ("B", "embedding"),
}
# Tensors PEFT writes for features lorax does not read, and what they are.
# PEFT's state dict drops the adapter name and the DoRA layer's ".weight" from this key.
_MAGNITUDE = ".lora_magnitude_vector"
_UNREAD_TENSORS = {
    ".lora_B.bias": "a bias on lora_B (lora_bias)",
    ".lora_embedding_B.bias": "a bias on lora_B (lora_bias)",
}
# Config entries that change what an adapter means, and lorax's word for each.
_UNREAD_CONFIG = {
    "lora_bias": "a trainable bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "target_parameters": "adapters on bare parameters (target_parameters)",
    "trainable_token_indices": "trainable token rows (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}
# Initialisations that change the base weights: such an adapter is relative to
# a modified base unless PEFT converted it when saving.
_BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda", "eva")


def _most_common(values: list[Any]) -> Any:
    return collections.Counter(values).most_common(1)[0][0]


def _pattern_key(name: str, names: list[str]) -> str:
    """A PEFT pattern that matches `name` and no other module of the adapter."""
    for key in (name, re.escape(name), "^" + re.escape(name)):
        if [n for n in names if _torch.pattern_matches(key, n)] == [name]:
            return key
    raise AssertionError(name)  # "^" + escaped always matches exactly itself


def save_peft(
    directory: str | os.PathLike,
    lora_params: Any,
    *,
    base_model_name_or_path: str | None = None,
    module_name: Any = None,
    layout: Any = None,
    task_type: str | None = None,
    dtype: Any = None,
) -> None:
    """Write the `LoraWeight`s of `lora_params` as a PEFT LoRA adapter.

    Writes `adapter_config.json` and `adapter_model.safetensors` into `directory`
    exactly as PEFT's `save_pretrained` does, so `peft.PeftModel.from_pretrained`,
    transformers, vLLM and the other PEFT consumers load it. Each `LoraWeight`
    becomes a torch module (a stacked `(layers, ...)` weight, one per layer):
    dense weights as `Linear` (multi-axis kernels flattened to torch's 2-D
    `(out, in)`), lookup tables as `Embedding`, conv kernels as `Conv`. The update
    is kept exactly: PEFT's `lora_alpha` for a module is the `LoraWeight`'s `alpha`
    (its scale is `alpha / r` in both), mixed ranks and alphas go to
    `rank_pattern` / `alpha_pattern`. [`lorax.DoraWeight`][]s are PEFT's DoRA
    (`use_dora`, the magnitude as `lora_magnitude_vector`; PEFT applies DoRA to every
    module of an adapter, so all weights must be DoRA or none). Fully trained (`LORA_FULL`) leaves are not part
    of a PEFT LoRA adapter; [`lorax.save_adapter`][] keeps them.

    The config's `target_modules` is the shortest list that selects exactly the adapted
    modules under PEFT's rule (an entry selects a module named by it or ending in
    `"." + entry`): each module's shortest dotted suffix that no other known module
    ends with, so every layer's `q_proj` is `"q_proj"` and a layer left out brings in
    `"1.self_attn.q_proj"`-style suffixes or full names only where needed. The known
    modules are the other leaves of `lora_params` (named by `module_name`, or by
    default; a `{layer}` template once per layer) and the modules containing any
    module (`model.layers.0` holds `model.layers.0.mlp.up_proj`): pass the whole
    parameter tree, since a module save_peft is not shown cannot be left out. A module
    that no list can single out (`mlp` beside `layers.0.mlp`) makes `target_modules`
    a regex of the full names. The factors themselves are keyed by full module name,
    which is what [`lorax.load_peft`][] reads.

    Sharded factors are gathered to the host; with several processes every
    process calls `save_peft` and process 0 writes.

    **Arguments:**

    - `directory`: where to write (created if missing).
    - `lora_params`: a LoRA parameter tree ([`lorax.init_lora`][] and training).
    - `base_model_name_or_path`: the base model's Hub id or path, recorded in the config.
    - `module_name`: torch module names. `None`: the key path joined with `.`, without
      a leading `params` and a trailing `value` / `kernel` / `weight` / `embedding(s)`
      / `w` (a Hugging Face Flax tree maps onto its torch names). A dict from key path
      (`'layers/q'`) to name, with `{layer}` for a stacked weight's layer index
      (`'model.layers.{layer}.self_attn.q_proj'`), or a callable `(path, layer) -> name`
      (`layer` is `None` for an unstacked weight). A stacked weight needs one of these.
      A tuple of names is a weight several torch modules use, each getting the same
      update: a tied embedding is `('model.embed_tokens', 'lm_head')`, with the layouts
      `('embedding', 'out_in')`.
    - `layout`: which side of each weight is the input: `'in_out'` (`x @ w`, Flax/Haiku
      kernels), `'out_in'` (torch/Equinox `Linear`), `'embedding'`, `'conv_in_out'`
      (Flax/Haiku conv), `'conv_out_in'` (torch/Equinox conv). One string for all, a
      dict by key path (`'params/conv/kernel'`) or by default module name (`'conv'`),
      or a callable `path -> layout | None` (a tuple, one per module, for a weight
      with several module names). `None`: known from the
      weight's name where it is unambiguous (`kernel` / `w` of a dense layer,
      `embedding`, a torch-style conv `weight`); otherwise a `ValueError` asks for it.
    - `task_type`: PEFT's `task_type`: `'CAUSAL_LM'` for a language model served with
      transformers' `generate` / vLLM, `'SEQ_CLS'`, ...; `None` (a plain `PeftModel`,
      for any torch module).
    - `dtype`: cast the factors to this dtype: `float32`, `float16`, `bfloat16` or
      `float64` (default: keep theirs).

    **Returns:**

    Nothing.

    **Raises:**

    `ValueError` naming the key path when a weight's layout or module name cannot be
    known, or two weights map to one module; naming the argument for a `dtype` not
    listed above or a `directory` that is a file.

    !!! Example

        ```python
        import json, tempfile, jax, jax.numpy as jnp
        import lorax

        params = {"model": {"q_proj": {"kernel": jnp.ones((16, 8))}}}  # Flax (in, out)
        lp = lorax.init_lora(params, {"model": {"q_proj": {"kernel": 4}}}, jax.random.PRNGKey(0))
        with tempfile.TemporaryDirectory() as d:
            lorax.save_peft(d, lp)
            config = json.load(open(f"{d}/adapter_config.json"))
            loaded, spec = lorax.load_peft(d, params)
        assert config["target_modules"] == ["q_proj"] and config["r"] == 4
        assert (loaded["model"]["q_proj"]["kernel"].a == lp["model"]["q_proj"]["kernel"].a).all()
        ```
    """
    if dtype is not None:
        dtype = check_dtype("save_peft", dtype, _DTYPES,
                            "floating point; None keeps the factors' own")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"save_peft: {os.fspath(directory)!r} is a file; a PEFT adapter is a "
                         f"directory ({CONFIG_NAME} + {WEIGHTS_NAME}): give a directory path.")
    modules = export_modules("save_peft", lora_params, module_name, layout, dtype)
    _check_all_or_no_dora(modules)
    others = _known_modules(lora_params, module_name, [m.name for m in modules])
    config = _peft_config(modules, others, base_model_name_or_path, task_type)
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        _write_safetensors(os.path.join(directory, WEIGHTS_NAME), _peft_tensors(modules),
                           {"format": "pt"})


def _check_all_or_no_dora(modules: list[Module]) -> None:
    names = [m.name for m in modules]
    dora = [m.name for m in modules if m.magnitude is not None]
    if dora and len(dora) != len(modules):
        plain = sorted(set(names) - set(dora))
        raise ValueError(
            f"save_peft: modules {sorted(dora)[:3]} are DoRA weights and {plain[:3]} are not; "
            "PEFT's use_dora applies to every module of an adapter. Make them all DoRA or none "
            "(LoraSpec(dora=...)), or save the two groups as two adapters.")


def _peft_tensors(modules: list[Module]) -> dict[str, np.ndarray]:
    """PEFT's state dict of the modules, sorted so the file's bytes do not depend on the
    parameter tree's order."""
    tensors: dict[str, np.ndarray] = {}
    for m in modules:
        if m.kind == "embedding":
            tensors[f"{_PREFIX}{m.name}.lora_embedding_A"] = m.lora_a
            tensors[f"{_PREFIX}{m.name}.lora_embedding_B"] = m.lora_b
        else:
            tensors[f"{_PREFIX}{m.name}.lora_A.weight"] = m.lora_a
            tensors[f"{_PREFIX}{m.name}.lora_B.weight"] = m.lora_b
        if m.magnitude is not None:
            tensors[f"{_PREFIX}{m.name}{_MAGNITUDE}"] = m.magnitude
    return dict(sorted(tensors.items()))


def _number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else float(x)


def _peft_config(modules: list[Module], others: set[str], base_model_name_or_path: str | None,
                 task_type: str | None) -> dict[str, Any]:
    """PEFT's `adapter_config.json`: the most common rank and alpha, the others by pattern."""
    names = [m.name for m in modules]
    r = _most_common([m.rank for m in modules])
    alpha = _most_common([m.alpha for m in modules])
    rank_pattern = {_pattern_key(m.name, names): m.rank for m in modules if m.rank != r}
    alpha_pattern = {_pattern_key(m.name, names): m.alpha for m in modules if m.alpha != alpha}
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": _number(alpha),
        "target_modules": _target_modules(names, others),
        "rank_pattern": rank_pattern,
        "alpha_pattern": {k: _number(v) for k, v in alpha_pattern.items()},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": any(m.magnitude is not None for m in modules),
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }


def _suffixes(name: str) -> list[str]:
    """A module name's dotted suffixes, shortest first: what PEFT's list entries match."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts) - 1, -1, -1)]


def _target_modules(names: list[str], others: set[str]) -> list[str] | str:
    """The shortest `target_modules` that selects exactly `names` among `names` and
    `others` under PEFT's rule for a list (a module is selected when its name equals an
    entry or ends with `"." + entry`, i.e. when the entry is a dotted suffix of it):
    each name's shortest suffix that is no other module's suffix. No list selects
    `names` with fewer entries (the safe suffixes of a name form a chain, the shortest
    selecting the most), and none of them is redundant. A name that is itself another
    module's suffix (`mlp` beside `layers.0.mlp`) cannot be singled out by a list: then
    a regex of the full names, which PEFT matches against the whole name."""
    blocked = {suffix for other in others for suffix in _suffixes(other)}
    if any(name in blocked for name in names):
        return "|".join(re.escape(name) for name in sorted(names))
    return sorted({next(s for s in _suffixes(name) if s not in blocked) for name in names})


def _known_modules(lora_params: Any, module_name: Any, names: list[str]) -> set[str]:
    """Every torch module save_peft can name besides the adapted `names`: the other
    leaves of `lora_params` (by `module_name` where it names them, else by default name;
    a stacked weight once per layer) and the modules that contain any of them (each
    dotted prefix: torch's `model.layers.0` holds `model.layers.0.mlp.up_proj`)."""
    leaves = jax.tree_util.tree_flatten_with_path(lora_params, is_leaf=_engine.is_value)[0]
    frozen = set()
    for path, leaf in leaves:
        if not isinstance(leaf, LoraWeight) and hasattr(leaf, "shape"):
            frozen |= _frozen_names(module_name, _torch.key_parts(path), tuple(leaf.shape))
    containers = {name[:i] for name in (*names, *frozen) for i, c in enumerate(name) if c == "."}
    return (frozen | containers) - set(names)


def _frozen_names(module_name: Any, parts: list[str], shape: tuple[int, ...]) -> set[str]:
    """The module name(s) of a weight that carries no LoRA, as far as they can be known:
    a `{layer}` template once per layer; a callable is asked with `layer=None` (one written
    for the adapted weights only may fail: then the default name)."""
    path = "/".join(parts)
    try:
        names = _torch.module_name_for("save_peft", module_name, path, parts, None, 0, shape)
    except Exception:  # noqa: BLE001
        names = (_torch.default_module_name(parts),)
    out = set()
    for name in map(str, names):
        if "{layer}" in name:
            out.update(name.replace("{layer}", str(i)) for i in range(shape[0] if shape else 1))
        else:
            out.add(name)
    return out


def _read_config(directory: str) -> dict[str, Any]:
    if os.path.isfile(directory):
        hint = (f" (pass {os.path.dirname(directory) or '.'!r}, the directory it is in)"
                if os.path.basename(directory) in (CONFIG_NAME, WEIGHTS_NAME) else "")
        raise ValueError(f"load_peft: {directory!r} is a file; a PEFT adapter is a directory "
                         f"holding {CONFIG_NAME} and {WEIGHTS_NAME}{hint}.")
    path = os.path.join(directory, CONFIG_NAME)
    try:
        config = read_json(path, "load_peft")
    except FileNotFoundError:
        raise ValueError(f"load_peft: {path!r} does not exist; expected a PEFT adapter "
                         f"directory ({CONFIG_NAME} + {WEIGHTS_NAME}).") from None
    _check_config(config, path)
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise ValueError(f"load_peft: {path!r} has peft_type {config.get('peft_type')!r}; "
                         "lorax reads LoRA adapters (peft_type 'LORA').")
    for key, what in _UNREAD_CONFIG.items():
        if config.get(key):
            raise ValueError(f"load_peft: the adapter uses {what}, which lorax does not read "
                             f"({key} = {config[key]!r} in {path!r}).")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(
            f"load_peft: the adapter was initialised with {init!r}, which changes the base "
            "weights: it fits the modified base, not the original one. Save it from PEFT with "
            "path_initial_model_for_weight_conversion= to get an adapter for the original base.")
    return config


# Fields lorax reads that may be `null` (PEFT's default then), and their kinds.
_NULLABLE_FIELDS = (("use_rslora", "bool"), ("use_dora", "bool"), ("rank_pattern", "dict"),
                    ("alpha_pattern", "dict"), ("peft_type", "str"))
# The numbers a LoraConfig carries: absent is PEFT's default, but `null`, `true`, a string
# or a container is an error (PEFT's own would come later, from torch). An alpha may be
# negative or zero (it scales the update; lorax's LoraWeight allows both, save_peft writes
# them); a rank is a whole number >= 1; dropout is a probability below 1.
_NUMBER_FIELDS = (("r", "pos_int"), ("lora_alpha", "number"), ("lora_dropout", "dropout"))
_PATTERN_FIELDS = (("rank_pattern", "pos_int"), ("alpha_pattern", "number"))


def _check_config(config: Any, path: str) -> None:
    """The types of every field lorax reads and every number PEFT's config carries (a
    downloaded config may say anything), each error naming the file and the field."""
    who, where = "load_peft", repr(path)
    for key, kind in _NULLABLE_FIELDS:
        field(config, key, kind, who, where, default=None)
    for key, kind in _NUMBER_FIELDS:
        if key in config:
            checked(config[key], kind, who, f"{where}: {key}")
    for key, kind in _PATTERN_FIELDS:
        for name, value in (config.get(key) or {}).items():
            checked(value, kind, who, f"{where}: {key}[{name!r}]")


def _read_modules(directory: str) -> dict[str, dict[str, Any]]:
    tensors, _ = _read_safetensors(os.path.join(directory, WEIGHTS_NAME), "load_peft")
    modules: dict[str, dict[str, Any]] = {}
    for key, arr in tensors.items():
        if key.startswith(_PREFIX) and key.endswith((_MAGNITUDE, _MAGNITUDE + ".weight")):
            name = key[len(_PREFIX):key.rindex(_MAGNITUDE)]
            modules.setdefault(name, {})["M"] = arr
            continue
        for suffix, what in _UNREAD_TENSORS.items():
            if key.endswith(suffix):
                module = key[len(_PREFIX):-len(suffix)] if key.startswith(_PREFIX) else key
                raise ValueError(f"load_peft: module {module!r} has {what} ({key!r}), which "
                                 "lorax does not read.")
        if key.startswith(_PREFIX) and key.endswith(_BASE_LAYER):
            # PEFT's save_embedding_layers: the base weight itself, saved alongside.
            modules.setdefault(key[len(_PREFIX):-len(_BASE_LAYER)], {})["base"] = arr
            continue
        for suffix, (side, kind) in _SUFFIXES.items():
            if key.startswith(_PREFIX) and key.endswith(suffix):
                name = key[len(_PREFIX):-len(suffix)]
                entry = modules.setdefault(name, {})
                entry[side] = arr
                entry["kind"] = kind or ("linear" if arr.ndim == 2 else "conv")
                break
        else:
            raise ValueError(
                f"load_peft: tensor {key!r} is not a LoRA factor lorax reads: expected "
                f"'{_PREFIX}<module>' + one of {sorted(_SUFFIXES)}.")
    for name, entry in modules.items():
        if "A" not in entry and "B" not in entry:
            what = (f"a base weight ({_PREFIX}{name}{_BASE_LAYER})" if "base" in entry
                    else f"a DoRA magnitude ({_PREFIX}{name}{_MAGNITUDE})")
            raise ValueError(f"load_peft: module {name!r} has {what} but no LoRA factors.")
        if "A" not in entry or "B" not in entry:
            missing = "lora_B" if "A" in entry else "lora_A"
            raise ValueError(f"load_peft: module {name!r} has no {missing} tensor.")
        for side in ("A", "B"):
            arr = entry[side]
            if arr.ndim < 2 or not (np.issubdtype(arr.dtype, np.floating)
                                    or arr.dtype.name == "bfloat16") or 0 in arr.shape:
                raise ValueError(f"load_peft: module {name!r}: lora_{side} has shape "
                                 f"{arr.shape} and dtype {arr.dtype}; expected a non-empty "
                                 "floating-point matrix (or conv kernel).")
        if entry["A"].shape[0] != entry["B"].shape[1]:
            raise ValueError(f"load_peft: module {name!r}: lora_A {entry['A'].shape} and lora_B "
                             f"{entry['B'].shape} have different ranks.")
    return modules


def _scale_of(config: dict[str, Any], name: str, r: int) -> float:
    alpha_pattern = config.get("alpha_pattern") or {}
    key = next((k for k in alpha_pattern if _torch.pattern_matches(k, name)), None)
    alpha = float(alpha_pattern[key] if key is not None else config.get("lora_alpha", 8))
    return alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _expected_rank(config: dict[str, Any], name: str) -> int | None:
    rank_pattern = config.get("rank_pattern") or {}
    key = next((k for k in rank_pattern if _torch.pattern_matches(k, name)), None)
    r = rank_pattern[key] if key is not None else config.get("r")
    return None if r is None else int(r)


def _load_layout(given: str | None, path: str, parts: list[str], kind: str, name: str) -> str:
    """The layout of a base weight that a `kind` torch module adapts (`given`, or
    known from the module kind and the weight's name)."""
    leaf = _torch.leaf_name(parts)
    if given is None:
        if kind == "embedding":
            given = "embedding"
        elif leaf in ("kernel", "w"):
            given = "in_out" if kind == "linear" else "conv_in_out"
        elif leaf == "weight":
            given = "out_in" if kind == "linear" else "conv_out_in"
        else:
            raise ValueError(
                f"load_peft: module {name!r} ({kind}) maps to {path!r}, whose layout cannot be "
                "known from its name; say it with layout={" f"{path!r}: ..." "}, one of "
                f"{sorted(_torch.LAYOUTS)}.")
    if given not in _torch.LAYOUTS:
        raise ValueError(f"load_peft: layout {given!r} for {path!r} is not one of "
                         f"{sorted(_torch.LAYOUTS)}.")
    if _torch.kind_of(given) != kind:
        raise ValueError(f"load_peft: module {name!r} is a {kind} adapter but {path!r} has "
                         f"layout {given!r} ({_torch.kind_of(given)}).")
    return given


def _groups(module_name: Any, path: str, parts: list[str], shape: tuple[int, ...],
            modules: dict[str, Any]) -> tuple[list[tuple[str, ...]] | None, bool]:
    """`(groups, stacked)`: the module names of a weight (one group, or one per layer of a
    stacked weight; a group has several names for a weight several modules use), or
    `(None, False)` when the adapter has nothing for it."""
    def has(group: tuple[str, ...]) -> bool:
        return any(n in modules for n in group)

    if callable(module_name):
        group = _torch.as_names(module_name(path, None))
        if has(group):
            return [group], False
        if len(shape) >= 3:
            groups = [_torch.as_names(module_name(path, i)) for i in range(shape[0])]
            if any(map(has, groups)):
                return groups, True
        return None, False
    if isinstance(module_name, dict) and path in module_name:
        templates = _torch.as_names(module_name[path])
        if any("{layer}" in t for t in templates):
            groups = [tuple(t.format(layer=i) for t in templates) for i in range(shape[0])]
            return (groups, True) if any(map(has, groups)) else (None, False)
        return ([templates], False) if has(templates) else (None, False)
    name = _torch.default_module_name(parts)
    return ([(name,)], False) if name in modules else (None, False)


def _same_update(x: tuple[np.ndarray, np.ndarray, float], y: tuple[np.ndarray, np.ndarray, float],
                 m: int) -> bool:
    """Whether `s·b@a` is the same for two factorisations, probed with a few random
    vectors (never forming the update)."""
    (a1, b1, s1), (a2, b2, s2) = x, y
    n_shape = a1.shape[1:]
    probe = np.random.default_rng(0).standard_normal((*n_shape, 4)).astype(np.float64)
    axes = (list(range(1, a1.ndim)), list(range(len(n_shape))))

    def apply(a, b, s):
        return s * np.tensordot(b.astype(np.float64), np.tensordot(a.astype(np.float64), probe, axes), 1)

    u, v = apply(a1, b1, s1), apply(a2, b2, s2)
    return bool(np.allclose(u, v, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(u).max(initial=0)))))


def _factors(name: str, entry: dict[str, Any], lay: str, shape: tuple[int, ...],
             path: str, m_hint: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """One module's torch factors as lorax `(a, b, m_ndim)` for an unbatched `shape`
    (`m_hint`: the split of a `LoraWeight` already there)."""
    lora_a, lora_b = entry["A"], entry["B"]
    r = lora_a.shape[0]
    # Every split of the weight's axes torch's layout allows; the factors pick one.
    splits = (list(range(1, len(shape))) if entry["kind"] == "linear"
              else _torch.fixed_split(lay, shape))
    expected = [_torch.torch_shapes(entry["kind"], lay, shape, m, r) for m in splits]
    got = (tuple(lora_a.shape), tuple(lora_b.shape))
    if m_hint is not None:
        expected = [e for m, e in zip(splits, expected) if m == m_hint]
        splits = [m_hint] if expected else []
    fits = [m for m, e in zip(splits, expected) if e == got]
    if len(fits) != 1:
        want = (" or ".join(f"lora_A {e[0]}, lora_B {e[1]}" for e in expected)
                or "factors of a 2-D (out, in) split of it")
        if len(fits) > 1:
            raise ValueError(
                f"load_peft: module {name!r}: the factors fit {path!r} (shape {shape}) in "
                f"{len(fits)} ways (m_ndim {fits}); load it onto a LoRA tree built with the "
                "factorisation you want (lorax.init_lora with LoraSpec(m_ndim=...)).")
        raise ValueError(
            f"load_peft: module {name!r} does not fit {path!r} (shape {shape}, layout "
            f"{lay!r}): the adapter has lora_A {got[0]}, lora_B {got[1]}; expected {want} "
            "(a different base model?).")
    m = fits[0]
    a, b = _torch.from_torch(lay, entry["kind"], lora_a, lora_b, shape, m)
    return a, b, m


def _norm(w: Any, layer: int, m_ndim: int, lay: str) -> np.ndarray:
    """DoRA's magnitude for a layer the adapter leaves out (zero factors): `||w||` per
    output feature, so the layer is unchanged."""
    wl = np.asarray(w.dequantize() if hasattr(w, "dequantize") else w)[layer].astype(np.float64)
    axes = (tuple(range(m_ndim)) if _torch.output_side(lay) == "a"
            else tuple(range(m_ndim, wl.ndim)))
    return np.sqrt(np.sum(wl * wl, axis=axes, keepdims=True))


def _check_base(name: str, base: np.ndarray, lay: str, w: Any, layer: int | None, m: int,
                path: str) -> None:
    """PEFT saves the embedding layers' base weights with the adapter (`save_embedding_layers`,
    on by default when an embedding is targeted). lorax keeps the given base: that is
    only right if the saved one is the same (no resized vocabulary, no other base)."""
    mine = np.asarray(w.dequantize() if hasattr(w, "dequantize") else w)
    if layer is not None:
        mine = mine[layer]
    kind = _torch.kind_of(lay)
    torch_view = {"in_out": lambda x: x.reshape(int(np.prod(x.shape[:m])), -1).T,
                  "out_in": lambda x: x.reshape(int(np.prod(x.shape[:m])), -1),
                  "embedding": lambda x: x,
                  "conv_in_out": lambda x: np.moveaxis(np.moveaxis(x, -1, 0), -1, 1),
                  "conv_out_in": lambda x: x}[lay](mine)
    same = torch_view.shape == base.shape and np.allclose(
        torch_view, base.astype(torch_view.dtype), rtol=1e-6, atol=1e-6 * float(np.abs(base).max(initial=1)))
    if not same:
        raise ValueError(
            f"load_peft: the adapter carries its own base weight for module {name!r} "
            f"({kind}, shape {base.shape}; PEFT's save_embedding_layers, e.g. after resizing the "
            f"vocabulary), and it differs from {path!r}. lorax does not replace base weights: "
            "load the base model the adapter was trained on.")


def load_peft(
    directory: str | os.PathLike,
    params: Any,
    *,
    module_name: Any = None,
    layout: Any = None,
) -> tuple[Any, Any]:
    """Put a PEFT LoRA adapter onto a JAX parameter tree.

    Reads `adapter_config.json` + `adapter_model.safetensors` as written by PEFT's
    `save_pretrained` (or [`lorax.save_peft`][]) and returns `params` with a
    [`lorax.LoraWeight`][] wherever the adapter has factors: `Linear` modules on
    dense weights (a multi-axis kernel takes the 2-D factors in the one split of
    its axes that fits), `Embedding` modules on lookup tables, `Conv` modules on
    conv kernels, and per-layer modules stacked onto stacked weights (a layer the
    adapter leaves out gets zero factors, ranks are zero-padded to the largest).
    `rank_pattern`, `alpha_pattern` and `use_rslora` are honoured; the update is
    PEFT's `scaling · B @ A` exactly. A DoRA adapter (`use_dora`) gives
    [`lorax.DoraWeight`][]s with PEFT's `lora_magnitude_vector` as `m` (a layer the
    adapter leaves out gets `m = ||w||`, which leaves it unchanged).

    Either everything is applied or an error is raised: a module no parameter maps
    to, factors that do not fit, or a PEFT feature lorax does not read (`lora_bias`,
    `modules_to_save`, ...) is a `ValueError`
    naming the module; a config number that is not of its kind (`r`, `lora_alpha`,
    `lora_dropout`, a `rank_pattern` / `alpha_pattern` value set to `null`, `true`, a
    string, a fraction for a rank, ...) a `ValueError` naming the file and the field.
    `params` is not modified.

    **Arguments:**

    - `directory`: the adapter directory (holding `adapter_config.json` and
      `adapter_model.safetensors`; a file is a `ValueError`).
    - `params`: the base model's parameters (arrays, [`lorax.QuantizedArray`][]s, or a
      LoRA tree whose factors are replaced).
    - `module_name`: how key paths map to torch module names, as in
      [`lorax.save_peft`][] (a stacked weight's callable is called with `layer=None`
      first, then with each layer index).
    - `layout`: which side of each weight is the input, as in [`lorax.save_peft`][];
      `None`: from the module kind and the weight's name (`kernel` / `w`: input
      first; `weight`: torch's `(out, in)`; embeddings: a lookup table).

    **Returns:**

    `(lora_params, spec)`, as [`lorax.load_adapter`][]: base arrays are reused, not
    copied; the spec has a `LoraSpec` per adapted weight and `LORA_FREEZE` elsewhere.

    !!! Example

        See [`lorax.save_peft`][].
    """
    directory = os.fspath(directory)
    try:
        return _load(directory, params, module_name, layout)
    except ValueError as err:  # what the files bring names them
        if directory in str(err):
            raise
        raise ValueError(f"{err} (PEFT adapter {directory!r})") from None


class _Target(NamedTuple):
    """A weight of `params` the adapter has modules for, and how torch sees it."""

    leaf: Any                       # the parameter (an array, or a LoraWeight to refill)
    w: Any                          # its frozen weight
    path: str
    parts: list[str]
    groups: list[tuple[str, ...]]   # module names: one group, or one per layer if stacked
    stacked: bool
    layouts: list[str | None]       # the given layout of each module of a group
    per_shape: tuple[int, ...]      # one layer's shape, in torch's (M..., N...) order
    m_hint: int | None              # the split a LoraWeight already has
    m_axes: tuple[int, ...] | None  # a non-contiguous LoraWeight's M axes


class _Factors(NamedTuple):
    """One module's factors as lorax's, for one layer of a target."""

    a: np.ndarray
    b: np.ndarray
    m: int               # m_ndim
    scale: float
    mag: np.ndarray | None
    lay: str


def _load(directory: str, params: Any, module_name: Any, layout: Any) -> tuple[Any, Any]:
    """load_peft's pipeline: read and check → map modules to leaves → read each module's
    factors → assemble stacks → place."""
    config = _read_config(directory)
    modules = _read_modules(directory)
    use_dora = bool(config.get("use_dora"))
    _check_dora_tensors(modules, use_dora)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_engine.is_value)
    leaves = [leaf for _, leaf in flat]
    spec: list[Any] = [LORA_FREEZE] * len(leaves)
    used: set[str] = set()
    for i, (key_path, leaf) in enumerate(flat):
        target = _target(key_path, leaf, module_name, layout, modules, use_dora)
        if target is None:
            continue
        loaded = _read_layers(target, modules, config, use_dora)
        used.update(n for group in target.groups for n in group if n in modules)
        leaves[i], spec[i] = _place(target, _assemble(target, loaded, use_dora))
    _check_all_used(modules, used, flat)
    return jax.tree_util.tree_unflatten(treedef, leaves), jax.tree_util.tree_unflatten(treedef, spec)


def _check_dora_tensors(modules: dict[str, dict[str, Any]], use_dora: bool) -> None:
    """Every module has a DoRA magnitude if the config says `use_dora`, none otherwise."""
    for name, entry in modules.items():
        if use_dora and "M" not in entry:
            raise ValueError(f"load_peft: the config says use_dora but module {name!r} has no "
                             f"DoRA magnitude ({_PREFIX}{name}{_MAGNITUDE}).")
        if not use_dora and "M" in entry:
            raise ValueError(f"load_peft: module {name!r} has a DoRA magnitude "
                             f"({_PREFIX}{name}{_MAGNITUDE}) but the config's use_dora is false.")


def _target(key_path: Any, leaf: Any, module_name: Any, layout: Any,
            modules: dict[str, Any], use_dora: bool) -> _Target | None:
    """The modules of the adapter that map to `leaf`, or `None` if none does."""
    w = leaf.w if isinstance(leaf, LoraWeight) else leaf
    shape = tuple(getattr(w, "shape", ()))
    if len(shape) < 2:
        return None
    parts = _torch.key_parts(key_path)
    path = "/".join(parts)
    groups, stacked = _groups(module_name, path, parts, shape, modules)
    if groups is None:
        return None
    given = _torch.given_layout(layout, path, parts)
    layouts = list(given) if isinstance(given, (tuple, list)) else [given] * len(groups[0])
    if len(layouts) != len(groups[0]):
        raise ValueError(f"load_peft: {path!r} maps to {len(groups[0])} modules "
                         f"{groups[0]} but has {len(layouts)} layouts {tuple(layouts)}.")
    per_shape = shape[1:] if stacked else shape
    m_hint, m_axes = None, None
    if isinstance(leaf, LoraWeight):
        per_shape, m_hint, m_axes = _existing_split(leaf, path, stacked, use_dora, per_shape)
    return _Target(leaf, w, path, parts, groups, stacked, layouts, per_shape, m_hint, m_axes)


def _existing_split(leaf: LoraWeight, path: str, stacked: bool, use_dora: bool,
                    per_shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, Any]:
    """`(per_shape, m_hint, m_axes)` of a LoraWeight being refilled: its factorisation
    decides where factors that fit two ways go."""
    n_b_have, m_hint, _ = leaf.structure
    if n_b_have != int(stacked):
        raise ValueError(
            f"load_peft: {path!r} is a LoraWeight with {n_b_have} batch axes but the "
            f"adapter has {'per-layer modules' if stacked else 'one module'} for it.")
    if leaf.contiguous:
        return per_shape, m_hint, None
    # Torch's 2-D weight is (M..., N...) flattened: read the factors against that order
    # of `w`'s axes (a Gemma (heads, embed, head_dim) q kernel is torch's
    # (heads * head_dim, embed) q_proj).
    if use_dora:
        raise ValueError(
            f"load_peft: {path!r} has M axes {leaf.axes.m} and N axes "
            f"{leaf.axes.n} that are not contiguous; DoRA magnitudes are not "
            "read onto such a weight.")
    shape = tuple(leaf.w.shape)
    return tuple(shape[d] for d in (*leaf.axes.m, *leaf.axes.n)), m_hint, leaf.axes.m


def _read_layers(target: _Target, modules: dict[str, Any], config: dict[str, Any],
                 use_dora: bool) -> dict[int, _Factors]:
    """Each adapted layer's factors (index 0 for an unstacked weight); a layer the
    adapter leaves out (PEFT's layers_to_transform) has none."""
    loaded: dict[int, _Factors] = {}
    for index, group in enumerate(target.groups):
        present = [n for n in group if n in modules]
        if not present:
            continue
        if len(present) < len(group):
            missing = [n for n in group if n not in modules]
            raise ValueError(
                f"load_peft: {target.path!r} is one array used by modules {group}; the adapter "
                f"adapts {present} but not {missing}, which lorax cannot apply to one array.")
        got = [_read_module(target, n, modules[n], given, config, use_dora, index, group)
               for n, given in zip(group, target.layouts)]
        _check_tied(target.path, group, got)
        loaded[index] = got[0]
    return loaded


def _read_module(target: _Target, name: str, entry: dict[str, Any], given: str | None,
                 config: dict[str, Any], use_dora: bool, index: int,
                 group: tuple[str, ...]) -> _Factors:
    """One module's factors (and DoRA magnitude) for one layer of `target`, checked
    against the config's rank and the weight's shape."""
    path = target.path
    lay = _load_layout(given, path, target.parts, entry["kind"], name)
    r_expected = _expected_rank(config, name)
    if r_expected is not None and entry["A"].shape[0] != r_expected:
        raise ValueError(f"load_peft: module {name!r} has rank {entry['A'].shape[0]} but "
                         f"the config says r = {r_expected}.")
    a, b, m = _factors(name, entry, lay, target.per_shape, path, target.m_hint)
    if "base" in entry:
        _check_base(name, entry["base"], lay, target.w, index if target.stacked else None, m, path)
    mag = None
    if use_dora:
        if len(group) > 1:
            raise ValueError(
                f"load_peft: {path!r} is one array used by modules {group}, each with "
                "its own DoRA magnitude over its own input axes; lorax's DoraWeight "
                "has one magnitude per array.")
        mag = _torch.magnitude_from_torch(lay, entry["M"], target.per_shape, m)
        if mag is None:
            raise ValueError(
                f"load_peft: module {name!r}: its DoRA magnitude has shape "
                f"{tuple(entry['M'].shape)}; {path!r} (shape {target.per_shape}, layout "
                f"{lay!r}) needs {_torch.magnitude_torch_shape(lay, target.per_shape, m)}.")
    return _Factors(a, b, m, _scale_of(config, name, entry["A"].shape[0]), mag, lay)


def _check_tied(path: str, group: tuple[str, ...], got: list[_Factors]) -> None:
    """Modules sharing one array (a tied embedding) must carry the same update."""
    first = got[0]
    for n, other in zip(group[1:], got[1:]):
        if other.m != first.m or not _same_update(
                (first.a, first.b, first.scale), (other.a, other.b, other.scale), first.m):
            raise ValueError(
                f"load_peft: modules {group[0]!r} and {n!r} both map to {path!r} (one "
                "array, e.g. a tied embedding) but the adapter gives them different "
                "updates, which lorax cannot apply to one array.")


class _Assembled(NamedTuple):
    """A target's factors as one LoraWeight's, on the host."""

    a: np.ndarray
    b: np.ndarray
    mag: np.ndarray | None
    alpha: float
    k: int          # rank
    n_b: int        # batch axes: 1 for a stacked weight
    m: int          # m_ndim
    lay: str
    dtype: Any


def _assemble(target: _Target, loaded: dict[int, _Factors], use_dora: bool) -> _Assembled:
    """The layers' factors as one weight's (stacked: zero for a layer the adapter leaves
    out, ranks zero-padded to the largest, each layer's scale folded into its `b`)."""
    ms = {f.m for f in loaded.values()}
    if len(ms) > 1:
        raise ValueError(f"load_peft: the per-layer modules of {target.path!r} split its axes "
                         f"differently: {sorted(ms)}.")
    m = ms.pop()
    w = target.w
    dtype = np.dtype(w.dtype) if jax.numpy.issubdtype(w.dtype, np.floating) else np.float32
    first = next(iter(loaded.values()))
    if not target.stacked:
        k = first.a.shape[0]
        alpha = _alpha(target, first.scale, k)
        return _Assembled(first.a, first.b, first.mag, alpha, k, 0, m, first.lay, dtype)
    n_layers = w.shape[0]
    k = max(f.a.shape[0] for f in loaded.values())
    scale = max((f.scale for f in loaded.values()), key=abs)  # 0 only if every layer's is
    a = np.zeros((n_layers, k, *target.per_shape[m:]), dtype)
    b = np.zeros((n_layers, *target.per_shape[:m], k), dtype)
    for layer, f in loaded.items():
        r = f.a.shape[0]
        a[layer, :r] = f.a
        # One alpha per LoraWeight: a layer's own scale is folded into its b (as a ratio
        # of at most 1, which cannot overflow).
        b[layer, ..., :r] = f.b * (f.scale / scale if scale else 1.0)
    mag = None
    if use_dora:
        mag = np.stack([loaded[i].mag if i in loaded else _norm(w, i, m, first.lay)
                        for i in range(n_layers)]).astype(dtype)
    return _Assembled(a, b, mag, _alpha(target, scale, k), k, 1, m, first.lay, dtype)


def _alpha(target: _Target, scale: float, k: int) -> float:
    """The LoraWeight's alpha for PEFT's `scale` at rank `k`, a finite float."""
    if not math.isfinite(scale * k):
        raise ValueError(f"load_peft: the adapter's scale for {target.path!r} ({scale} at rank "
                         f"{k}, from lora_alpha or alpha_pattern) is too large for a float.")
    return scale * k


def _place(target: _Target, x: _Assembled) -> tuple[Any, Any]:
    """The loaded weight and its spec, factors placed as the weight is sharded (or as
    the LoraWeight being refilled has them)."""
    leaf, w, m_axes = target.leaf, target.w, target.m_axes
    if isinstance(leaf, LoraWeight):
        a_sh, b_sh = _array_sharding(leaf.a), _array_sharding(leaf.b)
    else:
        a_sh, b_sh = factor_shardings(w, x.n_b, x.m) or (None, None)
    a = place_host_array(np.asarray(x.a, x.dtype), a_sh)
    b = place_host_array(np.asarray(x.b, x.dtype), b_sh)
    alpha, k = float(x.alpha), int(x.k)
    if x.mag is None:
        return (LoraWeight(w, a=a, b=b, alpha=alpha, m_axes=m_axes),
                LoraSpec(k, alpha, x.n_b, x.m, m_axes=m_axes))
    m_sh = _array_sharding(leaf.m) if isinstance(leaf, DoraWeight) else None
    mag = place_host_array(np.asarray(x.mag, x.dtype), m_sh)
    return (DoraWeight(w, a=a, b=b, m=mag, alpha=alpha),
            LoraSpec(k, alpha, x.n_b, x.m, dora=True,
                     input_factor="b" if _torch.output_side(x.lay) == "a" else "a"))


def _check_all_used(modules: dict[str, Any], used: set[str], flat: list[Any]) -> None:
    """Every module of the adapter went onto a parameter."""
    unused = sorted(set(modules) - used)
    if unused:
        names = [_torch.default_module_name(_torch.key_parts(p)) for p, leaf in flat
                 if len(getattr(leaf, "shape", ())) >= 2][:5]
        raise ValueError(
            f"load_peft: the adapter has module(s) {unused[:5]}{' ...' if len(unused) > 5 else ''} "
            f"that no parameter maps to (a different base model, or module names that differ: "
            f"the parameters' default names look like {names}; pass module_name=).")
