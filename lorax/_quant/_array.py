"""`QuantizedArray`: a frozen weight kept in its quantized blocks, as one array-ish value."""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import _engine
from .._checks import check_bool
from .._placement import on_device
from .._sharding import explicitly_typed, split_last, weight_aval
from . import _formats as F


def logical_shape(other: tuple[int, ...], k: int, axis: int) -> tuple[int, ...]:
    """The dense shape: `other` with the block axis (length `k`) at `axis` (< 0)."""
    shape = list(other)
    shape.insert(len(other) + 1 + axis, k)
    return tuple(shape)


class AbstractDequantized(_engine.ArrayValue):
    """A frozen weight held in another form than its dense value (codes and scales):
    a primitive with no rule of its own sees `dequantize()`'s array, frozen."""

    materialized_as = "dequantized to a dense array"

    def dequantize(self, dtype: Any = None) -> Array:
        raise NotImplementedError

    def materialise(self) -> Array:
        # Quax's fallback hook: the whole dense weight, frozen.
        return lax.stop_gradient(self.dequantize())

    @staticmethod
    def default(primitive: Any, values: Any, params: dict[str, Any]) -> Any:
        return _engine.materialize_fallback(primitive, values, params)


class QuantizedArray(AbstractDequantized, metaclass=_engine.FastPytreeMeta):
    """A frozen weight stored as quantized blocks; inside [`lorax.lora`][] it behaves
    like its dense value without that array being kept.

    Build one with [`lorax.quantize`][] (a whole parameter tree),
    `QuantizedArray.from_dense` (one array) or `QuantizedArray.from_gguf` (a GGUF
    tensor's bytes as they are on disk). It can stand anywhere a frozen weight can:
    as a bare leaf of the parameters or as a [`lorax.LoraWeight`][]'s `w` (QLoRA).
    Rules dequantize it per use, inside the operation that reads it, and the
    backward pass dequantizes again rather than keeping the dense weight: no
    dense copy of the base lives from one layer (or `lax.scan` iteration) to the next.

    Values are blocks of `block_size` consecutive entries along one axis, the *block
    axis* (`axis`, counted from the end: `-2` for an `(in, out)` kernel, whose blocks
    run along its input axis). The leaves are stored with that axis last and split
    into blocks (see `lorax/_quant/_formats.py`):

    - `codes`: `(*other, n_blocks, code_bytes)`, two 4-bit codes per byte;
    - `scales`: `(*other, n_blocks)`;
    - `mins`: Q4_1's per-block minimum, else `None`;
    - `scale_scales`, `scale_offset`: NF4's double quantization of `scales`, else `None`.

    `qtype`, `block_size`, `axis` and `dense_dtype` (the dtype of the dense value) are
    static. Slicing the leading axes of all leaves together (as `lax.scan` does with a
    stacked `(layers, in, out)` kernel) gives the per-layer weight.

    The codes and scales are frozen: [`lorax.lora`][] puts them behind
    `stop_gradient`, and `partition`, `wrap_optimizer` and the rules never train them.

    !!! Example

        ```python
        import jax, jax.numpy as jnp
        import lorax

        w = jax.random.normal(jax.random.PRNGKey(0), (256, 128))
        q = lorax.QuantizedArray.from_dense(w, "nf4")
        assert q.shape == (256, 128) and q.nbytes < 0.16 * w.nbytes
        assert jnp.abs(q.dequantize() - w).max() < 0.2 * jnp.abs(w).max()
        ```
    """

    codes: Array
    scales: Array
    mins: Array | None
    scale_scales: Array | None
    scale_offset: Array | None
    qtype: str = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    axis: int = eqx.field(static=True)
    dense_dtype: Any = eqx.field(static=True)
    # Set when the blocks run along the leading axis: slicing the leaves' leading axis
    # (`lax.scan`, `vmap`) would then cut across other axes than it should (see aval).
    blocks_lead: int = eqx.field(static=True, default=0)

    def __init__(self, codes: Array, scales: Array, mins: Array | None = None, *,
                 qtype: str, block_size: int, axis: int = -2, dense_dtype: Any = jnp.float32,
                 scale_scales: Array | None = None, scale_offset: Array | None = None):
        fmt = F.get_format(qtype)
        if axis >= 0:
            raise ValueError(f"QuantizedArray.axis counts from the end (< 0), got {axis}.")
        c_shape, s_shape = tuple(jnp.shape(codes)), tuple(jnp.shape(scales))
        if (len(c_shape) < 2 or c_shape[-1] != fmt.code_bytes(block_size)
                or s_shape != c_shape[:-1] or -axis > len(c_shape) - 1):
            raise ValueError(
                f"QuantizedArray({qtype!r}, block_size={block_size}, axis={axis}): expected "
                f"codes (*other, n_blocks, {fmt.code_bytes(block_size)}) and scales "
                f"(*other, n_blocks) with len(other) >= {-axis - 1}; got codes {c_shape}, "
                f"scales {s_shape}."
            )
        if fmt.has_mins != (mins is not None):
            raise ValueError(f"qtype {qtype!r} {'needs' if fmt.has_mins else 'has no'} mins.")
        if (scale_scales is None) != (scale_offset is None):
            raise ValueError("scale_scales and scale_offset come together (double quantization).")
        self.codes = codes
        self.scales = scales
        self.mins = mins
        self.scale_scales = scale_scales
        self.scale_offset = scale_offset
        self.qtype = qtype
        self.block_size = int(block_size)
        self.axis = int(axis)
        self.dense_dtype = jnp.dtype(dense_dtype)
        n = len(c_shape) - 1
        self.blocks_lead = n if n + axis == 0 else 0

    # -- array-ish interface -------------------------------------------------------

    @property
    def format(self) -> F.Format:
        return F.FORMATS[self.qtype]

    @property
    def storage_shape(self) -> tuple[int, ...]:
        """The dense value's shape with the block axis last: `(*other, n_blocks * block_size)`."""
        return (*self.codes.shape[:-2], self.codes.shape[-2] * self.block_size)

    def aval(self) -> jax.core.ShapedArray:
        if self.blocks_lead and self.codes.ndim - 1 < self.blocks_lead:
            raise ValueError(
                "A QuantizedArray whose blocks run along its leading axis lost a leading "
                "axis of its leaves (lax.scan or jax.vmap over it): its leaves are stored "
                "with the block axis last, so that sliced another axis than the leading "
                "one. Scan or vmap over an axis before the block axis (quantize stacked "
                "weights with the stack axis first: LoraSpec(batch_ndim=1)), or index the "
                "array inside the function instead.")
        st = self.storage_shape
        shape = logical_shape(st[:-1], st[-1], self.axis)
        if explicitly_typed(self.codes):  # typed as the dense value its codes' layout gives
            storage = jax.typeof(self.codes).sharding
            entries = tuple(storage.spec)[:-1]
            block = len(shape) + self.axis
            spec = P(*entries[:-1][:block], entries[-1], *entries[:-1][block:])
            return jax.core.ShapedArray(shape, self.dense_dtype,
                                        sharding=storage.update(spec=spec))
        dense = jax.ShapeDtypeStruct(shape, self.dense_dtype)
        # Inside a shard_map it varies over the manual axes its leaves vary over.
        return weight_aval(dense, tuple(x for x in self.leaves() if x is not None))

    @property
    def nbytes(self) -> int:
        """Bytes of every leaf (codes, scales and the rest): what the weight costs."""
        return sum(_nbytes(x) for x in jax.tree_util.tree_leaves(self))

    # -- sharding: the leaves follow the dense value's layout ---------------------------

    def leaf_specs(self, spec: P) -> tuple[P | None, ...]:
        """The `PartitionSpec` of each leaf (codes, scales, mins, scale_scales,
        scale_offset; `None` for absent leaves) when the dense value is laid out as
        `spec`. The block axis's mesh axes shard the blocks (`n_blocks`); a block's
        bytes are never split; double quantization's groups keep the leading axes'."""
        entries = tuple(spec)
        if len(entries) > self.ndim:
            raise ValueError(f"the spec {spec} has more entries than the weight has axes "
                             f"({self.ndim})")
        entries += (None,) * (self.ndim - len(entries))
        block = self.ndim + self.axis
        other = [e for d, e in enumerate(entries) if d != block]
        codes, scales = P(*other, entries[block], None), P(*other, entries[block])
        lead = P(*other[:-1], None) if self.scale_scales is not None else None
        return codes, scales, scales if self.mins is not None else None, lead, lead

    def leaves(self) -> tuple[Any, ...]:
        """`(codes, scales, mins, scale_scales, scale_offset)`, `None` where absent."""
        return self.codes, self.scales, self.mins, self.scale_scales, self.scale_offset

    def with_leaves(self, leaves: Any, **static: Any) -> "QuantizedArray":
        """The same static fields (or `static`'s) around other `leaves()`."""
        codes, scales, mins, ss, so = leaves
        meta = dict(qtype=self.qtype, block_size=self.block_size, axis=self.axis,
                    dense_dtype=self.dense_dtype)
        meta.update(static)
        return QuantizedArray(codes, scales, mins, scale_scales=ss, scale_offset=so, **meta)

    @property
    def sharding(self) -> NamedSharding | None:
        """The dense value's `NamedSharding`, read from the codes' (`None` if the
        codes have none: a single device, a tracer)."""
        sh = getattr(self.codes, "sharding", None)
        if not isinstance(sh, NamedSharding):
            return None
        c = tuple(sh.spec) + (None,) * (self.codes.ndim - len(tuple(sh.spec)))
        n_other = self.codes.ndim - 2
        entries = list(c[:n_other])
        entries.insert(self.ndim + self.axis, c[n_other])
        return NamedSharding(sh.mesh, P(*entries))

    def with_sharding(self, sharding: NamedSharding, where: str = "") -> "QuantizedArray":
        """The same weight with its leaves placed as `sharding` lays out the dense value
        (see `leaf_specs`); abstract leaves (`jax.ShapeDtypeStruct`) get the sharding
        without anything being placed.

        **Arguments:**

        - `sharding`: a `NamedSharding` of the dense (logical) shape.
        - `where`: a name for errors to start with (a parameter's key path).

        **Returns:**

        A `QuantizedArray` whose `sharding` is `sharding`.

        **Raises:**

        `ValueError` (prefixed by `where`) if the sharding would split a block.

        !!! Example

            ```python
            import jax, jax.numpy as jnp
            from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
            import lorax

            mesh = Mesh(jax.devices(), ("fsdp",))
            q = lorax.QuantizedArray.from_dense(jnp.ones((128, 64)), "nf4")
            placed = q.with_sharding(NamedSharding(mesh, P(None, "fsdp")))  # split `out`
            assert placed.sharding.spec == P(None, "fsdp")
            ```
        """
        where = f"{where}: " if where else ""
        if not isinstance(sharding, NamedSharding):
            raise TypeError(f"{where}a QuantizedArray is sharded by a NamedSharding, got "
                            f"{type(sharding).__name__}.")
        try:
            specs = self.leaf_specs(sharding.spec)
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
        n_blocks = self.storage_shape[-1] // self.block_size
        ways = math.prod(sharding.mesh.shape[a] for a in _spec_axes(tuple(specs[0])[-2]))
        if n_blocks % ways:
            length = n_blocks * self.block_size
            smaller = ("" if self.format.fixed_block or length % ways else
                       f", or quantize with a block_size that divides {length // ways}")
            raise ValueError(
                f"{where}the sharding {sharding.spec} splits the block axis (axis "
                f"{self.axis}, {n_blocks} blocks of {self.block_size}) {ways} ways, which "
                "does not divide the blocks: shard another axis, choose a mesh whose "
                f"size divides the number of blocks{smaller}.")
        return self.with_leaves([
            None if leaf is None else _place(leaf, NamedSharding(sharding.mesh, spec))
            for leaf, spec in zip(self.leaves(), specs)])

    def dequantize_storage(self, dtype: Any = None) -> Array:
        """The dense value with the block axis last (`storage_shape`), in `dtype`
        (default `dense_dtype`), rounded once from the float32 values."""
        dtype = self.dense_dtype if dtype is None else jnp.dtype(dtype)
        if explicitly_typed(self.codes):
            # Sharding in types: the lookups and reshapes below have no one result type,
            # so they run as on an Auto mesh, the result laid out as the codes' blocks.
            spec = P(*jax.typeof(self.codes).sharding.spec[:-1])
            return jax.sharding.auto_axes(
                lambda leaves: self.with_leaves(leaves).dequantize_storage(dtype),
                out_sharding=spec)(self.leaves())
        # Host-resident leaves (`lorax.offload_frozen`) are read in device memory.
        codes, scales, mins, ss, so = map(on_device, (self.codes, self.scales, self.mins,
                                                      self.scale_scales, self.scale_offset))
        if ss is not None:
            scales = F.double_dequantize(self.format, scales, ss, so)
        elif self.scaled_in_dense_dtype and dtype == self.dense_dtype:
            return F.scaled_blocks(codes, scales)  # the same values, in the form a GPU GEMM fuses
        w = F.dequantize_blocks(self.format, codes, scales, mins)
        return w.astype(dtype)

    def single_level_scales(self) -> "QuantizedArray":
        """The same weight with double-quantized scales (QLoRA's, bitsandbytes') expanded
        to the float32 values `dequantize` reads, the second level dropped: the codes
        untouched, the values bit for bit the same. For relaying out the blocks where a
        second-level group would straddle the new layout.

        **Returns:**

        A `QuantizedArray` with `scale_scales` and `scale_offset` `None` (`self` where
        there are none).

        **Example:**

        ```python
        import jax, jax.numpy as jnp, lorax
        w = lorax.QuantizedArray.from_dense(
            jax.random.normal(jax.random.PRNGKey(0), (256, 64)), "nf4", double_quant=True)
        plain = w.single_level_scales()
        assert plain.scale_scales is None
        assert jnp.array_equal(plain.dequantize(), w.dequantize())
        ```
        """
        if self.scale_scales is None:
            return self
        scales = F.double_dequantize(self.format, self.scales, self.scale_scales,
                                     self.scale_offset)
        return self.with_leaves((self.codes, scales, self.mins, None, None))

    @property
    def scaled_in_dense_dtype(self) -> bool:
        """int8 or int4 codes whose scales are stored in the 16-bit `dense_dtype`:
        dequantized as one product in that dtype (bit for bit the float32 one), which
        XLA's GPU compiler can fuse into the matrix product reading the codes."""
        return (self.scale_scales is None
                and F.scales_in_dense_dtype(self.format, self.scales.dtype, self.dense_dtype))

    def dequantize(self, dtype: Any = None) -> Array:
        """The dense array.

        **Arguments:**

        - `dtype`: the result's dtype (default: `dense_dtype`, the quantized weight's
          own). The values are computed in float32 and rounded once to it, so
          `dequantize(jnp.float32)` is the exact float32 value even where `dense_dtype`
          is bfloat16.

        **Returns:**

        An array of shape `self.shape`.
        """
        return jnp.moveaxis(self.dequantize_storage(dtype), -1, self.axis)

    def __repr__(self) -> str:
        return (f"QuantizedArray({self.qtype}, shape={self.shape}, dtype={self.dtype}, "
                f"block_size={self.block_size}, axis={self.axis}, {self.nbytes} bytes)")

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def from_dense(cls, w: Array, qtype: str = "nf4", *, block_size: int | None = None,
                   axis: int = -2, double_quant: bool = False, dtype: Any = None,
                   scale_dtype: Any = None) -> "QuantizedArray":
        """Quantize one array.

        **Arguments:**

        - `w`: a floating-point array with at least two axes.
        - `qtype`: one of `"int8"`, `"int4"`, `"s4"`, `"nf4"`, `"q4_0"`, `"q4_1"`, `"q5_0"`,
          `"q5_1"`, `"q8_0"`, or a Hugging Face checkpoint's `"bnb_nf4"`, `"bnb_fp4"`,
          `"bnb_int8"`, `"fp8_e4m3"`, `"int4_zp"` (see [`lorax.quantize`][]; the K-quants
          `"q2_k"` .. `"q6_k"` have no quantizer in lorax: wrap GGUF blocks with
          `from_gguf` or [`lorax.load_gguf`][]).
        - `block_size`: values per block along `axis` (default: the format's; `int8` is
          one block per output channel; the GGUF types are fixed at 32).
        - `axis`: the block axis (default `-2`, an `(in, out)` kernel's input axis).
        - `double_quant`: NF4, `bnb_nf4`, `bnb_fp4` only: also quantize the absmax values
          (8 bits, blocks of 256).
        - `dtype`: the dense value's dtype (default `w`'s).
        - `scale_dtype`: the dtype the scales are stored in (default the format's:
          float32, float16 for GGUF's types, which cannot change). `int8` or `s4` with
          scales in a bfloat16 or float16 `dtype` dequantizes as one product in that
          dtype, which XLA's GPU compiler can fuse into the matrix product (docs/qlora.md).

        **Returns:**

        A `QuantizedArray` of `w`'s shape; if `w` is sharded (a `NamedSharding` over
        several devices), its leaves are sharded the same way (see `with_sharding`).
        """
        fmt = F.get_format(qtype, "QuantizedArray.from_dense")
        double_quant = check_bool("QuantizedArray.from_dense", "double_quant", double_quant)
        shape = tuple(jnp.shape(w))
        check_options(block_size, dtype, "w")
        dtype = jnp.dtype(dtype or jnp.result_type(w))
        check_quantizable(fmt, shape, jnp.result_type(w), axis, block_size, double_quant, "w",
                          scale_dtype)
        bs = resolve_block_size(fmt, shape[axis], block_size)
        sd = None if scale_dtype is None else jnp.dtype(scale_dtype)
        leaves = _quantize_leaves(jnp.asarray(w), qtype, bs, axis, double_quant, sd)
        qa = cls(*leaves[:3], qtype=qtype, block_size=bs, axis=axis, dense_dtype=dtype,
                 scale_scales=leaves[3], scale_offset=leaves[4])
        sharding = getattr(w, "sharding", None)
        if isinstance(sharding, NamedSharding) and len(sharding.device_set) > 1:
            qa = qa.with_sharding(sharding, where="")  # a sharded weight stays sharded
        return qa

    @classmethod
    def from_gguf(cls, data: Any, qtype: str, *, transpose: bool = True,
                  dtype: Any = jnp.float32) -> "QuantizedArray":
        """Wrap a GGUF tensor's blocks as they are on disk (no re-quantization).

        **Arguments:**

        - `data`: the tensor's bytes as `gguf.GGUFReader` (or [`lorax.load_gguf`][])
          lays them out, a `uint8` array `(*rows, bytes_per_row)` (numpy order: an
          `(out, in)` weight or a `(vocab, dim)` embedding, blocks along the last axis).
        - `qtype`: a GGUF block type: `"q4_0"`, `"q4_1"`, `"q5_0"`, `"q5_1"`, `"q8_0"`
          (blocks of 32), `"q2_k"`, `"q3_k"`, `"q4_k"`, `"q5_k"`, `"q6_k"` (256).
        - `transpose`: `True` gives the `(in, out)` kernel `x @ W` expects (block axis
          `-2`); `False` keeps GGUF's `(out, in)` order (block axis `-1`), as an
          embedding table wants. Both are the same bytes.
        - `dtype`: the dense value's dtype.

        **Returns:**

        A `QuantizedArray` whose `dequantize()` equals `gguf.quants.dequantize(data)`
        (transposed if `transpose`) bit for bit, and whose `nbytes` is `data.nbytes`.

        !!! Example

            ```python
            import numpy as np
            import lorax

            # Two rows of one Q4_0 block each: float16 d = 1.0, then 16 bytes of nibbles.
            block = np.concatenate([np.float16(1.0).reshape(1).view(np.uint8),
                                    np.full(16, 0x98, np.uint8)])
            q = lorax.QuantizedArray.from_gguf(np.stack([block, block]), "q4_0", transpose=False)
            assert q.shape == (2, 32) and q.nbytes == 36
            assert (q.dequantize()[:, :16] == 0.0).all() and (q.dequantize()[:, 16:] == 1.0).all()
            ```
        """
        fmt = F.get_format(qtype, "QuantizedArray.from_gguf")
        transpose = check_bool("QuantizedArray.from_gguf", "transpose", transpose)
        rec = fmt.record
        if rec is None:
            gguf_types = ", ".join(n for n, f in F.FORMATS.items() if f.record is not None)
            raise ValueError(f"from_gguf: {qtype!r} is not a GGUF block type ({gguf_types}).")
        data = np.asarray(data)
        if data.dtype != np.uint8 or data.ndim < 2 or data.shape[-1] % rec.size:
            raise ValueError(
                f"from_gguf: expected uint8 bytes (*rows, n * {rec.size}) for {qtype}, got "
                f"{data.dtype} {data.shape}.")
        blocks = data.reshape(*data.shape[:-1], data.shape[-1] // rec.size, rec.size)

        def f16(at: int) -> np.ndarray:
            return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0]

        codes = np.ascontiguousarray(blocks[..., rec.codes:rec.codes + fmt.code_bytes(fmt.block_size)])
        if fmt.bits == 8:
            codes = codes.view(np.int8)
        mins = None if rec.m is None else jnp.asarray(f16(rec.m))
        return cls(jnp.asarray(codes), jnp.asarray(f16(rec.d)), mins, qtype=qtype,
                   block_size=fmt.block_size, axis=-2 if transpose else -1, dense_dtype=dtype)


def _spec_axes(entry: Any) -> tuple:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _nbytes(x: Any) -> int:
    # `int4` codes are two per byte where they live on an accelerator (XLA packs them);
    # NumPy's and XLA:CPU's copies spend a byte on each.
    if jnp.dtype(x.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4)):
        return -(-x.size // 2)
    return x.size * jnp.dtype(x.dtype).itemsize


def _place(leaf: Any, sharding: NamedSharding) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return jax.device_put(leaf, sharding)


def resolve_block_size(fmt: F.Format, k: int, block_size: int | None) -> int:
    if fmt.fixed_block or block_size is None:
        return fmt.block_size or k
    return int(block_size)


def check_quantizable(fmt: F.Format, shape: tuple[int, ...], dtype: Any, axis: int,
                      block_size: int | None, double_quant: bool, where: str,
                      scale_dtype: Any = None) -> None:
    """Raise a `ValueError` naming `where` if the array cannot be quantized as asked."""
    if fmt.quantize is None:
        quantizable = ", ".join(n for n, f in F.FORMATS.items() if f.quantize is not None)
        raise ValueError(
            f"quantize: lorax has no {fmt.name} quantizer (for {where}); the K-quants come "
            f"from GGUF files as they are (QuantizedArray.from_gguf, lorax.load_gguf). "
            f"Quantizable types: {quantizable}.")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"quantize: {where} has dtype {dtype}; only floating-point "
                         "arrays can be quantized.")
    if len(shape) < 2:
        raise ValueError(f"quantize: {where} has shape {shape}; quantized weights need at "
                         "least two axes (vectors and scalars stay dense).")
    if not -len(shape) <= axis < 0:
        raise ValueError(f"quantize: block axis {axis} is out of range for {where} of shape "
                         f"{shape} (count it from the end, -1 to -{len(shape)}).")
    if fmt.fixed_block and block_size not in (None, fmt.block_size):
        raise ValueError(f"quantize: {fmt.name} blocks are {fmt.block_size} values; got "
                         f"block_size={block_size} for {where}.")
    k = shape[axis]
    bs = resolve_block_size(fmt, k, block_size)
    if bs < 1 or k % bs or (fmt.bits == 4 and bs % 2):
        raise ValueError(
            f"quantize: {where} has shape {shape}; its block axis ({axis}, length {k}) is "
            f"not a multiple of the {fmt.name} block size {bs}"
            + (" (4-bit blocks need an even size)" if fmt.bits == 4 and bs % 2 else "")
            + ". Pass another block_size (or leave this weight dense with LORA_FULL).")
    if double_quant and not fmt.double_quantizable:
        kinds = ", ".join(n for n, f in F.FORMATS.items() if f.double_quantizable)
        raise ValueError(f"quantize: double_quant is for the absmax-scaled 4-bit types "
                         f"({kinds}); got qtype {fmt.name!r}.")
    if scale_dtype is not None:
        check_scale_dtype(fmt, scale_dtype, double_quant, where)


def check_options(block_size: Any, dtype: Any, where: str) -> None:
    """`block_size` and the dense `dtype`, checked before any leaf is looked at (where a
    leaf that cannot be quantized may stay dense, a bad option must not make them all)."""
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(
            block_size, (int, np.integer)) or block_size < 1):
        raise ValueError(f"quantize: block_size must be a positive int (or None for the "
                         f"format's own); got {block_size!r} (for {where}).")
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"quantize: dtype is what the weights dequantize to and must be a "
                         f"floating-point dtype; got {jnp.dtype(dtype)} (for {where}).")


def check_scale_dtype(fmt: F.Format, scale_dtype: Any, double_quant: bool, where: str) -> None:
    dt = jnp.dtype(scale_dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"quantize: scale_dtype must be a floating-point dtype; got {dt} "
                         f"(for {where}).")
    if not fmt.native and dt != jnp.dtype(fmt.scale_dtype):
        raise ValueError(f"quantize: {fmt.name} stores its scales as {jnp.dtype(fmt.scale_dtype)}"
                         f" (GGUF's layout); got scale_dtype={dt} (for {where}).")
    if double_quant:
        raise ValueError(f"quantize: double_quant stores the scales as 8-bit codes; "
                         f"scale_dtype={dt} cannot apply too (for {where}).")


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _quantize_leaves(w: Array, qtype: str, block_size: int, axis: int,
                     double_quant: bool, scale_dtype: Any = None) -> tuple[Any, ...]:
    fmt = F.FORMATS[qtype]
    st = jnp.moveaxis(w, axis, -1).astype(jnp.float32)
    blocks = split_last(st, block_size)
    stored = jnp.dtype(fmt.scale_dtype if scale_dtype is None else scale_dtype)
    if fmt.native and stored != jnp.dtype(fmt.scale_dtype):
        # The codes are computed against the scales as stored, not as first computed.
        q, d, m = fmt.quantize(blocks, lambda d: d.astype(stored).astype(jnp.float32))
    else:
        q, d, m = fmt.quantize(blocks)
    codes = F.pack(fmt, q).astype(fmt.code_dtype)
    d = d.astype(stored)
    m = None if m is None else m.astype(stored)
    if double_quant:
        dq, ds, off = F.double_quantize(d.astype(jnp.float32), fmt.double_code)
        return codes, dq, m, ds, off
    return codes, d, m, None, None


