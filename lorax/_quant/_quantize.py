"""`quantize(params, spec, qtype)`: quantize a model's frozen base, leaf by leaf."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _engine
from .._checks import check_bool, is_int
from .._spec import LORA_FREEZE, as_lora_spec, check_spec_structure, path_str, spec_axes
from . import _formats as F
from ._array import QuantizedArray, check_options, check_quantizable, check_scale_dtype


def _block_axis(spec_val: Any, ndim: int) -> int | None:
    """The block axis for a leaf with this spec value (`None`: keep it dense)."""
    ls = as_lora_spec(spec_val)
    if ls is None:
        return -2 if spec_val == LORA_FREEZE else None
    m = spec_axes((0,) * ndim, ls)[1]
    if not m:  # no factorisation fits (init_lora says why): the default axis
        return -2
    return m[-1] - ndim  # the last of the M (input) axes, counted from the end


def _vector_stack(shape: tuple[int, ...]) -> bool:
    """A frozen `(n, dim)` leaf that is a stack of per-layer vectors (norm scales), not a
    weight: few rows, or rows far fewer than columns (Llama-3-70B stacks 80 layers of
    8,192, Llama-3.1-405B 126 of 16,384)."""
    return len(shape) == 2 and (shape[0] < 32 or (shape[0] < 128 and 16 * shape[0] <= shape[1]))


def quantize(
    params: Any,
    spec: Any,
    qtype: str = "nf4",
    *,
    block_size: int | None = None,
    dtype: Any = None,
    double_quant: bool = False,
    scale_dtype: Any = None,
    axis: int | Callable[[str, Any], int | None] | None = None,
    min_size: int = 4096,
    is_leaf: Callable[[Any], bool] | None = None,
) -> Any:
    """Quantize the frozen base of a parameter tree: every weight a spec value marks
    as a LoRA target (a rank or [`lorax.LoraSpec`][]) or `LORA_FREEZE`.

    Vectors, scalars, non-float leaves, `LORA_FULL` leaves, frozen leaves of fewer
    than `min_size` values (multi-axis biases, small tables: nothing to save) and
    frozen leaves whose block axis does not split into whole blocks, and frozen
    `(n, dim)` leaves that look like stacked `(layers, dim)` norm scales (fewer than 32
    rows, or fewer than 128 and at least 16 times as wide):
    blocks along the layers would mix them) stay as they are (the same arrays);
    [`lorax.summary`][] says how many weights were quantized. Quantize *before* [`lorax.init_lora`][]: it then wraps each
    quantized weight in a `LoraWeight` whose `w` is the [`lorax.QuantizedArray`][]
    (QLoRA), with factors in the dequantized dtype.

    Blocks run along a weight's input axis: for a LoRA target the last of the axes
    `b` carries (its `M` axes, as `init_lora` factors it: the second-to-last axis
    unless the `LoraSpec` says otherwise; a stacked `(layers, in, out)` kernel with
    `batch_ndim=1` is quantized per layer), for a `LORA_FREEZE` leaf the
    second-to-last axis. An embedding looked up by rows keeps its lookups cheap
    either way; pass `axis` to choose (GGUF blocks its token embedding along `dim`,
    `axis=-1` for a `(vocab, dim)` table).

    **Arguments:**

    - `params`: the model's parameters (dense arrays).
    - `spec`: a spec tree with `params`' structure (see [`lorax.simple_spec`][]).
    - `qtype`: `"int8"` (symmetric, one scale per output channel), `"int4"`
      (symmetric, blocks of 32), `"s4"` (symmetric, blocks of 64, codes in JAX's `int4`
      dtype), `"nf4"` (QLoRA's NormalFloat4, absmax per block of 64), or GGUF's
      `"q4_0"`, `"q4_1"`, `"q5_0"`, `"q5_1"`, `"q8_0"` (blocks of 32, as llama.cpp's
      reference quantizer writes them). GGUF's K-quants (`"q2_k"` ..
      `"q6_k"`) are read from files ([`lorax.load_gguf`][]), not quantized here.
      Hugging Face checkpoints' layouts ([`lorax.load_safetensors`][]): `"bnb_nf4"`,
      `"bnb_fp4"` (bitsandbytes, blocks of 64), `"bnb_int8"` (LLM.int8, per row),
      `"fp8_e4m3"` (FP8 codes, blocks of 128), `"int4_zp"` (4-bit codes with a zero
      point per block of 128, as GPTQ and AWQ store them; scales float16).
    - `block_size`: values per block (not for the GGUF types, whose blocks are 32).
    - `dtype`: the dtype the weights dequantize to (default: each leaf's own).
    - `double_quant`: NF4 (and `bnb_nf4`, `bnb_fp4`) only: also quantize the per-block
      absmax values (8 bits per 256 of them), as QLoRA does: 0.127 instead of 0.141
      bytes per f32 byte. lorax's NF4 codes them as linear int8, bitsandbytes' types
      with bitsandbytes' dynamic map.
    - `scale_dtype`: the dtype the scales are stored in (default float32; GGUF's types
      keep float16). `"int8"` or `"s4"` with `scale_dtype` equal to a bfloat16 or
      float16 `dtype` dequantizes as one product in that dtype, bit for bit the float32
      one, which XLA's GPU compiler can fuse into the matrix product: it then reads the
      codes and writes no dense weight (docs/qlora.md, "Products that read the codes").
      The codes are computed against the scales as stored.
    - `axis`: the block axis for every quantized leaf (counted from the end), or a
      function `(key path string, leaf) -> axis or None` (`None`: the default rule).
    - `min_size`: `LORA_FREEZE` leaves with fewer values stay dense (LoRA targets are
      quantized whatever their size).
    - `is_leaf`: passed to `jax.tree_util`.

    **Returns:**

    `params` with a `QuantizedArray` for every quantized leaf.

    **Raises:**

    `ValueError` naming the key path, for an unknown `qtype` (listing the known
    ones), for a LoRA target that cannot be quantized: a block size that does not
    divide its block axis, an integer dtype, fewer than two axes; or for a weight
    that is already a `LoraWeight` (quantize before `init_lora`). A weight that is
    already a `QuantizedArray` (a GGUF file's blocks) stays as it is.
    `TypeError` for a `qtype` that is not a string (the spec goes second) or a
    `double_quant` that is not a bool.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        params = {"w": jax.random.normal(jax.random.PRNGKey(0), (128, 64)), "bias": jnp.zeros(64)}
        spec = {"w": 8, "bias": lorax.LORA_FREEZE}
        q = lorax.quantize(params, spec, "nf4")
        assert isinstance(q["w"], lorax.QuantizedArray) and q["bias"] is params["bias"]
        lp = lorax.init_lora(q, spec, jax.random.PRNGKey(1))
        y = lorax.lora(lambda p, x: x @ p["w"] + p["bias"])(lp, jnp.ones((2, 128)))
        assert y.shape == (2, 64)
        ```
    """
    if not isinstance(qtype, str):  # before the format lookup, which cannot hash a spec
        raise TypeError(f"quantize: qtype must be a string such as 'nf4'; got a "
                        f"{type(qtype).__name__} (the spec goes second).")
    fmt = F.get_format(qtype, "quantize")
    double_quant = check_bool("quantize", "double_quant", double_quant)
    if not is_int(min_size):
        raise TypeError(f"quantize: min_size must be an int, got {min_size!r}.")
    if fmt.quantize is None:  # otherwise every frozen leaf would quietly stay dense
        check_quantizable(fmt, (1, 1), jnp.float32, -2, None, False, "every weight")
    check_options(block_size, dtype, "every weight")
    if scale_dtype is not None:  # else frozen leaves would quietly stay dense
        check_scale_dtype(fmt, scale_dtype, double_quant, "every weight")
    check_spec_structure(spec, params, "quantize", is_leaf)
    # Stop at a LoraWeight or QuantizedArray, as the spec check does: `_check_dense`
    # then names it, where flattening into its leaves would not match the spec.
    stop = lambda x: _engine.is_value(x) or (is_leaf is not None and is_leaf(x))  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=stop)
    spec_leaves = treedef.flatten_up_to(spec)
    options = dict(block_size=block_size, dtype=dtype, double_quant=double_quant, axis=axis,
                   min_size=min_size, scale_dtype=scale_dtype)
    out = [_quantize_leaf(fmt, path, x, spec_val, **options)
           for (path, x), spec_val in zip(leaves, spec_leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_dense(where: str, x: Any) -> None:
    """Raise naming `where` if `x`, marked to be quantized, is a LoraWeight (or DoraWeight):
    init_lora came first, and its `w` would be quantized under trained factors."""
    if _engine.is_value(x):
        raise ValueError(f"quantize: {where} is already a {type(x).__name__}; quantize "
                         "the dense base before init_lora.")


def _quantize_leaf(fmt: F.Format, path: Any, x: Any, spec_val: Any, *, block_size: int | None,
                   dtype: Any, double_quant: bool, axis: Any, min_size: int,
                   scale_dtype: Any) -> Any:
    """One leaf of `quantize`: its `QuantizedArray`, or the leaf itself where it stays dense."""
    where = repr(path_str(path))
    shape = tuple(getattr(x, "shape", ()))
    dtype_x = getattr(x, "dtype", None)
    default = _block_axis(spec_val, len(shape))
    target = as_lora_spec(spec_val) is not None
    if default is None or isinstance(x, QuantizedArray):  # a GGUF tree's blocks stay theirs
        return x
    _check_dense(where, x)
    # Vectors and scalars stay dense when frozen; a rank on them is an error
    # init_lora reports anyway, so say it here with the quantization's words.
    if not target and (len(shape) < 2 or math.prod(shape) < min_size):
        return x
    if not target and (dtype_x is None or not jnp.issubdtype(dtype_x, jnp.floating)):
        return x  # integer buffers marked frozen are not weights
    chosen = axis(path_str(path), x) if callable(axis) else axis
    ax = default if chosen is None else int(chosen)
    try:
        check_quantizable(fmt, shape, dtype_x, ax, block_size, double_quant, where, scale_dtype)
    except ValueError:
        if target:
            raise
        # A frozen leaf that does not split into whole blocks (a stacked
        # `(layers, dim)` norm scale) is not a weight to quantize: it stays dense.
        return x
    if not target and chosen is None and _vector_stack(shape):
        # A frozen `(n, dim)` leaf with few rows (stacked norm scales, one row per
        # layer) is a stack of vectors, not a weight: blocks along its leading axis
        # would mix the layers (and break `lax.scan` over it). It stays dense.
        return x
    try:
        return QuantizedArray.from_dense(x, fmt.name, block_size=block_size, axis=ax,
                                         double_quant=double_quant, dtype=dtype,
                                         scale_dtype=scale_dtype)
    except ValueError as err:  # a sharding the blocks cannot follow
        raise ValueError(f"quantize: {where}: {err}") from None
