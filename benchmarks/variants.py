"""LoRA variants: step time and compiled memory of DoRA and LoRA dropout vs plain LoRA.

    python -m benchmarks.variants [--quick] [--out DIR] [--rounds N]

Models (the partition path, Adam on what is trained):

- `mlp`: the speed grid's 4-layer relu MLP (`benchmarks/speed.py`), unrolled, every
  d x d kernel adapted, batch x dim x rank;
- `scan`: the 8-layer pre-norm decoder stack of `benchmarks/qlora.py` under `lax.scan`
  (stacked q, k, v, o, up, down kernels; 8 x 128 tokens), rank 8.

Implementations: `lora` (lorax, plain LoRA), `dora` (lorax DoRA: the norm from
`||w||^2`, `b^T w` and rank-k products, `(x @ w + s (x @ b) @ a) * m / ||V||`),
`hand_dora` (DoRA as PEFT computes it, written by hand: the norm of the materialised
`w + s * b @ a`, then the same unmerged forward), `dropout` (lorax LoRA with LoRA
dropout 0.1, a fresh key per step). Step time: interleaved rounds in one process, each
ratio paired with `lora` within its round, medians. Memory: XLA's compiled
`memory_analysis()` temporaries beyond `lora`'s, in units of one d x d float32 weight.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import jax
import jax.numpy as jnp
import optax
from jax import lax

import lorax

from . import _common as C
from . import qlora

IMPLS = ("lora", "dora", "hand_dora", "dropout")
DEFAULT = dict(batch=(64, 256, 1024), dim=(512, 1024, 2048), rank=(8, 64), scan=(512, 1024),
               rounds=5)
QUICK = dict(batch=(32,), dim=(128,), rank=(4,), scan=(128,), rounds=2)
DROPOUT = 0.1


def _is_lora(x: Any) -> bool:
    return isinstance(x, lorax.LoraWeight)


def _mlp_params(d: int, layers: int = 4) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    return {f"l{i}": jax.random.normal(k, (d, d)) / d**0.5 for i, k in enumerate(keys)}


def _mlp_apply(params: dict, x: jax.Array, dot: Callable) -> jax.Array:
    n = len(params)
    for i in range(n):
        x = dot(x, params[f"l{i}"])
        x = jax.nn.relu(x) if i < n - 1 else x
    return x


def _hand_dora_dot(x: jax.Array, w: Any) -> jax.Array:
    """DoRA as PEFT's `DoraLinearLayer` computes it: the norm of the materialised
    weight (detached), then the unmerged forward scaled per output feature."""
    nb = w.structure[0]
    base = lax.stop_gradient(w.w)
    delta = w.scale * jnp.einsum("...ik,...ko->...io", w.b, w.a)
    norm = lax.stop_gradient(jnp.linalg.norm(base + delta, axis=nb, keepdims=True))
    y = x @ base + ((x @ w.b) * w.scale) @ w.a
    return y * (w.m / norm).reshape(w.m.shape[nb:]).squeeze(0)


class Runner(C.Timed):
    def __init__(self, step: Callable, state: tuple, frozen: Any, x: jax.Array, keyed: bool):
        self.step, self.state, self.frozen, self.x, self.keyed = step, state, frozen, x, keyed
        self.i = 0

    def call(self) -> Any:
        self.i += 1
        extra = (jax.random.fold_in(jax.random.key(0), self.i),) if self.keyed else ()
        self.state = self.step(*self.state, self.frozen, self.x, *extra)
        return self.state[0]


def _build(model: str, d: int, rank: int, impl: str, x: jax.Array) -> tuple[Runner, Any]:
    if model == "mlp":
        params, apply = _mlp_params(d), _mlp_apply
        spec = {k: lorax.LoraSpec(rank, dora=impl.endswith("dora")) for k in params}
    else:
        params, apply = qlora._scan_params(d), qlora._scan_apply
        ls = lorax.LoraSpec(rank, batch_ndim=1, m_ndim=1, dora=impl.endswith("dora"))
        spec = {"layers": {k: ls for k in params["layers"]}, "norm": lorax.LORA_FREEZE}
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(1), alpha=2.0 * rank)

    def nudge(w: Any) -> Any:  # non-zero b: the norm's cross terms are real work
        if isinstance(w, lorax.DoraWeight):
            return lorax.DoraWeight(w.w, w.a, jnp.full_like(w.b, 0.01), w.m, w.alpha)
        return lorax.LoraWeight(w.w, w.a, jnp.full_like(w.b, 0.01), w.alpha) if _is_lora(w) else w

    lp = jax.tree.map(nudge, lp, is_leaf=_is_lora)
    trainable, frozen = lorax.partition(lp, spec)
    keyed = impl == "dropout"
    if impl == "hand_dora":
        def loss(t, f, x):
            return jnp.mean(apply(lorax.combine(t, f), x, _hand_dora_dot) ** 2)
    else:
        fn = lorax.lora(lambda p, x: apply(p, x, qlora._plain_dot), on_materialize="error")
        if keyed:
            def loss(t, f, x, key):
                return jnp.mean(fn(lorax.dropout(lorax.combine(t, f), key, DROPOUT), x) ** 2)
        else:
            def loss(t, f, x):
                return jnp.mean(fn(lorax.combine(t, f), x) ** 2)
    opt = optax.adam(1e-3)

    def step(trainable, opt_state, frozen, x, *key):
        grads = jax.grad(loss)(trainable, frozen, x, *key)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    step = jax.jit(step, donate_argnums=(0, 1))
    extra = (jax.random.key(0),) if keyed else ()
    compiled = step.lower(trainable, opt.init(trainable), frozen, x, *extra).compile()
    state = (jax.tree.map(jnp.copy, trainable), opt.init(trainable))
    return Runner(step, state, frozen, x, keyed), compiled


class Cell:
    def __init__(self, model: str, batch: int, d: int, rank: int):
        self.model, self.batch, self.d, self.rank = model, batch, d, rank
        if model == "mlp":
            self.label = f"mlp b{batch} d{d} k{rank}"
            x = jax.random.normal(jax.random.PRNGKey(2), (batch, d))
        else:
            self.label = f"scan d{d} k{rank}"
            x = jax.random.normal(jax.random.PRNGKey(2), (8, 128, d))
        self.runners: dict[str, Runner] = {}
        self.temp: dict[str, int] = {}
        for impl in IMPLS:
            runner, compiled = _build(model, d, rank, impl, x)
            self.runners[impl] = runner
            self.temp[impl] = compiled.memory_analysis().temp_size_in_bytes
        self.times: dict[str, list[float]] = {n: [] for n in self.runners}
        warm = self.runners["lora"].measure(2)
        self.n_inner = max(1, min(20, int(0.05 / max(warm, 1e-6))))
        for r in self.runners.values():
            r.measure(1)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--models", default="mlp,scan", help="comma-separated subset")
    a = p.parse_args(argv)
    cfg = QUICK if a.quick else DEFAULT
    rounds = a.rounds or cfg["rounds"]
    out = C.out_dir(a.out)
    t0 = time.perf_counter()
    load_start = C.loadavg()
    cells = []
    models = a.models.split(",")
    if "mlp" in models:
        for b in cfg["batch"]:
            for d in cfg["dim"]:
                for k in cfg["rank"]:
                    cells.append(Cell("mlp", b, d, k))
                    print(f"[variants] compiled {cells[-1].label} ({time.perf_counter() - t0:.0f}s)",
                          flush=True)
    if "scan" in models:
        for d in cfg["scan"]:
            cells.append(Cell("scan", 1024, d, 8 if not a.quick else 4))
            print(f"[variants] compiled {cells[-1].label} ({time.perf_counter() - t0:.0f}s)", flush=True)
    raw = C.interleaved_rounds(cells, rounds, "variants", lambda c: dict(cell=c.label), t0)
    rows = []
    for c in cells:
        lb = c.d * c.d * 4
        for impl in IMPLS:
            ratios = [t / tl for t, tl in zip(c.times[impl], c.times["lora"])]
            rows.append(dict(model=c.model, batch=c.batch, d=c.d, rank=c.rank, impl=impl,
                             ms=C.median(c.times[impl]) * 1e3, time_vs_lora=C.median(ratios),
                             extra_temp_layers=(c.temp[impl] - c.temp["lora"]) / lb))
    C.write_csv(out / "variants.csv", rows)
    C.write_csv(out / "variants_rounds.csv", raw)
    (out / "variants.md").write_text(_markdown(rows, rounds, load_start, time.perf_counter() - t0))
    _plot(out / "variants.png", rows)
    print(f"[variants] wrote {out / 'variants.md'} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return out


def _markdown(rows: list[dict], rounds: int, load_start: str, elapsed: float) -> str:
    md = ["# LoRA variants: DoRA and LoRA dropout vs plain LoRA", "",
          C.machine_md({"load average (1/5/15 min) at start": load_start,
                        "load average at end": C.loadavg(),
                        "run": f"{rounds} rounds, {elapsed:.0f} s"}), "",
          "Step time of one training step (partition path, Adam), paired with plain lorax "
          "LoRA's step in each round (median of the ratios); `extra temp`: compiled "
          "temporaries beyond plain LoRA's, in units of one d x d float32 weight. DoRA's "
          "norm costs one `(k x d) . (d x d)` product per weight per step, so its floor "
          "over LoRA's ~`2 * batch * d^2` per weight is about `1 + k / (2 * batch)`.", ""]
    header = ["model", "batch", "d", "rank", "`dora` / lora", "`hand_dora` / lora",
              "`dropout` / lora", "floor `1 + k/2b`", "extra temp `dora`",
              "extra temp `hand_dora`", "lora ms"]
    cells = list(dict.fromkeys((r["model"], r["batch"], r["d"], r["rank"]) for r in rows))
    body = []
    for cell in cells:
        by = {r["impl"]: r for r in rows if (r["model"], r["batch"], r["d"], r["rank"]) == cell}
        model, batch, d, rank = cell
        tokens = batch if model == "mlp" else 8 * 128
        body.append([model, batch if model == "mlp" else "8x128", d, rank,
                     f"{by['dora']['time_vs_lora']:.2f}", f"{by['hand_dora']['time_vs_lora']:.2f}",
                     f"{by['dropout']['time_vs_lora']:.2f}", f"{1 + rank / (2 * tokens):.2f}",
                     f"{by['dora']['extra_temp_layers']:+.2f}",
                     f"{by['hand_dora']['extra_temp_layers']:+.2f}", f"{by['lora']['ms']:.1f}"])
    md.append(C.md_table(header, body))
    return "\n".join(md) + "\n"


def _plot(path: Path, rows: list[dict]) -> None:
    plt = C.pyplot("variants")
    if plt is None:
        return
    cells = list(dict.fromkeys((r["model"], r["batch"], r["d"], r["rank"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(cells)), 4.2))
    impls = [i for i in IMPLS if i != "lora"]
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ys = [next(r["time_vs_lora"] for r in rows
                   if (r["model"], r["batch"], r["d"], r["rank"]) == c and r["impl"] == impl)
              for c in cells]
        ax.bar([j + (i - len(impls) / 2 + 0.5) * width for j in range(len(cells))], ys, width,
               label=impl)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.axhline(1.15, color="r", lw=0.6, ls="--", label="1.15x")
    ax.set_xticks(range(len(cells)),
                  [f"{m}\nb{b} d{d}\nk{k}" if m == "mlp" else f"{m}\nd{d}\nk{k}"
                   for m, b, d, k in cells], fontsize=6)
    ax.set_ylabel("step time / plain LoRA")
    ax.legend(fontsize=7)
    ax.set_title("DoRA and LoRA dropout: training step vs plain LoRA")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
