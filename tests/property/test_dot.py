"""Property tests: `dot_general` (and einsum / matmul built on it) with `LoraWeight`s.

Every check compares `lora(f)(lw, x)` with `f(lw.materialize(), x)`, values and the
gradients w.r.t. the factors (and the dense operand), eagerly and under `jax.jit`.
`on_materialize="error"` everywhere: if a rule were missing or fell back to the dense
path for a case it is meant to cover, these tests fail instead of passing with a
warning.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from hypothesis import given, reject
from hypothesis import strategies as st
from jax import lax

import lorax

# (w dtype, factor dtype): f32, bf16, and "bf16 model, f32 factors".
DTYPES = {
    "f32": (jnp.float32, jnp.float32),
    "bf16": (jnp.bfloat16, jnp.bfloat16),
    "bf16_w_f32_factors": (jnp.bfloat16, jnp.float32),
}
DTYPE_KEYS = tuple(DTYPES)  # f32 first: hypothesis shrinks towards it
ROLES = ("contract", "batch", "free")


# -- helpers ------------------------------------------------------------------------


def _rand(rng: np.random.Generator, shape, dtype) -> jax.Array:
    # Cast on the host: an eager `astype` would compile one XLA program per shape.
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def make_lora(rng, structure, shape, rank, alpha, dtypes) -> lorax.LoraWeight:
    """A `LoraWeight` with random (non-zero) `w`, `a` and `b`."""
    nb, nm, _ = structure
    w_dtype, f_dtype = dtypes
    batch, m, n = shape[:nb], shape[nb : nb + nm], shape[nb + nm :]
    return lorax.LoraWeight(
        _rand(rng, shape, w_dtype),
        a=_rand(rng, (*batch, rank, *n), f_dtype),
        b=_rand(rng, (*batch, *m, rank), f_dtype),
        alpha=alpha,
    )


def _is_lora(x) -> bool:
    return isinstance(x, lorax.LoraWeight)


def _f64(x) -> np.ndarray:
    return np.asarray(np.asarray(x, np.float32), np.float64)


def _lora_subscripts(lw: lorax.LoraWeight, labels: str, k: str) -> tuple[str, str]:
    """Einsum labels of `b` and `a` for a weight labelled `labels`, rank label `k`."""
    nb, nm, _ = lw.structure
    return labels[: nb + nm] + k, labels[:nb] + k + labels[nb + nm :]


def numpy_reference(subscripts: str, operands, proj):
    """Value and gradients of `sum(proj * einsum(subscripts, *dense(operands)))` in f64.

    The dense reference, computed independently of JAX and of lorax's own label
    machinery: each LoraWeight is merged as `w + (alpha/k) * b @ a`, and the
    gradient w.r.t. a merged weight `G` is chained to `b` and `a` by hand
    (`db = s * G . a^T`, `da = s * b^T . G`). Returns `(value, grads)` with one
    entry per operand: a dict `{"a", "b"}` for a LoraWeight, an array otherwise.
    """
    ins, out = subscripts.split("->")
    in_l = ins.split(",")
    assert len(in_l) == len(operands) == 2
    spare = [c for c in "zyxwvutsrq" if c not in subscripts]
    dense, factors = [], []
    for o, labels in zip(operands, in_l):
        if _is_lora(o):
            k = spare.pop()
            bl, al = _lora_subscripts(o, labels, k)
            b, a = _f64(o.b), _f64(o.a)
            dense.append(_f64(o.w) + o.scale * np.einsum(f"{bl},{al}->{labels}", b, a))
            factors.append((bl, al, b, a))
        else:
            dense.append(_f64(o))
            factors.append(None)
    value = np.einsum(subscripts, *dense)
    proj = _f64(proj)
    grads = []
    for i, (o, labels) in enumerate(zip(operands, in_l)):
        j = 1 - i
        g = np.einsum(f"{out},{in_l[j]}->{labels}", proj, dense[j])
        if factors[i] is None:
            grads.append(g)
        else:
            bl, al, b, a = factors[i]
            grads.append({
                "b": o.scale * np.einsum(f"{labels},{al}->{bl}", g, a),
                "a": o.scale * np.einsum(f"{bl},{labels}->{al}", b, g),
            })
    return value, grads


def dot_general_subscripts(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> str:
    """The einsum equivalent of `dot_general` (output: batch, lhs free, rhs free)."""
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    lhs: list = [None] * lhs_ndim
    rhs: list = [None] * rhs_ndim
    for i, j in (*zip(lb, rb), *zip(lc, rc)):
        lhs[i] = rhs[j] = next(letters)
    lhs = [l or next(letters) for l in lhs]
    rhs = [l or next(letters) for l in rhs]
    out = [lhs[i] for i in lb]
    out += [l for i, l in enumerate(lhs) if i not in lc and i not in lb]
    out += [l for j, l in enumerate(rhs) if j not in rc and j not in rb]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def check_lora_fn(f, subscripts: str, operands, seed: int, *, eager: bool = True,
                  jit: bool = True):
    """Check `lora(f)(*operands)` against the dense reference, values and gradients.

    `f` is any JAX function equal to `einsum(subscripts, *operands)` on plain arrays;
    the reference is that einsum on the merged weights in f64 (cast to the dense
    function's output dtype), so bf16 runs are compared against the exact answer
    with bf16 tolerance. Gradients are those of a random projection of the output,
    for every factor and every dense operand; the frozen `w`'s gradient must be
    exactly zero, and the output dtype the one the dense function would produce.
    """
    lora_f = lorax.lora(f, on_materialize="error")
    dense_out = jax.eval_shape(f, *(o.materialize() if _is_lora(o) else o for o in operands))
    tol = jnp.bfloat16 if any(
        jnp.dtype(x.dtype) == jnp.bfloat16 for x in jax.tree.leaves(operands)
    ) else jnp.float32
    proj = _rand(np.random.default_rng(seed + 1), dense_out.shape, jnp.float32)
    value, ref_grads = numpy_reference(subscripts, operands, proj)
    expected = np.asarray(np.asarray(value, np.float32).astype(dense_out.dtype), np.float32)
    argnums = tuple(range(len(operands)))

    # `proj` is an argument rather than a closed-over constant.
    def loss(*ops_and_proj):
        *ops, p = ops_and_proj
        out = lora_f(*ops)
        return jnp.sum(p * out.astype(jnp.float32)), out

    modes = []
    if eager:
        modes.append(("eager", jax.value_and_grad(loss, argnums, has_aux=True)))
    if jit:
        modes.append(("jit", jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))))
    assert modes
    for mode, value_and_grad in modes:
        try:
            (_, out), grads = jax.block_until_ready(value_and_grad(*operands, proj))
        except jax.errors.JaxRuntimeError as e:
            # XLA:CPU cannot run some bf16 x bf16 -> f32 dots (rhs free axes not
            # contiguous, e.g. `dot_general(bf16[4,2], bf16[6,4,3], ((0,),(1,)))` with
            # preferred_element_type=f32 fails in plain JAX too). Not a lorax bug.
            if "Unsupported element type for DotThunk" in str(e):
                reject()
            raise
        assert out.shape == dense_out.shape, mode
        assert out.dtype == dense_out.dtype, (mode, out.dtype, dense_out.dtype)
        assert_close(out, expected, tol)
        for o, g, rg in zip(operands, grads, ref_grads):
            if _is_lora(o):
                assert g.a.dtype == o.a.dtype and g.b.dtype == o.b.dtype, mode
                assert_close(g.a, rg["a"], tol)
                assert_close(g.b, rg["b"], tol)
                # The frozen weight only enters through stop_gradient.
                assert g.w.shape == o.w.shape
                np.testing.assert_array_equal(np.asarray(g.w, np.float32), 0.0)
            else:
                assert g.dtype == o.dtype, mode
                assert_close(g, rg, tol)


# -- strategies ---------------------------------------------------------------------


@dataclasses.dataclass
class LoraSpec:
    structure: tuple[int, int, int]
    shape: tuple[int, ...]
    rank: int
    alpha: float


@st.composite
def lora_specs(draw, max_batch: int = 2) -> LoraSpec:
    nb = draw(st.integers(0, max_batch))
    nm = draw(st.integers(1, 2))
    nn = draw(st.integers(1, 2))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=nb + nm + nn, max_size=nb + nm + nn)))
    rank = draw(st.integers(1, 3))
    alpha = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0, 16.0]))
    return LoraSpec((nb, nm, nn), shape, rank, alpha)


@st.composite
def partner(draw, shape: tuple[int, ...], min_ndim: int = 0):
    """Roles for each axis of `shape` and a partner operand's axes, permuted.

    Returns `(pairs_contract, pairs_batch, partner_shape)`, each pair being
    `(axis in shape, axis in partner)`, in a random order (which sets the order of
    the output's batch axes).
    """
    roles = draw(st.lists(st.sampled_from(ROLES), min_size=len(shape), max_size=len(shape)))
    shared = [i for i, r in enumerate(roles) if r != "free"]
    n_extra = draw(st.integers(max(0, min_ndim - len(shared)), 2))
    extra = draw(st.lists(st.integers(1, 4), min_size=n_extra, max_size=n_extra))
    items = [("w", i) for i in shared] + [("x", j) for j in range(n_extra)]
    items = draw(st.permutations(items))
    pshape = tuple(shape[i] if kind == "w" else extra[i] for kind, i in items)
    pos = {i: p for p, (kind, i) in enumerate(items) if kind == "w"}
    contract = draw(st.permutations([(i, pos[i]) for i in shared if roles[i] == "contract"]))
    batch = draw(st.permutations([(i, pos[i]) for i in shared if roles[i] == "batch"]))
    return contract, batch, pshape


def _dimension_numbers(contract, batch, lora_is_lhs: bool):
    c_w, c_x = (tuple(p[0] for p in contract), tuple(p[1] for p in contract))
    b_w, b_x = (tuple(p[0] for p in batch), tuple(p[1] for p in batch))
    if lora_is_lhs:
        return ((c_w, c_x), (b_w, b_x))
    return ((c_x, c_w), (b_x, b_w))


def _dot_kwargs(draw, dtypes):
    precision = draw(st.sampled_from([None, lax.Precision.HIGHEST]))
    # bf16 models commonly ask for f32 accumulation.
    low = jnp.dtype(dtypes[0]) == jnp.bfloat16
    pet = draw(st.sampled_from([None, jnp.float32])) if low else None
    return dict(precision=precision, preferred_element_type=pet)


def _dot_fn(dn, kwargs):
    return lambda lhs, rhs: lax.dot_general(lhs, rhs, dn, **kwargs)


# -- dot_general: one LoraWeight, random dimension numbers ---------------------------


@given(data=st.data())
def test_dot_general_random_dimension_numbers(data):
    """`dot_general(lw, x)` / `dot_general(x, lw)` for random valid dimension numbers.

    Random LoraWeight structure (0-2 stack axes, 1-2 M, 1-2 N axes, sizes 1-5,
    rank 1-3, random alpha), each W axis randomly contracted, dot-batched or free,
    a dense partner with its axes permuted and 0-2 extra free axes, the weight on
    either side, three dtype set-ups, optional f32 accumulation for bf16. Values
    and gradients vs the merged-weight reference, under `jax.jit` and (for about
    one example in five) eagerly.
    """
    draw = data.draw
    spec = draw(lora_specs())
    contract, batch, xshape = draw(partner(spec.shape))
    lora_is_lhs = draw(st.booleans())
    dtypes = DTYPES[draw(st.sampled_from(DTYPE_KEYS))]
    kwargs = _dot_kwargs(draw, dtypes)
    # Eager dispatch compiles every op for every new shape: check it on some of
    # the examples (jit on all of them) to keep the default run fast.
    eager = draw(st.integers(0, 4)) == 0
    seed = draw(st.integers(0, 2**16))

    rng = np.random.default_rng(seed)
    lw = make_lora(rng, spec.structure, spec.shape, spec.rank, spec.alpha, dtypes)
    x = _rand(rng, xshape, dtypes[0])
    dn = _dimension_numbers(contract, batch, lora_is_lhs)
    operands = (lw, x) if lora_is_lhs else (x, lw)
    subscripts = dot_general_subscripts(operands[0].ndim, operands[1].ndim, dn)
    check_lora_fn(_dot_fn(dn, kwargs), subscripts, operands, seed, eager=eager)


# -- dot_general: both operands LoraWeight ----------------------------------------------


@given(data=st.data())
def test_dot_general_both_lora(data):
    """`dot_general(lw1, lw2)`: two LoraWeights, independent random structures.

    The second weight's axes are the first's contracted / dot-batch partners plus
    extra free axes, permuted, then split at random into its own stack / M / N
    groups; values and gradients of all four factors vs the merged reference.
    """
    draw = data.draw
    spec1 = draw(lora_specs(max_batch=1))
    contract, batch, shape2 = draw(partner(spec1.shape, min_ndim=2))
    nd2 = len(shape2)
    nb2 = draw(st.integers(0, nd2 - 2))
    nm2 = draw(st.integers(1, nd2 - nb2 - 1))
    structure2 = (nb2, nm2, nd2 - nb2 - nm2)
    rank2 = draw(st.integers(1, 3))
    alpha2 = draw(st.sampled_from([1.0, 2.0, 8.0]))
    first_is_lhs = draw(st.booleans())
    dtypes = DTYPES[draw(st.sampled_from(DTYPE_KEYS))]
    kwargs = _dot_kwargs(draw, dtypes)
    # Eager dispatch compiles every op for every new shape: check it on some of
    # the examples (jit on all of them) to keep the default run fast.
    eager = draw(st.integers(0, 4)) == 0
    seed = draw(st.integers(0, 2**16))

    rng = np.random.default_rng(seed)
    lw1 = make_lora(rng, spec1.structure, spec1.shape, spec1.rank, spec1.alpha, dtypes)
    lw2 = make_lora(rng, structure2, shape2, rank2, alpha2, dtypes)
    dn = _dimension_numbers(contract, batch, first_is_lhs)
    operands = (lw1, lw2) if first_is_lhs else (lw2, lw1)
    subscripts = dot_general_subscripts(operands[0].ndim, operands[1].ndim, dn)
    check_lora_fn(_dot_fn(dn, kwargs), subscripts, operands, seed, eager=eager)


# -- einsum / matmul patterns from real models ---------------------------------------------


def _einsum(pattern):
    return lambda w, x: jnp.einsum(pattern, x, w)


def _einsum_w_first(pattern):
    return lambda w, x: jnp.einsum(pattern, w, x)


def _eqx_linear(w, x):
    # equinox.nn.Linear: weight (out, in), `weight @ x` per example, vmapped.
    return jax.vmap(lambda v: w @ v)(x)


def _x_at_wt(w, x):
    return x @ w.T


def _x_at_w(w, x):
    return x @ w


# name: (f(w, x), the same as an einsum over (w, x), w shape, structure, x shape)
EINSUM_CASES = {
    # Flax DenseGeneral query kernel (embed, heads, head_dim); b: (embed, k), a: (k, heads, head_dim).
    "bsd,dhk->bshk": (_einsum("bsd,dhk->bshk"), "dhk,bsd->bshk", (6, 2, 3), (0, 1, 2), (2, 3, 6)),
    # Attention out kernel (heads, head_dim, embed); b: (heads, head_dim, k), a: (k, embed).
    "bshk,hkd->bsd": (_einsum("bshk,hkd->bsd"), "hkd,bshk->bsd", (2, 3, 6), (0, 2, 1), (2, 3, 2, 3)),
    # Stacked per-expert weights (experts, in, out); the factors carry the expert axis.
    "ebi,eio->ebo": (_einsum("ebi,eio->ebo"), "eio,ebi->ebo", (3, 4, 5), (1, 1, 1), (3, 2, 4)),
    "eio,ebi->ebo": (_einsum_w_first("eio,ebi->ebo"), "eio,ebi->ebo", (3, 4, 5), (1, 1, 1), (3, 2, 4)),
    # Weight (out, in) contracted on its N side: `W @ x` (equinox) and `x @ W.T`.
    "oi,bi->bo": (_einsum_w_first("oi,bi->bo"), "oi,bi->bo", (5, 4), (0, 1, 1), (3, 4)),
    "eqx_linear_W@x": (_eqx_linear, "oi,bi->bo", (5, 4), (0, 1, 1), (3, 4)),
    "x@W.T": (_x_at_wt, "oi,bi->bo", (5, 4), (0, 1, 1), (3, 4)),
    # Plain `x @ W` with leading batch axes on x, and a stacked W under matmul.
    "x@W": (_x_at_w, "io,bsi->bso", (4, 5), (0, 1, 1), (2, 3, 4)),
    "stacked_matmul": (_x_at_w, "eio,ebi->ebo", (3, 4, 5), (1, 1, 1), (3, 2, 4)),
}


@pytest.mark.parametrize("dtype_key", DTYPE_KEYS)
@pytest.mark.parametrize("case", sorted(EINSUM_CASES))
def test_einsum_patterns(case, dtype_key):
    """jnp.einsum / matmul / vmapped `W @ x` patterns: values and factor gradients
    vs the merged-weight einsum, under jit (and eagerly for f32)."""
    f, subscripts, wshape, structure, xshape = EINSUM_CASES[case]
    dtypes = DTYPES[dtype_key]
    seed = sorted(EINSUM_CASES).index(case)
    rng = np.random.default_rng(seed)
    lw = make_lora(rng, structure, wshape, rank=2, alpha=4.0, dtypes=dtypes)
    x = _rand(rng, xshape, dtypes[0])
    check_lora_fn(f, subscripts, (lw, x), seed, eager=dtype_key == "f32")


def test_equinox_linear_module():
    """An actual `eqx.nn.Linear` whose weight is swapped for a LoraWeight."""
    rng = np.random.default_rng(0)
    model = eqx.nn.Linear(4, 5, key=jax.random.PRNGKey(0))
    lw = make_lora(rng, (0, 1, 1), (5, 4), 2, 2.0, DTYPES["f32"])
    lw = dataclasses.replace(lw, w=model.weight)
    lora_model = eqx.tree_at(lambda m: m.weight, model, lw)
    x = _rand(rng, (3, 4), jnp.float32)

    def f(m, x):
        return jax.vmap(m)(x)

    out = lorax.lora(f, on_materialize="error")(lora_model, x)
    dense = eqx.tree_at(lambda m: m.weight, model, lw.materialize())
    assert_close(out, f(dense, x))
    assert not np.allclose(out, f(model, x))  # the update is really applied


# -- the frozen weight gets no gradient ------------------------------------------------------


@pytest.mark.parametrize("lora_is_lhs", [True, False])
def test_frozen_weight_gradient_is_exactly_zero(lora_is_lhs):
    """d loss / d w is exactly 0 through the rule, while a, b and x get real gradients."""
    rng = np.random.default_rng(1)
    lw = make_lora(rng, (0, 1, 1), (4, 5), 2, 2.0, DTYPES["f32"])
    if lora_is_lhs:
        x = _rand(rng, (5, 3), jnp.float32)
        f = lambda w, x: w @ x  # noqa: E731
    else:
        x = _rand(rng, (3, 4), jnp.float32)
        f = lambda w, x: x @ w  # noqa: E731

    def loss(lw, x):
        return jnp.sum(jnp.sin(lorax.lora(f, on_materialize="error")(lw, x)))

    for grad in (jax.grad(loss, (0, 1)), jax.jit(jax.grad(loss, (0, 1)))):
        g_lw, g_x = grad(lw, x)
        assert g_lw.w.shape == lw.w.shape
        assert np.all(np.asarray(g_lw.w) == 0.0)
        for g in (g_lw.a, g_lw.b, g_x):
            assert float(jnp.abs(g).max()) > 0
    # The same loss on the merged weight does give w a gradient: the zero above is
    # the rule's stop_gradient, not a property of the loss.
    g_dense = jax.grad(lambda lw, x: jnp.sum(jnp.sin(f(lw.materialize(), x))))(lw, x)
    assert float(jnp.abs(g_dense.w).max()) > 0
