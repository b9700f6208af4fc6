"""Stacked layers under `lax.scan` against the same layers unrolled, compile-only: what the
compiled Llama step holds and how long it takes to compile.

The step is `benchmarks._llama`'s (lorax LoRA or QLoRA nf4 with double quantization, rank
16 on the seven projections, bf16, one 2048-token window, Adam), its
layers either stacked (`(layers, ...)` arrays, one layer compiled inside a loop) or a list
of per-layer arrays (`llama.unstack_layers`: the loop unrolled). Per remat choice:

- XLA's `memory_analysis()` of the compiled step: arguments and temporaries (GiB);
- weight slices: the program's slices, dynamic slices and copies whose result is one
  layer's frozen weight (its codes and scales for QLoRA) with a unit layer axis, i.e. a
  layer's weight copied out of its stack before it is read (under `lax.scan`, each runs
  once per layer per pass);
- compile seconds.

Compiled for the machine this runs on. On XLA:CPU, bf16 figures are high (no bf16
arithmetic: float32 copies), so read the two layer loops against each other; what a GPU
compile holds and the step times come from `python -m benchmarks.accelerator`'s
`...:unrolled` cells, on a card.

    python -m benchmarks.layers [--models llama-3-8b] [--methods lora,qlora-nf4]
                                [--remats none,dots,layer] [--out DIR] [--quick]
"""

from __future__ import annotations

import re
import time
from typing import Any

import jax
import jax.numpy as jnp

import lorax

from . import _common as C
from . import _llama as L

_OP = re.compile(r"= \w+\[([\d,]*)\]\S* (slice|dynamic-slice|copy)\(")


def layer_weight_shapes(cfg: Any, method: str) -> set[tuple[int, ...]]:
    """The shapes of one layer's frozen matrices (a quantized one's codes and scales)."""
    params, _ = L.build(cfg._replace(n_layers=1), method, jnp.bfloat16, "unrolled")
    (layer,) = params["layers"]
    frozen = [x.w if isinstance(x, lorax.LoraWeight) else x
              for k, x in layer.items() if k in L.TARGETS]
    return {tuple(a.shape) for a in jax.tree.leaves(frozen) if len(a.shape) >= 2}


def weight_slices(hlo_text: str, shapes: set[tuple[int, ...]]) -> int:
    """Slices, dynamic slices and copies in `hlo_text` whose result is one of `shapes`
    with a leading unit axis: a scan's slice of a stack, before it is reshaped (a weight's
    shape alone can also be another buffer's, such as a chunk of the tied embedding)."""
    n = 0
    for dims, _ in _OP.findall(hlo_text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        n += shape[:1] == (1,) and shape[1:] in shapes
    return n


def measure(model: str, method: str, remat: str, layers: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    step, args = L.abstract_step(model, method, False, remat, layers, attention="auto")
    compiled = jax.jit(step, donate_argnums=(0, 2)).lower(*args).compile()
    seconds = time.perf_counter() - t0
    m = C.memory_gib(compiled.memory_analysis())
    shapes = layer_weight_shapes(L.config(model, remat=remat), method)
    return dict(model=model, method=method, remat=remat, layers=layers, args_gib=m["args"],
                temps_gib=m["temps"], weight_slices=weight_slices(compiled.as_text(), shapes),
                compile_s=seconds, platform=jax.default_backend())


def markdown(rows: list[dict[str, Any]]) -> str:
    pairs: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        pairs.setdefault((r["model"], r["method"], r["remat"]), {})[r["layers"]] = r
    f = lambda r, k, fmt: format(r[k], fmt) if r else ""  # noqa: E731
    return C.md_table(
        ["model", "method", "remat", "temps GiB: scan", "unrolled", "weight slices: scan",
         "unrolled", "compile s: scan", "unrolled"],
        [[*key, f(p.get("scan"), "temps_gib", ".2f"), f(p.get("unrolled"), "temps_gib", ".2f"),
          f(p.get("scan"), "weight_slices", "d"), f(p.get("unrolled"), "weight_slices", "d"),
          f(p.get("scan"), "compile_s", ".0f"), f(p.get("unrolled"), "compile_s", ".0f")]
         for key, p in pairs.items()])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = C.parser(__doc__, rounds=False, plot=False)
    p.add_argument("--models", default="llama-3-8b")
    p.add_argument("--methods", default="lora,qlora-nf4")
    p.add_argument("--remats", default="none,dots,layer")
    args = p.parse_args(argv)
    out = C.out_dir(args.out)
    models = ["tiny"] if args.quick else args.models.split(",")
    rows = []
    for model in models:
        for method in args.methods.split(","):
            for remat in args.remats.split(","):
                for layers in L.LAYER_LOOPS:
                    rows.append(row := measure(model, method, remat, layers))
                    print(f"[layers] {model} {method} {remat} {layers}: temps "
                          f"{row['temps_gib']:.2f} GiB, {row['weight_slices']} weight slices "
                          f"({row['compile_s']:.0f} s)", flush=True)
    note = (f"Compiled for `{rows[0]['platform']}` (XLA:CPU's bf16 figures are high: compare "
            "the two columns, not a card).")
    C.write_results(out, "layers", rows, [markdown(rows), "", note])
    return rows


if __name__ == "__main__":
    main()
