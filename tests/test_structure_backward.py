"""Structural checks on the jaxprs lorax emits: what is *not* computed.

The low-rank rules must never form a weight-sized array other than the frozen `w`
itself: in particular the backward pass must not compute a dense weight gradient
(`x^T @ g`, a `dot_general` or conv whose output has the weight's shape) to then
project it onto the factors. Values-only tests cannot see this, since the
materializing path gives the same numbers; these tests walk the jaxprs.

Each check comes with a negative control showing that the same walker *does*
find the weight-shaped op when the weight is materialized (with or without
`stop_gradient`, or with the dot rule swapped for a materializing one), so the
checks cannot pass vacuously.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import lorax
from conftest import assert_close
from lorax._rules import _contract as contract_mod
from lorax._rules import dot as dot_mod

B = 11  # activation batch size: no weight or factor axis has this size
D_IN, D_HID, D_OUT, K = 8, 6, 5, 2
WEIGHT_PRIMS = ("dot_general", "conv_general_dilated")


# -- a recursive jaxpr walker ------------------------------------------------------------


def _sub_jaxprs(value) -> Iterator[jex.Jaxpr]:
    if isinstance(value, jex.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def iter_eqns(jaxpr) -> Iterator[jex.JaxprEqn]:
    """Every equation of `jaxpr`, recursing into sub-jaxprs held in params (jit/pjit,
    scan, cond branches, while, remat, custom_jvp_call / custom_vjp_call, ...)."""
    if isinstance(jaxpr, jex.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from iter_eqns(sub)


def weight_shaped_ops(jaxpr, weight_shapes) -> list[str]:
    """`dot_general` / conv equations whose output has a weight's shape (in any axis
    order: a materialized transposed weight counts too)."""
    targets = {tuple(sorted(s)) for s in weight_shapes}
    found = []
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name in WEIGHT_PRIMS:
            for v in eqn.outvars:
                if tuple(sorted(v.aval.shape)) in targets:
                    found.append(f"{eqn.primitive.name} -> {v.aval.shape}")
    return found


def count_prims(jaxpr, names) -> int:
    return sum(eqn.primitive.name in names for eqn in iter_eqns(jaxpr))


def test_walker_recurses_into_sub_jaxprs():
    """Sanity: a weight-shaped dot hidden in a jit inside a scan inside a cond is found."""
    w = jnp.ones((D_IN, D_HID))

    def f(x):
        def body(c, _):
            inner = jax.jit(lambda x: x.T @ x)  # (D_IN, D_IN)
            return c, lax.cond(x.sum() > 0, lambda: inner(x), lambda: jnp.zeros((D_IN, D_IN)))
        return lax.scan(body, 0.0, None, length=2)[1].sum() + (x @ w).sum()

    jaxpr = jax.make_jaxpr(f)(jnp.ones((B, D_IN)))
    assert not [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"
                and e.outvars[0].aval.shape == (D_IN, D_IN)]
    assert weight_shaped_ops(jaxpr, [(D_IN, D_IN)]) == ["dot_general -> (8, 8)"]
    assert weight_shaped_ops(jaxpr, [(D_HID, D_IN)]) == []


# -- models ----------------------------------------------------------------------------------


def _lora(rng, shape, structure=(0, 1, 1), k=K) -> lorax.LoraWeight:
    nb, nm, _ = structure
    batch, m, n = shape[:nb], shape[nb : nb + nm], shape[nb + nm :]
    return lorax.LoraWeight(
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        a=jnp.asarray(rng.standard_normal((*batch, k, *n)), jnp.float32),
        b=jnp.asarray(rng.standard_normal((*batch, *m, k)), jnp.float32),
        alpha=2.0,
    )


def dense(params, x):
    return x @ params["w"]


def mlp(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


def scanned_mlp(params, x):
    # Stacked per-layer weights (L, D, D), sliced by lax.scan.
    def layer(h, w):
        return jnp.tanh(h @ w), None
    return lax.scan(layer, x, params["stack"])[0]


def conv_nhwc(params, x):
    return lax.conv_general_dilated(
        x, params["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_nchw(params, x):
    return lax.conv_general_dilated(
        x, params["kernel"], (2, 1), ((1, 1), (0, 2)), rhs_dilation=(1, 2),
        dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _models():
    rng = np.random.default_rng(0)
    return {
        "dense": (dense, {"w": _lora(rng, (D_IN, D_HID))}, (B, D_IN)),
        "mlp": (mlp, {"w1": _lora(rng, (D_IN, D_HID)), "w2": _lora(rng, (D_HID, D_OUT))},
                (B, D_IN)),
        "scanned_mlp": (scanned_mlp, {"stack": _lora(rng, (3, D_IN, D_IN), (1, 1, 1))},
                        (B, D_IN)),
        # HWIO kernel (3, 3, 4, 5): b (3, 3, 4, k), a (k, 5).
        "conv_hwio": (conv_nhwc, {"kernel": _lora(rng, (3, 3, 4, 5), (0, 3, 1))},
                      (2, 7, 7, 4)),
        # OIHW kernel (5, 4, 3, 3): b (5, k), a (k, 4, 3, 3).
        "conv_oihw": (conv_nchw, {"kernel": _lora(rng, (5, 4, 3, 3), (0, 1, 3))},
                      (2, 4, 7, 7)),
    }


MODELS = sorted(_models())


def _weight_shapes(params):
    shapes = []
    for lw in jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, lorax.LoraWeight)):
        shapes.append(lw.shape)
        nb = lw.structure[0]
        shapes.append(lw.shape[nb:])  # one slice of a stacked weight
    return shapes


def _grad_jaxpr(model, params, x_shape, forward):
    """The jaxpr of `grad(loss)` w.r.t. the LoRA params and the input, with the loss
    jitted inside so that the walker has to recurse."""
    proj = jnp.asarray(np.random.default_rng(1).standard_normal(
        jax.eval_shape(model, _materialized(params), jnp.zeros(x_shape)).shape), jnp.float32)

    @jax.jit
    def loss(params, x):
        return jnp.sum(jnp.sin(forward(model)(params, x)) * proj)

    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, jnp.ones(x_shape))


def _materialized(params, stop_w: bool = False):
    def m(v):
        if not isinstance(v, lorax.LoraWeight):
            return v
        return lax.stop_gradient(v.w) + v.delta() if stop_w else v.materialize()
    return jax.tree.map(m, params, is_leaf=lambda v: isinstance(v, lorax.LoraWeight))


def _lora_forward(model):
    return lorax.lora(model, on_materialize="error")


@pytest.mark.parametrize("name", MODELS)
def test_backward_has_no_weight_shaped_dot_or_conv(name):
    """grad(loss) of a LoRA layer / MLP / scanned MLP / conv: no dot_general or conv
    anywhere (sub-jaxprs included) produces an array of a weight's shape."""
    model, params, x_shape = _models()[name]
    jaxpr = _grad_jaxpr(model, params, x_shape, _lora_forward)
    assert count_prims(jaxpr, WEIGHT_PRIMS) > 0
    assert weight_shaped_ops(jaxpr, _weight_shapes(params)) == []


@pytest.mark.parametrize("stop_w", [False, True], ids=["materialize", "stop_gradient_w"])
@pytest.mark.parametrize("name", MODELS)
def test_negative_control_materialized_weight_is_detected(name, stop_w):
    """The same walker finds weight-shaped ops when the loss uses the merged weight,
    with `w` trainable (`lw.materialize()`) or frozen (`stop_gradient(w) + delta`, which
    is what the materializing fallback computes): the check above is not vacuous."""
    model, params, x_shape = _models()[name]

    def forward(model):
        return lambda params, x: model(_materialized(params, stop_w), x)

    jaxpr = _grad_jaxpr(model, params, x_shape, forward)
    assert weight_shaped_ops(jaxpr, _weight_shapes(params))


def test_negative_control_materializing_dot_rule_is_detected(monkeypatch):
    """Swap the one-sided dot rule's core for one that materializes the weight: the
    backward check must then fail (and values stay right, so only structure tells)."""

    def materializing(lw, lwl, x, xl, out, lora_first, fresh, **params):
        merged = lw.materialise()
        if lora_first:
            y, yl = contract_mod.contract(merged, lwl, x, xl, out, **params)
        else:
            y, yl = contract_mod.contract(x, xl, merged, lwl, out, **params)
        return contract_mod.arrange(y, yl, out)

    model, params, x_shape = _models()["mlp"]
    x = jnp.asarray(np.random.default_rng(2).standard_normal(x_shape), jnp.float32)
    expected = _lora_forward(model)(params, x)
    monkeypatch.setattr(dot_mod, "lora_contract", materializing)
    assert_close(_lora_forward(model)(params, x), expected, rtol=1e-5)  # outputs reach ~30
    jaxpr = _grad_jaxpr(model, params, x_shape, _lora_forward)
    assert weight_shaped_ops(jaxpr, _weight_shapes(params))


def test_negative_control_conv_fallback_is_detected():
    """A conv the rule cannot factor (`O` in the middle of the kernel layout) goes
    through the materializing fallback: the walker sees the weight-shaped ops."""
    rng = np.random.default_rng(3)
    kernel = _lora(rng, (3, 5, 3, 4), (0, 2, 2))  # HOWI: O is not a factor group

    def f(params, x):
        return lax.conv_general_dilated(
            x, params["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HOWI", "NHWC"))

    params = {"kernel": kernel}
    jaxpr = _grad_jaxpr(f, params, (2, 7, 7, 4),
                        lambda m: lorax.lora(m, on_materialize="allow"))
    assert weight_shaped_ops(jaxpr, _weight_shapes(params))


# -- forward: operand order and no activation transposes ---------------------------------------


def activation_flow(closed, activation_invars) -> Iterator[tuple[jex.JaxprEqn, list[bool]]]:
    """Yield `(eqn, [is each input activation-derived])` for every equation, tracking
    which values depend on the activation through sub-jaxprs whose inputs map
    one-to-one onto the equation's (jit, scan, remat, custom_jvp_call, ...)."""
    jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
    flags = {v: True for v in activation_invars}

    def is_act(v):
        return isinstance(v, jex.Var) and flags.get(v, False)

    for eqn in jaxpr.eqns:
        in_flags = [is_act(v) for v in eqn.invars]
        yield eqn, in_flags
        out_flags = [any(in_flags)] * len(eqn.outvars)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                if len(sub.invars) == len(eqn.invars):
                    act = [v for v, f in zip(sub.invars, in_flags) if f]
                else:  # unknown plumbing: be conservative
                    act = list(sub.invars) if any(in_flags) else []
                yield from activation_flow(sub, act)
        for v, f in zip(eqn.outvars, out_flags):
            flags[v] = f


FORWARD_CASES = {
    # name: (f(w, x), w shape, structure, x shape, activation side in the caller's dots)
    "x@W": (lambda w, x: x @ w, (D_IN, D_HID), (0, 1, 1), (B, D_IN), "lhs"),
    "x@W.T": (lambda w, x: x @ w.T, (D_HID, D_IN), (0, 1, 1), (B, D_IN), "lhs"),
    "W@x": (lambda w, x: w @ x, (D_HID, D_IN), (0, 1, 1), (D_IN, B), "rhs"),
    "bsd,dhk->bshk": (lambda w, x: jnp.einsum("bsd,dhk->bshk", x, w), (D_IN, 3, 4), (0, 1, 2),
                      (B, 3, D_IN), "lhs"),
    "bshk,hkd->bsd": (lambda w, x: jnp.einsum("bshk,hkd->bsd", x, w), (3, 4, D_IN), (0, 2, 1),
                      (B, 7, 3, 4), "lhs"),
    "stacked ebi,eio->ebo": (lambda w, x: jnp.einsum("ebi,eio->ebo", x, w), (3, D_IN, D_HID),
                             (1, 1, 1), (3, B, D_IN), "lhs"),
}


@pytest.mark.parametrize("name", sorted(FORWARD_CASES))
def test_forward_keeps_operand_order_and_transposes_no_activation(name):
    """In the forward jaxpr, every dot touching the activation has it on the side the
    caller put it (no dot has `x`, or anything computed from it, on the other side),
    and no `transpose` is applied to anything computed from the activation."""
    f, w_shape, structure, x_shape, side = FORWARD_CASES[name]
    lw = _lora(np.random.default_rng(4), w_shape, structure)
    jaxpr = jax.make_jaxpr(lorax.lora(f, on_materialize="error"))(lw, jnp.ones(x_shape))
    x_var = jaxpr.jaxpr.invars[-1]
    assert x_var.aval.shape == x_shape

    dots = 0
    wrong = ("rhs", 1) if side == "lhs" else ("lhs", 0)
    for eqn, in_flags in activation_flow(jaxpr, [x_var]):
        if eqn.primitive.name == "dot_general" and any(in_flags):
            dots += 1
            assert not in_flags[wrong[1]], (
                f"activation-derived {wrong[0]} in {eqn}")
        assert not (eqn.primitive.name == "transpose" and any(in_flags)), (
            f"activation transposed: {eqn}")
    # The base dot and both low-rank dots all read the activation.
    assert dots >= 3


def test_forward_order_check_detects_a_swapped_dot():
    """Negative control: `W^T @ x^T`-style code that puts the activation on the
    wrong side, or transposes it, is flagged by the same walk."""
    w = jnp.ones((D_IN, D_HID))

    def f(x):
        return (w.T @ x.T).T  # dense, activation transposed and used as rhs

    jaxpr = jax.make_jaxpr(f)(jnp.ones((B, D_IN)))
    flows = list(activation_flow(jaxpr, [jaxpr.jaxpr.invars[0]]))
    assert any(e.primitive.name == "transpose" and any(fl) for e, fl in flows)
    assert any(e.primitive.name == "dot_general" and fl[1] for e, fl in flows)


# -- scanned layers: the backward pass reads the stacked W, it does not copy it ----------

L_SCAN, D_SCAN = 6, 64


def _scanned_model(params, x):
    def layer(h, w):
        return jnp.tanh(h @ w["up"]) @ w["down"], None

    return jnp.sum(lax.scan(layer, x, params)[0] ** 2)


def _scan_residuals(monkeypatch=None):
    """Shapes of every stacked per-iteration output of the scans in grad's jaxpr, and
    the compiled step's temp bytes, for LoRA on stacked `(layers, d, 2d)` kernels."""
    rng = np.random.default_rng(0)
    params = {
        "up": jnp.asarray(rng.standard_normal((L_SCAN, D_SCAN, 2 * D_SCAN)), jnp.float32),
        "down": jnp.asarray(rng.standard_normal((L_SCAN, 2 * D_SCAN, D_SCAN)), jnp.float32),
    }
    x = jnp.ones((B, D_SCAN))
    spec = lorax.infer_layout(_scanned_model, params, {"up": 2, "down": 2}, x)
    trainable, frozen = lorax.partition(
        lorax.init_lora(params, spec, jax.random.PRNGKey(0)), spec)
    lora_model = lorax.lora(_scanned_model, on_materialize="error")

    def grad(t, f, x):
        return jax.grad(lambda t: lora_model(lorax.combine(t, f), x))(t)

    jaxpr = jax.make_jaxpr(grad)(trainable, frozen, x)
    stacked = [tuple(v.aval.shape) for e in iter_eqns(jaxpr) if e.primitive.name == "scan"
               for v in e.outvars]
    temp = jax.jit(grad).lower(trainable, frozen, x).compile().memory_analysis()
    return stacked, temp.temp_size_in_bytes, params


def test_scanned_backward_saves_no_weight_copy():
    """With stacked layers under `lax.scan`, the backward pass needs each layer's `W`
    for `dx = dy @ W^T`. JAX hands a scan *input* to the backward scan for free, but
    any value computed from it (e.g. `stop_gradient(W_i)`) is saved per iteration:
    a stacked copy of every weight. `lora` freezes W before the scan, so the rules use
    the loop input itself."""
    stacked, temp, params = _scan_residuals()
    w_shapes = {p.shape for p in params.values()}
    assert not [s for s in stacked if s in w_shapes], stacked
    assert temp < sum(p.nbytes for p in params.values())


def test_negative_control_stop_gradient_weight_is_copied(monkeypatch):
    """With `stop_gradient(W)` applied inside the dot rule (what the rules did before
    `lora` froze W on the way in), the stacked weights reappear as scan outputs and the
    compiled step needs a weight-sized buffer more: the checks above can fail."""
    import dataclasses

    _, fixed_temp, _ = _scan_residuals()
    original = dot_mod.lora_contract

    def stop_gradient_inside(lw, *args, **kwargs):
        return original(dataclasses.replace(lw, w=lax.stop_gradient(lw.w)), *args, **kwargs)

    monkeypatch.setattr(dot_mod, "lora_contract", stop_gradient_inside)
    stacked, temp, params = _scan_residuals()
    assert {p.shape for p in params.values()} <= set(stacked)
    assert temp >= fixed_temp + sum(p.nbytes for p in params.values())



# -- compiled layout on a multi-axis (einsum) decoder ------------------------------------------
#
# XLA:CPU rewrites a dot whose operands are not [batch..., free, contracting] into one behind
# transposes, which become copies of activations (docs/how-it-works.md). On an
# einsum-attention decoder the low-rank path is emitted so that its dots, forward and
# backward, need no such copy: the LoRA step moves no more data through transposes and
# copies than the frozen model's own forward + backward, beyond rank-k arrays.


def _decoder_stats(impl):
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.blocks import block_stats

    # 2 layers, d 256 (4 heads of 64), 4x64 tokens, rank 8 on q, k, v, o, up, down.
    return block_stats("einsum", 256, 8, 4, 64, impl, layers=2)


N_ADAPTED, D_FF, RANK, ROWS = 2 * 6, 4 * 256, 8, 4 * 64


def _within_budget(stats, floor):
    # Per adapted weight, four rank-k arrays' worth (a factor or a (rows, k) intermediate,
    # forward and backward) of layout changes over the frozen step; memory traffic at most
    # 1.45x the frozen step's (the low-rank path's own reads and writes: docs/benchmarks.md).
    rank_k_bytes = 4 * RANK * max(D_FF, ROWS)
    extra_layout = stats["layout_bytes"] - floor["layout_bytes"]
    return (extra_layout <= N_ADAPTED * 4 * rank_k_bytes
            and stats["bytes_accessed"] <= 1.45 * floor["bytes_accessed"])


@pytest.fixture(scope="module")
def decoder_floor():
    return _decoder_stats("floor")


def test_einsum_decoder_step_moves_no_activation_to_change_its_layout(decoder_floor):
    stats = _decoder_stats("lorax")
    assert _within_budget(stats, decoder_floor), (stats, decoder_floor)


def test_einsum_decoder_budget_catches_the_einsum_formulation(decoder_floor):
    """Negative control: LoRA written as einsums (lorax 0.4.0's emitted form, and what
    hand-written LoRA usually is) copies activations around its dots."""
    stats = _decoder_stats("hand_einsum")
    assert not _within_budget(stats, decoder_floor), (stats, decoder_floor)


# -- the input-side factor's cotangent, rank-major ---------------------------------------------


def _factor_grad_dots(use_lorax):
    """Output shapes of the compiled `dot`s of a LoRA layer's gradient w.r.t. `b` (M, k)."""
    m, n, k, rows = 96, 80, 4, 64
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    lw = lorax.LoraWeight(w=jax.random.normal(keys[0], (m, n)), b=jax.random.normal(keys[1], (m, k)),
                          a=jax.random.normal(keys[2], (k, n)), alpha=1.0)
    x = jax.random.normal(keys[3], (rows, m))
    if use_lorax:
        f = lorax.lora(lambda w, x: x @ w)
    else:  # hand-written
        f = lambda w, x: x @ jax.lax.stop_gradient(w.w) + (x @ w.b) @ w.a  # noqa: E731
    grad = jax.jit(jax.grad(lambda b: jnp.sum(jnp.tanh(f(dataclasses.replace(lw, b=b), x)))))
    hlo = grad.lower(lw.b).compile().as_text()
    return re.findall(r"= f32\[(\d+),(\d+)\]\S* dot\(", hlo), (m, k)


def test_input_side_factor_cotangent_is_a_rank_major_dot():
    """`dL/db = x^T dt` is computed as the (k, M) product `dt^T x` and transposed: XLA:CPU
    runs the (M, k)-shaped dot with the activation as a transposed lhs ~7-10x slower."""
    dots, (m, k) = _factor_grad_dots(use_lorax=True)
    assert (str(k), str(m)) in dots and (str(m), str(k)) not in dots, dots
    # Negative control: the hand-written step lets XLA fold the transpose into the dot.
    dots, _ = _factor_grad_dots(use_lorax=False)
    assert (str(m), str(k)) in dots, dots
