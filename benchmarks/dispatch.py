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

import time


import equinox as eqx
import jax
import jax.numpy as jnp
import quax

import lorax

from . import _common as C


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


def measure(n_weights: int, number: int, repeats: int) -> list[dict]:
    w, a, b = jnp.ones((16, 16)), jnp.ones((2, 16)), jnp.ones((16, 2))
    trees = {name: [make(w, a, b) for _ in range(n_weights)] for name, make in CONTAINERS.items()}
    fns = {"args": jax.jit(lambda t: jnp.zeros(())), "identity": jax.jit(lambda t: t)}
    cells = [C.Cell(fn_name, {name: C.Call(fn, tree) for name, tree in trees.items()}, number)
             for fn_name, fn in fns.items()]
    for c in cells:  # compile everything first
        for r in c.runners.values():
            jax.block_until_ready(r.call())
    C.interleaved_rounds(cells, repeats, "dispatch", lambda c: dict(function=c.label),
                         time.perf_counter())
    return [dict(function=c.label, container=name, weights=n_weights,
                 us_per_call=1e6 * C.median(ts),
                 ratio_to_dict=C.median(ts) / C.median(c.times["dict"]),
                 repeats=repeats, calls_per_repeat=number)
            for c in cells for name, ts in c.times.items()]


def main(argv: list[str] | None = None) -> list[dict]:
    p = C.parser(__doc__, rounds=False)
    p.add_argument("--weights", type=int, default=96)
    a = p.parse_args(argv)
    out = C.out_dir(a.out)
    number, repeats = (20, 3) if a.quick else (300, 21)
    clock = C.Clock("dispatch")
    rows = measure(a.weights, number, repeats)
    C.write_results(out, "dispatch", rows, _markdown(rows), clock.facts(
        f"{a.weights} weights of (16, 16) with rank-2 factors; median of {repeats} repeats of "
        f"{number} calls, containers interleaved"))
    return rows


def _markdown(rows: list[dict]) -> list[str]:
    get = {(r["function"], r["container"]): r for r in rows}
    return [C.md_table(["function", *(f"`{n}` µs/call" for n in CONTAINERS),
                      *(f"`{n}` / `dict`" for n in CONTAINERS if n != "dict")],
                     [[f, *(f"{get[(f, n)]['us_per_call']:.0f}" for n in CONTAINERS),
                       *(f"{get[(f, n)]['ratio_to_dict']:.2f}" for n in CONTAINERS if n != "dict")]
                      for f in ("args", "identity")]),
          "", "Target: `lorax` / `dict` <= 1.5 for a jitted call taking `LoraWeight`s (`args`).",
            "", __doc__.split("\n\n", 2)[2].strip()]


if __name__ == "__main__":
    main()
