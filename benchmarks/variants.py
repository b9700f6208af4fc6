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

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import lorax

from . import _common as C
from . import _models as M

IMPLS = ("lora", "dora", "hand_dora", "dropout")
DEFAULT = dict(batch=(64, 256, 1024), dim=(512, 1024, 2048), rank=(8, 64), scan=(512, 1024),
               rounds=5)
QUICK = dict(batch=(32,), dim=(128,), rank=(4,), scan=(128,), rounds=2)
DROPOUT = 0.1


def _hand_dora_dot(x: jax.Array, w: Any) -> jax.Array:
    """DoRA as PEFT's `DoraLinearLayer` computes it: the norm of the materialised
    weight (detached), then the unmerged forward scaled per output feature."""
    nb = w.structure[0]
    base = lax.stop_gradient(w.w)
    delta = w.scale * jnp.einsum("...ik,...ko->...io", w.b, w.a)
    norm = lax.stop_gradient(jnp.linalg.norm(base + delta, axis=nb, keepdims=True))
    y = x @ base + ((x @ w.b) * w.scale) @ w.a
    return y * (w.m / norm).reshape(w.m.shape[nb:]).squeeze(0)


def _build(model: str, d: int, rank: int, impl: str, x: jax.Array) -> tuple[C.Step, Any]:
    dora = impl.endswith("dora")
    if model == "mlp":
        params, apply = M.mlp_params(d), M.mlp_apply
        spec = {k: lorax.LoraSpec(rank, dora=dora) for k in params}
    else:
        params, apply = M.scan_params(d), M.scan_apply
        ls = lorax.LoraSpec(rank, batch_ndim=1, m_ndim=1, dora=dora)
        spec = {"layers": {k: ls for k in params["layers"]}, "norm": lorax.LORA_FREEZE}
    # (a non-zero b: the norm's cross terms are real work)
    lp = M.nonzero_b(lorax.init_lora(params, spec, jax.random.PRNGKey(1), alpha=2.0 * rank))
    trainable, frozen = lorax.partition(lp, spec)
    keyed = impl == "dropout"
    if impl == "hand_dora":
        def loss(t, f, x):
            return jnp.mean(apply(lorax.combine(t, f), x, _hand_dora_dot) ** 2)
    else:
        fn = lorax.lora(lambda p, x: apply(p, x, M.plain_dot), on_materialize="error")
        if keyed:
            def loss(t, f, x, key):
                return jnp.mean(fn(lorax.dropout(lorax.combine(t, f), key, DROPOUT), x) ** 2)
        else:
            def loss(t, f, x):
                return jnp.mean(fn(lorax.combine(t, f), x) ** 2)
    return C.train_runner(loss, trainable, (frozen, x), keyed=keyed)


class Cell:
    def __init__(self, model: str, batch: int, d: int, rank: int):
        self.model, self.batch, self.d, self.rank = model, batch, d, rank
        if model == "mlp":
            self.label = f"mlp b{batch} d{d} k{rank}"
            x = jax.random.normal(jax.random.PRNGKey(2), (batch, d))
        else:
            self.label = f"scan d{d} k{rank}"
            x = jax.random.normal(jax.random.PRNGKey(2), (8, 128, d))
        self.runners: dict[str, C.Step] = {}
        self.temp: dict[str, int] = {}
        for impl in IMPLS:
            runner, compiled = _build(model, d, rank, impl, x)
            self.runners[impl] = runner
            self.temp[impl] = compiled.memory_analysis().temp_size_in_bytes


def _specs(cfg: dict, models: list[str], quick: bool) -> list[tuple[str, int, int, int]]:
    """(model, batch, d, rank) of every cell."""
    specs = []
    if "mlp" in models:
        specs += [("mlp", b, d, k) for b in cfg["batch"] for d in cfg["dim"] for k in cfg["rank"]]
    if "scan" in models:
        specs += [("scan", 1024, d, 4 if quick else 8) for d in cfg["scan"]]
    return specs


def main(argv: list[str] | None = None) -> Path:
    a = C.parse(C.parser(__doc__, plot=True, models="mlp,scan"), argv, DEFAULT, QUICK)
    if a.plot_only:
        return C.replot(a.out, "variants", _plot)
    clock, cells, raw = C.measure_cells("variants", _specs(a.cfg, a.models.split(","), a.quick),
                                        Cell, a.rounds, 0.05, cap=20)
    rows = [dict(model=c.model, batch=c.batch, d=c.d, rank=c.rank, impl=impl,
                 ms=C.median(c.times[impl]) * 1e3,
                 time_vs_lora=C.median(C.paired(c.times[impl], c.times["lora"])),
                 extra_temp_layers=(c.temp[impl] - c.temp["lora"]) / (c.d * c.d * 4))
            for c in cells for impl in IMPLS]
    return C.write_results(a.out, "variants", rows, _markdown(rows), clock.facts(f"{a.rounds} rounds"),
                           raw, _plot)


def _markdown(rows: list[dict]) -> list[str]:
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
    return ["Step time of one training step (partition path, Adam), paired with plain lorax "
            "LoRA's step in each round (median of the ratios); `extra temp`: compiled "
            "temporaries beyond plain LoRA's, in units of one d x d float32 weight. DoRA's "
            "norm costs one `(k x d) . (d x d)` product per weight per step, so its floor "
            "over LoRA's ~`2 * batch * d^2` per weight is about `1 + k / (2 * batch)`.", "",
            C.md_table(header, body)]


def _plot(rows: list[dict], path: Path) -> None:
    """Small multiples, a panel per model and rank: each variant's step time over plain
    LoRA's per cell, the 1.15 aim drawn."""
    panels = list(dict.fromkeys((r["model"], r["rank"]) for r in rows))
    fig, axes = C.small_multiples(len(panels), 1, 2.2, sharey=True)
    impls = [i for i in IMPLS if i != "lora"]
    for ax, (model, rank) in zip(axes.flat, panels):
        prs = [r for r in rows if (r["model"], r["rank"]) == (model, rank)]
        batches = list(dict.fromkeys(r["batch"] for r in prs))
        ds = list(dict.fromkeys(r["d"] for r in prs))
        by = {(r["batch"], r["d"], r["impl"]): r["time_vs_lora"] for r in prs}
        xs = C.group_ticks(ax, [(f"batch {b}" if model == "mlp" else "8×128 tokens",
                                 [f"d{d}" for d in ds]) for b in batches])
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            ax.bar([x + (i - len(impls) / 2 + 0.5) * width for x in xs],
                   [by[(b, d, impl)] for b in batches for d in ds], width, label=impl, color=f"C{i}")
        ax.axhline(1.0, color="k", lw=0.6)
        C.target_line(ax, 1.15, "aim: 1.15 × plain LoRA", place="legend")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_title(f"{model}, rank {rank}")
        ax.grid(True, axis="y", alpha=0.3)
    C.finish(fig, axes, path, "step / plain LoRA", ncol=4)


if __name__ == "__main__":
    main()
