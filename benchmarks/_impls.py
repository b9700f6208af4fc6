"""The training steps compared by the benchmarks, built for one model and one set of shapes.

Every implementation is a function `step(*state, *const) -> (aux, *new_state)`:
`state` is what a training loop threads from one step to the next (parameters being
trained and the optimizer state; donated when `donate=True`), `const` is what stays
(frozen weights, the batch). `aux` is the loss (or, for the floor, the input gradient).

Implementations (all use `optax.adam(1e-3)` on what they train):

- `full_ft`: full fine-tuning, gradient and Adam on every weight.
- `naive_lora`: materialise `W_eff = stop_gradient(W) + s * b @ a`, then `x @ W_eff`;
  gradient and Adam on the factors only.
- `hand_lora`: hand-written LoRA, `x @ stop_gradient(W) + ((x @ b) * s) @ a`; gradient
  and Adam on the factors only, frozen weights passed as a jit argument.
- `lorax_partition`: the model unchanged, wrapped in `lorax.lora`; `lorax.partition`
  outside the step, `lorax.combine(trainable, frozen)` inside, frozen passed as an
  argument (docs/training.md, path 1).
- `lorax_wrap`: the lorax 0.3 README path, `lorax.wrap_optimizer` over the whole LoRA
  tree, `jax.value_and_grad` of the whole tree, `optax.apply_updates` (path 2).
- `floor`: the frozen model's forward and backward with respect to the input only: what
  any LoRA step has to pay at least.
- `quax_lora`: quax's own example, `quax.examples.lora.LoraArray` + `quax.quaxify`, the
  factors split off with `equinox.tree_at` and frozen weights passed as an argument.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import quax
from jax import lax
from quax.examples.lora import LoraArray

import lorax

from ._common import train_step

IMPLS = (
    "full_ft",
    "naive_lora",
    "hand_lora",
    "lorax_partition",
    "lorax_wrap",
    "floor",
    "quax_lora",
)
LORAX_IMPLS = ("lorax_partition", "lorax_wrap")
DESCRIPTIONS = {
    "full_ft": "(a) full fine-tuning",
    "naive_lora": "(b) naive LoRA, W + B@A materialised",
    "hand_lora": "(c) hand-written LoRA, x@sg(W) + (x@b)@a",
    "lorax_partition": "(d) lorax partition/combine",
    "lorax_wrap": "(e) lorax 0.3 path, wrap_optimizer, donated",
    "floor": "(f) floor: frozen fwd + bwd w.r.t. x",
    "quax_lora": "(g) quax.examples.lora.LoraArray",
}
LR = 1e-3


# -- models ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    """A model written with no LoRA in mind: `apply(dense, x)` calls `dense(name, x)`
    for every matmul with a weight; each implementation supplies its own `dense`.
    (`lorax` and `quax` get `dense = lambda n, x: x @ params[n]`, the plain model.)"""

    kind: str
    shapes: dict[str, tuple[int, ...]]  # weight name -> shape
    lora_names: tuple[str, ...]  # weights given LoRA; the others are frozen
    x_shape: tuple[int, ...]
    apply: Callable[[Callable[[str, jax.Array], jax.Array], jax.Array], jax.Array]
    dtype: Any = jnp.float32

    @property
    def frozen_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.shapes if n not in self.lora_names)


def mlp(batch: int, dim: int, layers: int = 4, in_dim: int | None = None,
        out_dim: int | None = None) -> Model:
    """`layers` Linear layers (no bias) with relu between them; every weight LoRA'd."""
    dims = [in_dim or dim] + [dim] * (layers - 1) + [out_dim or dim]
    names = tuple(f"w{i}" for i in range(layers))
    shapes = {n: (dims[i], dims[i + 1]) for i, n in enumerate(names)}

    def apply(dense, x):
        for i, n in enumerate(names):
            x = dense(n, x)
            if i < layers - 1:
                x = jax.nn.relu(x)
        return x

    return Model("mlp", shapes, names, (batch, dims[0]), apply)


def attention(batch: int, seq: int, dim: int) -> Model:
    """Single-head self-attention over `(batch, seq, dim)` with an output projection;
    `wq`, `wk`, `wv` LoRA'd, `wo` frozen (trained too by full fine-tuning)."""
    names = ("wq", "wk", "wv", "wo")

    def apply(dense, x):
        q, k, v = dense("wq", x), dense("wk", x), dense("wv", x)
        s = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(dim)
        o = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)
        return dense("wo", o)

    return Model("attn", {n: (dim, dim) for n in names}, names[:3], (batch, seq, dim), apply)


def loss_value(y: jax.Array) -> jax.Array:
    return jnp.mean(y**2)


def make_weights(model: Model, seed: int = 0, abstract: bool = False) -> dict[str, Any]:
    if abstract:
        return {n: jax.ShapeDtypeStruct(s, model.dtype) for n, s in model.shapes.items()}
    keys = jax.random.split(jax.random.PRNGKey(seed), len(model.shapes))
    return {
        n: jax.random.normal(k, s, model.dtype) / math.sqrt(s[0])
        for k, (n, s) in zip(keys, model.shapes.items())
    }


def make_x(model: Model, seed: int = 1, abstract: bool = False) -> Any:
    if abstract:
        return jax.ShapeDtypeStruct(model.x_shape, model.dtype)
    return jax.random.normal(jax.random.PRNGKey(seed), model.x_shape, model.dtype)


def spec_for(model: Model, rank: int) -> dict[str, int]:
    return {n: (rank if n in model.lora_names else lorax.LORA_FREEZE) for n in model.shapes}


# -- steps -----------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    name: str
    fn: Callable[..., Any]  # the un-jitted step
    state: tuple[Any, ...]
    const: tuple[Any, ...]
    donate: bool
    loss: Callable[..., Any] | None = None  # differentiated w.r.t. its first argument
    loss_args: tuple[Any, ...] = ()

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        return tuple(range(len(self.state))) if self.donate else ()

    @property
    def args(self) -> tuple[Any, ...]:
        return (*self.state, *self.const)

    def jit(self) -> Callable[..., Any]:
        return jax.jit(self.fn, donate_argnums=self.donate_argnums)


def _own(tree: Any, abstract: bool) -> Any:
    """A private copy of every array, so that donating it deletes nothing shared."""
    if abstract:
        return tree
    return jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), tree)


def _init_state(opt: optax.GradientTransformation, trainable: Any, abstract: bool) -> Any:
    return jax.eval_shape(opt.init, trainable) if abstract else opt.init(trainable)


def _lora_params(model: Model, weights: dict[str, Any], rank: int, abstract: bool) -> Any:
    spec = spec_for(model, rank)
    init = lambda w: lorax.init_lora(w, spec, jax.random.PRNGKey(2))  # noqa: E731
    return (jax.eval_shape(init, weights) if abstract else init(weights)), spec


def _scale(t: jax.Array, s: float) -> jax.Array:
    return t if s == 1.0 else t * jnp.asarray(s, t.dtype)


def build(impl: str, model: Model, weights: dict[str, Any], x: Any, rank: int = 8,
          donate: bool = True, abstract: bool = False) -> Built:
    """The step of `impl` for `model`; `weights`/`x` are arrays, or ShapeDtypeStructs
    with `abstract=True` (for lowering only: memory analysis, trace time)."""
    opt = optax.adam(LR)
    apply, frozen_names = model.apply, model.frozen_names

    if impl == "full_ft":
        def loss(p, x):
            return loss_value(apply(lambda n, h: h @ p[n], x))

        params = _own(weights, abstract)
        return Built(impl, train_step(loss, opt), (params, _init_state(opt, params, abstract)), (x,), donate,
                     loss, (params, x))

    if impl == "floor":
        def loss(x, params):
            return loss_value(apply(lambda n, h: h @ params[n], x))

        def step(params, x):
            return (jax.grad(loss)(x, params),)

        return Built(impl, step, (), (weights, x), donate, loss, (x, weights))

    lp, spec = _lora_params(model, weights, rank, abstract)

    if impl in ("naive_lora", "hand_lora"):
        # The same numbers as lorax: b (M, k), a (k, N), scale alpha / k; leaves in
        # LoraWeight's order (a, b), so that argument and output orders match lorax's
        # (XLA's buffer assignment depends on them, by a few KiB).
        factors = {n: (lp[n].a, lp[n].b) for n in model.lora_names}
        scales = {n: lp[n].scale for n in model.lora_names}
        frozen = {n: weights[n] for n in model.shapes}

        if impl == "naive_lora":
            def dense_of(fs, fr):
                def dense(n, h):
                    if n not in fs:
                        return h @ fr[n]
                    a, b = fs[n]
                    return h @ (lax.stop_gradient(fr[n]) + scales[n] * (b @ a))
                return dense
        else:
            def dense_of(fs, fr):
                def dense(n, h):
                    if n not in fs:
                        return h @ fr[n]
                    a, b = fs[n]
                    return h @ lax.stop_gradient(fr[n]) + _scale(h @ b, scales[n]) @ a
                return dense

        def loss(fs, fr, x):
            return loss_value(apply(dense_of(fs, fr), x))

        fs = _own(factors, abstract)
        return Built(impl, train_step(loss, opt), (fs, _init_state(opt, fs, abstract)),
                     (frozen, x), donate, loss, (fs, frozen, x))

    lora_loss = lorax.lora(
        lambda p, x: loss_value(apply(lambda n, h: h @ p[n], x)), on_materialize="error"
    )

    if impl == "lorax_partition":
        trainable, frozen = lorax.partition(lp, spec)

        def loss(tr, fr, x):
            return lora_loss(lorax.combine(tr, fr), x)

        tr = _own(trainable, abstract)
        return Built(impl, train_step(loss, opt), (tr, _init_state(opt, tr, abstract)), (frozen, x), donate,
                     loss, (tr, frozen, x))

    if impl == "lorax_wrap":
        wopt = lorax.wrap_optimizer(optax.adam(LR), spec)
        lp = _own(lp, abstract)
        return Built(impl, train_step(lora_loss, wopt), (lp, _init_state(wopt, lp, abstract)), (x,), donate,
                     lora_loss, (lp, x))

    if impl == "quax_lora":
        # quax's LoraArray is `w + a @ b` with a: (M, k), b: (k, N), no scale: its `a`
        # is lorax's `b` and vice versa. Templates fix the static fields.
        templates = {
            n: jax.eval_shape(
                lambda w: LoraArray(w, rank=rank, key=jax.random.PRNGKey(0)),
                jax.ShapeDtypeStruct(model.shapes[n], model.dtype),
            )
            for n in model.lora_names
        }
        factors = {n: (lp[n].b, lp[n].a) for n in model.lora_names}
        frozen = {n: weights[n] for n in model.shapes}
        q_loss = quax.quaxify(lambda p, x: loss_value(apply(lambda n, h: h @ p[n], x)))

        def assemble(fs, fr):
            p = {n: fr[n] for n in frozen_names}
            for n, (qa, qb) in fs.items():
                p[n] = eqx.tree_at(lambda l: (l._w, l.a, l.b), templates[n], (fr[n], qa, qb))
            return p

        def loss(fs, fr, x):
            return q_loss(assemble(fs, fr), x)

        fs = _own(factors, abstract)
        return Built(impl, train_step(loss, opt), (fs, _init_state(opt, fs, abstract)),
                     (frozen, x), donate, loss, (fs, frozen, x))

    raise ValueError(f"unknown implementation {impl!r}; expected one of {IMPLS}")


def nbytes(tree: Any) -> int:
    return sum(
        math.prod(l.shape) * jnp.dtype(l.dtype).itemsize
        for l in jax.tree_util.tree_leaves(tree)
    )
