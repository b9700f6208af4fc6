"""Training-step speed: full fine-tuning, naive / hand-written LoRA, lorax, quax, and the floor.

Every implementation (see `benchmarks/_impls.py`) is a jitted step: loss, gradient,
`optax.adam`, apply. Method:

1. Build and compile every step of every cell first (first call), check that all
   implementations give the same first-step loss, and time one warm call to pick, per
   cell, how many back-to-back steps one measurement holds (`n_inner`, so that the
   fastest implementation's measurement lasts >= `--min-measure` seconds) and how many
   rounds fit the time budget.
2. Interleaved rounds in one process: each round runs every implementation once (one
   measurement of `n_inner` steps, `block_until_ready` at the end) per cell, in an order
   that rotates with the round and the cell.
3. Paired ratios per round (implementation / full FT, implementation / hand-written
   LoRA, both from the same round and cell), medians over rounds.

Also recorded per cell: whether each step's compiled HLO is the hand-written step's
(same instructions and dot dimension numbers, names and argument order ignored), and the
Python cost of flattening its arguments and unflattening its outputs (the pytree part of
jit's per-call dispatch).

Training state (parameters being trained, optimizer state) is threaded from step to step
and donated to the step in every implementation, as a training loop would do; frozen
weights and the batch are plain (not donated) jit arguments.

    python -m benchmarks.speed            # default grid, <= ~15 min on 2 cores
    python -m benchmarks.speed --quick    # ~1 min smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

if __package__ in (None, ""):  # `python benchmarks/speed.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from . import _common as C  # noqa: E402
from . import _impls as I  # noqa: E402

MLP_GRID = dict(batch=(64, 256, 1024), dim=(512, 1024, 2048), rank=(1, 8, 64))
ATTN_GRID = dict(shape=((16, 128, 256), (8, 256, 512), (4, 512, 1024)), rank=(8, 64))
QUICK_MLP_GRID = dict(batch=(32,), dim=(64,), rank=(4,))
QUICK_ATTN_GRID = dict(shape=((2, 16, 64),), rank=(4,))


@dataclasses.dataclass
class Runner(C.Timed):
    """One implementation's jitted step plus the state it threads."""

    built: I.Built
    fn: Any = None
    warm: float = float("nan")
    first_loss: float = float("nan")

    def __post_init__(self) -> None:
        self.fn = self.built.jit()
        self.state = self.built.state
        self.const = self.built.const

    def call(self) -> Any:
        out = self.fn(*self.state, *self.const)
        if self.state:
            self.state = tuple(out[1:])
        return out


@dataclasses.dataclass
class Cell:
    grid: str
    batch: int
    seq: int  # 0 for the MLP
    dim: int
    rank: int
    runners: dict[str, Runner]
    n_inner: int = 1
    same_hlo: dict[str, bool] = dataclasses.field(default_factory=dict)
    pytree_us: dict[str, float] = dataclasses.field(default_factory=dict)
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        s = f"s{self.seq} " if self.seq else ""
        return f"b{self.batch} {s}d{self.dim} k{self.rank}"


def _wait_quiet(limit: float, threshold: float) -> str:
    t0 = time.perf_counter()
    while True:
        load = float(C.loadavg().split()[0])
        if load < threshold:
            return f"waited {time.perf_counter() - t0:.0f} s for load < {threshold}"
        if time.perf_counter() - t0 > limit:
            return (f"**machine not quiet**: 1-minute load {load} after waiting "
                    f"{time.perf_counter() - t0:.0f} s (threshold {threshold})")
        print(f"[speed] load {load} >= {threshold}, waiting", flush=True)
        time.sleep(30)


def _pytree_cost(r: Runner, reps: int = 200) -> float:
    """Seconds to flatten a step's arguments and unflatten its outputs in Python: the
    pytree part of jit's per-call dispatch, which grows with custom pytree nodes."""
    args = (*r.state, *r.const)
    out_def = jax.tree_util.tree_structure(jax.eval_shape(r.built.fn, *args))
    out_leaves = [None] * out_def.num_leaves
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.tree_util.tree_flatten(args)
            out_def.unflatten(out_leaves)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two tiny cells, few rounds (smoke run)")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run, compile included (default 840; quick 45)")
    p.add_argument("--max-rounds", type=int, default=None, help="default 30; quick 3")
    p.add_argument("--min-rounds", type=int, default=None, help="default 5; quick 2")
    p.add_argument("--min-measure", type=float, default=0.02,
                   help="seconds one measurement should last at least (sets n_inner)")
    p.add_argument("--impls", default=",".join(I.IMPLS),
                   help=f"comma-separated subset of {','.join(I.IMPLS)}")
    p.add_argument("--grids", default="mlp,attn", help="mlp, attn or both")
    for axis in ("batch", "dim", "rank"):
        p.add_argument(f"--mlp-{axis}", default=None,
                       help=f"comma-separated MLP {axis} values (default {MLP_GRID[axis]})")
    p.add_argument("--attn-rank", default=None, help=f"comma-separated (default {ATTN_GRID['rank']})")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to SECONDS for the 1-minute load average to drop below "
                        "--quiet-load (then run anyway, noting it in speed.md)")
    p.add_argument("--quiet-load", type=float, default=1.0)
    p.add_argument("--hlo-only", action="store_true",
                   help="no timing: compile each cell's LoRA steps on abstract inputs and write "
                        "speed_hlo.md (HLO identical to hand-written? pytree cost per call)")
    a = p.parse_args(argv)
    a.budget = a.budget if a.budget is not None else (45.0 if a.quick else 840.0)
    a.max_rounds = a.max_rounds or (3 if a.quick else 30)
    a.min_rounds = a.min_rounds or (2 if a.quick else 5)
    a.impls = [i for i in a.impls.split(",") if i]
    for i in a.impls:
        if i not in I.IMPLS:
            p.error(f"unknown implementation {i!r}")
    for must in ("full_ft", "hand_lora"):  # the two references of the paired ratios
        if must not in a.impls:
            a.impls.insert(0, must)
    a.grids = [g for g in a.grids.split(",") if g]
    return a


def _cell_specs(a: argparse.Namespace) -> list[tuple[str, int, int, int, int]]:
    """(grid, batch, seq, dim, rank) of every cell."""
    mg = dict(QUICK_MLP_GRID if a.quick else MLP_GRID)
    ag = dict(QUICK_ATTN_GRID if a.quick else ATTN_GRID)
    for axis in ("batch", "dim", "rank"):
        if getattr(a, f"mlp_{axis}"):
            mg[axis] = tuple(int(v) for v in getattr(a, f"mlp_{axis}").split(","))
    if a.attn_rank:
        ag["rank"] = tuple(int(v) for v in a.attn_rank.split(","))
    specs = []
    if "mlp" in a.grids:
        specs += [("mlp", b, 0, d, k) for b in mg["batch"] for d in mg["dim"] for k in mg["rank"]]
    if "attn" in a.grids:
        specs += [("attn", b, s, d, k) for (b, s, d) in ag["shape"] for k in ag["rank"]]
    return specs


def _model(grid: str, b: int, s: int, d: int) -> I.Model:
    return I.mlp(b, d) if grid == "mlp" else I.attention(b, s, d)


def _cells(a: argparse.Namespace) -> list[Cell]:
    shared: dict[tuple, tuple] = {}  # per shape: model, weights, x, rank-independent runners
    cells = []
    for grid, b, s, d, k in _cell_specs(a):
        key = (grid, b, s, d)
        if key not in shared:
            model = _model(grid, b, s, d)
            w, x = I.make_weights(model), I.make_x(model)
            indep = {n: Runner(I.build(n, model, w, x)) for n in ("full_ft", "floor") if n in a.impls}
            shared[key] = (model, w, x, indep)
        model, w, x, indep = shared[key]
        runners = {}
        for n in a.impls:
            runners[n] = indep[n] if n in indep else Runner(I.build(n, model, w, x, rank=k))
        cells.append(Cell(grid, b, s, d, k, runners))
    return cells


def main(argv: list[str] | None = None) -> Path:
    a = _parse(argv)
    out = C.out_dir(a.out)
    if a.hlo_only:
        return _hlo_only(a, out)
    waited = _wait_quiet(a.wait_quiet, a.quiet_load) if a.wait_quiet > 0 else ""
    t_start = time.perf_counter()
    load_start = C.loadavg()
    print(f"[speed] load average at start: {load_start}", flush=True)

    # 1. compile everything, check first-step losses, time one warm call.
    cells = _cells(a)
    seen: set[int] = set()
    problems = []
    for c in cells:
        for n, r in c.runners.items():
            if id(r) not in seen:
                seen.add(id(r))
                first = r.call()
                jax.block_until_ready(first)
                if n != "floor":
                    r.first_loss = float(first[0])
                r.warm = r.measure(1)
        ref = c.runners["full_ft"].first_loss
        for n, r in c.runners.items():
            if n not in ("floor", "full_ft") and not np.isclose(r.first_loss, ref, rtol=1e-4, atol=1e-6):
                problems.append(f"{c.grid} {c.label}: {n} first loss {r.first_loss} != full FT {ref}")
        # Compiled HLO of each step (jit's cache: no recompilation) against hand-written.
        sig = {n: C.hlo_signature(r.fn.lower(*r.state, *r.const).compile().as_text())
               for n, r in c.runners.items() if n not in ("full_ft", "floor")}
        c.same_hlo = {n: sig[n] == sig["hand_lora"] for n in sig}
        c.pytree_us = {n: 1e6 * _pytree_cost(r) for n, r in c.runners.items()}
        fastest = min(r.warm for r in c.runners.values())
        c.n_inner = max(1, min(50, math.ceil(a.min_measure / max(fastest, 1e-6))))
        c.times = {n: [] for n in c.runners}
        print(f"[speed] compiled {c.grid} {c.label} (n_inner={c.n_inner}, "
              f"{time.perf_counter() - t_start:.0f}s)", flush=True)
    for msg in problems:
        print("[speed] MISMATCH", msg, flush=True)

    per_round = sum(r.warm * c.n_inner for c in cells for r in c.runners.values())
    left = a.budget - (time.perf_counter() - t_start) - 5.0
    rounds = int(max(a.min_rounds, min(a.max_rounds, left // max(per_round, 1e-9))))
    print(f"[speed] ~{per_round:.1f}s per round, running {rounds} rounds", flush=True)

    # 2. interleaved rounds.
    names = list(cells[0].runners)
    raw = C.interleaved_rounds(cells, rounds, "speed", lambda c: dict(grid=c.grid, cell=c.label),
                               t_start)
    load_end = C.loadavg()
    elapsed = time.perf_counter() - t_start

    # 3. paired ratios, medians over rounds.
    rows = []
    for c in cells:
        ft, hand = c.times["full_ft"], c.times["hand_lora"]
        for n in names:
            ts = c.times[n]
            r_ft = [t / f for t, f in zip(ts, ft)]
            r_hand = [t / h for t, h in zip(ts, hand)]
            rows.append(dict(
                grid=c.grid, batch=c.batch, seq=c.seq, dim=c.dim, rank=c.rank, impl=n,
                rounds=len(ts), n_inner=c.n_inner,
                median_ms=1e3 * C.median(ts), p25_ms=1e3 * C.quantile(ts, 0.25),
                p75_ms=1e3 * C.quantile(ts, 0.75),
                ratio_ft=C.median(r_ft), ratio_ft_p25=C.quantile(r_ft, 0.25),
                ratio_ft_p75=C.quantile(r_ft, 0.75),
                ratio_hand=C.median(r_hand), ratio_hand_p25=C.quantile(r_hand, 0.25),
                ratio_hand_p75=C.quantile(r_hand, 0.75),
                first_loss=c.runners[n].first_loss,
                hlo_same_as_hand=c.same_hlo.get(n, ""),
                pytree_us=c.pytree_us[n],
            ))
    C.write_csv(out / "speed.csv", rows)
    C.write_csv(out / "speed_rounds.csv", raw)
    (out / "speed.md").write_text(_markdown(a, cells, rows, names, rounds, problems,
                                            load_start, load_end, elapsed, waited))
    _plot(out / "speed.png", cells, rows, names)
    print(f"[speed] wrote {out / 'speed.md'} ({elapsed:.0f}s)", flush=True)
    return out


def _hlo_only(a: argparse.Namespace, out: Path) -> Path:
    """Load-independent part of the speed comparison: compile only, nothing runs."""
    a.impls = [n for n in a.impls if n not in ("full_ft", "floor")]
    rows = []
    for grid, bt, sq, d, k in _cell_specs(a):
        c = Cell(grid, bt, sq, d, k, {})
        model = _model(grid, bt, sq, d)
        w, x = I.make_weights(model, abstract=True), I.make_x(model, abstract=True)
        sig, cost = {}, {}
        for n in a.impls:
            b = I.build(n, model, w, x, rank=c.rank, abstract=True)
            sig[n] = C.hlo_signature(b.jit().lower(*b.args).compile().as_text())
            cost[n] = 1e6 * _pytree_cost(Runner(b))
        for n in a.impls:
            rows.append(dict(grid=c.grid, cell=c.label, impl=n, hlo_same_as_hand=sig[n] == sig["hand_lora"],
                             pytree_us=cost[n]))
        print(f"[speed --hlo-only] {c.grid} {c.label}: " + ", ".join(
            f"{n} {'=' if sig[n] == sig['hand_lora'] else '!='} hand, {cost[n]:.0f}us" for n in a.impls), flush=True)
    C.write_csv(out / "speed_hlo.csv", rows)
    md = ["# Speed benchmark, compile-only part", "", C.machine_md(), "",
          "Per cell: is the compiled HLO of each step the hand-written step's (entry-computation "
          "instructions and every dot's dimension numbers; names and argument order ignored), and "
          "the Python cost (µs) of flattening its arguments and unflattening its outputs, the pytree "
          "part of jit's per-call dispatch.", ""]
    labels = list(dict.fromkeys((r["grid"], r["cell"]) for r in rows))
    get = {(r["grid"], r["cell"], r["impl"]): r for r in rows}
    md.append(C.md_table(["grid", "cell"] + [f"`{n}`" for n in a.impls],
                         [[g, cl] + [f"{'same' if get[(g, cl, n)]['hlo_same_as_hand'] else 'differs'}, "
                                     f"{get[(g, cl, n)]['pytree_us']:.0f} µs" for n in a.impls]
                          for g, cl in labels]))
    (out / "speed_hlo.md").write_text("\n".join(md) + "\n")
    print(f"[speed --hlo-only] wrote {out / 'speed_hlo.md'}", flush=True)
    return out


def _markdown(a, cells, rows, names, rounds, problems, load_start, load_end, elapsed, waited) -> str:
    by = {(r["grid"], r["batch"], r["seq"], r["dim"], r["rank"], r["impl"]): r for r in rows}
    get = lambda c, n: by[(c.grid, c.batch, c.seq, c.dim, c.rank, n)]  # noqa: E731
    md = ["# Training-step speed", ""]
    md.append(C.machine_md({
        "load average (1/5/15 min) at start": load_start,
        "load average at end": load_end,
        "run": f"{'--quick, ' if a.quick else ''}{rounds} rounds, {elapsed:.0f} s",
        "quiet-machine wait": waited,
    }))
    md += ["", "Method: every step jitted and compiled first; interleaved rounds in one process "
           "(each round runs every implementation once per cell, rotating order; one "
           "measurement = `n_inner` back-to-back steps, `block_until_ready` at the end); "
           "ratios paired within a round, medians over rounds. Training state donated in "
           "every implementation; frozen weights passed as jit arguments. Loss = mean "
           "square of the output; `optax.adam(1e-3)`.", ""]
    md += ["Implementations:", ""] + [f"- `{n}`: {I.DESCRIPTIONS[n]}" for n in names] + [""]
    if problems:
        md += ["**First-step loss mismatches:**", ""] + [f"- {p}" for p in problems] + [""]

    # summary
    md += ["## Summary", "",
           "Per implementation, over all cells: the per-cell median ratio (paired per round) to "
           "full fine-tuning and to the hand-written LoRA step.", ""]
    srows = []
    for grid in sorted({c.grid for c in cells}, reverse=True):
        for n in names:
            rs = [get(c, n) for c in cells if c.grid == grid]
            ft = [r["ratio_ft"] for r in rs]
            hd = [r["ratio_hand"] for r in rs]
            worst = max(rs, key=lambda r: r["ratio_hand"])
            wc = next(c for c in cells if get(c, n) is worst)
            srows.append((grid, f"`{n}`", f"{C.median(ft):.3f}", f"{min(ft):.3f}", f"{max(ft):.3f}",
                          f"{C.median(hd):.3f}", f"{max(hd):.3f} ({wc.label})"))
    md.append(C.md_table(["grid", "impl", "/ full FT median", "min", "max",
                          "/ hand-written median", "/ hand-written max (cell)"], srows))

    # targets
    md += ["", "## Target: lorax / hand-written <= 1.05 in every cell", ""]
    for n in (x for x in I.LORAX_IMPLS if x in names):
        bad = [(c, get(c, n)) for c in cells if get(c, n)["ratio_hand"] > 1.05]
        worst = max(get(c, n)["ratio_hand"] for c in cells)
        if not bad:
            md.append(f"- `{n}`: **holds** (max {worst:.3f} over {len(cells)} cells)")
        else:
            md.append(f"- `{n}`: **misses** in {len(bad)}/{len(cells)} cells (max {worst:.3f}): "
                      + ", ".join(f"{c.grid} {c.label} {r['ratio_hand']:.3f} "
                                  f"[p25 {r['ratio_hand_p25']:.3f}, p75 {r['ratio_hand_p75']:.3f}]"
                                  for c, r in bad))

    md += ["", "Python pytree cost per call (flatten the arguments + unflatten the outputs, "
           "part of jit's dispatch; µs, median over cells):", ""]
    md.append(C.md_table(["impl"] + [f"`{n}`" for n in names],
                         [["µs"] + [f"{C.median(c.pytree_us[n] for c in cells):.0f}" for n in names]]))
    md += ["", "Compiled HLO (entry-computation instructions and every dot's dimension numbers, "
           "names and argument order ignored) identical to the hand-written step's in:", ""]
    for n in names:
        if n in ("full_ft", "floor", "hand_lora"):
            continue
        same = sum(bool(c.same_hlo.get(n)) for c in cells)
        md.append(f"- `{n}`: {same}/{len(cells)} cells")

    # per-cell tables
    for grid, title in (("mlp", "4-layer relu MLP"), ("attn", "Self-attention (Wq, Wk, Wv LoRA'd)")):
        gc_ = [c for c in cells if c.grid == grid]
        if not gc_:
            continue
        md += ["", f"## {title}", "",
               "Median ms per step (ratio to full FT); last columns: lorax / hand-written "
               "(median of paired ratios, [p25, p75]).", ""]
        head = ["cell"] + [n for n in names] + [f"{n} / hand" for n in I.LORAX_IMPLS if n in names]
        trows = []
        for c in gc_:
            row = [c.label]
            for n in names:
                r = get(c, n)
                row.append(f"{r['median_ms']:.2f}" if n == "full_ft"
                           else f"{r['median_ms']:.2f} ({r['ratio_ft']:.2f})")
            for n in (x for x in I.LORAX_IMPLS if x in names):
                r = get(c, n)
                row.append(f"{r['ratio_hand']:.3f} [{r['ratio_hand_p25']:.2f}, {r['ratio_hand_p75']:.2f}]"
                           + ("" if c.same_hlo.get(n, True) else " (HLO differs)"))
            trows.append(row)
        md.append(C.md_table(head, trows))
    return "\n".join(md) + "\n"


def _plot(path: Path, cells, rows, names) -> None:
    plt = C.pyplot("speed")
    if plt is None:
        return
    by = {(r["grid"], r["batch"], r["seq"], r["dim"], r["rank"], r["impl"]): r for r in rows}
    grids = [g for g in ("mlp", "attn") if any(c.grid == g for c in cells)]
    widths = [sum(c.grid == g for c in cells) for g in grids]
    fig, axes = plt.subplots(1, len(grids), figsize=(max(8, 0.45 * sum(widths) + 4), 5.5),
                             gridspec_kw=dict(width_ratios=widths), squeeze=False)
    markers = dict(full_ft="", naive_lora="s", hand_lora="o", lorax_partition="^",
                   lorax_wrap="v", floor="_", quax_lora="x")
    for ax, g in zip(axes[0], grids):
        gc_ = [c for c in cells if c.grid == g]
        xs = range(len(gc_))
        for n in names:
            if n == "full_ft":
                continue
            ys = [by[(c.grid, c.batch, c.seq, c.dim, c.rank, n)]["ratio_ft"] for c in gc_]
            ax.plot(xs, ys, marker=markers.get(n, "."), linestyle="-", linewidth=0.8, label=n)
        ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plt.matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([c.label for c in gc_], rotation=70, fontsize=7)
        ax.set_title("4-layer MLP" if g == "mlp" else "self-attention")
        ax.set_ylabel("step time / full fine-tuning (median of paired ratios)")
        ax.grid(True, which="both", axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"Training-step time relative to full fine-tuning ({C.cpu_model()}, jax {jax.__version__})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
