"""The CPU benchmarks' models and the training steps they compare.

A `Model` is written with no LoRA in mind (`apply(dense, x)` calls `dense(name, x)` for
every product with a weight); `build(impl, ...)` makes one implementation's step for it,
`step(*state, *const) -> (aux, *new_state)`: `state` what a training loop threads from
step to step (the parameters trained and the optimizer state; donated), `const` what
stays (frozen weights, the batch), `aux` the loss (the floor's: the input gradient). All
use `optax.adam(1e-3)` on what they train:

- `full_ft`: gradient and Adam on every weight;
- `naive_lora`: `x @ (stop_gradient(W) + s * b @ a)`, the sum materialised;
- `hand_lora`: `x @ stop_gradient(W) + ((x @ b) * s) @ a`, frozen weights a jit argument;
- `lorax_partition`: the model in `lorax.lora`, `lorax.partition` outside the step and
  `lorax.combine` inside (docs/training.md, path 1);
- `lorax_wrap`: the lorax 0.3 path, `lorax.wrap_optimizer` over the whole tree (path 2);
- `floor`: the frozen model's forward and backward to its input only, what any LoRA step
  pays at least;
- `quax_lora`: quax's own example, `quax.examples.lora.LoraArray` + `quax.quaxify`.

Also the models the variant, QLoRA and adapter benchmarks share (`mlp_params`, `scan_params`,
`nnx_stack`) and `nonzero_b`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
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

from ._common import own, train_step

IMPLS = ("full_ft", "naive_lora", "hand_lora", "lorax_partition", "lorax_wrap", "floor",
         "quax_lora")
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
HAVE_QWIX = importlib.util.find_spec("qwix") is not None


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
    return {n: jax.random.normal(k, s, model.dtype) / math.sqrt(s[0])
            for k, (n, s) in zip(keys, model.shapes.items())}


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
    return tree if abstract else own(tree)


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
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# -- the models several benchmarks share -----------------------------------------------


def is_lora(x: Any) -> bool:
    return isinstance(x, lorax.LoraWeight)


def nonzero_b(tree: Any, value: float = 0.01) -> Any:
    """Every LoRA weight with its `b` at `value` (`init_lora` makes it zero): the low-rank
    path's products are real work."""
    return jax.tree.map(lambda w: eqx.tree_at(lambda l: l.b, w, jnp.full_like(w.b, value))
                        if is_lora(w) else w, tree, is_leaf=is_lora)


def plain_dot(x: jax.Array, w: Any) -> jax.Array:
    return x @ w


def mlp_params(d: int, layers: int = 4) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    return {f"l{i}": jax.random.normal(k, (d, d)) / d**0.5 for i, k in enumerate(keys)}


def mlp_apply(params: dict, x: jax.Array, dot: Callable = jnp.matmul,
              relu_last: bool = False) -> jax.Array:
    """The `l0`, `l1`, ... layers of `mlp_params` with relu between them (and after the
    last with `relu_last`), each product `dot(x, w)`."""
    n = len(params)
    for i in range(n):
        x = dot(x, params[f"l{i}"])
        x = jax.nn.relu(x) if i < n - 1 or relu_last else x
    return x


def scan_params(d: int, layers: int = 8) -> dict:
    """A pre-norm decoder stack's weights, stacked `(layers, in, out)`: q, k, v, o (d x d),
    up (d x 4d), down (4d x d), and the norms."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    shapes = dict(q=(d, d), k=(d, d), v=(d, d), o=(d, d), up=(d, 4 * d), down=(4 * d, d))
    ws = {n: jax.random.normal(k, (layers, *s)) / s[0] ** 0.5
          for k, (n, s) in zip(keys, shapes.items())}
    return {"layers": ws, "norm": jnp.ones((layers, d))}


def scan_apply(params: dict, x: jax.Array, dot: Callable) -> jax.Array:
    """The `scan_params` stack under `lax.scan`: causal attention (heads of 64), gelu MLP."""
    heads = x.shape[-1] // 64

    def block(x, p):
        w, norm = p
        h = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * norm
        b, t, d = h.shape
        q, k, v = (dot(h, w[n]).reshape(b, t, heads, 64) for n in ("q", "k", "v"))
        s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
        x = x + dot(a, w["o"])
        return x + dot(jax.nn.gelu(dot(h, w["up"])), w["down"]), None

    return lax.scan(block, x, (params["layers"], params["norm"]))[0]


def nnx_stack(d: int, layers: int, seed: int = 0) -> Any:
    """A Flax NNX decoder stack: `nnx.MultiHeadAttention` (causal, heads of 64),
    `nnx.Linear` gelu MLP of 4 d, `nnx.RMSNorm`, no biases."""
    from flax import nnx  # lazy: Flax loads in seconds, for the nnx cells only

    class Block(nnx.Module):
        def __init__(self, d: int, rngs: nnx.Rngs):
            self.norm1 = nnx.RMSNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=d // 64, in_features=d,
                                               decode=False, use_bias=False, rngs=rngs)
            self.norm2 = nnx.RMSNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, use_bias=False, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(x[..., 0]))
            return x + self.down(nnx.gelu(self.up(self.norm2(x))))

    class Stack(nnx.Module):
        def __init__(self, d: int, layers: int, rngs: nnx.Rngs):
            self.layers = nnx.List([Block(d, rngs) for _ in range(layers)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Stack(d, layers, nnx.Rngs(seed))
