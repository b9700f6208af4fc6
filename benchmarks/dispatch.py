"""Per-call dispatch cost of a jitted function taking `LoraWeight`s, against the same leaves
in plain dicts.

    python -m benchmarks.dispatch [--quick] [--out DIR] [--weights 96]

Every call of a jitted step flattens its arguments (and unflattens its outputs) before
XLA runs; for a model's worth of `LoraWeight`s that is per-step overhead a training
loop pays on every call. Three containers of the same `w`, `a`, `b` arrays:

- `dict`: `{"w": w, "a": a, "b": b}` (JAX's C++ pytree path);
- `lorax`: `LoraWeight` with lorax's own registration (`_engine.FastPytreeMeta`);
- `equinox`: the same class registered by equinox, as in lorax 0.4.0.

Two functions: `args` takes the tree and returns a scalar (the partition path's frozen
half, or any step's inputs); `identity` returns the tree (the lorax 0.3 path returns
the whole LoRA tree every step). Times are medians over repeats of `number` calls,
taken in interleaved order -> `dispatch.csv`, `dispatch.md`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import quax  # noqa: E402

import lorax  # noqa: E402

from . import _common as C  # noqa: E402


class EquinoxLoraWeight(quax.ArrayValue):
    """`LoraWeight`'s fields under equinox's own pytree registration (lorax 0.4.0)."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    alpha: float = eqx.field(static=True, default=1.0)

    def aval(self):  # never traced here: only flattened and unflattened
        return jax.core.ShapedArray(self.w.shape, self.w.dtype)

    def materialise(self):
        return self.w


CONTAINERS = {
    "dict": lambda w, a, b: {"w": w, "a": a, "b": b},
    "lorax": lambda w, a, b: lorax.LoraWeight(w, a, b, alpha=2.0),
    "equinox": lambda w, a, b: EquinoxLoraWeight(w, a, b, alpha=2.0),
}


def _time_calls(fn, tree, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn(tree)
    jax.block_until_ready(fn(tree))
    return (time.perf_counter() - start) / (number + 1)


def measure(n_weights: int, number: int, repeats: int) -> list[dict]:
    w, a, b = jnp.ones((16, 16)), jnp.ones((2, 16)), jnp.ones((16, 2))
    trees = {name: [make(w, a, b) for _ in range(n_weights)] for name, make in CONTAINERS.items()}
    fns = {"args": jax.jit(lambda t: jnp.zeros(())), "identity": jax.jit(lambda t: t)}
    samples: dict[tuple[str, str], list[float]] = {}
    for fn in fns.values():  # compile everything first
        for tree in trees.values():
            jax.block_until_ready(fn(tree))
    for rep in range(repeats):
        for fn_name, fn in fns.items():
            names = list(trees)
            names = names[rep % len(names):] + names[: rep % len(names)]  # rotate the order
            for name in names:
                samples.setdefault((fn_name, name), []).append(_time_calls(fn, trees[name], number))
    rows = []
    for (fn_name, name), ts in samples.items():
        us = 1e6 * statistics.median(ts)
        base = 1e6 * statistics.median(samples[(fn_name, "dict")])
        rows.append(dict(function=fn_name, container=name, weights=n_weights, us_per_call=us,
                         ratio_to_dict=us / base, repeats=repeats, calls_per_repeat=number))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--weights", type=int, default=96)
    a = p.parse_args(argv)
    out = C.out_dir(a.out)
    number, repeats = (20, 3) if a.quick else (300, 21)
    load = C.loadavg()
    rows = measure(a.weights, number, repeats)
    C.write_csv(out / "dispatch.csv", rows)
    get = {(r["function"], r["container"]): r for r in rows}
    md = ["# Per-call dispatch: `LoraWeight` vs plain pytrees", "",
          C.machine_md({"load average (1/5/15 min) at start": load,
                        "load average at end": C.loadavg(),
                        "run": f"{a.weights} weights of (16, 16) with rank-2 factors; median of "
                               f"{repeats} repeats of {number} calls, containers interleaved"}),
          "", __doc__.split("\n\n", 2)[2].strip(), "",
          C.md_table(["function", *(f"`{n}` µs/call" for n in CONTAINERS),
                      *(f"`{n}` / `dict`" for n in CONTAINERS if n != "dict")],
                     [[f, *(f"{get[(f, n)]['us_per_call']:.0f}" for n in CONTAINERS),
                       *(f"{get[(f, n)]['ratio_to_dict']:.2f}" for n in CONTAINERS if n != "dict")]
                      for f in ("args", "identity")]),
          "", "Target: `lorax` / `dict` <= 1.5 for a jitted call taking `LoraWeight`s (`args`)."]
    (out / "dispatch.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return rows


if __name__ == "__main__":
    main()
