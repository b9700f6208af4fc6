"""Many adapters over one base: mixed-adapter batches and adapters trained side by side.

    python -m benchmarks.adapters [--quick] [--out DIR] [--rounds N] [--no-llama]

Mixed batch (inference, a forward pass): 8 adapters, batch 64, each example with its
own adapter (ids drawn at random, 8 examples per adapter):

- `one`: the same batch with one adapter (`lorax.lora`): the target is <= 1.3x this;
- `mixed`: `lorax.mixed_batch` (the 8 adapters' factors side by side on the rank
  axis and a per-example rank gate, `vmap` over examples: the base matmul and the two
  low-rank matmuls each once for the whole batch);
- `gather`: `lorax.select_adapters` + `vmap` (each example's factors gathered: a copy
  per example and one matrix-vector product each);
- `ragged`: the other way to do it by hand: sort the rows by adapter, the base matmul
  once, the low-rank part as two `lax.ragged_dot`s over the 8 adapters' factors;
- `loop`: PEFT's way (`adapter_names=`): one forward per adapter over its sub-batch.

Models: the speed grid's 4-layer relu MLP (each example a `d`-vector), and the main
job's SmolLM2-135M (`examples/shakespeare/llama.py`, dense float32 base, every
projection adapted at rank 8; each example a 16-token sequence, or one token, the
shape of a decode step; `--no-llama` skips it). FLOPs: XLA's cost analysis of each
compiled program.

Side by side (training): 8 adapters of the MLP, each with its own learning rate and
its own batch (or all on the same batch; 64 or 8 examples), trained in one jitted
step (`vmap` over `lorax.stack_adapters`' adapter axis, Adam) against 8 separate
jitted steps, and hand-written LoRA vmapped the same way; the compiled FLOPs of the
joint step against 8 single ones; compiled memory: the side-by-side step's arguments
and temporaries against the base's bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

import lorax

from . import _common as C
from ._models import is_lora, mlp_apply, mlp_params

N_ADAPTERS = 8
DEFAULT = dict(dim=(512, 1024), rank=(8, 64), batch=64, rounds=7, llama_rounds=3,
               side=[(d, r, 64, same) for same in (False, True) for d in (512, 1024) for r in (8, 64)]
               + [(d, 8, 8, same) for same in (False, True) for d in (1024, 2048)])
QUICK = dict(dim=(64,), rank=(4,), batch=16, rounds=2, llama_rounds=1, side=[(64, 4, 16, True)])
MIXED = ("one", "mixed", "gather", "ragged", "loop")
SIDE = ("together", "separate")


def make_adapters(params: dict, spec: Any, n: int) -> list:
    out = []
    for i in range(n):
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(100 + i))
        keys = iter(jax.random.split(jax.random.PRNGKey(200 + i), 1000))
        out.append(jax.tree.map(lambda w: lorax.LoraWeight(
            w.w, w.a, 0.01 * jax.random.normal(next(keys), w.b.shape), w.alpha) if is_lora(w) else w,
            lp, is_leaf=is_lora))
    return out


def ragged_dot_mixed(sizes: jax.Array):
    """A `dot` for rows sorted by adapter: `x @ w` once, the low-rank part per adapter
    as two grouped matmuls over the stacked factors."""
    def dot(x: jax.Array, w: Any) -> jax.Array:
        if not is_lora(w):
            return x @ w
        base = x @ w.w
        return base + lax.ragged_dot(lax.ragged_dot(x, w.b, sizes) * w.scale, w.a, sizes)
    return dot


def mixed_runners(apply: Callable, adapters: list, x: jax.Array, ids: jax.Array,
                  ragged_ok: bool, batched: Callable | None = None) -> dict[str, C.Call]:
    """`apply(params, one_example)` is vmapped by `mixed_batch`; `batched(params, x)` (default
    `apply`) runs a whole (sub-)batch for `one` and `loop`; `x` is the whole batch."""
    batched = batched or apply
    stack = lorax.stack_adapters(adapters)
    order = jnp.argsort(ids)
    sizes = jnp.bincount(ids, length=len(adapters)).astype(jnp.int32)
    per = x.shape[0] // len(adapters)
    runners = {
        "one": C.Call(jax.jit(lorax.lora(batched, on_materialize="error")), adapters[0], x),
        "mixed": C.Call(jax.jit(lorax.mixed_batch(apply, on_materialize="error")), stack, ids, x),
    }

    def gather(stack, ids, x):
        sel = lorax.select_adapters(stack, ids)
        f = lorax.lora(apply, on_materialize="error")
        return jax.vmap(f, in_axes=(lorax.adapter_axes(sel), 0))(sel, x)
    runners["gather"] = C.Call(jax.jit(gather), stack, ids, x)
    if ragged_ok:
        def ragged(stack, x, order, sizes):
            y = mlp_apply(stack, x[order], ragged_dot_mixed(sizes))
            return jnp.zeros_like(y).at[order].set(y)
        runners["ragged"] = C.Call(jax.jit(ragged), stack, x, order, sizes)

    def loop(adapters, x, order):
        f = lorax.lora(batched, on_materialize="error")
        xs = x[order].reshape(len(adapters), per, *x.shape[1:])
        y = jnp.concatenate([f(a, xs[i]) for i, a in enumerate(adapters)])
        return jnp.zeros_like(y).at[order].set(y)
    runners["loop"] = C.Call(jax.jit(loop), adapters, x, order)
    return runners


class MixedCell:
    """Runners timed side by side, at most `cap` calls per measurement (~0.3 s)."""

    def __init__(self, label: str, runners: dict[str, C.Timed], cap: int = 1000):
        self.label, self.runners = label, runners
        C.calibrate([self], 0.3, cap)
        self.flops = ({k: C.flops(r.fn, *r.args) for k, r in runners.items()}
                      if all(isinstance(r, C.Call) for r in runners.values()) else {})


def mlp_mixed_cell(d: int, rank: int, batch: int) -> MixedCell:
    params = mlp_params(d)
    adapters = make_adapters(params, {k: rank for k in params}, N_ADAPTERS)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, d))
    ids = jax.random.permutation(jax.random.PRNGKey(2), jnp.arange(batch) % N_ADAPTERS)
    return MixedCell(f"mlp d{d} k{rank} b{batch}", mixed_runners(mlp_apply, adapters, x, ids, True))


def llama_mixed_cell(batch: int, seq: int = 16, rank: int = 8, loaded: Any = None) -> MixedCell:
    from examples.shakespeare import llama, train  # lazy: the SmolLM2 cells only (--no-llama)

    params, config = loaded or load_llama()
    cfg = llama.Config(**config)
    spec = lorax.simple_spec(params, targets=rf"^layers/({'|'.join(train.TARGETS)})$", rank=rank)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, cfg.vocab)
    one = lambda p, t: llama.logits(cfg, p, t[None])[0]  # noqa: E731
    spec = lorax.infer_layout(lambda p, t: llama.logits(cfg, p, t), params, spec, tokens[:1])
    adapters = make_adapters(params, spec, N_ADAPTERS)
    ids = jax.random.permutation(jax.random.PRNGKey(2), jnp.arange(batch) % N_ADAPTERS)
    runners = mixed_runners(one, adapters, tokens, ids, False,
                            batched=lambda p, t: llama.logits(cfg, p, t))
    shape = "one token each (decode-shaped)" if seq == 1 else f"{seq} tokens each"
    return MixedCell(f"SmolLM2-135M b{batch}, {shape}, k{rank}", runners, cap=1)


def load_llama() -> tuple[Any, dict]:
    from examples.shakespeare import gguf_loader  # lazy: the SmolLM2 cells only

    params, config, _ = gguf_loader.load(quantized=False)
    return jax.tree.map(jnp.asarray, params), config


# -- side by side ---------------------------------------------------------------------------------


def side_cell(d: int, rank: int, batch: int, same: bool = False) -> tuple[MixedCell, dict]:
    """`same`: every adapter trains on the same batch (the base's first matmul is then
    one for all of them); otherwise each has its own."""
    params = mlp_params(d)
    spec = {k: rank for k in params}
    adapters = make_adapters(params, spec, N_ADAPTERS)
    xs = jax.random.normal(jax.random.PRNGKey(1), (N_ADAPTERS, batch, d))
    ys = jax.random.normal(jax.random.PRNGKey(2), (N_ADAPTERS, batch, d))
    if same:
        xs, ys = jnp.broadcast_to(xs[0], xs.shape), jnp.broadcast_to(ys[0], ys.shape)
    lrs = jnp.geomspace(1e-4, 1e-2, N_ADAPTERS)
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    f = lorax.lora(mlp_apply, on_materialize="error")

    step = C.train_step(lambda t, frozen, x, y: jnp.mean((f(lorax.combine(t, frozen), x) - y) ** 2),
                        opt, with_loss=False)

    def init(trainable, lr):
        state = opt.init(trainable)
        state.hyperparams["learning_rate"] = jnp.asarray(lr)
        return state

    trainable, frozen = lorax.partition(lorax.stack_adapters(adapters), spec)
    axes = lorax.adapter_axes(trainable)
    states = jax.vmap(init, in_axes=(axes, 0))(trainable, lrs)
    data_axis = None if same else 0
    together = jax.jit(jax.vmap(step, in_axes=(axes, 0, None, data_axis, data_axis),
                                out_axes=(axes, 0)), donate_argnums=(0, 1))
    data = (xs[0], ys[0]) if same else (xs, ys)
    mem = together.lower(trainable, states, frozen, *data).compile().memory_analysis()
    one_step = jax.jit(step, donate_argnums=(0, 1))
    singles = []
    for i, a in enumerate(adapters):
        t, fr = lorax.partition(a, spec)
        singles.append([t, init(t, lrs[i]), fr])


    # Hand-written LoRA side by side: the same step on (b, a) pairs, vmapped the same way.
    ws = [params[f"l{i}"] for i in range(len(params))]
    scale = adapters[0]["l0"].scale
    hand_f = {n: (jnp.stack([a[n].b for a in adapters]), jnp.stack([a[n].a for a in adapters]))
              for n in params}

    def hand_mlp(fs, x):
        def dot(x, name):
            b, a = fs[name]
            return x @ ws[int(name[1:])] + (x @ b) @ a * scale
        return mlp_apply({n: n for n in params}, x, dot)

    hand_step = C.train_step(lambda f, x, y: jnp.mean((hand_mlp(f, x) - y) ** 2), opt,
                             with_loss=False)

    hand_states = jax.tree.map(jnp.copy, jax.vmap(init)(hand_f, lrs))  # donated: own buffers
    hand = jax.jit(jax.vmap(hand_step, in_axes=(0, 0, data_axis, data_axis)), donate_argnums=(0, 1))

    class Separate(C.Timed):
        def call(self) -> Any:
            for i, s in enumerate(singles):
                s[0], s[1] = one_step(s[0], s[1], s[2], xs[i], ys[i])
            return singles[-1][0]

    t0, s0 = singles[0][0], singles[0][1]
    flops_ratio = (C.flops(together, trainable, states, frozen, *data)
                   / (N_ADAPTERS * C.flops(one_step, t0, s0, singles[0][2], xs[0], ys[0])))
    cell = MixedCell(f"side by side: mlp d{d} k{rank} b{batch}{' same batch' if same else ''}",
                     {"together": C.Step(together, (trainable, states), (frozen, *data), aux=False),
                      "hand": C.Step(hand, (hand_f, hand_states), data, aux=False),
                      "separate": Separate()}, cap=3)
    base = sum(x.nbytes for x in jax.tree.leaves(frozen))
    info = dict(flops_together_over_separate=flops_ratio,
                arguments_over_base=mem.argument_size_in_bytes / base,
                temps_over_base=mem.temp_size_in_bytes / base)
    return cell, info


def _ratios(c: MixedCell, ref: str) -> Callable[[str], float]:
    return lambda n: C.median(C.paired(c.times[n], c.times[ref])) if n in c.times else float("nan")


def mixed_row(c: MixedCell) -> dict[str, Any]:
    over = _ratios(c, "one")
    return dict(cell=c.label, mixed_ms=1e3 * C.median(c.times["mixed"]), mixed_over_one=over("mixed"),
                flops_mixed_over_one=c.flops["mixed"] / c.flops["one"],
                gather_over_one=over("gather"), ragged_over_one=over("ragged"),
                loop_over_one=over("loop"), mixed_over_loop=_ratios(c, "loop")("mixed"))


def side_row(c: MixedCell, info: dict) -> dict[str, Any]:
    over = _ratios(c, "separate")
    return dict(cell=c.label, together_ms=1e3 * C.median(c.times["together"]),
                together_over_separate=over("together"), hand_over_separate=over("hand"), **info)


def main(argv: list[str] | None = None) -> Path:
    p = C.parser(__doc__)
    p.add_argument("--no-llama", dest="llama", action="store_false")
    a = C.parse(p, argv, DEFAULT, QUICK)
    cfg, rounds, out = a.cfg, a.rounds, a.out
    clock = C.Clock("adapters")

    mixed = [mlp_mixed_cell(d, r, cfg["batch"]) for d in cfg["dim"] for r in cfg["rank"]]
    C.interleaved_rounds(mixed, rounds, "adapters/mixed", lambda c: dict(cell=c.label), clock.t0)
    if a.llama and not a.quick:
        loaded = load_llama()
        for seq in (16, 1):
            llama_cell = llama_mixed_cell(cfg["batch"], seq=seq, loaded=loaded)
            C.interleaved_rounds([llama_cell], cfg["llama_rounds"], "adapters/llama",
                                 lambda c: dict(cell=c.label), clock.t0)
            mixed.append(llama_cell)
    rows = [mixed_row(c) for c in mixed]
    C.write_csv(out / "adapters_mixed.csv", rows)

    sides = [side_cell(d, r, b, same) for d, r, b, same in cfg["side"]]
    C.interleaved_rounds([c for c, _ in sides], rounds, "adapters/side", lambda c: dict(cell=c.label),
                         clock.t0)
    side_rows = [side_row(c, info) for c, info in sides]
    C.write_csv(out / "adapters_side.csv", side_rows)
    C.write_md(out / "adapters.md", _markdown(rows, side_rows), clock.facts(f"{rounds} rounds"))
    return out


def _markdown(rows: list[dict], side_rows: list[dict]) -> list[str]:
    f3 = lambda v: f"{v:.3g}"  # noqa: E731
    return [f"Mixed batch: {N_ADAPTERS} adapters, one per example, forward pass. Times are "
          "ratios to the same batch with one adapter (`one`); FLOPs from XLA's cost analysis "
          "of the compiled programs.", "",
          C.md_table(["cell", "mixed ms", "mixed / one", "FLOPs mixed / one", "gather / one",
                      "sort + ragged_dot / one", "loop / one", "mixed / loop"],
                     [[r["cell"], f3(r["mixed_ms"]), f3(r["mixed_over_one"]),
                       f3(r["flops_mixed_over_one"]), f3(r["gather_over_one"]),
                       f3(r["ragged_over_one"]), f3(r["loop_over_one"]), f3(r["mixed_over_loop"])]
                      for r in rows]), "",
          f"Side by side: {N_ADAPTERS} adapters trained in one step vs {N_ADAPTERS} separate steps "
          "(lorax, and hand-written LoRA vmapped the same way).", "",
          C.md_table(["cell", "together ms", "together / separate", "hand-written / separate",
                      "FLOPs together / separate", "arguments / base bytes",
                      "temporaries / base bytes"],
                     [[r["cell"], f3(r["together_ms"]), f3(r["together_over_separate"]),
                       f3(r["hand_over_separate"]), f3(r["flops_together_over_separate"]),
                       f3(r["arguments_over_base"]), f3(r["temps_over_base"])] for r in side_rows])]


if __name__ == "__main__":
    main()
