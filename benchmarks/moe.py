"""Mixture-of-experts: a LoRA step on the experts vs hand-written LoRA, full fine-tuning
and the frozen model's own forward + backward.

    python -m benchmarks.moe [--quick] [--out DIR] [--rounds N]

The block is Mixtral's sparse MLP: a router picks the top 2 of `E` experts per token,
the tokens are sorted by expert and each expert's SwiGLU runs as a grouped matmul,
`lax.ragged_dot(x_sorted, w, group_sizes)` with `w: (E, in, out)` (MaxText's and
tunix's form). `moe_mlp_einsum` is the same block with GShard-style dispatch: a
one-hot dispatch tensor gathers each expert's tokens into `(E, capacity, d)` and the
experts run as a batched `dot_general` (`einsum('ecd,edf->ecf')`).

Implementations (the partition path, Adam on what is trained):

- `lorax`: `lorax.lora(moe_mlp)` with per-expert factors on `gate`, `up`, `down`
  (`b: (E, in, k)`, `a: (E, k, out)`), through lorax's `ragged_dot` rule;
- `hand`: the same adapter written by hand,
  `ragged_dot(x, w) + s·ragged_dot(ragged_dot(x, b), a)`;
- `full`: full fine-tuning of the expert weights;
- `floor`: the frozen model's forward and backward to its input (no weight gradient).

Step time: interleaved rounds in one process, medians of the per-round ratios.
Memory: XLA's compiled `memory_analysis()` temporaries, in units of one expert stack
`(E, d, f)` float32.
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
from ._models import nonzero_b

EXPERT_WEIGHTS = ("gate", "up", "down")
IMPLS = ("lorax", "hand", "full", "floor")
DEFAULT = dict(dim=(256, 512), rank=(8, 64), tokens=(512, 2048), experts=8, rounds=7)
QUICK = dict(dim=(64,), rank=(4,), tokens=(64,), experts=4, rounds=2)


def moe_params(key: jax.Array, d: int, f: int, experts: int) -> dict:
    """Router `(d, E)` and the experts' SwiGLU weights `gate`, `up`: `(E, d, f)`, `down`: `(E, f, d)`."""
    k = jax.random.split(key, 4)
    return {
        "router": jax.random.normal(k[0], (d, experts)) / d**0.5,
        "gate": jax.random.normal(k[1], (experts, d, f)) / d**0.5,
        "up": jax.random.normal(k[2], (experts, d, f)) / d**0.5,
        "down": jax.random.normal(k[3], (experts, f, d)) / f**0.5,
    }


def _route(params: dict, x: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    weights, experts = lax.top_k(x @ params["router"], top_k)  # (T, K)
    return jax.nn.softmax(weights, axis=-1), experts


def moe_mlp(params: dict, x: jax.Array, top_k: int = 2,
            ragged_dot: Callable = lax.ragged_dot) -> jax.Array:
    """Mixtral's sparse MLP on `x: (T, d)`: top-`k` routing, tokens sorted by expert,
    each expert's SwiGLU as a grouped matmul (`ragged_dot`)."""
    n_experts = params["router"].shape[1]
    weights, experts = _route(params, x, top_k)
    flat = experts.reshape(-1)                        # (T*K,) expert of each (token, slot)
    order = jnp.argsort(flat)
    token = order // top_k
    xs = x[token]                                     # (T*K, d), grouped by expert
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    h = jax.nn.silu(ragged_dot(xs, params["gate"], sizes)) * ragged_dot(xs, params["up"], sizes)
    y = ragged_dot(h, params["down"], sizes) * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


def moe_mlp_einsum(params: dict, x: jax.Array, top_k: int = 2) -> jax.Array:
    """The same block with GShard-style dispatch into `(E, capacity, d)` (capacity `T`:
    no token is dropped) and the experts as a batched `dot_general`."""
    t = x.shape[0]
    n_experts = params["router"].shape[1]
    weights, experts = _route(params, x, top_k)
    mask = jax.nn.one_hot(experts, n_experts, dtype=x.dtype)                   # (T, K, E)
    pos = (jnp.cumsum(mask.reshape(-1, n_experts), axis=0).reshape(mask.shape) - 1) * mask
    slot = jax.nn.one_hot(pos.astype(jnp.int32), t, dtype=x.dtype) * mask[..., None]  # (T, K, E, C)
    dispatch = slot.sum(1)                                                     # (T, E, C)
    combine = (slot * weights[..., None, None]).sum(1)
    xe = jnp.einsum("tec,td->ecd", dispatch, x)
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xe, params["gate"])) * jnp.einsum(
        "ecd,edf->ecf", xe, params["up"])
    return jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", h, params["down"]))


def moe_spec(params: dict, rank: int) -> dict:
    """Per-expert factors on the experts; the router frozen."""
    ls = lorax.LoraSpec(rank, batch_ndim=1)
    return {k: (ls if k in EXPERT_WEIGHTS else lorax.LORA_FREEZE) for k in params}


def hand_ragged_dot(x: jax.Array, w: Any, sizes: jax.Array) -> jax.Array:
    """Hand-written LoRA on a grouped matmul: per-expert factors, the same groups."""
    if not isinstance(w, lorax.LoraWeight):
        return lax.ragged_dot(x, w, sizes)
    base = lax.ragged_dot(x, lax.stop_gradient(w.w), sizes)
    return base + lax.ragged_dot(lax.ragged_dot(x, w.b, sizes) * w.scale, w.a, sizes)


# -- the benchmark ------------------------------------------------------------------------------


def _loss_of(apply: Callable) -> Callable:
    return lambda p, x: jnp.mean(apply(p, x) ** 2)


def build(impl: str, d: int, rank: int, tokens: int, experts: int) -> tuple[C.Step, Any]:
    params = moe_params(jax.random.PRNGKey(0), d, 2 * d, experts)
    x = jax.random.normal(jax.random.PRNGKey(1), (tokens, d))
    opt = optax.adam(1e-3)
    if impl in ("lorax", "hand"):
        spec = moe_spec(params, rank)
        lp = nonzero_b(lorax.init_lora(params, spec, jax.random.PRNGKey(2), alpha=2.0 * rank))
        trainable, frozen = lorax.partition(lp, spec)
        if impl == "lorax":
            fn = lorax.lora(moe_mlp, on_materialize="error")
        else:
            fn = lambda p, x: moe_mlp(p, x, ragged_dot=hand_ragged_dot)  # noqa: E731
        loss = lambda t, f, x: _loss_of(fn)(lorax.combine(t, f), x)  # noqa: E731
    elif impl == "full":
        trainable = {k: params[k] for k in EXPERT_WEIGHTS}
        frozen = {"router": params["router"]}
        loss = lambda t, f, x: _loss_of(moe_mlp)({**t, **f}, x)  # noqa: E731
    else:  # floor: forward + backward to the input only
        trainable, frozen = x, params
        loss = lambda t, f, _: _loss_of(moe_mlp)(f, t)  # noqa: E731

    if impl == "floor":
        opt = optax.sgd(1e-3)  # x - 1e-3 * grad: the input gradient is all the floor makes
    return C.train_runner(loss, trainable, (frozen, x), opt)


class Cell:
    def __init__(self, d: int, rank: int, tokens: int, experts: int):
        self.d, self.rank, self.tokens, self.experts = d, rank, tokens, experts
        self.label = f"moe d{d} k{rank} T{tokens} E{experts}"
        self.runners, self.mib = {}, {}
        for impl in IMPLS:
            runner, compiled = build(impl, d, rank, tokens, experts)
            self.runners[impl] = runner
            self.mib[impl] = compiled.memory_analysis().temp_size_in_bytes / 2**20
        self.stack_mib = experts * d * 2 * d * 4 / 2**20


def _row(c: Cell) -> dict[str, Any]:
    t = c.times
    ratio = lambda x, y: C.median(C.paired(t[x], t[y]))  # noqa: E731
    return dict(
        cell=c.label, d=c.d, rank=c.rank, tokens=c.tokens, experts=c.experts,
        lorax_ms=1e3 * C.median(t["lorax"]), hand_ms=1e3 * C.median(t["hand"]),
        lorax_over_hand=ratio("lorax", "hand"), lorax_over_full=ratio("lorax", "full"),
        lorax_over_floor=ratio("lorax", "floor"), hand_over_floor=ratio("hand", "floor"),
        **{f"temp_{n}_stacks": c.mib[n] / c.stack_mib for n in IMPLS})


def main(argv: list[str] | None = None) -> Path:
    a = C.parse(C.parser(__doc__), argv, DEFAULT, QUICK)
    specs = [(d, r, t, a.cfg["experts"]) for d in a.cfg["dim"] for r in a.cfg["rank"]
             for t in a.cfg["tokens"]]
    clock, cells, raw = C.measure_cells("moe", specs, Cell, a.rounds, 0.3, cap=1000)
    rows = [_row(c) for c in cells]
    return C.write_results(a.out, "moe", rows, _markdown(rows), clock.facts(f"{a.rounds} rounds"), raw)


def _markdown(rows: list[dict]) -> list[str]:
    header = ["cell", "lorax ms", "lorax / hand", "lorax / full FT", "lorax / floor",
              "hand / floor", "temps (expert stacks): lorax", "hand", "full FT", "floor"]
    keys = ["lorax_ms", "lorax_over_hand", "lorax_over_full", "lorax_over_floor", "hand_over_floor",
            "temp_lorax_stacks", "temp_hand_stacks", "temp_full_stacks", "temp_floor_stacks"]
    return [C.md_table(header, [[r["cell"], *(f"{r[k]:.3g}" for k in keys)] for r in rows])]


if __name__ == "__main__":
    main()
