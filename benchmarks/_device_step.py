"""One cell of `benchmarks.accelerator`, in a process of its own: a real training step on the
default device, its parameters random values made on that device.

    python -m benchmarks._device_step MODEL:METHOD:BATCH:REMAT:ATTENTION [--steps N] [--trace DIR]
    python -m benchmarks._device_step --ceiling     # the device's bf16 matrix rate

Prints one line, `RESULT {json}`.
"""

from __future__ import annotations

import argparse
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
import optax

from . import _common as C
from . import _llama as L
from ._batch import MODELS, learning_windows
from ._llama import DEQUANT_OPTIONS, DTYPE  # noqa: F401  (docs/gpu-measurements.md names it here)
from .accelerator import Cell

GiB = 2**30


# -- the step ----------------------------------------------------------------------------------


def compiled_step(cell: Cell) -> tuple[Any, tuple, dict]:
    """The jitted Adam step of `cell`, compiled, its arguments, and the setup facts."""
    cfg, seq = L.config(cell.model, cell.attention, cell.remat), MODELS[cell.model][-1]
    t0 = time.perf_counter()
    trainable, frozen, loss = L.setup(cfg, cell.method, cell.layers)
    optimizer = optax.adam(1e-4)
    state = optimizer.init(trainable)
    windows = jnp.asarray(learning_windows(cell.batch, seq, cfg.vocab))  # every stack's tokens
    jax.block_until_ready((trainable, frozen, state, windows))
    facts = dict(setup_s=time.perf_counter() - t0, resident_gib=_in_use() / GiB,
                 frozen_gib=_nbytes(frozen) / GiB, trainable_gib=_nbytes(trainable) / GiB,
                 host_gib=sum(x.nbytes for x in jax.tree.leaves(frozen)
                              if x.sharding.memory_kind == "pinned_host") / GiB)
    t0 = time.perf_counter()
    args = (trainable, frozen, state, windows)
    options = L.compiler_options(cell.method)
    compiled = jax.jit(L.adam_step(loss, optimizer), donate_argnums=(0, 2)).lower(*args).compile(
        compiler_options=options)
    facts.update(compile_s=time.perf_counter() - t0, compiler_options=options or "")
    m = C.memory_gib(compiled.memory_analysis())
    facts.update(xla_args_gib=m["args"], xla_temps_gib=m["temps"], xla_peak_gib=m["peak"])
    return compiled, args, facts


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
    seq = MODELS[cell.model][-1]
    cfg = L.config(cell.model, cell.attention, cell.remat)
    q = jnp.zeros((1, 1, cfg.n_heads, cfg.dim // cfg.n_heads), DTYPE)
    row.update(cell=str(cell), **cell._asdict(), device=jax.devices()[0].device_kind,
               attention_used=L.LLAMA._attention_implementation(cell.attention, q),
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
