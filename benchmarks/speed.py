"""Training-step speed: full fine-tuning, naive / hand-written LoRA, lorax, quax, and the floor.

Every implementation (`benchmarks._models.build`) is a jitted step (loss, gradient,
`optax.adam`, apply), its training state threaded from step to step and donated, as a
training loop would; frozen weights and the batch plain jit arguments. Every step of every
cell is compiled and called first (all must give the same first-step loss), one warm call
sets each cell's `n_inner` (the fastest step's measurement lasts `--min-measure` seconds)
and the rounds that fit `--budget`; then interleaved rounds in one process (every
implementation once per cell and round, in a rotating order), ratios to full FT and to
hand-written LoRA paired within a round, medians over rounds. Also per cell: whether each
step's compiled HLO is the hand-written step's (instructions and dot dimension numbers,
names and argument order ignored), and the Python cost of flattening its arguments and
unflattening its outputs (the pytree part of jit's per-call dispatch).

    python -m benchmarks.speed            # default grid, <= ~15 min on 2 cores
    python -m benchmarks.speed --quick    # ~1 min smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from . import _common as C
from . import _models as M

MLP_GRID = dict(batch=(64, 256, 1024), dim=(512, 1024, 2048), rank=(1, 8, 64))
ATTN_GRID = dict(shape=((16, 128, 256), (8, 256, 512), (4, 512, 1024)), rank=(8, 64))
QUICK_MLP_GRID = dict(batch=(32,), dim=(64,), rank=(4,))
QUICK_ATTN_GRID = dict(shape=((2, 16, 64),), rank=(4,))


def _runner(built: M.Built) -> C.Step:
    """One implementation's jitted step and the state it threads."""
    r = C.Step(built.jit(), built.state, built.const)
    r.built, r.first_loss = built, float("nan")
    return r


@dataclasses.dataclass
class Cell:
    grid: str
    batch: int
    seq: int  # 0 for the MLP
    dim: int
    rank: int
    runners: dict[str, C.Step]
    n_inner: int = 1
    same_hlo: dict[str, bool] = dataclasses.field(default_factory=dict)
    pytree_us: dict[str, float] = dataclasses.field(default_factory=dict)
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return _label(self.batch, self.seq, self.dim, self.rank)


def _label(batch: int, seq: int, dim: int, rank: int) -> str:
    s = f"s{seq} " if seq else ""
    return f"b{batch} {s}d{dim} k{rank}"


def _pytree_cost(fn: Any, args: tuple, reps: int = 200) -> float:
    """Seconds to flatten a step's arguments and unflatten its outputs in Python: the
    pytree part of jit's per-call dispatch, which grows with custom pytree nodes."""
    out_def = jax.tree_util.tree_structure(jax.eval_shape(fn, *args))
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
    p = C.parser(__doc__, rounds=False, plot=True)
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run, compile included (default 840; quick 45)")
    p.add_argument("--max-rounds", type=int, default=None, help="default 30; quick 3")
    p.add_argument("--min-rounds", type=int, default=None, help="default 5; quick 2")
    p.add_argument("--min-measure", type=float, default=0.02,
                   help="seconds one measurement should last at least (sets n_inner)")
    p.add_argument("--impls", default=",".join(M.IMPLS),
                   help=f"comma-separated subset of {','.join(M.IMPLS)}")
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
        if i not in M.IMPLS:
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
            mg[axis] = C.ints(getattr(a, f"mlp_{axis}"))
    if a.attn_rank:
        ag["rank"] = C.ints(a.attn_rank)
    specs = []
    if "mlp" in a.grids:
        specs += [("mlp", b, 0, d, k) for b in mg["batch"] for d in mg["dim"] for k in mg["rank"]]
    if "attn" in a.grids:
        specs += [("attn", b, s, d, k) for (b, s, d) in ag["shape"] for k in ag["rank"]]
    return specs


def _model(grid: str, b: int, s: int, d: int) -> M.Model:
    return M.mlp(b, d) if grid == "mlp" else M.attention(b, s, d)


def _cells(a: argparse.Namespace) -> list[Cell]:
    shared: dict[tuple, tuple] = {}  # per shape: model, weights, x, rank-independent runners
    cells = []
    for grid, b, s, d, k in _cell_specs(a):
        key = (grid, b, s, d)
        if key not in shared:
            model = _model(grid, b, s, d)
            w, x = M.make_weights(model), M.make_x(model)
            indep = {n: _runner(M.build(n, model, w, x)) for n in ("full_ft", "floor") if n in a.impls}
            shared[key] = (model, w, x, indep)
        model, w, x, indep = shared[key]
        runners = {}
        for n in a.impls:
            runners[n] = indep[n] if n in indep else _runner(M.build(n, model, w, x, rank=k))
        cells.append(Cell(grid, b, s, d, k, runners))
    return cells


def _check(cells: list[Cell]) -> list[str]:
    """First call of every step: the same first-step loss as full FT everywhere; per cell,
    which compiled steps are the hand-written one's, and the pytree cost per call."""
    problems = []
    for c in cells:
        for n, r in c.runners.items():
            if n != "floor" and math.isnan(r.first_loss):
                r.first_loss = float(r.call()[0])
        ref = c.runners["full_ft"].first_loss
        for n, r in c.runners.items():
            if n not in ("floor", "full_ft") and not np.isclose(r.first_loss, ref, rtol=1e-4, atol=1e-6):
                problems.append(f"{c.grid} {c.label}: {n} first loss {r.first_loss} != full FT {ref}")
        # Compiled HLO of each step (jit's cache: no recompilation) against hand-written.
        sig = {n: C.hlo_signature(r.fn.lower(*r.state, *r.const).compile().as_text())
               for n, r in c.runners.items() if n not in ("full_ft", "floor")}
        c.same_hlo = {n: sig[n] == sig["hand_lora"] for n in sig}
        c.pytree_us = {n: 1e6 * _pytree_cost(r.built.fn, (*r.state, *r.const))
                       for n, r in c.runners.items()}
    for msg in problems:
        print("[speed] MISMATCH", msg, flush=True)
    return problems


def _row(c: Cell, n: str) -> dict[str, Any]:
    ts = c.times[n]
    return dict(grid=c.grid, batch=c.batch, seq=c.seq, dim=c.dim, rank=c.rank, impl=n,
                rounds=len(ts), n_inner=c.n_inner, **C.time_cols(ts),
                **C.ratio_cols("ratio_ft", ts, c.times["full_ft"]),
                **C.ratio_cols("ratio_hand", ts, c.times["hand_lora"]),
                first_loss=c.runners[n].first_loss, hlo_same_as_hand=c.same_hlo.get(n, ""),
                pytree_us=c.pytree_us[n])


def main(argv: list[str] | None = None) -> Path:
    a = _parse(argv)
    out = C.out_dir(a.out)
    if a.plot_only:
        return C.replot(out, "speed", _plot)
    if a.hlo_only:
        return _hlo_only(a, out)
    waited = C.wait_quiet(a.wait_quiet, a.quiet_load, "speed") if a.wait_quiet > 0 else ""
    clock = C.Clock("speed")
    clock.log(f"load average at start: {clock.load_start}")

    # 1. compile everything, check first-step losses, time one warm call.
    cells = _cells(a)
    problems = _check(cells)
    C.calibrate(cells, a.min_measure)
    rounds = C.rounds_in(cells, a.budget - clock.elapsed - 5.0, a.min_rounds, a.max_rounds)
    clock.log(f"compiled {len(cells)} cells, running {rounds} rounds")

    # 2. interleaved rounds; 3. paired ratios, medians over rounds.
    raw = C.interleaved_rounds(cells, rounds, "speed", lambda c: dict(grid=c.grid, cell=c.label),
                               clock.t0)
    rows = [_row(c, n) for c in cells for n in c.runners]
    names = list(cells[0].runners)
    facts = clock.facts(f"{'--quick, ' if a.quick else ''}{rounds} rounds")
    facts["quiet-machine wait"] = waited
    return C.write_results(out, "speed", rows, _markdown(rows, names, problems), facts, raw, _plot)


def _hlo_only(a: argparse.Namespace, out: Path) -> Path:
    """Load-independent part of the speed comparison: compile only, nothing runs."""
    a.impls = [n for n in a.impls if n not in ("full_ft", "floor")]
    rows = []
    for grid, bt, sq, d, k in _cell_specs(a):
        label = _label(bt, sq, d, k)
        model = _model(grid, bt, sq, d)
        w, x = M.make_weights(model, abstract=True), M.make_x(model, abstract=True)
        sig, cost = {}, {}
        for n in a.impls:
            b = M.build(n, model, w, x, rank=k, abstract=True)
            sig[n] = C.hlo_signature(b.jit().lower(*b.args).compile().as_text())
            cost[n] = 1e6 * _pytree_cost(b.fn, b.args)
        for n in a.impls:
            rows.append(dict(grid=grid, cell=label, impl=n, hlo_same_as_hand=sig[n] == sig["hand_lora"],
                             pytree_us=cost[n]))
        print(f"[speed --hlo-only] {grid} {label}: " + ", ".join(
            f"{n} {'=' if sig[n] == sig['hand_lora'] else '!='} hand, {cost[n]:.0f}us" for n in a.impls), flush=True)
    labels = list(dict.fromkeys((r["grid"], r["cell"]) for r in rows))
    get = {(r["grid"], r["cell"], r["impl"]): r for r in rows}
    md = ["Per cell: is the compiled HLO of each step the hand-written step's (entry-computation "
          "instructions and every dot's dimension numbers; names and argument order ignored), and "
          "the Python cost (µs) of flattening its arguments and unflattening its outputs, the pytree "
          "part of jit's per-call dispatch.", "",
          C.md_table(["grid", "cell"] + [f"`{n}`" for n in a.impls],
                     [[g, cl] + [f"{'same' if get[(g, cl, n)]['hlo_same_as_hand'] else 'differs'}, "
                                 f"{get[(g, cl, n)]['pytree_us']:.0f} µs" for n in a.impls]
                      for g, cl in labels])]
    return C.write_results(out, "speed_hlo", rows, md)


def _markdown(rows: list[dict], names: list[str], problems: list[str]) -> list[str]:
    by = {(r["grid"], r["batch"], r["seq"], r["dim"], r["rank"], r["impl"]): r for r in rows}
    cells = list(dict.fromkeys((r["grid"], r["batch"], r["seq"], r["dim"], r["rank"]) for r in rows))
    label = {c: _label(*c[1:]) for c in cells}
    get = lambda c, n: by[(*c, n)]  # noqa: E731
    md = []
    if problems:
        md += ["**First-step loss mismatches:**", ""] + [f"- {p}" for p in problems] + [""]

    # targets
    md += ["### Target: lorax / hand-written <= 1.05 in every cell", ""]
    for n in (x for x in M.LORAX_IMPLS if x in names):
        bad = [(c, get(c, n)) for c in cells if get(c, n)["ratio_hand"] > 1.05]
        worst = max(get(c, n)["ratio_hand"] for c in cells)
        if not bad:
            md.append(f"- `{n}`: **holds** (max {worst:.3f} over {len(cells)} cells)")
        else:
            md.append(f"- `{n}`: **misses** in {len(bad)}/{len(cells)} cells (max {worst:.3f}): "
                      + ", ".join(f"{c[0]} {label[c]} {r['ratio_hand']:.3f} "
                                  f"[p25 {r['ratio_hand_p25']:.3f}, p75 {r['ratio_hand_p75']:.3f}]"
                                  for c, r in bad))

    # summary
    md += ["", "### Summary", "",
           "Per implementation, over all cells: the per-cell median ratio (paired per round) to "
           "full fine-tuning and to the hand-written LoRA step.", ""]
    srows = []
    for grid in sorted({c[0] for c in cells}, reverse=True):
        for n in names:
            rs = [(c, get(c, n)) for c in cells if c[0] == grid]
            ft = [r["ratio_ft"] for _, r in rs]
            hd = [r["ratio_hand"] for _, r in rs]
            wc, worst = max(rs, key=lambda cr: cr[1]["ratio_hand"])
            srows.append((grid, f"`{n}`", f"{C.median(ft):.3f}", f"{min(ft):.3f}", f"{max(ft):.3f}",
                          f"{C.median(hd):.3f}", f"{max(hd):.3f} ({label[wc]})"))
    md.append(C.md_table(["grid", "impl", "/ full FT median", "min", "max",
                          "/ hand-written median", "/ hand-written max (cell)"], srows))

    md += ["", "Python pytree cost per call (flatten the arguments + unflatten the outputs, "
           "part of jit's dispatch; µs, median over cells):", ""]
    md.append(C.md_table(["impl"] + [f"`{n}`" for n in names],
                         [["µs"] + [f"{C.median(get(c, n)['pytree_us'] for c in cells):.0f}"
                                    for n in names]]))
    md += ["", "Compiled HLO (entry-computation instructions and every dot's dimension numbers, "
           "names and argument order ignored) identical to the hand-written step's in:", ""]
    for n in names:
        if n in ("full_ft", "floor", "hand_lora"):
            continue
        same = sum(get(c, n)["hlo_same_as_hand"] is True for c in cells)
        md.append(f"- `{n}`: {same}/{len(cells)} cells")

    # per-cell tables
    for grid, title in (("mlp", "4-layer relu MLP"), ("attn", "Self-attention (Wq, Wk, Wv LoRA'd)")):
        gc_ = [c for c in cells if c[0] == grid]
        if not gc_:
            continue
        md += ["", f"### {title}", "",
               "Median ms per step (ratio to full FT); last columns: lorax / hand-written "
               "(median of paired ratios, [p25, p75]).", ""]
        head = ["cell"] + [n for n in names] + [f"{n} / hand" for n in M.LORAX_IMPLS if n in names]
        trows = []
        for c in gc_:
            row = [label[c]]
            for n in names:
                r = get(c, n)
                row.append(f"{r['median_ms']:.2f}" if n == "full_ft"
                           else f"{r['median_ms']:.2f} ({r['ratio_ft']:.2f})")
            for n in (x for x in M.LORAX_IMPLS if x in names):
                r = get(c, n)
                row.append(f"{r['ratio_hand']:.3f} [{r['ratio_hand_p25']:.2f}, {r['ratio_hand_p75']:.2f}]"
                           + ("" if r["hlo_same_as_hand"] is not False else " (HLO differs)"))
            trows.append(row)
        md.append(C.md_table(head, trows))

    md += ["", "Method: every step jitted and compiled first; interleaved rounds in one process "
           "(each round runs every implementation once per cell, rotating order; one "
           "measurement = `n_inner` back-to-back steps, `block_until_ready` at the end); "
           "ratios paired within a round, medians over rounds. Training state donated in "
           "every implementation; frozen weights passed as jit arguments. Loss = mean "
           "square of the output; `optax.adam(1e-3)`.", ""]
    md += ["Implementations:", ""] + [f"- `{n}`: {M.DESCRIPTIONS[n]}" for n in names]
    return md


MARKERS = dict(naive_lora="s", hand_lora="o", lorax_partition="^", lorax_wrap="v", floor="_",
               quax_lora="x")


def _plot(rows: list[dict], path: Path) -> None:
    """Small multiples: one panel per MLP width and one for self-attention, each cell's
    step time over full fine-tuning's, one line per implementation."""
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault((r["grid"], r["dim"] if r["grid"] == "mlp" else 0), []).append(r)
    fig, axes = C.small_multiples(len(panels), 2 if len(panels) > 1 else 1, 3.0, sharey=True)
    impls = [n for n in dict.fromkeys(r["impl"] for r in rows) if n != "full_ft"]
    for ax, ((grid, dim), prs) in zip(axes.flat, panels.items()):
        by = {(r["batch"], r["seq"], r["dim"], r["rank"], r["impl"]): r["ratio_ft"] for r in prs}
        shapes = list(dict.fromkeys((r["batch"], r["seq"], r["dim"]) for r in prs))
        ranks = sorted({r["rank"] for r in prs})
        xs = C.group_ticks(ax, [(f"batch {b}" if grid == "mlp" else f"d{d}, {b}x{s}",
                                 [f"k{k}" for k in ranks]) for b, s, d in shapes])
        for n in impls:
            C.plot_groups(ax, xs, [by[(*shape, k, n)] for shape in shapes for k in ranks], len(ranks),
                          marker=MARKERS.get(n, "."), linewidth=0.9, markersize=5, label=n)
        C.target_line(ax, 1.0, "full fine-tuning", color="k")
        ax.set_title(f"4-layer MLP, d{dim}" if grid == "mlp" else "self-attention")
    C.ratio_axis(axes)
    C.finish(fig, axes, path, "step time / full FT", ncol=3, legend_rows=2)


if __name__ == "__main__":
    main()
