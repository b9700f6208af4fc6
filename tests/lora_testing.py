"""Helpers shared by the rule tests: LoRA weights from a seed, merged references, and
`(gradient, output)` of a function in one pass."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np

import lorax
from lorax._formats._safetensors_files import open_checkpoint

F32 = np.float32


def put(x):
    """numpy -> device without a compile (`jnp.asarray` of an ndarray stages it through XLA)."""
    return jax.device_put(np.asarray(x))


def is_lw(x):
    return isinstance(x, lorax.LoraWeight)


def make_lw(seed, w_shape, b_shape, a_shape, alpha=2.0, dtype=np.float32):
    """A `LoraWeight` with N(0, 1) `w` (in `dtype`) and N(0, 0.25) f32 factors."""
    rng = np.random.default_rng(seed)
    normal = lambda shape, s=1.0, dt=np.float32: put((s * rng.standard_normal(shape)).astype(dt))  # noqa: E731
    return lorax.LoraWeight(normal(w_shape, dt=dtype), a=normal(a_shape, 0.5), b=normal(b_shape, 0.5), alpha=alpha)


def dense(tree):
    """`tree` with every `LoraWeight` replaced by its merged weight."""
    return jax.tree.map(lambda x: x.materialize() if is_lw(x) else x, tree, is_leaf=is_lw)


def np_materialize(lw):
    """`w + (alpha/k) b @ a` in numpy, independent of `LoraWeight.materialize` (with
    non-contiguous `m_axes`, each axis of `b @ a` goes back where `w` has it)."""
    batch, m, n = lw.axes
    w, b, a = (np.asarray(v, np.float64) for v in (lw.w, lw.b, lw.a))
    k = lw.rank
    ba = b.reshape(math.prod(w.shape[i] for i in batch), -1, k) @ a.reshape(
        math.prod(w.shape[i] for i in batch), k, -1)
    ba = ba.reshape([w.shape[i] for i in (*batch, *m, *n)])
    return w + lw.alpha / k * np.transpose(ba, np.argsort((*batch, *m, *n)))


def float_leaves(tree):
    return [x for x in jax.tree.leaves(dense(tree)) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


def grad_and_out(fn, cts, argnum, mat_inputs):
    """`args -> (d<ct, fn(args)>/d args[argnum], fn(args))` in one pass; with
    `mat_inputs`, `fn` gets the merged weights (the dense reference)."""
    def loss(diff, args):
        args = list(args)
        args[argnum] = diff
        out = fn(*(dense(args) if mat_inputs else args))
        leaves = float_leaves(out)
        return sum(jnp.vdot(c.astype(F32), o.astype(F32)) for c, o in zip(cts, leaves, strict=True)), out

    grad = jax.grad(loss, has_aux=True, allow_int=True)
    return lambda args: grad(args[argnum], args)


def tiny_llama(key, n_layers=2, dim=64, hidden=128, n_heads=4, n_kv_heads=2, vocab=256,
               scale=0.1, embed_scale=0.1):
    """`(cfg, params)` of a small random model for the main job's `llama.py`: stacked
    `(layers, in, out)` kernels, unit norm scales, a tied embedding. The weights use the
    first 8 of `jax.random.split(key, 12)`; callers draw inputs from the others."""
    from examples.shakespeare import llama

    cfg = llama.Config(n_layers=n_layers, dim=dim, hidden=hidden, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, rope_theta=10000.0, norm_eps=1e-5, vocab=vocab)
    k = iter(jax.random.split(key, 12))
    L, d, h = n_layers, dim, hidden
    kv = d // n_heads * n_kv_heads
    params = {"embed": jax.random.normal(next(k), (vocab, d)) * embed_scale,
              "layers": {"attn_norm": jnp.ones((L, d)), "mlp_norm": jnp.ones((L, d)),
                         **{n: jax.random.normal(next(k), (L, a, b)) * scale for n, (a, b) in
                            dict(q=(d, d), k=(d, kv), v=(d, kv), o=(d, d), gate=(d, h),
                                 up=(d, h), down=(h, d)).items()}},
              "final_norm": jnp.ones(d)}
    return cfg, params


def gguf_blocks(qtype, shape, seed=0, std=None):
    """Random GGUF blocks of `qtype` for a numpy-order tensor `shape` (`(..., rows, n)`,
    blocks along the last axis): `uint8 (..., rows, n / block * block_bytes)`, as a GGUF
    file stores them. Every code byte random; the float16 `d` (and `m`) finite, of
    random sign and magnitude (1e-7 .. 10: float16 subnormals included), or with `std`
    scaled so the values have about that standard deviation."""
    import gguf

    from lorax._quant import _formats as F

    fmt = F.FORMATS[qtype]
    rec = fmt.record
    rng = np.random.default_rng(seed)
    n_blocks = shape[-1] // fmt.block_size
    data = rng.integers(0, 256, (*shape[:-1], n_blocks, rec.size), dtype=np.uint8)
    fields = [rec.d] if rec.m is None else [rec.d, rec.m]
    mag = rng.standard_normal((len(fields), *shape[:-1], n_blocks)) * 10 ** rng.uniform(-7, 1, (len(fields), *shape[:-1], n_blocks))
    if std is not None:  # values are linear in (d, m): centre with m, then rescale both
        mag = rng.uniform(0.5, 1.5, mag.shape)

        def values(mag):
            for at, v in zip(fields, mag):
                data[..., at:at + 2] = v.astype(np.float16)[..., None].view(np.uint8)
            # gguf-py's numpy dequantizer: no XLA compile per shape
            return gguf.quants.dequantize(data.reshape(*shape[:-1], -1),
                                          gguf.GGMLQuantizationType[qtype.upper()])

        if len(fields) == 2:
            mu_d = values(mag * np.array([1.0, 0.0]).reshape(2, *[1] * (mag.ndim - 1))).mean()
            mu_m = values(mag * np.array([0.0, 1.0]).reshape(2, *[1] * (mag.ndim - 1))).mean()
            mag[1] *= -mu_d / mu_m
        mag = mag * std / float(np.std(values(mag)))
    for at, v in zip(fields, mag):
        data[..., at:at + 2] = v.astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(*shape[:-1], -1)


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write_safetensors(path, tensors, metadata=None):
    """A safetensors file of numpy arrays, ml_dtypes' (bfloat16, float8) included, which
    `safetensors.numpy` does not write."""
    header, offset = {}, 0
    for name, x in tensors.items():
        header[name] = {"dtype": _SAFETENSORS_DTYPES[np.asarray(x).dtype.name],
                        "shape": list(np.shape(x)), "data_offsets": [offset, offset + np.asarray(x).nbytes]}
        offset += np.asarray(x).nbytes
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())


def read_safetensors_all(path):
    """Every tensor of a safetensors file, in file order (ml_dtypes dtypes included)."""
    ck = open_checkpoint(path, "test")
    return {name: ck.read(name) for name in ck.entries}
