"""QLoRA: compiled memory and step time of a quantized frozen base vs dense LoRA.

    python -m benchmarks.qlora [--quick] [--out DIR] [--rounds N]

Models (LoRA rank 8 on every kernel, Adam on the factors, the partition path):

- `mlp`: an 8-layer relu MLP, unrolled, d x d kernels, batch 64;
- `scan`: an 8-layer pre-norm decoder stack under `lax.scan` (stacked `(layers, in,
  out)` kernels q, k, v, o (d x d), up (d x 4d), down (4d x d); 8 x 128 tokens);
- `nnx`: the Flax NNX stack of `benchmarks/blocks.py` (`_models.nnx_stack`, 4 layers,
  `nnx.MultiHeadAttention` + `nnx.Linear`), where qwix's QLoRA (`qwix.LoraProvider`
  with `weight_qtype` nf4 / int8) runs side by side with lorax's on the same model.

Implementations: `dense` (LoRA on the float32 base), `int8` / `nf4` / `q4_1` / `q5_0` /
`q4_k` / `q6_k` (lorax's `QuantizedArray` base; GGUF's K-quants `q4_k` / `q6_k`, which
lorax reads from files but does not quantize, are random GGUF blocks of the kernel's
shape, centred, with the dense weights' standard deviation: step time and memory do not
depend on the values), `naive_nf4` (the dequantize-then-dot one writes by hand:
`x @ stop_gradient(q.dequantize()) + (x @ b) @ a`), and on `nnx` `qwix_nf4` /
`qwix_int8`. Memory is XLA's `memory_analysis()` of the compiled step (deterministic on
CPU): arguments (the base, factors, optimizer state, batch) and temporaries, also in
units of one dense layer's weights. Step time: interleaved rounds in one process, the
ratio to `dense` paired within each round, medians.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lorax

from . import _common as C
from . import _models as M

RANK = 8
QTYPES = ("int8", "nf4", "q4_1", "q5_0", "q4_k", "q6_k")
# GGUF K-quant blocks filled at random: (values, bytes, byte of d, byte of dmin, mean code
# product / mean min, so dmin = d * that centres the values).
K_BLOCKS = {"q4_k": (256, 144, 0, 2, 7.5), "q6_k": (256, 210, 208, None, 0.0)}
DEFAULT = dict(mlp=(512, 1024, 2048), scan=(512, 1024), nnx=(256, 512), rounds=5)
QUICK = dict(mlp=(128,), scan=(128,), nnx=(128,), rounds=2)


def _naive_dot(x: jax.Array, w: Any) -> jax.Array:
    # What one writes first: dequantize the base, then LoRA by hand.
    base = lax.stop_gradient(w.w.dequantize())
    return x @ base + ((x @ w.b.astype(base.dtype)) @ w.a.astype(base.dtype)) * w.scale


def _random_gguf(kernels: dict, qtype: str) -> dict:
    """Each `(..., in, out)` kernel as random `qtype` blocks of its shape (see above)."""
    values, size, d_at, m_at, centre = K_BLOCKS[qtype]
    rng = np.random.default_rng(0)

    def blocks(w: jax.Array) -> lorax.QuantizedArray:
        *lead, k, n = w.shape  # an (in, out) kernel: GGUF rows are its output channels
        data = rng.integers(0, 256, (*lead, n, k // values, size), dtype=np.uint8)

        def wrap(d: float) -> lorax.QuantizedArray:
            for at, v in ((d_at, d), (m_at, d * centre)):
                if at is not None:
                    data[..., at:at + 2] = np.float16(v).reshape(1).view(np.uint8)
            return lorax.QuantizedArray.from_gguf(data.reshape(*lead, n, -1), qtype)

        std = float(jnp.std(wrap(1.0).dequantize()))
        return wrap(float(jnp.std(w)) / std)

    return {name: blocks(w) for name, w in kernels.items()}


# -- one implementation's step -----------------------------------------------------------


def _lorax_runner(model: str, d: int, impl: str, x: jax.Array) -> tuple[C.Step, Any]:
    params, apply = ((M.mlp_params(d, 8), functools.partial(M.mlp_apply, relu_last=True))
                     if model == "mlp" else (M.scan_params(d), M.scan_apply))
    if model == "mlp":
        spec = {k: RANK for k in params}
    else:
        spec = {"layers": {k: lorax.LoraSpec(RANK, batch_ndim=1, m_ndim=1) for k in params["layers"]},
                "norm": lorax.LORA_FREEZE}
    qtype = impl.removeprefix("naive_")
    if qtype in K_BLOCKS:  # every kernel; the norms stay
        params = (_random_gguf(params, qtype) if model == "mlp"
                  else dict(params, layers=_random_gguf(params["layers"], qtype)))
    elif impl != "dense":
        params = lorax.quantize(params, spec, qtype)
    lp = M.nonzero_b(lorax.init_lora(params, spec, jax.random.PRNGKey(1), alpha=2.0 * RANK))
    trainable, frozen = lorax.partition(lp, spec)
    if impl.startswith("naive_"):
        def loss(t, f, x):
            return jnp.mean(apply(lorax.combine(t, f), x, _naive_dot) ** 2)
    else:
        fn = lorax.lora(lambda p, x: apply(p, x, M.plain_dot), on_materialize="error")

        def loss(t, f, x):
            return jnp.mean(fn(lorax.combine(t, f), x) ** 2)
    return C.train_runner(loss, trainable, (frozen, x))


def _nnx_runner(d: int, impl: str, x: jax.Array) -> tuple[C.Step, Any]:
    from flax import nnx  # lazy: Flax loads in seconds, for the nnx cells only

    module = M.nnx_stack(d, 4)
    if impl.startswith("qwix_"):
        import qwix  # lazy: optional (the bench group)

        qtype = {"qwix_nf4": "nf4", "qwix_int8": "int8"}[impl]
        provider = qwix.LoraProvider(module_path=r".*/(query|key|value|out|up|down)", rank=RANK,
                                     alpha=2.0 * RANK, weight_qtype=qtype,
                                     tile_size=64 if qtype == "nf4" else None)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            qm = qwix.apply_lora_to_model(module, provider, jnp.zeros((1, 8, d), jnp.float32),
                                          rngs=nnx.Rngs(0))
        graphdef, lora_state, rest = nnx.split(qm, nnx.LoRAParam, ...)
        lora_state = jax.tree.map(lambda a: jnp.full_like(a, 0.01), lora_state)

        def loss(t, f, x):
            return jnp.mean(nnx.merge(graphdef, t, f)(x) ** 2)
        trainable, frozen = lora_state, rest
    else:
        graphdef, state = nnx.split(module)
        spec = lorax.simple_spec(state, targets=r"(query|key|value|out|up|down)/kernel", rank=RANK)
        spec = lorax.infer_layout(lambda s, x: nnx.merge(graphdef, s)(x), state, spec, x)
        if impl != "dense":
            state = lorax.quantize(state, spec, impl)
        lp = lorax.init_lora(state, spec, jax.random.PRNGKey(1), alpha=2.0 * RANK)
        trainable, frozen = lorax.partition(lp, spec)
        fn = lorax.lora(lambda s, x: nnx.merge(graphdef, s)(x), on_materialize="error")

        def loss(t, f, x):
            return jnp.mean(fn(lorax.combine(t, f), x) ** 2)
    return C.train_runner(loss, trainable, (frozen, x))


def _impls(model: str, d: int) -> tuple[str, ...]:
    if model == "nnx":
        return ("dense", "int8", "nf4", *(("qwix_int8", "qwix_nf4") if M.HAVE_QWIX else ()))
    # K-quant blocks are 256 values long: d must split into them (not at --quick's 128).
    return ("dense", *(q for q in QTYPES if q not in K_BLOCKS or d % 256 == 0), "naive_nf4")


class Cell:
    def __init__(self, model: str, d: int):
        self.model, self.d = model, d
        self.label = f"{model} d{d}"
        if model == "mlp":
            x = jax.random.normal(jax.random.PRNGKey(2), (64, d))
        else:
            x = jax.random.normal(jax.random.PRNGKey(2), (8, 128, d) if model == "scan" else (4, 128, d))
        self.runners: dict[str, C.Step] = {}
        self.memory: dict[str, tuple[float, float]] = {}
        for impl in _impls(model, d):
            runner, compiled = (_nnx_runner(d, impl, x) if model == "nnx"
                                else _lorax_runner(model, d, impl, x))
            m = compiled.memory_analysis()
            self.runners[impl] = runner
            self.memory[impl] = (m.argument_size_in_bytes, m.temp_size_in_bytes)


def _row(c: Cell, impl: str) -> dict[str, Any]:
    lb = c.d * c.d * 4  # one d x d float32 weight
    args_b, temp_b = c.memory[impl]
    return dict(model=c.model, d=c.d, impl=impl, args_mib=args_b / 2**20, temp_mib=temp_b / 2**20,
                temp_layers=temp_b / lb, extra_temp_layers=(temp_b - c.memory["dense"][1]) / lb,
                args_vs_dense=args_b / c.memory["dense"][0], ms=C.median(c.times[impl]) * 1e3,
                time_vs_dense=C.median(C.paired(c.times[impl], c.times["dense"])))


def main(argv: list[str] | None = None) -> Path:
    a = C.parse(C.parser(__doc__, plot=True, models="mlp,scan,nnx"), argv, DEFAULT, QUICK)
    if a.plot_only:
        return C.replot(a.out, "qlora", _plot)
    models = [m for m in ("mlp", "scan", "nnx") if m in a.models.split(",")]
    if "nnx" in models and not M.HAVE_QWIX and not a.quick:
        print("[qlora] qwix not installed: nnx cells without qwix", flush=True)
    clock, cells, raw = C.measure_cells("qlora", [(m, d) for m in models for d in a.cfg[m]], Cell,
                                        a.rounds, 0.05, cap=20)
    rows = [_row(c, impl) for c in cells for impl in c.runners]
    return C.write_results(a.out, "qlora", rows, _markdown(rows), clock.facts(f"{a.rounds} rounds"),
                           raw, _plot)


def _markdown(rows: list[dict]) -> list[str]:
    header = ["model", "d", "impl", "arguments MiB", "args / dense", "temporaries MiB",
              "temp (layers)", "extra (layers)", "ms / step", "time / dense"]
    body = [[r["model"], r["d"], f"`{r['impl']}`", f"{r['args_mib']:.1f}",
             f"{r['args_vs_dense']:.2f}", f"{r['temp_mib']:.1f}", f"{r['temp_layers']:.2f}",
             f"{r['extra_temp_layers']:+.2f}", f"{r['ms']:.1f}", f"{r['time_vs_dense']:.2f}"]
            for r in rows]
    return ["Compiled memory of one training step (XLA's `memory_analysis()`) and step time. "
            "`temp (layers)`: temporaries in units of one d x d float32 weight; `extra`: "
            "temporaries beyond the dense-LoRA step's. `/ dense`: the step time paired with "
            "the dense-LoRA step's in each round (median).", "", C.md_table(header, body)]


def _plot(rows: list[dict], path: Path) -> None:
    """Three panels stacked, one per question (arguments, extra temporaries, step time,
    each against dense LoRA), grouped bars per cell, one colour per implementation."""
    cells = list(dict.fromkeys((r["model"], r["d"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = C.small_multiples(3, 1, 2.55, sharex=True)
    width = 0.8 / len(impls)
    for ax, (key, label, ref) in zip(axes[:, 0], (
            ("args_vs_dense", "arguments / dense LoRA", 1.0),
            ("extra_temp_layers", "temporaries beyond dense LoRA\n(d x d layers)", 0.0),
            ("time_vs_dense", "step time / dense LoRA", 1.0))):
        for i, impl in enumerate(impls):
            got = {(r["model"], r["d"]): r[key] for r in rows if r["impl"] == impl}
            xs = [c + (i - len(impls) / 2 + 0.5) * width for c, cell in enumerate(cells) if cell in got]
            ax.bar(xs, [got[cell] for cell in cells if cell in got], width, label=impl)
        ax.axhline(ref, color="k", lw=0.7)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[1, 0].set_yscale("symlog", linthresh=1)
    axes[1, 0].yaxis.set_major_formatter(C.pyplot("qlora").matplotlib.ticker.FormatStrFormatter("%g"))
    axes[-1, 0].set_xticks(range(len(cells)), [f"{m} d{d}" for m, d in cells])
    C.finish(fig, axes, path, None, ncol=5, legend_rows=2)


if __name__ == "__main__":
    main()
