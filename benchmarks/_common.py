"""The harness every benchmark runs on.

- the command line: `parser(doc)` (`--quick`, `--out DIR`, `--rounds N`, `--plot-only`,
  `--models`) and `parse`;
- runners and cells: `Step` threads a jitted step's training state from call to call,
  `Call` calls a function (`measure(n)`: `n` back-to-back calls); `calibrate` makes every
  runner's first call and sets each cell's `n_inner`; `interleaved_rounds` measures every
  runner of every cell once a round, in an order that rotates (`measure_cells`: both);
- paired ratios: `paired`, `time_cols`, `ratio_cols` (medians and quartiles over rounds);
- compiled programs: `memory_gib` (XLA's memory analysis), `hlo_executions` (how often
  each computation runs), `hlo_signature`, `hlo_bytes`, `cost`, `flops`;
- results: `write_results` writes `<name>.csv` (+ `_rounds.csv`), `<name>.md` (the result
  first, no title: the docs include it under their own heading; the machine and run in a
  collapsed note at the end) and `<name>.png`, plotted from the CSV just written, so that
  `--plot-only` redraws the same plot; `write_table` a table with no note;
- plots for the docs' page width: `small_multiples`, `ratio_axis`, `target_line`, `finish`.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gc
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib
import optax

DEFAULT_OUT = Path(__file__).resolve().parent / "results"

# -- the machine -----------------------------------------------------------------------------


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
    return {
        "cpu": cpu_model(),
        "cores": f"{usable} usable ({os.cpu_count()} online)",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": f"{jax.default_backend()} ({len(jax.devices())} device)",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }


def machine_note(extra: dict[str, Any] | None = None) -> str:
    """The machine and run facts as a collapsed note (`<details>`: GitHub and the docs'
    `md_in_html` both render the list inside), for the end of a result file."""
    rows = {**machine(), **(extra or {})}
    return ("<details markdown><summary>Machine and run</summary>\n\n"
            + "\n".join(f"- **{k}**: {v}" for k, v in rows.items() if v != "")
            + "\n\n</details>")


class Clock:
    """A run's elapsed time and machine load, and its log lines (`[tag] ... (12s)`)."""

    def __init__(self, tag: str):
        self.tag, self.t0, self.load_start = tag, time.perf_counter(), loadavg()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.tag}] {msg} ({self.elapsed:.0f}s)", flush=True)

    def facts(self, run: str = "", **extra: Any) -> dict[str, Any]:
        """Load at start and end and `run` (with the elapsed time) for `machine_note`."""
        return {"load average (1/5/15 min) at start": self.load_start,
                "load average at end": loadavg(),
                "run": f"{run}{', ' if run else ''}{self.elapsed:.0f} s", **extra}


def wait_quiet(limit: float, threshold: float, tag: str) -> str:
    """Wait up to `limit` seconds for the 1-minute load average to drop below `threshold`;
    says how it went (for the run facts)."""
    t0 = time.perf_counter()
    while True:
        load = float(loadavg().split()[0])
        if load < threshold:
            return f"waited {time.perf_counter() - t0:.0f} s for load < {threshold}"
        if time.perf_counter() - t0 > limit:
            return (f"**machine not quiet**: 1-minute load {load} after waiting "
                    f"{time.perf_counter() - t0:.0f} s (threshold {threshold})")
        print(f"[{tag}] load {load} >= {threshold}, waiting", flush=True)
        time.sleep(30)


# -- the command line --------------------------------------------------------------------------


def parser(doc: str, rounds: bool = True, plot: bool = False, models: str | None = None,
           quick: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: `--out`, `--quick` (a smoke run), and `--rounds`
    (timed benchmarks), `--plot-only` (those with a plot), `--models` (default `models`,
    for those with several); the description is `doc`'s first line."""
    p = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
    if quick:
        p.add_argument("--quick", action="store_true", help="smoke run: tiny cells, few rounds")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    if rounds:
        p.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    if plot:
        p.add_argument("--plot-only", action="store_true",
                       help="measure nothing: redraw the plot from the CSV in --out")
    if models:
        p.add_argument("--models", default=models, help=f"comma-separated subset of {models}")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None, default: dict | None = None,
          quick: dict | None = None) -> argparse.Namespace:
    """Parse `argv`: `out` becomes the (created) output directory; given the benchmark's
    `default` and `quick` configurations, `cfg` is the one `--quick` picks and `rounds`
    `--rounds` or `cfg["rounds"]`."""
    a = p.parse_args(argv)
    a.out = out_dir(a.out)
    if default is not None:
        a.cfg = quick if a.quick else default
        a.rounds = getattr(a, "rounds", None) or a.cfg.get("rounds")
    return a


def ints(s: str) -> tuple[int, ...]:
    """`"1,8,64"` -> `(1, 8, 64)`."""
    return tuple(int(v) for v in s.split(",") if v)


def out_dir(arg: str | os.PathLike | None) -> Path:
    p = Path(arg) if arg else DEFAULT_OUT
    p.mkdir(parents=True, exist_ok=True)
    return p


# -- statistics -----------------------------------------------------------------------------


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


def paired(ts: Sequence[float], ref: Sequence[float] | None) -> list[float]:
    """Per-round ratios `ts[i] / ref[i]` (NaNs when there is no reference)."""
    if ref is None:
        return [float("nan")] * len(ts)
    return [t / r for t, r in zip(ts, ref)]


def time_cols(ts: Sequence[float]) -> dict[str, float]:
    """`median_ms`, `p25_ms`, `p75_ms` of per-step seconds."""
    return {"median_ms": 1e3 * median(ts), "p25_ms": 1e3 * quantile(ts, 0.25),
            "p75_ms": 1e3 * quantile(ts, 0.75)}


def ratio_cols(name: str, ts: Sequence[float], ref: Sequence[float] | None) -> dict[str, float]:
    """`name`, `name_p25`, `name_p75`: median and quartiles of the paired ratios."""
    r = paired(ts, ref)
    return {name: median(r), f"{name}_p25": quantile(r, 0.25), f"{name}_p75": quantile(r, 0.75)}


# -- timing -----------------------------------------------------------------------------------


class Timed:
    """Mixin for a runner with a `call()` that runs one step: `measure(n)` is the mean
    time of `n` back-to-back calls, waiting for the last result; `warm` is one warm
    call's time once `calibrate` has run."""

    warm: float = float("nan")

    def call(self) -> Any:
        raise NotImplementedError

    def measure(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            out = self.call()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / n


class State:
    """The training state a step threads from call to call; several runners may share
    one (executables of different batch shapes that take the same state)."""

    def __init__(self, state: tuple, keep_init: bool = False):
        self.state = tuple(state)
        self._init = own(self.state) if keep_init else None

    def reset(self) -> None:
        """Back to the initial values (kept with `keep_init`), e.g. for a loss check."""
        if self._init is not None:
            self.state = own(self._init)


def own(tree: Any) -> Any:
    """A private copy of every array, so that donating it deletes nothing shared."""
    return jax.tree_util.tree_map(lambda a: jax.numpy.array(a, copy=True), tree)


class Step(Timed):
    """`fn(*state, *const[, key])`, a jitted (or compiled) step: it returns `(aux,
    *new_state)` (`aux=True`: a loss, or the floor's input gradient) or the new state
    itself; `keyed` passes a fresh PRNG key every call (dropout)."""

    def __init__(self, fn: Callable, state: State | tuple, const: tuple = (), aux: bool = True,
                 keyed: bool = False):
        self.fn, self.const, self.aux, self.keyed, self.i = fn, tuple(const), aux, keyed, 0
        self.holder = state if isinstance(state, State) else State(state)

    @property
    def state(self) -> tuple:
        return self.holder.state

    def call(self) -> Any:
        self.i += 1
        key = (jax.random.fold_in(jax.random.key(0), self.i),) if self.keyed else ()
        out = self.fn(*self.holder.state, *self.const, *key)
        if self.holder.state:
            self.holder.state = tuple(out[1:]) if self.aux else tuple(out)
        return out


class Call(Timed):
    """A stateless runner: `fn(*args)`."""

    def __init__(self, fn: Callable, *args: Any):
        self.fn, self.args = fn, args

    def call(self) -> Any:
        return self.fn(*self.args)


class Cell:
    """Runners measured side by side: `label`, `runners` by name, `n_inner` calls per
    measurement, `times` by name (one entry per round)."""

    def __init__(self, label: str, runners: dict[str, Timed], n_inner: int = 1):
        self.label, self.runners, self.n_inner = label, runners, n_inner
        self.times: dict[str, list[float]] = {n: [] for n in runners}


def train_step(loss: Callable, opt: Any, with_loss: bool = True) -> Callable:
    """`step(trainable, opt_state, *rest)`: the gradient of `loss(trainable, *rest)`, one
    optimizer update; returns `(loss, trainable, opt_state)` (or without the loss)."""
    def step(trainable, opt_state, *rest):
        value, grads = jax.value_and_grad(loss)(trainable, *rest)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        new = optax.apply_updates(trainable, updates)
        return (value, new, opt_state) if with_loss else (new, opt_state)
    return step


def train_runner(loss: Callable, trainable: Any, const: tuple, opt: Any = None,
                 keyed: bool = False) -> tuple[Step, Any]:
    """`train_step(loss, opt)` jitted with the training state donated (Adam at 1e-3 by
    default) as a `Step` from `trainable`, and its compiled executable (for its memory)."""
    opt = opt or optax.adam(1e-3)
    step = jax.jit(train_step(loss, opt, with_loss=False), donate_argnums=(0, 1))
    key = (jax.random.key(0),) if keyed else ()
    compiled = step.lower(trainable, opt.init(trainable), *const, *key).compile()
    state = (jax.tree.map(jax.numpy.copy, trainable), opt.init(trainable))
    return Step(step, state, const, aux=False, keyed=keyed), compiled


def n_inner(seconds: float, target: float, cap: int = 50) -> int:
    """Back-to-back calls per measurement so that one lasts at least `target` seconds."""
    return max(1, min(cap, math.ceil(target / max(seconds, 1e-6))))


def calibrate(cells: Sequence[Any], target: float, cap: int = 50) -> None:
    """First call (compiles a jitted step) and one timed warm call of every runner
    (`runner.warm`; runners shared between cells once), then per cell `n_inner` (from
    its fastest runner) and empty `times`."""
    seen: set[int] = set()
    for c in cells:
        for r in c.runners.values():
            if id(r) not in seen:
                seen.add(id(r))
                jax.block_until_ready(r.call())
                r.warm = r.measure(1)
        c.n_inner = n_inner(min(r.warm for r in c.runners.values()), target, cap)
        c.times = {n: [] for n in c.runners}


def measure_cells(tag: str, specs: Iterable[tuple], make: Callable[..., Any], rounds: int,
                  target: float, cap: int = 50) -> tuple[Clock, list[Any], list[dict[str, Any]]]:
    """The usual run: `make(*spec)` every cell (each with a `label` and its `runners`),
    `calibrate`, `interleaved_rounds`; returns the clock, the cells and the raw rows."""
    clock = Clock(tag)
    cells = []
    for spec in specs:
        cells.append(make(*spec))
        clock.log(f"compiled {cells[-1].label}")
    calibrate(cells, target, cap)
    raw = interleaved_rounds(cells, rounds, tag, lambda c: dict(cell=c.label), clock.t0)
    return clock, cells, raw


def rounds_in(cells: Sequence[Any], budget: float, lo: int, hi: int) -> int:
    """How many rounds, between `lo` and `hi`, fit `budget` seconds (from the warm times)."""
    per_round = sum(r.warm * c.n_inner for c in cells for r in c.runners.values())
    return int(max(lo, min(hi, budget // max(per_round, 1e-9))))


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


# -- compiled programs ------------------------------------------------------------------------


def hlo_signature(hlo_text: str) -> collections.Counter[str]:
    """The multiset of instructions of an optimized HLO module's entry computation,
    with names, metadata and backend configs stripped (parameters, tuples,
    get-tuple-element, constants and bitcasts left out): two steps with the same
    signature run the same kernels on the same shapes, whatever their argument order.
    Dots inside fusions are included, with their dimension numbers."""
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


DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}


# A computation of an HLO module's text: its name (`%name (params) -> result {`, or
# `ENTRY %name ...`) and its body.
HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?(%\S+) \(.*?\{\n(.*?)\n\}", re.S | re.M)


def hlo_executions(hlo_text: str) -> tuple[dict[str, str], dict[str, int]]:
    """Each computation's body by name (`%name`), and how many times it runs in one
    execution of the module: the entry once, a `while` body its known trip count times
    its caller's, a fusion's computation (`calls=`) as often as its caller. Computations
    reached otherwise (reducers, conditionals) are not in the counts."""
    bodies = {m.group(1): m.group(2) for m in HLO_COMPUTATION.finditer(hlo_text)}
    entry = re.search(r"^ENTRY (%\S+)", hlo_text, re.M)
    runs = {entry.group(1): 1} if entry else {}
    pending = list(runs)
    while pending:
        name = pending.pop()
        for line in bodies.get(name, "").splitlines():
            trips = re.search(r'known_trip_count":\{"n":"([0-9]+)"', line)
            for key, callee in re.findall(r"\b(calls|body)=(%[\w.-]+)", line):
                n = runs[name] * (int(trips.group(1)) if key == "body" and trips else 1)
                if callee not in runs:
                    pending.append(callee)
                runs[callee] = runs.get(callee, 0) + n
    return bodies, runs


def hlo_bytes(shapes: Iterable[tuple[str, str]]) -> int:
    """Bytes of HLO shapes given as `(dtype, "d0,d1,...")` pairs (as `f32[8,128]` reads)."""
    return sum(math.prod(int(v) for v in dims.split(",") if v) * DTYPE_BYTES.get(dtype, 4)
               for dtype, dims in shapes)


def cost(compiled: Any) -> dict[str, float]:
    """XLA's cost analysis of a compiled executable (one dict on every jax version)."""
    c = compiled.cost_analysis()
    return c[0] if isinstance(c, (list, tuple)) else c


def flops(jitted: Any, *args: Any) -> float:
    """The compiled program's floating-point operation count (XLA's cost analysis)."""
    return float(cost(jitted.lower(*args).compile())["flops"])


def memory_gib(m: Any) -> dict[str, float]:
    """XLA's memory analysis of a compiled program in GiB: `args`, `temps`, `outputs`,
    `aliased` (outputs in donated inputs' buffers), `peak` (what the program holds at
    once: arguments + temporaries + outputs - aliased), `host_args`, `host_temps`, `host`."""
    b = dict(args=m.argument_size_in_bytes, temps=m.temp_size_in_bytes,
             outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
             host_args=getattr(m, "host_argument_size_in_bytes", 0),
             host_temps=getattr(m, "host_temp_size_in_bytes", 0))
    b["peak"] = b["args"] + b["temps"] + b["outputs"] - b["aliased"]
    b["host"] = b["host_args"] + b["host_temps"]
    return {k: v / 2**30 for k, v in b.items()}


def bits(hlo_dtype: str) -> int:
    """Bits of an HLO element type (`bf16`: 16, `s4`: 4; `pred`: a byte)."""
    found = re.search(r"[0-9]+$", hlo_dtype)
    return int(found.group()) if found else 8


# -- results ------------------------------------------------------------------------------------


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


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows as `write_csv` wrote them, numbers and `True`/`False` parsed back."""
    with open(path, newline="") as f:
        return [{k: _parse_cell(v) for k, v in r.items()} for r in csv.DictReader(f)]


def _parse_cell(v: str) -> Any:
    if v in ("True", "False"):
        return v == "True"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def write_results(out: Path, name: str, rows: list[dict[str, Any]], md: Sequence[str],
                  facts: dict[str, Any] | None = None, raw: list[dict[str, Any]] | None = None,
                  plot: Callable[[list[dict[str, Any]], Path], None] | None = None) -> Path:
    """`<name>.csv`, `<name>_rounds.csv` (`raw`), `<name>.md` (the lines `md`, then the
    machine and run `facts` in a collapsed note) and `<name>.png` (`plot(rows read back
    from the CSV, path)`, as `--plot-only` draws it). Included in the docs under a
    section heading of their own: no H1 in `md`."""
    write_csv(out / f"{name}.csv", rows)
    if raw is not None:
        write_csv(out / f"{name}_rounds.csv", raw)
    write_md(out / f"{name}.md", md, facts)
    if plot is not None:
        replot(out, name, plot)
    return out


def write_md(path: Path, md: Sequence[str], facts: dict[str, Any] | None = None) -> None:
    """The lines `md`, then the machine and run `facts` in a collapsed note."""
    path.write_text("\n".join([*md, "", machine_note(facts)]) + "\n")
    print(f"[{path.stem}] wrote {path}", flush=True)


def write_table(out: Path, name: str, rows: list[dict[str, Any]], text: str) -> None:
    """`<name>.csv` and `<name>.md` (`text` as it is, no machine note: a compiled program's
    table, the same on any machine)."""
    write_csv(out / f"{name}.csv", rows)
    (out / f"{name}.md").write_text(text)
    print(text, flush=True)


def column_table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A table of `(key, title)` columns, floats to 2 places (`compile_s`: 0)."""
    return md_table([title for _, title in columns], (
        ["" if r.get(k) is None else f"{r[k]:.{0 if k == 'compile_s' else 2}f}"
         if isinstance(r[k], float) else r[k] for k, _ in columns] for r in rows))


def replot(out: Path, name: str, plot: Callable[[list[dict[str, Any]], Path], None]) -> Path:
    """Draw `<name>.png` from `<name>.csv` in `out` (nothing is measured)."""
    if pyplot(name) is not None:
        plot(read_csv(out / f"{name}.csv"), out / f"{name}.png")
        print(f"[{name}] plotted {out / (name + '.png')}", flush=True)
    return out


# -- plots ----------------------------------------------------------------------------------------
# Drawn for the docs' page width: the content column is 688 px wide in a 1280 px window,
# so a figure WIDTH inches wide shows a point of text as 688 / (72 * WIDTH) px whatever
# the dpi: at 7.2 inches 9-point tick labels are 12 px, 10-point titles 13 px.

WIDTH = 7.2
DPI = 150


def pyplot(tag: str) -> Any:
    """`matplotlib.pyplot` on the Agg backend (with `matplotlib.ticker` loaded), or `None`
    with a note when matplotlib is not installed (the bench group has it)."""
    try:
        import matplotlib  # lazy: optional (the bench group), for the plots only
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after choosing the backend
        import matplotlib.ticker  # noqa: F401  # lazy: (plt.matplotlib.ticker below)
    except ImportError:
        print(f"[{tag}] matplotlib not installed: no PNG (pip install matplotlib)", flush=True)
        return None
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10,
                         "legend.fontsize": 9.5, "xtick.labelsize": 9, "ytick.labelsize": 9})
    return plt


TICKS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.25, 1.5, 2, 3, 4, 5, 7, 10, 15,
         20, 30, 50, 100, 200, 500, 1000)


def ratio_axis(axes: Any, log: bool = True, ticks: Sequence[float] = TICKS) -> None:
    """Ratio axes (call it after plotting; one axis or an array of them sharing y): log
    scale labelled with plain numbers (from `ticks`), at most about twelve, a light grid."""
    ticker = __import__("matplotlib.ticker").ticker
    axes = list(getattr(axes, "flat", [axes]))
    for ax in axes:
        if log:
            ax.set_yscale("log")
            lo, hi = ax.get_ylim()
            shown = [t for t in ticks if lo <= t <= hi]
            ax.yaxis.set_major_locator(ticker.FixedLocator(shown[::1 + len(shown) // 13]))
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_locator(ticker.NullLocator())
            ax.set_ylim(lo, hi)
        ax.grid(True, which="major", axis="y", alpha=0.3)


def target_line(ax: Any, y: float, label: str, color: str = "r", style: str = "--",
                place: str = "on") -> None:
    """A horizontal reference line, labelled: `place="on"` writes the label on the line
    at its right end, `"right"` just outside the axes (where data would sit under it),
    `"legend"` in the figure legend, `""` not at all (a panel beside a labelled one)."""
    ax.axhline(y, color=color, linewidth=0.9, linestyle=style, zorder=1,
               label=label if place == "legend" else None)
    if place in ("on", "right"):
        inside = place == "on"
        ax.annotate(label, xy=(1, y), xycoords=("axes fraction", "data"),
                    xytext=(-2 if inside else 3, 2 if inside else 0), textcoords="offset points",
                    ha="right" if inside else "left", va="bottom" if inside else "center",
                    fontsize=9, color=color, annotation_clip=False)


def group_ticks(ax: Any, groups: Sequence[tuple[str, Sequence[str]]]) -> list[int]:
    """Categories in groups along x: each its own short tick label, each group's label
    once beneath its ticks, a light line between groups. Returns the x positions."""
    xs: list[int] = []
    labels: list[str] = []
    for gi, (group, ticks) in enumerate(groups):
        first = len(xs)
        xs += range(first, first + len(ticks))
        labels += ticks
        if group:
            ax.annotate(group, xy=((first + len(xs) - 1) / 2, 0), xycoords=("data", "axes fraction"),
                        xytext=(0, -17), textcoords="offset points", ha="center", va="top")
        if gi:
            ax.axvline(first - 0.5, color="0.8", linewidth=0.8, zorder=0)
    ax.set_xticks(xs, labels)
    ax.set_xlim(-0.5, len(xs) - 0.5)
    return xs


def plot_groups(ax: Any, xs: Sequence[float], ys: Sequence[float], size: int, **kw: Any) -> None:
    """One line per group of `size` points (no line across a group boundary), one label."""
    for g in range(0, len(xs), size):
        ax.plot(xs[g:g + size], ys[g:g + size], **kw)
        kw = {**kw, "label": None, "color": ax.get_lines()[-1].get_color()}


def legend_below(fig: Any, axes: Any, ncol: int = 4) -> None:
    """One legend for the figure, below the panels (off the data): every label any of
    `axes` (one or an array) has, once."""
    handles: dict[str, Any] = {}
    for ax in getattr(axes, "flat", [axes]):
        handles.update({label: h for h, label in zip(*ax.get_legend_handles_labels())})
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, frameon=False)


def small_multiples(n: int, ncol: int, panel_height: float = 2.7, **kw: Any) -> tuple[Any, Any]:
    """A page-wide figure of `n` panels in rows of `ncol` (the unused ones hidden)."""
    plt = pyplot("plot")
    nrow = -(-n // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(WIDTH, panel_height * nrow + 0.6),
                             squeeze=False, **kw)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes


def finish(fig: Any, axes: Any, path: Path, ylabel: str | None, ncol: int = 3,
           legend_rows: int = 1) -> None:
    """`ylabel` on the first column, one legend below the panels, laid out and written."""
    for ax in axes[:, 0] if ylabel else ():
        ax.set_ylabel(ylabel)
    legend_below(fig, axes, ncol)
    save(fig, path, legend_rows)


def save(fig: Any, path: Path, legend_rows: int = 1) -> None:
    """Lay out (room at the bottom for `legend_rows` of figure legend) and write."""
    plt = __import__("matplotlib.pyplot").pyplot
    bottom = 0.0 if not legend_rows else (0.2 * legend_rows + 0.05) / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
