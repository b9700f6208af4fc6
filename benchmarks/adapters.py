"""Many adapters over one base: mixed-adapter batches and adapters trained side by side.

    python -m benchmarks.adapters [--quick] [--out DIR] [--rounds N] [--no-llama]

Mixed batch (inference, a forward pass): 8 adapters, batch 64, each example with its
own adapter (ids drawn at random, 8 examples per adapter):

- `one`: the same batch with one adapter (`lorax.lora`): the target is <= 1.3x this;
- `mixed`: `lorax.mixed_batch` (gather each example's factors, `vmap` over examples,
  `w` unbatched: the base matmul once for the whole batch);
- `ragged`: the other way to do it by hand: sort the rows by adapter, the base matmul
  once, the low-rank part as two `lax.ragged_dot`s over the 8 adapters' factors;
- `loop`: PEFT's way (`adapter_names=`): one forward per adapter over its sub-batch.

Models: the speed grid's 4-layer relu MLP (each example a `d`-vector), and the main
job's SmolLM2-135M (`examples/shakespeare/llama.py`, dense float32 base, every
projection adapted at rank 8; each example a 16-token sequence; `--no-llama` skips it).

Side by side (training): 8 adapters of the MLP, each with its own batch of 64 and
learning rate, trained in one jitted step (`vmap` over `lorax.stack_adapters`' adapter
axis, Adam) against 8 separate jitted steps; compiled memory: the side-by-side step's
arguments and temporaries against the base's bytes.
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

N_ADAPTERS = 8
DEFAULT = dict(dim=(512, 1024), rank=(8, 64), batch=64, rounds=7, llama_rounds=3)
QUICK = dict(dim=(64,), rank=(4,), batch=16, rounds=2, llama_rounds=1)
MIXED = ("one", "mixed", "ragged", "loop")
SIDE = ("together", "separate")


def _is_lora(x: Any) -> bool:
    return isinstance(x, lorax.LoraWeight)


def mlp_params(d: int, layers: int = 4) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    return {f"l{i}": jax.random.normal(k, (d, d)) / d**0.5 for i, k in enumerate(keys)}


def mlp(params: dict, x: jax.Array, dot: Callable = jnp.matmul) -> jax.Array:
    n = len(params)
    for i in range(n):
        x = dot(x, params[f"l{i}"])
        x = jax.nn.relu(x) if i < n - 1 else x
    return x


def make_adapters(params: dict, spec: Any, n: int) -> list:
    out = []
    for i in range(n):
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(100 + i))
        keys = iter(jax.random.split(jax.random.PRNGKey(200 + i), 1000))
        out.append(jax.tree.map(lambda w: lorax.LoraWeight(
            w.w, w.a, 0.01 * jax.random.normal(next(keys), w.b.shape), w.alpha) if _is_lora(w) else w,
            lp, is_leaf=_is_lora))
    return out


def ragged_dot_mixed(sizes: jax.Array):
    """A `dot` for rows sorted by adapter: `x @ w` once, the low-rank part per adapter
    as two grouped matmuls over the stacked factors."""
    def dot(x: jax.Array, w: Any) -> jax.Array:
        if not _is_lora(w):
            return x @ w
        base = x @ w.w
        return base + lax.ragged_dot(lax.ragged_dot(x, w.b, sizes) * w.scale, w.a, sizes)
    return dot


class Call(C.Timed):
    def __init__(self, fn: Callable, *args: Any):
        self.fn, self.args = fn, args

    def call(self) -> Any:
        return self.fn(*self.args)


def mixed_runners(apply: Callable, adapters: list, x: jax.Array, ids: jax.Array,
                  ragged_ok: bool, batched: Callable | None = None) -> dict[str, Call]:
    """`apply(params, one_example)` is vmapped by `mixed_batch`; `batched(params, x)` (default
    `apply`) runs a whole (sub-)batch for `one` and `loop`; `x` is the whole batch."""
    batched = batched or apply
    stack = lorax.stack_adapters(adapters)
    order = jnp.argsort(ids)
    sizes = jnp.bincount(ids, length=len(adapters)).astype(jnp.int32)
    per = x.shape[0] // len(adapters)
    runners = {
        "one": Call(jax.jit(lorax.lora(batched, on_materialize="error")), adapters[0], x),
        "mixed": Call(jax.jit(lorax.mixed_batch(apply, on_materialize="error")), stack, ids, x),
    }
    if ragged_ok:
        def ragged(stack, x, order, sizes):
            y = mlp(stack, x[order], ragged_dot_mixed(sizes))
            return jnp.zeros_like(y).at[order].set(y)
        runners["ragged"] = Call(jax.jit(ragged), stack, x, order, sizes)

    def loop(adapters, x, order):
        f = lorax.lora(batched, on_materialize="error")
        xs = x[order].reshape(len(adapters), per, *x.shape[1:])
        y = jnp.concatenate([f(a, xs[i]) for i, a in enumerate(adapters)])
        return jnp.zeros_like(y).at[order].set(y)
    runners["loop"] = Call(jax.jit(loop), adapters, x, order)
    return runners


class MixedCell:
    def __init__(self, label: str, runners: dict[str, Call], n_inner: int | None = None):
        self.label, self.runners = label, runners
        self.times = {k: [] for k in runners}
        for r in runners.values():
            r.measure(1)  # compile
        self.n_inner = n_inner or max(1, int(0.3 / runners["mixed"].measure(2)))


def mlp_mixed_cell(d: int, rank: int, batch: int) -> MixedCell:
    params = mlp_params(d)
    adapters = make_adapters(params, {k: rank for k in params}, N_ADAPTERS)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, d))
    ids = jax.random.permutation(jax.random.PRNGKey(2), jnp.arange(batch) % N_ADAPTERS)
    return MixedCell(f"mlp d{d} k{rank} b{batch}", mixed_runners(mlp, adapters, x, ids, True))


def llama_mixed_cell(batch: int, seq: int = 16, rank: int = 8) -> MixedCell:
    from examples.shakespeare import gguf_loader, llama, train

    params, config, _ = gguf_loader.load(quantized=False)
    cfg = llama.Config(**config)
    params = jax.tree.map(jnp.asarray, params)
    spec = lorax.simple_spec(params, targets=rf"^layers/({'|'.join(train.TARGETS)})$", rank=rank)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, cfg.vocab)
    one = lambda p, t: llama.logits(cfg, p, t[None])[0]  # noqa: E731
    spec = lorax.infer_layout(lambda p, t: llama.logits(cfg, p, t), params, spec, tokens[:1])
    adapters = make_adapters(params, spec, N_ADAPTERS)
    ids = jax.random.permutation(jax.random.PRNGKey(2), jnp.arange(batch) % N_ADAPTERS)
    runners = mixed_runners(one, adapters, tokens, ids, False,
                            batched=lambda p, t: llama.logits(cfg, p, t))
    return MixedCell(f"SmolLM2-135M b{batch} x {seq} tokens k{rank}", runners, n_inner=1)


# -- side by side ---------------------------------------------------------------------------------


def side_cell(d: int, rank: int, batch: int) -> tuple[MixedCell, dict]:
    params = mlp_params(d)
    spec = {k: rank for k in params}
    adapters = make_adapters(params, spec, N_ADAPTERS)
    xs = jax.random.normal(jax.random.PRNGKey(1), (N_ADAPTERS, batch, d))
    ys = jax.random.normal(jax.random.PRNGKey(2), (N_ADAPTERS, batch, d))
    lrs = jnp.geomspace(1e-4, 1e-2, N_ADAPTERS)
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    f = lorax.lora(mlp, on_materialize="error")

    def step(trainable, opt_state, frozen, x, y):
        grads = jax.grad(lambda t: jnp.mean((f(lorax.combine(t, frozen), x) - y) ** 2))(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    def init(trainable, lr):
        state = opt.init(trainable)
        state.hyperparams["learning_rate"] = jnp.asarray(lr)
        return state

    trainable, frozen = lorax.partition(lorax.stack_adapters(adapters), spec)
    axes = lorax.adapter_axes(trainable)
    states = jax.vmap(init, in_axes=(axes, 0))(trainable, lrs)
    together = jax.jit(jax.vmap(step, in_axes=(axes, 0, None, 0, 0), out_axes=(axes, 0)),
                       donate_argnums=(0, 1))
    mem = together.lower(trainable, states, frozen, xs, ys).compile().memory_analysis()
    one_step = jax.jit(step, donate_argnums=(0, 1))
    singles = []
    for i, a in enumerate(adapters):
        t, fr = lorax.partition(a, spec)
        singles.append([t, init(t, lrs[i]), fr])

    class Together(C.Timed):
        def __init__(self):
            self.state = (trainable, states)

        def call(self) -> Any:
            self.state = together(*self.state, frozen, xs, ys)
            return self.state[0]

    class Separate(C.Timed):
        def call(self) -> Any:
            for i, s in enumerate(singles):
                s[0], s[1] = one_step(s[0], s[1], s[2], xs[i], ys[i])
            return singles[-1][0]

    cell = MixedCell(f"side by side: mlp d{d} k{rank} b{batch}", {"together": Together(), "separate": Separate()},
                     n_inner=3)
    base = sum(x.nbytes for x in jax.tree.leaves(frozen))
    info = dict(arguments_over_base=mem.argument_size_in_bytes / base,
                temps_over_base=mem.temp_size_in_bytes / base)
    return cell, info


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--no-llama", dest="llama", action="store_false")
    a = p.parse_args(argv)
    cfg = QUICK if a.quick else DEFAULT
    rounds = a.rounds or cfg["rounds"]
    out = C.out_dir(a.out)
    t0 = time.perf_counter()

    mixed = [mlp_mixed_cell(d, r, cfg["batch"]) for d in cfg["dim"] for r in cfg["rank"]]
    C.interleaved_rounds(mixed, rounds, "adapters/mixed", lambda c: dict(cell=c.label), t0)
    if a.llama and not a.quick:
        llama_cell = llama_mixed_cell(cfg["batch"])
        C.interleaved_rounds([llama_cell], cfg["llama_rounds"], "adapters/llama",
                             lambda c: dict(cell=c.label), t0)
        mixed.append(llama_cell)
    rows = []
    for c in mixed:
        t = c.times
        ratio = lambda x, y: C.median(u / v for u, v in zip(t[x], t[y]))  # noqa: E731
        rows.append(dict(cell=c.label, mixed_ms=1e3 * C.median(t["mixed"]),
                         mixed_over_one=ratio("mixed", "one"), mixed_over_loop=ratio("mixed", "loop"),
                         ragged_over_mixed=ratio("ragged", "mixed") if "ragged" in t else float("nan")))
    C.write_csv(out / "adapters_mixed.csv", rows)

    sides = [side_cell(d, r, cfg["batch"]) for d in cfg["dim"] for r in cfg["rank"]]
    C.interleaved_rounds([c for c, _ in sides], rounds, "adapters/side", lambda c: dict(cell=c.label), t0)
    side_rows = []
    for c, info in sides:
        t = c.times
        side_rows.append(dict(cell=c.label, together_ms=1e3 * C.median(t["together"]),
                              together_over_separate=C.median(u / v for u, v in zip(t["together"], t["separate"])),
                              **info))
    C.write_csv(out / "adapters_side.csv", side_rows)

    f3 = lambda v: f"{v:.3g}"  # noqa: E731
    md = [C.machine_md({"rounds": rounds}), "",
          f"Mixed batch: {N_ADAPTERS} adapters, one per example, forward pass.", "",
          C.md_table(["cell", "mixed ms", "mixed / one adapter", "mixed / loop over adapters",
                      "sort + ragged_dot / mixed"],
                     [[r["cell"], f3(r["mixed_ms"]), f3(r["mixed_over_one"]), f3(r["mixed_over_loop"]),
                       f3(r["ragged_over_mixed"])] for r in rows]), "",
          f"Side by side: {N_ADAPTERS} adapters trained in one step vs {N_ADAPTERS} separate steps.", "",
          C.md_table(["cell", "together ms", "together / separate", "arguments / base bytes",
                      "temporaries / base bytes"],
                     [[r["cell"], f3(r["together_ms"]), f3(r["together_over_separate"]),
                       f3(r["arguments_over_base"]), f3(r["temps_over_base"])] for r in side_rows])]
    (out / "adapters.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return out


if __name__ == "__main__":
    main()
