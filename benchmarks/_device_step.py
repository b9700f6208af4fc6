"""One cell of `benchmarks.accelerator`, in a process of its own: a real training step on the
default device, its parameters random values made on that device.

    python -m benchmarks._device_step MODEL:METHOD:BATCH:REMAT:ATTENTION [--steps N] [--trace DIR]
    python -m benchmarks._device_step --ceiling     # the device's bf16 matrix rate

Prints one line, `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lorax

from . import scale as S
from ._batch import learning_windows
from .accelerator import GiB, Cell

DTYPE = jnp.bfloat16
HOST_BLOCK = 1 << 26  # bytes of fresh random codes per host leaf (`_host_fill`)
WEIGHT_STD = 0.02  # a dense weight's values (transformers' `initializer_range` for Llama)
SCALE = 1e-3  # a quantized weight's float scales before `quant_scale` sizes them


# -- parameters on the device ------------------------------------------------------------------


def _fill(sds: Any, key: Any, scale: float) -> Any:
    """Random values of `sds`'s kind: codes as random bits; `scale` (non-zero: a quantized
    weight's float leaves) `scale * (1 + U)`; else normal with `WEIGHT_STD`."""
    dt = jnp.dtype(sds.dtype)
    if dt == jnp.dtype(jnp.int4):  # 4-bit codes, one per element
        return jax.random.randint(key, sds.shape, -8, 8, jnp.int8).astype(dt)
    if jnp.issubdtype(dt, jnp.integer):  # codes: random bits
        bits = jax.random.bits(key, sds.shape, jnp.dtype(f"uint{dt.itemsize * 8}"))
        return jax.lax.bitcast_convert_type(bits, dt)
    if scale:  # a quantized weight's scales: small and positive
        return (scale * (1 + jax.random.uniform(key, sds.shape))).astype(dt)
    return (WEIGHT_STD * jax.random.normal(key, sds.shape)).astype(dt)


def _host_fill(sds: Any, seed: int, scale: float) -> Any:
    """`_fill`'s kind of values made by NumPy, put in the device's host memory: a frozen
    stack is never whole on the device, not even while it is made."""
    rng, dt = np.random.default_rng(seed), jnp.dtype(sds.dtype)
    if dt == jnp.dtype(jnp.int4):  # (NumPy's int4 takes a byte each: one code per byte)
        n = int(np.prod(sds.shape))
        block = rng.integers(-8, 8, min(n, HOST_BLOCK), np.int8)
        x = _repeated(block, n).astype(dt).reshape(sds.shape)
    elif jnp.issubdtype(dt, jnp.integer):
        # One random block repeated: NumPy's generator made ~0.3 GB/s on the card's host, so
        # 70B's 33 GiB of codes drawn whole took 100 s of device time, and a code's value
        # does not change the step's speed.
        n = int(np.prod(sds.shape)) * dt.itemsize
        x = _repeated(np.frombuffer(rng.bytes(min(n, HOST_BLOCK)), np.uint8), n)
        x = x.view(dt).reshape(sds.shape)
    elif scale:
        x = (scale * (1 + rng.random(sds.shape, np.float32))).astype(dt)
    else:
        x = (WEIGHT_STD * rng.standard_normal(sds.shape, np.float32)).astype(dt)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    return jax.device_put(x, host)


def _repeated(block: np.ndarray, n: int) -> np.ndarray:
    """`np.resize(block, n)` at copy speed (a broadcast store, not concatenated copies)."""
    x, whole = np.empty(n, block.dtype), n - n % block.size
    x[:whole].reshape(-1, block.size)[:] = block
    x[whole:] = block[:n - whole]
    return x


def materialise(abstract: Any, seed: int = 0, frozen_on_host: bool = False,
                quant_scale: float = SCALE) -> Any:
    """Random arrays of an abstract tree, each leaf made on the device by a jitted fill
    (`QuantizedArray` leaves as codes and scales, so no dense weight is made for them, its
    float leaves `quant_scale * (1 + U)`: `quant_scale_for` gives the size at which the
    weights it codes have `WEIGHT_STD`); norm weights (a leaf named `*norm`) are ones, as a
    model starts training. `frozen_on_host`: each `LoraWeight`'s `w` and each bare
    `QuantizedArray` made in host memory instead (what `lorax.offload_frozen` would have
    put there)."""
    is_q = lambda x: isinstance(x, lorax.QuantizedArray)  # noqa: E731
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_q)
    key = jax.random.PRNGKey(seed)

    def values(i: int, path: Any, node: Any) -> Any:
        if is_norm(path):
            return jnp.ones(node.shape, node.dtype)
        host = frozen_on_host and (is_q(node) or any(getattr(k, "name", None) == "w" for k in path))
        scale = quant_scale if is_q(node) else 0.0
        leaves, tree = jax.tree.flatten(node)  # a QuantizedArray's codes and scales
        return jax.tree.unflatten(tree, [
            _host_fill(s, (seed, i, j), scale) if host else _device_fill(
                jax.random.fold_in(jax.random.fold_in(key, i), j), tuple(s.shape),
                jnp.dtype(s.dtype), scale)
            for j, s in enumerate(leaves)])

    out = [values(i, path, node) for i, (path, node) in enumerate(paths)]
    return jax.tree_util.tree_unflatten(treedef, out)


def is_norm(path: Any) -> bool:
    """A norm's weight: the last dict key on its path ends with `norm` (`attn_norm`,
    `mlp_norm`, `final_norm`)."""
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return bool(names) and str(names[-1]).endswith("norm")


@functools.cache
def quant_scale_for(method: str) -> float:
    """The float-scale size at which `method`'s random codes decode to weights of standard
    deviation `WEIGHT_STD` (as the dense methods' weights): measured on the tiny model's
    weights of the same format filled at `SCALE` (a format's decoding is linear in its
    float leaves, and the codes are random bits whatever the shape)."""
    abstract, _ = S.build(S.config("tiny"), method.removesuffix("+host"), DTYPE)
    params = materialise(abstract)
    is_q = lambda x: isinstance(x, lorax.QuantizedArray)  # noqa: E731
    stds = [float(jnp.std(q.dequantize().astype(jnp.float32)))
            for q in jax.tree.leaves(params, is_leaf=is_q) if is_q(q)]
    return SCALE * WEIGHT_STD / float(np.mean(stds)) if stds else SCALE


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_fill(key: Any, shape: tuple, dtype: Any, scale: float) -> Any:
    # One program per leaf signature, not one for the whole tree: unrolled layers' hundreds
    # of leaves in one program took XLA:GPU over 5 minutes to compile (an H200, jax 0.11.2);
    # each layer's leaves share their signatures, so a model compiles a handful.
    return _fill(jax.ShapeDtypeStruct(shape, dtype), key, scale)


# -- the methods -------------------------------------------------------------------------------


def hand_block(cfg: Any, x: Any, layer: dict) -> Any:
    """`llama.block` with LoRA written into it by hand (factors cast to the activations'
    dtype, as lorax's rule casts them to the weight's)."""
    L = S.LLAMA
    b, t, _ = x.shape
    hd = cfg.dim // cfg.n_heads

    def lin(h: Any, name: str) -> Any:
        a, bb = layer[name + "_a"].astype(h.dtype), layer[name + "_b"].astype(h.dtype)
        return h @ layer[name] + (h @ a) @ bb

    h = L.rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    q = L.rope(lin(h, "q").reshape(b, t, cfg.n_heads, hd), cfg.rope_theta)
    k = L.rope(lin(h, "k").reshape(b, t, cfg.n_kv_heads, hd), cfg.rope_theta)
    v = lin(h, "v").reshape(b, t, cfg.n_kv_heads, hd)
    x = x + lin(L.attention(q, k, v, implementation=cfg.attention), "o")
    h = L.rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
    return x + lin(jax.nn.silu(lin(h, "gate")) * lin(h, "up"), "down")


def hand_factors(layer: dict, key: Any) -> dict:
    """LoRA factors for one layers dict (stacked or one layer's): `a` random, `b` zero."""
    factors = {}
    for i, name in enumerate(S.TARGETS):
        *lead, d_in, d_out = layer[name].shape
        factors[name + "_a"] = 0.01 * jax.random.normal(
            jax.random.fold_in(key, i), (*lead, d_in, S.RANK))
        factors[name + "_b"] = jnp.zeros((*lead, S.RANK, d_out), jnp.float32)
    return factors


def setup(cfg: Any, method: str, layers: str = "scan") -> tuple[Any, Any, Callable]:
    """(trainable, frozen, loss(trainable, frozen, windows)), the arrays on the device."""
    if method == "hand":
        dense = materialise(S.abstract_params(cfg, DTYPE, layers))
        keys = iter(jax.random.split(jax.random.PRNGKey(1), cfg.n_layers))
        factors = S.map_layers(lambda layer: hand_factors(layer, next(keys)), dense["layers"])
        S.LLAMA.block = hand_block  # this process runs this one cell

        def hand_loss(t: Any, f: Any, w: Any) -> Any:
            fl, tl = f["layers"], t["layers"]
            merged = ([dict(a, **b) for a, b in zip(fl, tl)] if isinstance(fl, list)
                      else dict(fl, **tl))
            return S.LLAMA.loss(cfg, dict(f, layers=merged), w)
        return {"layers": factors}, dense, hand_loss
    abstract, spec = S.build(cfg, method.removesuffix("+host"), DTYPE, layers)
    params = materialise(abstract, frozen_on_host=method.endswith("+host"),
                         quant_scale=quant_scale_for(method) if "qlora" in method else SCALE)
    trainable, frozen = lorax.partition(params, spec)
    apply = lorax.lora(lambda p, w: S.LLAMA.loss(cfg, p, w), on_materialize="allow")
    return trainable, frozen, lambda t, f, w: apply(lorax.combine(t, f), w)


# -- the step ----------------------------------------------------------------------------------


def compiled_step(cell: Cell) -> tuple[Any, tuple, dict]:
    """The jitted Adam step of `cell`, compiled, its arguments, and the setup facts."""
    cfg, seq = S.config(cell.model, cell.attention, cell.remat), S.MODELS[cell.model][-1]
    t0 = time.perf_counter()
    trainable, frozen, loss = setup(cfg, cell.method, cell.layers)
    optimizer = optax.adam(1e-4)
    state = optimizer.init(trainable)
    windows = jnp.asarray(learning_windows(cell.batch, seq, cfg.vocab))  # every stack's tokens
    jax.block_until_ready((trainable, frozen, state, windows))
    facts = dict(setup_s=time.perf_counter() - t0, resident_gib=_in_use() / GiB,
                 frozen_gib=_nbytes(frozen) / GiB, trainable_gib=_nbytes(trainable) / GiB,
                 host_gib=sum(x.nbytes for x in jax.tree.leaves(frozen)
                              if x.sharding.memory_kind == "pinned_host") / GiB)

    def step(trainable: Any, frozen: Any, opt_state: Any, windows: Any) -> tuple:
        value, grads = jax.value_and_grad(lambda t: loss(t, frozen, windows))(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    t0 = time.perf_counter()
    args = (trainable, frozen, state, windows)
    options = compiler_options(cell.method)
    compiled = jax.jit(step, donate_argnums=(0, 2)).lower(*args).compile(compiler_options=options)
    facts.update(compile_s=time.perf_counter() - t0, compiler_options=options or "")
    m = compiled.memory_analysis()
    facts.update(xla_args_gib=m.argument_size_in_bytes / GiB, xla_temps_gib=m.temp_size_in_bytes / GiB,
                 xla_peak_gib=(m.argument_size_in_bytes + m.temp_size_in_bytes
                               + m.output_size_in_bytes - m.alias_size_in_bytes) / GiB)
    return compiled, args, facts


# XLA's fusion of a dequantization into the product reading it (`benchmarks.gpu_compile`'s
# `dequant`): int8 or int4 codes times scales in the weight's dtype, the dot merger off so
# that a layer's k and v products are not joined over written weights (docs/qlora.md).
# int4 codes (`s4`) stay packed along the axis they are stored in: XLA would otherwise
# lay every stacked weight out again for the backward product, once per step, whole.
DEQUANT_OPTIONS = {"xla_gpu_experimental_enable_subchannel_dequantisation_fusion": True,
                   "xla_gpu_dot_merger_threshold_mb": 0,
                   "xla_gpu_experimental_pack_dot_operands_along_k_dimension": False}


def compiler_options(method: str) -> dict[str, Any] | None:
    """The compile options a method is measured with: `qlora-int8-bf16` and
    `qlora-s4-bf16` on a GPU, XLA's dequantization fusion; every other method, none."""
    fused = method.removesuffix("+host") in ("qlora-int8-bf16", "qlora-s4-bf16")
    if fused and jax.default_backend() == "gpu":
        return dict(DEQUANT_OPTIONS)
    return None


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _in_use(key: str = "bytes_in_use") -> int:
    return (jax.devices()[0].memory_stats() or {}).get(key, 0)


def run(cell: Cell, steps: int, trace: Path | None) -> dict[str, Any]:
    compiled, (trainable, frozen, state, windows), row = compiled_step(cell)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainable, state, value = compiled(trainable, frozen, state, windows)
        losses.append(float(jax.block_until_ready(value)))  # the step's end
        times.append(time.perf_counter() - t0)
    timed = times[min(2, steps - 1):]  # the first two: warm-up
    seq = S.MODELS[cell.model][-1]
    cfg = S.config(cell.model, cell.attention, cell.remat)
    q = jnp.zeros((1, 1, cfg.n_heads, cfg.dim // cfg.n_heads), DTYPE)
    row.update(cell=str(cell), **cell._asdict(), device=jax.devices()[0].device_kind,
               attention_used=S.LLAMA._attention_implementation(cell.attention, q),
               platform=jax.default_backend(), jax=jax.__version__, seq=seq,
               xla_flags=os.environ.get("XLA_FLAGS", ""),
               step_s=statistics.median(timed), step_s_all=[round(t, 4) for t in times],
               tokens_per_s=cell.batch * seq / statistics.median(timed),
               peak_gib=_in_use("peak_bytes_in_use") / GiB,
               bytes_limit_gib=_in_use("bytes_limit") / GiB, losses=[round(v, 4) for v in losses],
               first_loss=losses[0], last_loss=losses[-1],
               finite=all(v == v and abs(v) != float("inf") for v in losses))
    if trace is not None:
        row["trace"] = profile(lambda: compiled(trainable, frozen, state, windows),
                               trace / str(cell).replace(":", "_"))
    return row


# -- where the time goes -----------------------------------------------------------------------

KINDS = (("attention", r"sdpa|fmha|flash|attn|cudnn"),
         ("matmul", r"gemm|xmma|nvjet|cutlass|cublas|matmul|\bdot"),
         ("copy", r"memcpy|memset|copy|dynamic.update.slice"))


def kind_of(kernel: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, kernel, re.IGNORECASE):
            return kind
    return "other"


def profile(fn: Callable, where: Path) -> dict[str, Any]:
    """One call of `fn` under JAX's profiler; the device kernels' time, by kind and the
    longest kernels (a failed profile is reported, not raised: the timings stand)."""
    try:
        with jax.profiler.trace(str(where), create_perfetto_trace=True):
            jax.block_until_ready(fn())
        path = max(where.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
        with gzip.open(path, "rt") as f:
            return summarise(json.load(f))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def summarise(trace: dict, top: int = 12) -> dict[str, Any]:
    """Kernel time (ms) by kind and the `top` longest kernels, from a Perfetto trace:
    the GPU streams' events where there are any (else every complete event)."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    procs = {e.get("pid"): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in procs.items() if "GPU" in n or "gpu" in n}
    spans = [e for e in events if e.get("ph") == "X" and (not gpu or e.get("pid") in gpu)]
    streams = [e for e in spans if names.get((e.get("pid"), e.get("tid")), "").startswith("Stream")]
    spans = streams or spans
    by_kernel: dict[str, float] = {}
    for e in spans:
        by_kernel[e.get("name", "?")] = by_kernel.get(e.get("name", "?"), 0.0) + e.get("dur", 0) / 1e3
    by_kind: dict[str, float] = {}
    for name, ms in by_kernel.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
    # Which stream ran the copies says whether they could overlap the computation.
    by_stream: dict[str, dict[str, float]] = {}
    for e in spans:
        kinds = by_stream.setdefault(names.get((e.get("pid"), e.get("tid")), "?")[:60], {})
        kind = kind_of(e.get("name", "?"))
        kinds[kind] = kinds.get(kind, 0.0) + e.get("dur", 0) / 1e3
    longest = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    threads: dict[str, float] = {}  # what the trace holds, to check the choice above
    for e in (e for e in events if e.get("ph") == "X"):
        where = f"{procs.get(e.get('pid'), '?')} / {names.get((e.get('pid'), e.get('tid')), '?')}"
        threads[where] = threads.get(where, 0.0) + e.get("dur", 0) / 1e3
    return {"device_events": "gpu streams" if streams else ("gpu" if gpu else "all"),
            "threads_ms": sorted(([k[:80], round(v, 1)] for k, v in threads.items()),
                                 key=lambda kv: -kv[1])[:10],
            "busy_ms": round(sum(by_kernel.values()), 2),
            "by_kind_ms": {k: round(v, 2) for k, v in sorted(by_kind.items())},
            "by_stream_ms": {t: {k: round(v, 2) for k, v in sorted(kinds.items())}
                             for t, kinds in by_stream.items()},
            "longest_ms": [[n[:120], round(ms, 2)] for n, ms in longest]}


# -- the device's matrix rate ------------------------------------------------------------------


def ceiling(n: int = 8192, reps: int = 20) -> dict[str, Any]:
    """bf16 `n x n x n` matrix products on random data: TFLOP/s (the median of `reps`
    timed calls, each the mean of 10 products chained in one program)."""
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), DTYPE) for i in (0, 1))
    if jax.default_backend() == "cpu":
        n, a, b = 512, a[:512, :512], b[:512, :512]

    @jax.jit
    def ten(a: Any, b: Any) -> Any:
        return jax.lax.fori_loop(0, 10, lambda i, x: (x @ b) * 1e-3, a)  # bounded values

    jax.block_until_ready(ten(a, b))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(ten(a, b))
        times.append((time.perf_counter() - t0) / 10)
    return {"ceiling_tflops": 2 * n**3 / statistics.median(times) / 1e12, "n": n,
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
            "jax": jax.__version__, **device_memory()}


def device_memory() -> dict[str, float]:
    """The card's memory, GiB: the allocator's limit over the share of the card it was
    given (JAX's default .75), where the device reports a limit (a GPU; not the CPU)."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    share = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION") or ".75"
    return {"device_memory_gib": limit / float(share) / GiB} if limit else {}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cell", nargs="?")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trace", type=Path, default=None)
    p.add_argument("--ceiling", action="store_true")
    args = p.parse_args(argv)
    row = ceiling() if args.ceiling else run(Cell.parse(args.cell), args.steps, args.trace)
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
