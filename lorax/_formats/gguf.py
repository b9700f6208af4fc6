"""llama.cpp's LoRA adapter format: a GGUF file of `<base tensor>.lora_a` / `.lora_b` pairs.

What llama.cpp reads (convert_lora_to_gguf.py, src/llama-adapter.cpp):

- metadata `general.type = "adapter"`, `adapter.type = "lora"`, `adapter.lora.alpha`
  (f32) and the base's `general.architecture`;
- for a base tensor `W` of ggml shape `[in, out]` (numpy `(out, in)`): `W.lora_a`
  numpy `(r, in)` and `W.lora_b` numpy `(out, r)` (PEFT's `lora_A` / `lora_B`); the
  token embedding (numpy `(vocab, dim)`) flips them: `lora_a (vocab, r)`, `lora_b
  (dim, r)`, because llama.cpp gathers rows of `lora_a`;
- one alpha for the whole file: each pair is scaled by `alpha / r` (`r` its own rank);
- Llama-family q/k weights are stored with each head's rows reordered for
  llama.cpp's RoPE (`reshape(heads, 2, d/2, in).swapaxes(1, 2)`); the converter
  reorders `lora_b`'s rows the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Any, Literal

import jax
import ml_dtypes
import numpy as np

from .._files import read_gguf_header
from .._spec import path_str
from .._variants.dora import DoraWeight
from ._export import Module, check_dtype, export_modules

# Architectures whose q/k rows llama.cpp's converter reorders (LlamaModel.permute).
_QK_PERMUTED = ("llama",)
_QK = re.compile(r"^blk\.\d+\.attn_(q|k)\.weight$")
# The adapter tensors' dtypes, those llama.cpp's converter writes (integer types would
# truncate the factors).
_DTYPES = ("float32", "float16", "bfloat16")


def _gguf() -> Any:
    try:
        import gguf  # lazy: optional (the `gguf` extra), needed by save_gguf_lora only
    except ImportError:
        raise ImportError("save_gguf_lora needs the `gguf` package: pip install gguf "
                          "(or pip install 'jax-lorax[gguf]').") from None
    return gguf


def _permute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: per head, pairs (i, i + d/2) interleaved."""
    out = rows.shape[0]
    return (rows.reshape(n_head, 2, out // n_head // 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


def save_gguf_lora(
    path: str | os.PathLike,
    lora_params: Any,
    base: str | os.PathLike,
    *,
    module_name: Any = None,
    layout: Any = None,
    qk_rows: Literal["hf", "gguf"] | None = None,
    dtype: Any = np.float32,
) -> None:
    """Write the `LoraWeight`s of `lora_params` as a llama.cpp LoRA adapter (GGUF).

    The file loads in llama.cpp (`--lora`, `llama_adapter_lora_init`, the server's
    `lora` list) on top of the GGUF model `base`. Each `LoraWeight` (each layer of a
    stacked one) becomes a `<tensor>.lora_a` / `.lora_b` pair for the base tensor it
    adapts; which base tensor is given by a torch-style module name (as in
    [`lorax.save_peft`][]: `model.layers.3.self_attn.q_proj`, mapped through the
    `gguf` package's name table for the base's architecture) or by the GGUF tensor
    name itself (`blk.3.attn_q.weight`). Every pair is checked against the base
    tensor's shape. The update is kept exactly: llama.cpp scales every pair by the
    file's one `alpha / r`, so weights whose alpha differs from the most common one
    (rsLoRA included: it is in `LoraWeight.alpha`) have the ratio folded into `lora_b`.

    Llama-family GGUF files store q/k rows reordered for llama.cpp's RoPE. `qk_rows`
    says which order the factors were trained in: `'hf'` (the Hugging Face
    checkpoint's, as PEFT adapters are: `lora_b`'s rows are reordered as llama.cpp's
    converter does) or `'gguf'` (trained directly on the GGUF file's rows: written as
    they are). For such architectures it must be given when q or k is adapted.

    Needs the `gguf` package.

    **Arguments:**

    - `path`: the adapter file to write.
    - `lora_params`: a LoRA parameter tree.
    - `base`: the GGUF model file the adapter is for (read for its architecture, head
      counts and tensor shapes; not modified).
    - `module_name`: key path -> module or tensor name, as in [`lorax.save_peft`][].
    - `layout`: which side of each weight is the input, as in [`lorax.save_peft`][].
    - `qk_rows`: `'hf'` or `'gguf'`, see above.
    - `dtype`: the adapter tensors' dtype: `np.float32` (default), `np.float16` or
      `jnp.bfloat16` (`"bfloat16"`), each rounded to nearest from float32.

    **Returns:**

    Nothing.

    **Raises:**

    `ValueError` when `path` is `base` (the model is not overwritten) or `dtype` is not
    one of the three above; naming the module when it maps to no tensor of `base`, its factors
    do not fit that tensor, or `qk_rows` is needed and missing; naming the key path of
    a [`lorax.DoraWeight`][] (llama.cpp has no DoRA); naming `base` and the field when
    its header cannot be read (as [`lorax.load_gguf`][]) or its block or head count does
    not fit its tensors.

    !!! Example

        ```py
        lorax.save_gguf_lora(
            "adapter.gguf", lora_params, "SmolLM2-135M-Instruct.Q4_1.gguf",
            module_name={"layers/q": "model.layers.{layer}.self_attn.q_proj"},
            qk_rows="hf")
        ```
    """
    _refuse_overwriting_base(path, base)
    dtype = check_dtype("save_gguf_lora", dtype, _DTYPES,
                        "the llama.cpp LoRA tensor types gguf writes")
    _refuse_dora(lora_params)
    gguf = _gguf()
    if qk_rows not in (None, "hf", "gguf"):
        raise ValueError(f"save_gguf_lora: qk_rows must be 'hf' or 'gguf', not {qk_rows!r}.")
    model = _base_model(gguf, base)
    modules = export_modules("save_gguf_lora", lora_params, module_name, layout, np.float32)
    alpha = collections.Counter(m.alpha for m in modules).most_common(1)[0][0]
    tensors: dict[str, np.ndarray] = {}
    for m in modules:
        if m.kind == "conv":
            raise ValueError(f"save_gguf_lora: module {m.name!r} is a conv adapter; llama.cpp "
                             "LoRA adapters are for matmul and embedding weights.")
        t = model.tensor_of(m.name)
        if t in tensors or t + ".lora_a" in tensors:
            raise ValueError(f"save_gguf_lora: two modules map to tensor {t!r}.")
        lora_a, lora_b = _pair(m, t, model, alpha, qk_rows)
        tensors[t + ".lora_a"] = np.ascontiguousarray(lora_a, dtype=dtype)
        tensors[t + ".lora_b"] = np.ascontiguousarray(lora_b, dtype=dtype)
    if jax.process_index() == 0:
        _write(gguf, path, model.arch, alpha, tensors)


def _refuse_overwriting_base(path: Any, base: Any) -> None:
    """`path` is not the base model's file: writing the adapter there would destroy it."""
    for name, value in (("path", path), ("base", base)):
        if not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"save_gguf_lora: {name} must be a file path, got {value!r}.")
    p, b = os.fspath(path), os.fspath(base)
    if os.path.exists(p) and os.path.exists(b):
        same = os.path.samefile(p, b)  # also through hard links
    else:
        same = os.path.realpath(p) == os.path.realpath(b)
    if same:
        raise ValueError(f"save_gguf_lora: path {p!r} is the base model file {b!r}; writing the "
                         "adapter there would overwrite the model. Give the adapter a file of "
                         "its own.")


def _refuse_dora(lora_params: Any) -> None:
    dora = [path_str(p) for p, x in jax.tree_util.tree_flatten_with_path(
        lora_params, is_leaf=lambda x: isinstance(x, DoraWeight))[0] if isinstance(x, DoraWeight)]
    if dora:
        raise ValueError(
            f"save_gguf_lora: {dora[0]!r} is a DoraWeight; llama.cpp's LoRA adapters have no "
            "DoRA magnitude. Merge it (lorax.merge_params) and convert the merged model, or "
            "export it for PEFT (lorax.save_peft).")


@dataclasses.dataclass(frozen=True)
class _Base:
    """What an adapter needs to know of the GGUF model it is for."""

    file: str
    arch: str
    shapes: dict[str, tuple[int, ...]]  # tensor name -> ggml dims
    name_map: Any                       # gguf's torch -> GGUF name table, or None
    n_head: int | None                  # set where llama.cpp reorders q/k rows
    n_head_kv: int | None

    def tensor_of(self, name: str) -> str:
        """The base tensor a module name (torch-style or GGUF) adapts."""
        if name in self.shapes:
            return name
        if name + ".weight" in self.shapes:
            return name + ".weight"
        mapped = self.name_map.get_name(name) if self.name_map is not None else None
        if mapped is not None and mapped + ".weight" in self.shapes:
            return mapped + ".weight"
        raise ValueError(
            f"save_gguf_lora: module {name!r} maps to no tensor of {self.file!r} "
            f"({self.arch}); expected a torch module name of that architecture or a GGUF "
            f"tensor name such as {next(iter(self.shapes))!r}.")


def _base_model(gguf: Any, base: str | os.PathLike) -> _Base:
    header = read_gguf_header(base, "save_gguf_lora")
    arch = header.value("general.architecture", "str", "save_gguf_lora")
    shapes = {name: t.dims for name, t in header.tensors.items()}  # ggml order
    if not shapes:
        raise ValueError(f"save_gguf_lora: {os.fspath(base)!r} holds no tensors; expected the "
                         "base model's GGUF file.")
    n_block = header.value(f"{arch}.block_count", "int", "save_gguf_lora")
    if n_block > len(shapes):  # gguf's name table has entries for every block
        raise ValueError(f"save_gguf_lora: GGUF {header.path!r}: {arch}.block_count is "
                         f"{n_block}, more blocks than the file's {len(shapes)} tensors.")
    try:
        arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
        name_map = gguf.get_tensor_name_map(arch_enum, n_block)
    except StopIteration:
        name_map = None
    n_head = n_head_kv = None
    if arch in _QK_PERMUTED:
        n_head = header.value(f"{arch}.attention.head_count", "pos_int", "save_gguf_lora")
        n_head_kv = n_head
        if f"{arch}.attention.head_count_kv" in header.metadata:
            n_head_kv = header.value(f"{arch}.attention.head_count_kv", "pos_int", "save_gguf_lora")
    return _Base(os.fspath(base), arch, shapes, name_map, n_head, n_head_kv)


def _pair(m: Module, t: str, base: _Base, alpha: float,
          qk_rows: str | None) -> tuple[np.ndarray, np.ndarray]:
    """A module's `(lora_a, lora_b)` as llama.cpp reads them for base tensor `t`: the
    file's one alpha folded in, checked against `t`'s shape, q/k rows reordered."""
    lora_a, lora_b = m.lora_a, m.lora_b * (m.alpha / alpha)
    ne = base.shapes[t]
    if m.kind == "embedding":
        # (vocab, dim) table, ggml [dim, vocab]; llama.cpp gathers rows of lora_a.
        want_a, want_b = (ne[1], m.rank), (ne[0], m.rank)
        lora_a = lora_a.T
    else:
        want_a, want_b = (m.rank, ne[0]), (ne[1], m.rank)
    if (tuple(lora_a.shape), tuple(lora_b.shape)) != (want_a, want_b):
        raise ValueError(
            f"save_gguf_lora: module {m.name!r} ({m.path!r}) does not fit {t!r} of "
            f"{base.file!r} (ggml "
            f"shape {list(ne)}): lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}; "
            f"expected {want_a} and {want_b}.")
    qk = _QK.match(t)
    if qk and base.n_head is not None:
        if qk_rows is None:
            raise ValueError(
                f"save_gguf_lora: {base.file!r} is a {base.arch!r} model, whose q/k rows "
                f"llama.cpp stores reordered, and module {m.name!r} adapts {t!r}. Say which "
                "order the factors were trained in: qk_rows='hf' (the Hugging Face "
                "checkpoint's, as PEFT adapters) or qk_rows='gguf' (the GGUF file's rows).")
        if qk_rows == "hf":
            lora_b = _permute_rows(lora_b, _heads(base, t, qk.group(1), lora_b.shape[0]))
    return lora_a, lora_b


def _heads(base: _Base, t: str, which: str, rows: int) -> int:
    """The head count that reorders `t`'s rows, checked to split them in halves per head."""
    n, key = ((base.n_head, "head_count") if which == "q"
              else (base.n_head_kv, "head_count_kv (head_count where absent)"))
    if rows % (2 * n):
        raise ValueError(f"save_gguf_lora: GGUF {base.file!r}: {base.arch}.attention.{key} is "
                         f"{n}, which does not split the {rows} rows of {t!r} into two halves "
                         "per head.")
    return n


def _write(gguf: Any, path: str | os.PathLike, arch: str, alpha: float,
           tensors: dict[str, np.ndarray]) -> None:
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for name, arr in tensors.items():
        if arr.dtype == ml_dtypes.bfloat16:  # gguf's writer takes BF16 as its raw bits
            writer.add_tensor(name, arr.view(np.uint16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
