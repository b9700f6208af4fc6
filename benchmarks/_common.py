"""Helpers shared by the benchmarks: machine description, CSV and markdown output."""

from __future__ import annotations

import csv
import gc
import os
import time
import platform
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def machine() -> dict[str, str]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    import jaxlib
    return {
        "cpu": cpu_model(),
        "cores": f"{usable} usable ({os.cpu_count()} online)",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": f"{jax.default_backend()} ({len(jax.devices())} device)",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }


def machine_md(extra: dict[str, Any] | None = None) -> str:
    rows = {**machine(), **(extra or {})}
    return "\n".join(f"- **{k}**: {v}" for k, v in rows.items() if v != "")


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def quantile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v) for k, v in r.items()})


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def out_dir(arg: str | os.PathLike | None) -> Path:
    p = Path(arg) if arg else DEFAULT_OUT
    p.mkdir(parents=True, exist_ok=True)
    return p




def hlo_signature(hlo_text: str) -> "collections.Counter[str]":
    """The multiset of instructions of an optimized HLO module's entry computation,
    with names, metadata and backend configs stripped (parameters, tuples,
    get-tuple-element, constants and bitcasts left out): two steps with the same
    signature run the same kernels on the same shapes, whatever their argument order.
    Dots inside fusions are included, with their dimension numbers."""
    import collections
    import re

    entry = hlo_text[hlo_text.index("\nENTRY"):]
    sig: collections.Counter[str] = collections.Counter()
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = re.sub(r", backend_config=.*", "", line)
        m = re.match(r"\s*%?\S+ = (\S+) ([\w-]+)\((.*?)\)(.*)", line)
        if not m or m.group(2) in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
            continue
        sig[f"{m.group(1)} {m.group(2)}{re.sub(r'calls=%[^ ,]+', '', m.group(4))}"] += 1
    for m in re.finditer(r"= (\S+) dot\([^)]*\)(, [^\n]*?_dims=\{[^}]*\}(?:, [^\n]*?_dims=\{[^}]*\})*)", hlo_text):
        sig[f"dot {m.group(1)}{m.group(2)}"] += 1
    return sig


class Timed:
    """Mixin for a runner with a `call()` that runs one step: `measure(n)` is the mean
    time of `n` back-to-back calls, waiting for the last result."""

    def call(self) -> Any:
        raise NotImplementedError

    def measure(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = self.call()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / n


def interleaved_rounds(cells: Sequence[Any], rounds: int, tag: str, cell_fields: Any,
                       t_start: float) -> list[dict[str, Any]]:
    """Measure every cell's runners `rounds` times, interleaved: each round runs every
    runner of every cell once (`runner.measure(cell.n_inner)`, appended to
    `cell.times[name]`), starting one implementation later each round and each cell,
    with the garbage collector off. Returns the raw rows, `cell_fields(cell)` plus
    round, impl and seconds."""
    raw = []
    for rnd in range(rounds):
        gc.collect()
        gc.disable()
        try:
            for ci, c in enumerate(cells):
                names = list(c.runners)
                shift = (rnd + ci) % len(names)
                for n in names[shift:] + names[:shift]:
                    t = c.runners[n].measure(c.n_inner)
                    c.times[n].append(t)
                    raw.append(dict(**cell_fields(c), round=rnd, impl=n, seconds=t))
        finally:
            gc.enable()
        print(f"[{tag}] round {rnd + 1}/{rounds} done ({time.perf_counter() - t_start:.0f}s)",
              flush=True)
    return raw


def pyplot(tag: str) -> Any:
    """`matplotlib.pyplot` on the Agg backend (with `matplotlib.ticker` loaded), or `None`
    with a note when matplotlib is not installed (the bench group has it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401  (plt.matplotlib.ticker below)
    except ImportError:
        print(f"[{tag}] matplotlib not installed: no PNG (pip install matplotlib)", flush=True)
        return None
    return plt
