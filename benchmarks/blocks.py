"""Training-step speed on multi-axis transformer blocks: lorax vs hand-written LoRA, full FT, the floor.

Models (written with no LoRA in mind; 4 layers, pre-norm RMSNorm, causal softmax
attention, gelu MLP of 4 d, heads of 64, no biases; loss the mean square of the output):
`einsum` (`wq`/`wk`/`wv` `(d, heads, 64)` and `wo` `(heads, 64, d)` through multi-axis
einsums), `2d` (the same decoder, the same values, with `(d, d)` kernels and reshapes) and
`nnx` (Flax NNX, `_models.nnx_stack`, applied through `nnx.split`/`nnx.merge`). LoRA on q,
k, v, o, up, down (rank r, alpha 2r), every LoRA implementation of a cell from the same
factor values (`a` and `b` both N(0, 0.02^2)): their first-step losses must agree (rtol
1e-4), else `MISMATCH` is printed and written into the markdown.

Implementations (`optax.adam(1e-3)`, training state donated, frozen weights and the batch
plain jit arguments): `full_ft`, `floor` (the frozen forward + backward to x only),
`hand_einsum` (`einsum(x, sg(W)) + einsum(einsum(x, B) * s, A)`, B over W's input axes and
the rank, A over the rank and W's output axes), `hand_2d` (the low-rank path as 2-D
matmuls on `(batch*seq, features)`), `qwix` (nnx: `qwix.LoraProvider` +
`qwix.apply_lora_to_model`, its `nnx.LoRAParam` state trained; skipped, with a note,
without qwix) and `lorax` (`lorax.lora` on the partition path, factors laid out by
`lorax.infer_layout`). The reference hand-written LoRA is `hand_einsum` (`qwix` for nnx).

Measured as `speed.py` measures, paired ratios to the floor, full FT and the reference. From
each compiled executable (deterministic): XLA's `cost_analysis()` flops and bytes accessed,
and in `compiled.as_text()` the `transpose(`, `copy(` and `dot(` instructions wherever they
sit (a transpose fused into a loop fusion counts too; `copy-start`/`copy-done`, bitcasts
and layouts folded into a dot do not) and the bytes the transposes and copies write: data
moved only to change its layout. `block_stats(...)` returns those for one step, not run.

    python -m benchmarks.blocks                # 3 models x 3 dims x 2 ranks x 2 shapes
    python -m benchmarks.blocks --quick        # one tiny cell per model, 2 rounds
    python -m benchmarks.blocks --stats-only --models einsum --dims 512 --ranks 8 --shapes 8x128
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import lorax

from . import _common as C
from ._models import HAVE_QWIX, is_lora, nnx_stack

MODELS = ("einsum", "2d", "nnx")
IMPLS = {
    "einsum": ("full_ft", "floor", "hand_einsum", "hand_2d", "lorax"),
    "2d": ("full_ft", "floor", "hand_einsum", "hand_2d", "lorax"),
    "nnx": ("full_ft", "floor", "qwix", "lorax"),
}
REF = {"einsum": "hand_einsum", "2d": "hand_einsum", "nnx": "qwix"}
LORA_IMPLS = ("hand_einsum", "hand_2d", "qwix", "lorax")
DESCRIPTIONS = {
    "full_ft": "full fine-tuning, Adam on every weight",
    "floor": "frozen forward + backward w.r.t. x only",
    "hand_einsum": "hand-written LoRA as einsums, einsum(x, sg(W)) + einsum(einsum(x, B)*s, A)",
    "hand_2d": "hand-written LoRA, low-rank path as 2-D matmuls on (batch*seq, features)",
    "qwix": "qwix.LoraProvider + qwix.apply_lora_to_model, nnx.LoRAParam trained",
    "lorax": "lorax.lora(model) on the partition/combine path, infer_layout factors",
}
DEFAULT = dict(dims=(256, 512, 1024), ranks=(8, 64), shapes=((8, 128), (4, 512)), layers=4, rounds=5)
QUICK = dict(dims=(128,), ranks=(8,), shapes=((2, 32),), layers=2, rounds=2)
HEAD_DIM = 64
LR = 1e-3
FACTOR_STD = 0.02
TARGETS_MD = (
    "Targets (issue \"Speed on multi-axis transformer blocks\"): "
    "**lorax <= 1.25x the floor in every cell**; "
    "**lorax <= 0.7x hand-written einsum LoRA on the einsum d512 r8 8x128 block**; "
    "**lorax <= 0.65x full FT**."
)


def impls_for(model: str) -> tuple[str, ...]:
    """The implementations run for `model` (`qwix` only when qwix is installed)."""
    return tuple(n for n in IMPLS[model] if n != "qwix" or HAVE_QWIX)


# -- models -------------------------------------------------------------------------

QKV = ("wq", "wk", "wv")
TARGET_NAMES = (*QKV, "wo", "up", "down")
# How each plain-JAX model contracts an activation with each weight (None: `h @ w`).
EQ = {
    "einsum": {"wq": "btd,dhk->bthk", "wk": "btd,dhk->bthk", "wv": "btd,dhk->bthk",
               "wo": "bthk,hkd->btd", "up": None, "down": None},
    "2d": {n: None for n in TARGET_NAMES},
}


def _contract(eq: str | None, h: jax.Array, w: jax.Array) -> jax.Array:
    return h @ w if eq is None else jnp.einsum(eq, h, w)


def _rms(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention, q/k/v `(batch, seq, heads, head_dim)`."""
    t = q.shape[1]
    s = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(s, axis=-1), v)


def decoder(kind: str, dense: Callable, params: Any, x: jax.Array) -> jax.Array:
    """The `einsum` or `2d` decoder; `dense(layer, name, h)` applies weight `name`."""
    b, t, d = x.shape
    heads = d // HEAD_DIM
    for i, lp in enumerate(params["layers"]):
        h = _rms(x, lp["ln1"])
        if kind == "einsum":
            q, k, v = (dense(i, n, h) for n in QKV)
            o = _attention(q, k, v)
        else:
            q, k, v = (dense(i, n, h).reshape(b, t, heads, HEAD_DIM) for n in QKV)
            o = _attention(q, k, v).reshape(b, t, d)
        x = x + dense(i, "wo", o)
        h = _rms(x, lp["ln2"])
        x = x + dense(i, "down", jax.nn.gelu(dense(i, "up", h)))
    return x


def plain_apply(kind: str) -> Callable[[Any, jax.Array], jax.Array]:
    """`apply(params, x)`: the model as written, no LoRA anywhere."""
    def apply(params, x):
        return decoder(kind, lambda i, n, h: _contract(EQ[kind][n], h, params["layers"][i][n]),
                       params, x)
    return apply


def weight_shapes(kind: str, d: int) -> dict[str, tuple[int, ...]]:
    heads = d // HEAD_DIM
    if kind == "einsum":
        qkv, o = (d, heads, HEAD_DIM), (heads, HEAD_DIM, d)
    else:
        qkv, o = (d, d), (d, d)
    return {"ln1": (d,), "wq": qkv, "wk": qkv, "wv": qkv, "wo": o, "ln2": (d,),
            "up": (d, 4 * d), "down": (4 * d, d)}


def make_params(kind: str, d: int, layers: int, seed: int = 0) -> dict[str, Any]:
    shapes = weight_shapes(kind, d)
    key = jax.random.PRNGKey(seed)
    out = []
    for i in range(layers):
        lp = {}
        for j, (n, s) in enumerate(shapes.items()):
            if len(s) == 1:
                lp[n] = jnp.ones(s, jnp.float32)
            else:
                fan_in = d if n in (*QKV, "wo") else s[0]
                k = jax.random.fold_in(key, 100 * i + j)
                lp[n] = jax.random.normal(k, s, jnp.float32) / math.sqrt(fan_in)
        out.append(lp)
    return {"layers": out}


def loss_value(y: jax.Array) -> jax.Array:
    return jnp.mean(y ** 2)


# -- building the steps -------------------------------------------------------------------


def _path(keypath: tuple) -> str:
    parts = []
    for k in keypath:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


@dataclasses.dataclass
class Step:
    fn: Callable
    holder: C.State
    const: tuple
    # qwix 0.1.8 uses NNX APIs flax 0.12 deprecates (`.value`, `iter_modules`): its
    # DeprecationWarnings are silenced while it builds and traces.
    quiet: bool = False

    def compile(self):
        n = len(self.holder.state)
        with warnings.catch_warnings():
            if self.quiet:
                warnings.filterwarnings("ignore", category=DeprecationWarning)
            return jax.jit(self.fn, donate_argnums=tuple(range(n))).lower(
                *self.holder.state, *self.const).compile()


class Builder:
    """Builds every step, sharing weights, factors and training states between cells."""

    def __init__(self, layers: int):
        self.layers = layers
        self.cache: dict[tuple, Any] = {}

    def _get(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    # model-level objects
    def base(self, kind: str, d: int) -> tuple[Callable, Any, Any]:
        """`(apply, params, extra)`; for nnx `extra` is the module, params its state."""
        def make():
            if kind == "nnx":
                from flax import nnx  # lazy: Flax loads in seconds, for the nnx cells only
                model = nnx_stack(d, self.layers)
                graphdef, state = nnx.split(model)
                return (lambda p, x: nnx.merge(graphdef, p)(x)), state, model
            return plain_apply(kind), make_params(kind, d, self.layers), None
        return self._get(("base", kind, d), make)

    def x(self, d: int, batch: int, seq: int) -> jax.Array:
        return self._get(("x", d, batch, seq), lambda: jax.random.normal(
            jax.random.PRNGKey(1), (batch, seq, d), jnp.float32))

    def lora_params(self, kind: str, d: int, rank: int) -> tuple[Any, Any]:
        """lorax's LoRA tree (b nonzero) and spec: the factor values every LoRA impl uses."""
        def make():
            apply, params, _ = self.base(kind, d)
            targets = (r"/(query|key|value|out|up|down)/kernel" if kind == "nnx"
                       else r"/(wq|wk|wv|wo|up|down)$")
            spec = lorax.simple_spec(params, targets=targets, rank=rank)
            x = jax.ShapeDtypeStruct((1, 8, d), jnp.float32)
            spec = lorax.infer_layout(apply, params, spec, x)
            lp = lorax.init_lora(params, spec, jax.random.PRNGKey(2), stddev=FACTOR_STD,
                                 alpha=2.0 * rank)
            leaves, treedef = jax.tree_util.tree_flatten(lp, is_leaf=is_lora)
            out = []
            for i, leaf in enumerate(leaves):
                if is_lora(leaf):
                    b = FACTOR_STD * jax.random.normal(jax.random.PRNGKey(1000 + i), leaf.b.shape)
                    leaf = eqx.tree_at(lambda l: l.b, leaf, b.astype(leaf.b.dtype))
                out.append(leaf)
            return jax.tree_util.tree_unflatten(treedef, out), spec
        return self._get(("lora", kind, d, rank), make)

    def holder(self, key: tuple, make: Callable[[], tuple], keep_init: bool) -> C.State:
        return self._get(("holder", *key), lambda: C.State(make(), keep_init))

    # the steps
    def build(self, impl: str, kind: str, d: int, rank: int, batch: int, seq: int) -> Step:
        apply, params, module = self.base(kind, d)
        x = self.x(d, batch, seq)
        opt = optax.adam(LR)

        if impl == "full_ft":
            def make():
                p = C.own(params)
                return (p, opt.init(p))
            h = self.holder((impl, kind, d), make, keep_init=False)
            return Step(C.train_step(lambda p, x: loss_value(apply(p, x)), opt), h, (x,))

        if impl == "floor":
            def step(p, x):
                return (jax.grad(lambda x: loss_value(apply(p, x)))(x),)
            return Step(step, C.State((), False), (params, x))

        lp, spec = self.lora_params(kind, d, rank)
        if impl == "lorax":
            lora_loss = lorax.lora(lambda p, x: loss_value(apply(p, x)), on_materialize="error")
            trainable, frozen = lorax.partition(lp, spec)

            def loss(tr, fr, x):
                return lora_loss(lorax.combine(tr, fr), x)

            def make():
                tr = C.own(trainable)
                return (tr, opt.init(tr))
            h = self.holder((impl, kind, d, rank), make, keep_init=True)
            return Step(C.train_step(loss, opt), h, (frozen, x))

        if impl in ("hand_einsum", "hand_2d"):
            if kind == "nnx":
                raise ValueError(f"{impl} is for the einsum and 2d models; nnx has qwix")
            eqs, scale = EQ[kind], 2.0  # alpha / rank
            layers = lp["layers"]
            if impl == "hand_einsum":  # factors in lorax's layout: b (*M, k), a (k, *N)
                factors = [{n: (l[n].a, l[n].b) for n in TARGET_NAMES} for l in layers]
            else:  # 2-D factors: b (K, k), a (k, N)
                factors = [{n: (l[n].a.reshape(rank, -1), l[n].b.reshape(-1, rank))
                            for n in TARGET_NAMES} for l in layers]

            def lowrank(eq, h, a, b):
                if impl == "hand_2d":
                    lo = (h.reshape(-1, b.shape[0]) @ b) * scale
                    return lo @ a
                if eq is None:
                    return ((h @ b) * scale) @ a
                xs, rest = eq.split(",")
                ws, out = rest.split("->")
                inner = "".join(c for c in ws if c in xs)
                outer = "".join(c for c in ws if c not in xs)
                keep = "".join(c for c in xs if c not in inner)
                lo = jnp.einsum(f"{xs},{inner}r->{keep}r", h, b) * scale
                return jnp.einsum(f"{keep}r,r{outer}->{out}", lo, a)

            def loss(fs, fr, x):
                def dense(i, n, h):
                    base = _contract(eqs[n], h, lax.stop_gradient(fr["layers"][i][n]))
                    a, b = fs[i][n]
                    return base + lowrank(eqs[n], h, a, b).reshape(base.shape)
                return loss_value(decoder(kind, dense, fr, x))

            def make():
                fs = C.own(factors)
                return (fs, opt.init(fs))
            h = self.holder((impl, kind, d, rank), make, keep_init=True)
            return Step(C.train_step(loss, opt), h, (params, x))

        if impl == "qwix":
            if kind != "nnx":
                raise ValueError("qwix is for the nnx model")
            from flax import nnx  # lazy: as above
            graphdef, lora_state, rest = self._get(("qwix", d, rank), lambda: self._qwix(
                module, lp, d, rank))

            def loss(lo, rest, x):
                return loss_value(nnx.merge(graphdef, lo, rest)(x))

            def make():
                lo = C.own(lora_state)
                return (lo, opt.init(lo))
            h = self.holder((impl, kind, d, rank), make, keep_init=True)
            return Step(C.train_step(loss, opt), h, (rest, x), quiet=True)

        raise ValueError(f"unknown implementation {impl!r} for model {kind!r}")

    @staticmethod
    def _qwix(module: Any, lp: Any, d: int, rank: int) -> tuple:
        """qwix's LoRA model with lorax's factor values: qwix's `lora_a` (fan-in,
        `(K, k)`) is lorax's `b`, its `lora_b` (`(k, N)`) lorax's `a`."""
        import qwix  # lazy: optional (the bench group)
        from flax import nnx  # lazy: as above
        provider = qwix.LoraProvider(module_path=r".*/(query|key|value|out|up|down)",
                                     rank=rank, alpha=2.0 * rank)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            qm = qwix.apply_lora_to_model(module, provider, jnp.zeros((1, 8, d), jnp.float32),
                                          rngs=nnx.Rngs(0))
        graphdef, lora_state, rest = nnx.split(qm, nnx.LoRAParam, ...)
        ours = {_path(p).removesuffix("/value"): w for p, w in
                jax.tree_util.tree_flatten_with_path(lp, is_leaf=is_lora)[0] if is_lora(w)}

        def value(path, leaf):
            p = _path(path).removesuffix("/value")
            m = re.fullmatch(r"(.*)/(\w+)_lora_([ab])", p)
            w = ours[f"{m.group(1)}/{m.group(2)}"]
            src = w.b.reshape(-1, rank) if m.group(3) == "a" else w.a.reshape(rank, -1)
            assert src.shape == leaf.shape, (p, src.shape, leaf.shape)
            return src.astype(leaf.dtype)

        lora_state = jax.tree_util.tree_map_with_path(value, lora_state)
        n = len(jax.tree_util.tree_leaves(lora_state))
        assert n == 2 * len(ours), (n, len(ours))
        return graphdef, lora_state, rest


# -- compiled-HLO statistics ------------------------------------------------------------------

_TRANSPOSE = re.compile(r"= \S+ transpose\(")
_COPY = re.compile(r"= \S+ copy\(")
_DOT = re.compile(r"= \S+ dot\(")
_LAYOUT_OP = re.compile(r"= (\w+)\[([\d,]*)\]\S* (?:transpose|copy)\(")


def _layout_bytes(text: str) -> int:
    """Bytes written by `transpose(` and `copy(` instructions: data moved only to change
    its layout (a transpose fused into a copy counts twice, the same in every step)."""
    return C.hlo_bytes(_LAYOUT_OP.findall(text))


def hlo_stats(compiled: Any) -> dict[str, float]:
    """flops, bytes accessed (XLA cost analysis) and transpose/copy/dot counts of a
    compiled executable's optimized HLO (see the module docstring for what is counted)."""
    cost = C.cost(compiled)
    text = compiled.as_text()
    return {
        "flops": float(cost.get("flops", float("nan"))),
        "bytes_accessed": float(cost.get("bytes accessed", float("nan"))),
        "transposes": len(_TRANSPOSE.findall(text)),
        "copies": len(_COPY.findall(text)),
        "dots": len(_DOT.findall(text)),
        "layout_bytes": float(_layout_bytes(text)),
    }


def block_stats(model_name: str, d: int, rank: int, batch: int, seq: int, impl: str,
                layers: int = 4) -> dict[str, float]:
    """Compile one training step (nothing runs) and return its HLO statistics:
    `{"flops", "bytes_accessed", "transposes", "copies", "dots", "layout_bytes"}`."""
    step = Builder(layers).build(impl, model_name, d, rank, batch, seq)
    return hlo_stats(step.compile())


# -- the benchmark ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    model: str
    d: int
    rank: int
    batch: int
    seq: int
    runners: dict[str, C.Step]
    n_inner: int = 1
    first_loss: dict[str, float] = dataclasses.field(default_factory=dict)
    times: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"d{self.d} r{self.rank} {self.batch}x{self.seq}"


def _shapes(s: str) -> tuple[tuple[int, int], ...]:
    out = []
    for v in s.split(","):
        if v:
            b, t = v.lower().split("x")
            out.append((int(b), int(t)))
    return tuple(out)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = C.parser(__doc__, plot=True, models=",".join(MODELS))
    p.add_argument("--dims", default=None, help=f"comma-separated d (default {DEFAULT['dims']})")
    p.add_argument("--ranks", default=None, help=f"comma-separated ranks (default {DEFAULT['ranks']})")
    p.add_argument("--shapes", default=None,
                   help="comma-separated batch x seq, e.g. 8x128,4x512 (the default)")
    p.add_argument("--layers", type=int, default=None, help="default 4; quick 2")
    p.add_argument("--min-measure", type=float, default=0.02,
                   help="seconds one measurement should last at least (sets n_inner)")
    p.add_argument("--stats-only", action="store_true",
                   help="compile each step and write its HLO statistics (blocks_stats.*); no timing")
    a = p.parse_args(argv)
    base = QUICK if a.quick else DEFAULT
    a.models = [m for m in a.models.split(",") if m]
    for m in a.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}")
    a.dims = C.ints(a.dims) if a.dims else base["dims"]
    a.ranks = C.ints(a.ranks) if a.ranks else base["ranks"]
    a.shapes = _shapes(a.shapes) if a.shapes else base["shapes"]
    a.layers = a.layers or base["layers"]
    a.rounds = a.rounds or base["rounds"]
    for d in a.dims:
        if d % HEAD_DIM:
            p.error(f"d must be a multiple of {HEAD_DIM}, got {d}")
    return a


def _specs(a: argparse.Namespace) -> list[tuple[str, int, int, int, int]]:
    return [(m, d, r, b, t) for m in a.models for d in a.dims for (b, t) in a.shapes
            for r in a.ranks]


def _build_cells(a: argparse.Namespace, builder: Builder, log: str) -> list[Cell]:
    """Every cell's runners, each implementation compiled once per cell (full FT and the
    floor once per model, d and shape)."""
    compiled: dict[tuple, C.Step] = {}
    cells = []
    t0 = time.perf_counter()
    for m, d, r, b, t in _specs(a):
        runners = {}
        for impl in impls_for(m):
            key = (impl, m, d, b, t) + (() if impl in ("full_ft", "floor") else (r,))
            if key not in compiled:
                step = builder.build(impl, m, d, r, b, t)
                c = step.compile()
                compiled[key] = C.Step(c, step.holder, step.const)
                compiled[key].stats = hlo_stats(c)
            runners[impl] = compiled[key]
        cells.append(Cell(m, d, r, b, t, runners))
        print(f"[{log}] compiled {m} {cells[-1].label} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return cells


def _stat_row(c: Cell, impl: str) -> dict[str, Any]:
    s = c.runners[impl].stats
    return dict(model=c.model, d=c.d, rank=c.rank, batch=c.batch, seq=c.seq, layers=None,
                impl=impl, gflops=s["flops"] / 1e9, gb_accessed=s["bytes_accessed"] / 1e9,
                transposes=s["transposes"], copies=s["copies"], dots=s["dots"],
                layout_mb=s["layout_bytes"] / 2**20)


def _stats_table(rows: list[dict[str, Any]]) -> str:
    return C.md_table(
        ["model", "cell", "impl", "GFLOP", "GB accessed", "transposes", "copies",
         "MiB moved by them", "dots"],
        [(r["model"], _label(r), f"`{r['impl']}`",
          f"{r['gflops']:.3f}", f"{r['gb_accessed']:.4f}", r["transposes"], r["copies"],
          f"{r['layout_mb']:.1f}", r["dots"])
         for r in rows])


def _label(r: dict[str, Any]) -> str:
    return f"d{r['d']} r{r['rank']} {r['batch']}x{r['seq']}"


def _stats_only(a: argparse.Namespace, out: Path) -> Path:
    cells = _build_cells(a, Builder(a.layers), "blocks --stats-only")
    rows = [{**_stat_row(c, impl), "layers": a.layers} for c in cells for impl in c.runners]
    md = [f"{a.layers} layers. Per training step, from the compiled executable: XLA "
          "`cost_analysis()` flops and bytes accessed; `transpose(`, `copy(` and `dot(` "
          "instructions anywhere in `compiled.as_text()` (fused computations included).", "",
          TARGETS_MD, "", _stats_table(rows)]
    return C.write_results(out, "blocks_stats", rows, md)


def _first_losses(cells: list[Cell]) -> list[str]:
    """Every LoRA implementation from the same factors: the same first-step loss."""
    problems = []
    for c in cells:
        for impl, r in c.runners.items():
            if impl in LORA_IMPLS:
                r.holder.reset()
            first = r.call()
            if impl != "floor":
                c.first_loss[impl] = float(first[0])
        ref = REF[c.model] if REF[c.model] in c.runners else "lorax"
        for n in (n for n in c.runners if n in LORA_IMPLS):
            if not np.isclose(c.first_loss[n], c.first_loss[ref], rtol=1e-4, atol=1e-6):
                problems.append(f"{c.model} {c.label}: {n} first loss {c.first_loss[n]!r} != "
                                f"{ref} {c.first_loss[ref]!r}")
    for msg in problems:
        print("[blocks] MISMATCH", msg, flush=True)
    return problems


def _row(c: Cell, n: str, layers: int) -> dict[str, Any]:
    ts, ref = c.times[n], REF[c.model]
    return {**_stat_row(c, n), "layers": layers, "ref": ref, "rounds": len(ts),
            "n_inner": c.n_inner, **C.time_cols(ts),
            **C.ratio_cols("ratio_floor", ts, c.times["floor"]),
            **C.ratio_cols("ratio_ft", ts, c.times["full_ft"]),
            **C.ratio_cols("ratio_ref", ts, c.times.get(ref)),
            "first_loss": c.first_loss.get(n, "")}


def main(argv: list[str] | None = None) -> Path:
    a = _parse(argv)
    out = C.out_dir(a.out)
    if a.plot_only:
        return C.replot(out, "blocks", _plot)
    if not HAVE_QWIX and "nnx" in a.models:
        print("[blocks] qwix not installed: the nnx model runs without the qwix implementation",
              flush=True)
    if a.stats_only:
        return _stats_only(a, out)
    clock = C.Clock("blocks")
    clock.log(f"load average at start: {clock.load_start}")
    cells = _build_cells(a, Builder(a.layers), "blocks")
    problems = _first_losses(cells)
    C.calibrate(cells, a.min_measure)
    clock.log(f"compiled and checked {len(cells)} cells; {a.rounds} rounds")
    raw = C.interleaved_rounds(cells, a.rounds, "blocks",
                               lambda c: dict(model=c.model, cell=c.label), clock.t0)
    rows = [_row(c, n, a.layers) for c in cells for n in c.runners]
    facts = clock.facts(f"{'--quick, ' if a.quick else ''}{len(cells)} cells, {a.layers} layers, "
                        f"{a.rounds} rounds")
    md = _markdown(rows, problems, nnx_without_qwix=not HAVE_QWIX and "nnx" in a.models)
    return C.write_results(out, "blocks", rows, md, facts, raw, _plot)


def _targets(rows: list[dict[str, Any]]) -> list[str]:
    lor = [r for r in rows if r["impl"] == "lorax"]
    if not lor:
        return []
    bad = [r for r in lor if r["ratio_floor"] > 1.25]
    worst = max(lor, key=lambda r: r["ratio_floor"])
    md = [f"- lorax / floor <= 1.25 in every cell: **{'holds' if not bad else 'misses'}** "
          f"({len(lor) - len(bad)}/{len(lor)} cells; max {worst['ratio_floor']:.3f}, "
          f"{worst['model']} {_label(worst)})"
          + ("" if not bad else "; misses: " + ", ".join(
              f"{r['model']} {_label(r)} {r['ratio_floor']:.3f}" for r in bad))]
    key = [r for r in lor if (r["model"], r["d"], r["rank"], r["batch"], r["seq"])
           == ("einsum", 512, 8, 8, 128)]
    if key:
        v = key[0]["ratio_ref"]
        md.append(f"- lorax / hand_einsum <= 0.7 on einsum d512 r8 8x128: "
                  f"**{'holds' if v <= 0.7 else 'misses'}** ({v:.3f} "
                  f"[p25 {key[0]['ratio_ref_p25']:.3f}, p75 {key[0]['ratio_ref_p75']:.3f}])")
    else:
        md.append("- lorax / hand_einsum <= 0.7 on einsum d512 r8 8x128: not in this run")
    ft = [r["ratio_ft"] for r in lor]
    ok = sum(v <= 0.65 for v in ft)
    md.append(f"- lorax / full FT <= 0.65: {ok}/{len(lor)} cells (median {C.median(ft):.3f}, "
              f"max {max(ft):.3f})")
    return md


def _markdown(rows: list[dict[str, Any]], problems: list[str], nnx_without_qwix: bool) -> list[str]:
    md = ["### Targets", "", TARGETS_MD, ""] + _targets(rows) + [""]
    if nnx_without_qwix:
        md += ["**qwix is not installed**: the `nnx` model runs without `qwix` (no reference "
               "hand-written LoRA there; `pip install qwix`).", ""]
    if problems:
        md += ["**First-step loss mismatches (MISMATCH):**", ""] + [f"- {p}" for p in problems] + [""]

    # summary per model
    md += ["### Summary", "",
           "Per model and implementation, over cells: median of the per-cell ratios (each a "
           "median of paired ratios over rounds) to the floor, to full FT and to the reference "
           "hand-written LoRA; worst cell = largest ratio to the floor.", ""]
    srows = []
    for m in (m for m in MODELS if any(r["model"] == m for r in rows)):
        for n in dict.fromkeys(r["impl"] for r in rows if r["model"] == m):
            rs = [r for r in rows if r["model"] == m and r["impl"] == n]
            worst = max(rs, key=lambda r: r["ratio_floor"])
            srows.append((m, f"`{n}`", f"{C.median(r['ratio_floor'] for r in rs):.3f}",
                          f"{C.median(r['ratio_ft'] for r in rs):.3f}",
                          f"{C.median(r['ratio_ref'] for r in rs):.3f} (`{REF[m]}`)",
                          f"{worst['ratio_floor']:.3f} ({_label(worst)})"))
    md.append(C.md_table(["model", "impl", "/ floor", "/ full FT", "/ ref", "worst / floor (cell)"],
                         srows))

    # per-cell timing
    md += ["", "### Per cell", "",
           "Median ms per step; ratios are medians of paired per-round ratios, [p25, p75] for "
           "the ratio to the floor.", ""]
    md.append(C.md_table(["model", "cell", "impl", "ms", "/ floor", "/ full FT", "/ ref", "n_inner"],
                         [(r["model"], _label(r), f"`{r['impl']}`", f"{r['median_ms']:.2f}",
                           f"{r['ratio_floor']:.3f} [{r['ratio_floor_p25']:.2f}, {r['ratio_floor_p75']:.2f}]",
                           f"{r['ratio_ft']:.3f}", f"{r['ratio_ref']:.3f}", r["n_inner"])
                          for r in rows]))

    # HLO statistics
    md += ["", "### Compiled HLO", "",
           "Per step, from the compiled executable (deterministic): XLA `cost_analysis()` flops "
           "and bytes accessed, the `transpose(` / `copy(` / `dot(` instructions anywhere in "
           "`compiled.as_text()` (fused computations included), and the MiB the transposes and "
           "copies write.", ""]
    md.append(_stats_table(rows))
    md += ["", "Method: every step jitted (training state donated, frozen weights and the batch "
           "as plain arguments) and compiled once per cell; interleaved rounds in one process "
           "(each round runs every implementation once per cell, rotating order; one "
           "measurement = `n_inner` back-to-back steps, `block_until_ready` at the end); "
           "ratios paired within a round, medians over rounds. Loss = mean square of the "
           "output; `optax.adam(1e-3)`; LoRA on q, k, v, o, up, down, rank r, alpha 2r. "
           "The reference hand-written LoRA (`/ ref`) is `hand_einsum` for the `einsum` and "
           "`2d` models and `qwix` for `nnx`.", "",
           "Models: `einsum` (wq/wk/wv `(d, h, 64)`, wo `(h, 64, d)` through multi-axis "
           "einsums), `2d` (the same decoder with `(d, d)` kernels and reshapes), `nnx` (Flax "
           "NNX `MultiHeadAttention` + `Linear` + `RMSNorm`, through `nnx.split`/`nnx.merge`).",
           "", "Implementations:", ""]
    md += [f"- `{n}`: {DESCRIPTIONS[n]}" for n in DESCRIPTIONS]
    return md


MARKERS = dict(lorax="^", hand_einsum="o", hand_2d="s", qwix="x", full_ft="d")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Small multiples: a panel per model (columns) and rank (rows), each cell's step
    time over the floor's (1 = the floor), one line per implementation, the target drawn."""
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    ranks = sorted({r["rank"] for r in rows})
    fig, axes = C.small_multiples(len(ranks) * len(models), len(models), 2.7, sharey=True)
    for (i, k), (j, m) in ((ik, jm) for ik in enumerate(ranks) for jm in enumerate(models)):
        ax, prs = axes[i][j], [r for r in rows if r["model"] == m and r["rank"] == k]
        by = {(r["d"], r["batch"], r["seq"], r["impl"]): r["ratio_floor"] for r in prs}
        ds = list(dict.fromkeys(r["d"] for r in prs))
        shapes = list(dict.fromkeys((r["batch"], r["seq"]) for r in prs))
        xs = C.group_ticks(ax, [(f"d at {b}×{t}", [str(d) for d in ds]) for b, t in shapes])
        for n in (n for n in MARKERS if any(r["impl"] == n for r in prs)):
            C.plot_groups(ax, xs, [by[(d, *shape, n)] for shape in shapes for d in ds], len(ds),
                          marker=MARKERS[n], linestyle=":" if n == "full_ft" else "-",
                          linewidth=0.9, markersize=5, label=n,
                          color={"lorax": "C3", "full_ft": "0.5"}.get(n))
        C.target_line(ax, 1.25, "target: lorax ≤ 1.25 × floor", place="legend")
        ax.set_title(f"{m}, rank {k}")
    C.ratio_axis(axes)
    C.finish(fig, axes, path, "step time / floor", ncol=3, legend_rows=2)


if __name__ == "__main__":
    main()
