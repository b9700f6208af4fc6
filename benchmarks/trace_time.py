"""Trace + lower time and compile time of the training step: lorax vs hand-written LoRA.

For the relu MLP at dim 256 (batch 64, rank 8) with 4 and 32 layers: the wall time of
`jax.jit(step).lower(*args)` (tracing, the lorax re-trace included, and lowering to
StableHLO) and, separately, of `.compile()` (XLA). Each repetition clears JAX's caches
(`jax.clear_caches()`) and builds fresh step functions, so nothing is reused from the
previous one; implementations are interleaved within a repetition (rotating order) and
the lorax / hand-written ratios are paired per repetition; medians over repetitions.
One discarded warm-up repetition first (imports, first-use initialisation).

    python -m benchmarks.trace_time [--quick] [--out DIR] [--reps N]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

import jax

from . import _common as C
from . import _models as M

IMPLS = ("hand_lora", "lorax_partition", "lorax_wrap")
DIM, BATCH, RANK = 256, 64, 8


def _time_one(impl: str, layers: int) -> tuple[float, float, float, float]:
    """(trace + lower, compile, trace alone, trace + lower process CPU time) seconds;
    `.lower()` is `.trace().lower()`."""
    model = M.mlp(BATCH, DIM, layers=layers)
    b = M.build(impl, model, M.make_weights(model, abstract=True), M.make_x(model, abstract=True),
                rank=RANK, donate=True, abstract=True)
    jitted = b.jit()
    c0 = time.process_time()
    t0 = time.perf_counter()
    traced = jitted.trace(*b.args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    c2 = time.process_time()
    lowered.compile()
    t3 = time.perf_counter()
    return t2 - t0, t3 - t2, t1 - t0, c2 - c0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = C.parser(__doc__, rounds=False)
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 7; quick 1)")
    p.add_argument("--layers", default=None, help="comma-separated (default 4,32; quick 1,2)")
    a = p.parse_args(argv)
    a.reps = a.reps or (1 if a.quick else 7)
    a.layers = [int(v) for v in (a.layers or ("1,2" if a.quick else "4,32")).split(",")]
    return a


def _measure(a: argparse.Namespace, clock: C.Clock) -> list[dict[str, Any]]:
    """Every implementation at every depth, `a.reps` times, rotating the order."""
    for impl in ("lorax_partition", "hand_lora")[: 1 if a.quick else 2]:
        _time_one(impl, 1)  # warm-up: first-use initialisation
    raw: list[dict[str, Any]] = []
    for rep in range(a.reps):
        for layers in a.layers:
            for impl in IMPLS[rep % len(IMPLS):] + IMPLS[: rep % len(IMPLS)]:
                jax.clear_caches()
                gc.collect()
                lower, comp, trace, cpu = _time_one(impl, layers)
                raw.append(dict(rep=rep, layers=layers, impl=impl, lower_s=lower, compile_s=comp,
                                trace_s=trace, lower_cpu_s=cpu))
        clock.log(f"rep {rep + 1}/{a.reps}")
    return raw


def _row(raw: list[dict[str, Any]], layers: int, impl: str) -> dict[str, Any]:
    rs = [r for r in raw if r["layers"] == layers and r["impl"] == impl]
    hand = {r["rep"]: r for r in raw if r["layers"] == layers and r["impl"] == "hand_lora"}
    h = [hand[r["rep"]] for r in rs]
    col = lambda k: [r[k] for r in rs]  # noqa: E731
    ref = lambda k: [x[k] for x in h]  # noqa: E731
    tot = lambda xs: [x["lower_s"] + x["compile_s"] for x in xs]  # noqa: E731
    return dict(
        layers=layers, dim=DIM, impl=impl, reps=len(rs),
        trace_ms=1e3 * C.median(col("trace_s")), lower_ms=1e3 * C.median(col("lower_s")),
        compile_ms=1e3 * C.median(col("compile_s")), total_ms=1e3 * C.median(tot(rs)),
        trace_ratio_hand=C.median(C.paired(col("trace_s"), ref("trace_s"))),
        lower_ratio_hand=C.median(C.paired(col("lower_s"), ref("lower_s"))),
        lower_cpu_ms=1e3 * C.median(col("lower_cpu_s")),
        lower_cpu_ratio_hand=C.median(C.paired(col("lower_cpu_s"), ref("lower_cpu_s"))),
        compile_ratio_hand=C.median(C.paired(col("compile_s"), ref("compile_s"))),
        total_ratio_hand=C.median(C.paired(tot(rs), tot(h))),
        lower_ms_min=1e3 * min(col("lower_s")), lower_ms_max=1e3 * max(col("lower_s")))


def main(argv: list[str] | None = None) -> Path:
    a = _parse(argv)
    out = C.out_dir(a.out)
    clock = C.Clock("trace_time")
    raw = _measure(a, clock)
    rows = [_row(raw, layers, impl) for layers in a.layers for impl in IMPLS]
    C.write_csv(out / "trace_time_raw.csv", raw)
    return C.write_results(out, "trace_time", rows, _markdown(rows),
                           clock.facts(f"{'--quick, ' if a.quick else ''}{a.reps} repetitions"))


def _markdown(rows: list[dict[str, Any]]) -> list[str]:
    top = max(r["layers"] for r in rows)
    md = [f"### Target: trace time <= 1.2 x hand-written at {top} layers", ""]
    for r in rows:
        if r["layers"] == top and r["impl"] != "hand_lora":
            ok = r["lower_ratio_hand"] <= 1.2
            md.append(f"- `{r['impl']}`: trace+lower / hand = {r['lower_ratio_hand']:.2f} "
                      f"({'**holds**' if ok else '**misses**'}); CPU time {r['lower_cpu_ratio_hand']:.2f}; "
                      f"trace+lower+compile / hand = {r['total_ratio_hand']:.2f}")
    md += ["", C.md_table(
        ["layers", "impl", "trace ms", "trace+lower ms", "compile ms", "total ms", "trace / hand",
         "**trace+lower / hand**", "trace+lower CPU / hand", "compile / hand", "total / hand"],
        [(r["layers"], f"`{r['impl']}`", f"{r['trace_ms']:.1f}", f"{r['lower_ms']:.1f}",
          f"{r['compile_ms']:.1f}", f"{r['total_ms']:.1f}", f"{r['trace_ratio_hand']:.2f}",
          f"**{r['lower_ratio_hand']:.2f}**", f"{r['lower_cpu_ratio_hand']:.2f}",
          f"{r['compile_ratio_hand']:.2f}",
          f"{r['total_ratio_hand']:.2f}") for r in rows]), "",
        f"Relu MLP, dim {DIM}, batch {BATCH}, rank {RANK}; the full training step (value_and_grad + "
        "adam + apply). `trace+lower` = `jax.jit(step).lower(*args)`, timed as `.trace(*args)` "
        "(`trace`: Python tracing, the lorax re-trace included) then `.lower()`; `compile` = "
        "`.compile()`; `CPU` = process CPU time of trace+lower (less sensitive to other "
        "processes' load than wall time). Fresh functions and `jax.clear_caches()` before every "
        "measurement; medians over repetitions; ratios to hand-written paired per repetition."]
    return md


if __name__ == "__main__":
    main()
