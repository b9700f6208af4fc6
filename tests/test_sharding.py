"""LoRA on JAX's SPMD engine: 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS).

A small transformer block (attention q/k/v/o + MLP, LoRA on all six matrices) is
trained for two steps under three layouts -- data parallel, FSDP and Megatron
tensor parallel -- and compared with the single-device run. The compiled HLO is
checked structurally: no dense op produces a weight-shaped (full or per-shard)
result, and every collective LoRA adds over the frozen model's forward+backward
moves a rank-`K` (factor- or activation-by-rank-sized) operand.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import lorax
from conftest import assert_close
from lorax import _engine
from lorax._sharding import factor_specs

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS from tests/conftest.py)"
)

# K = 3 appears in no other dimension, so "the operand has K in its shape" means
# "the operand is a factor, or an activation multiplied by a factor".
D, H, F, K, B, T = 64, 4, 128, 3, 8, 12
NAMES = ("q", "k", "v", "o", "up", "down")
SHAPES = dict(q=(D, D), k=(D, D), v=(D, D), o=(D, D), up=(D, F), down=(F, D))
COLUMN, ROW = P(None, "model"), P("model", None)
LAYOUTS = {
    # mesh shape, mesh axes, weight specs, activation spec
    "dp": ((8,), ("data",), dict.fromkeys(NAMES, P()), P("data")),
    "fsdp": ((8,), ("data",), dict.fromkeys(NAMES, P("data", None)), P("data")),
    "tp": ((2, 4), ("data", "model"),
           dict(q=COLUMN, k=COLUMN, v=COLUMN, up=COLUMN, o=ROW, down=ROW), P("data")),
}


def block(p, x):
    """Attention + MLP in plain jnp; head count fixed, head size from the weights."""
    b, t, _ = x.shape

    def heads(w):
        return jnp.einsum("btd,de->bte", x, w).reshape(b, t, H, -1)

    q, k, v = heads(p["q"]), heads(p["k"]), heads(p["v"])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
    att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, -1)
    x = x + jnp.einsum("bte,ed->btd", att, p["o"])
    h = jax.nn.gelu(jnp.einsum("btd,df->btf", x, p["up"]))
    return x + jnp.einsum("btf,fd->btd", h, p["down"])


def loss(p, x, y):
    return jnp.mean((block(p, x) - y) ** 2)


# -- compiled-HLO inspection -----------------------------------------------------------

_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DENSE_OPS = ("dot", "add", "subtract", "multiply", "convolution")


def _instructions(hlo):
    """(name, opcode, output shapes, operand names) of every instruction, fused ones included."""
    for line in hlo.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        rhs = re.sub(r"/\*.*?\*/", "", rhs)
        if rhs.startswith("("):  # a tuple-shaped result
            depth = 0
            for i, ch in enumerate(rhs):
                depth += (ch == "(") - (ch == ")")
                if depth == 0:
                    break
            out, rest = rhs[: i + 1], rhs[i + 1 :].strip()
        else:
            out, _, rest = rhs.partition(" ")
        op = re.match(r"([\w\-]+)\(", rest)
        if op:
            args = rest[op.end():].split(")")[0]
            shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
                      for dt, dims in _SHAPE.findall(out)]
            yield name, op.group(1), shapes, re.findall(r"%?([\w.\-]+)", args)


def collectives(hlo):
    """Counter of (kind, dtype, operand dims), one entry per operand of each collective."""
    instrs = list(_instructions(hlo))
    table = {name: shapes for name, _, shapes, _ in instrs}
    found = collections.Counter()
    for _, op, _, operands in instrs:
        kind = op.removesuffix("-start")
        if kind in COLLECTIVES:
            for operand in operands:
                for dtype, dims in table.get(operand, []):
                    found[kind, dtype, dims] += 1
    return found


def dense_ops_on(hlo, shapes):
    """Counter of (opcode, dims) of arithmetic whose single result has one of `shapes`."""
    return collections.Counter(
        (op, out[0][1]) for _, op, out, _ in _instructions(hlo)
        if op in DENSE_OPS and len(out) == 1 and out[0][1] in shapes
    )


def weight_shapes(params):
    return {tuple(w.shape) for w in params.values()} | {
        tuple(w.sharding.shard_shape(w.shape)) for w in params.values()}


# -- set-up ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data():
    # numpy, so that building every layout's inputs compiles nothing.
    rng = np.random.default_rng(0)
    w = {n: (rng.standard_normal(SHAPES[n]) / np.sqrt(SHAPES[n][0])).astype(np.float32)
         for n in NAMES}
    a = {n: (0.1 * rng.standard_normal((K, SHAPES[n][1]))).astype(np.float32) for n in NAMES}
    b = {n: (0.1 * rng.standard_normal((SHAPES[n][0], K))).astype(np.float32) for n in NAMES}
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    y = rng.standard_normal((B, T, D)).astype(np.float32)
    return w, a, b, x, y


def mesh_for(layout, axis_types=None):
    shape, axes, _, _ = LAYOUTS[layout]
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, axes) if axis_types is None else Mesh(devices, axes, axis_types=axis_types)


def lora_setup(data, mesh=None, specs=None):
    """LoRA params (factors set to the fixed test values) on `mesh`, or on one device."""
    w, a, b, _, _ = data
    put = (lambda v, s: jnp.asarray(v)) if mesh is None else (
        lambda v, s: jax.device_put(v, NamedSharding(mesh, s)))
    params = {n: put(w[n], specs and specs[n]) for n in NAMES}
    spec = dict.fromkeys(NAMES, K)
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    # init_lora placed the factors; keep those shardings for the test values.
    lp = {n: dataclasses.replace(lw, a=jax.device_put(a[n], lw.a.sharding),
                                 b=jax.device_put(b[n], lw.b.sharding)) for n, lw in lp.items()}
    return params, lp, spec


def make_step(optimizer, on_materialize="error", model_loss=None):
    lloss = model_loss or lorax.lora(loss, on_materialize=on_materialize)

    def step(trainable, frozen, opt_state, x, y):
        value, grads = jax.value_and_grad(
            lambda t: lloss(lorax.combine(t, frozen), x, y))(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return value, grads, optax.apply_updates(trainable, updates), opt_state

    return step


_FROZEN_HLO: dict = {}


def frozen_step_hlo(layout, x, params, y):
    """The frozen model's forward + backward w.r.t. its input: the communication baseline."""
    if layout not in _FROZEN_HLO:
        _FROZEN_HLO[layout] = jax.jit(jax.value_and_grad(lambda x, p, y: loss(p, x, y))).lower(
            x, params, y).compile().as_text()
    return _FROZEN_HLO[layout]


def shardings_of(tree, mesh):
    # Scalars (Adam's step count) are created uncommitted on one device: replicate them.
    return jax.tree.map(
        lambda v: v.sharding if v.ndim else NamedSharding(mesh, P()), tree)


@pytest.fixture(scope="module")
def reference(data):
    """Two single-device training steps: losses, first-step grads, final factors."""
    _, lp, spec = lora_setup(data)
    trainable, frozen = lorax.partition(lp, spec)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)
    step = jax.jit(make_step(optimizer))
    x, y = data[3], data[4]
    l1, g1, trainable, opt_state = step(trainable, frozen, opt_state, x, y)
    l2, _, trainable, _ = step(trainable, frozen, opt_state, x, y)
    return [float(l1), float(l2)], g1, trainable


# -- training under each layout --------------------------------------------------------


def factor_leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_matches_reference(losses, grads, trainable, reference):
    """Two steps' losses, the first step's factor gradients and the trained factors equal
    the single-device step's (`reference`)."""
    ref_losses, ref_grads, ref_trainable = reference
    # Sharded vs single-device: other reduction orders, so an atol for values near 0.
    assert_close([float(v) for v in losses], ref_losses, rtol=1e-5)
    for tree, ref in ((grads, ref_grads), (trainable, ref_trainable)):
        got, want = factor_leaves(tree), factor_leaves(ref)
        assert got.keys() == want.keys()
        for key in want:
            assert_close(got[key], want[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_training_step_matches_single_device_and_adds_only_rank_k_communication(
        layout, data, reference):
    _, _, specs, x_spec = LAYOUTS[layout]
    mesh = mesh_for(layout)
    params, lp, spec = lora_setup(data, mesh, specs)
    for n in NAMES:
        a_spec, b_spec = factor_specs(specs[n], 2, 0, 1)
        assert lp[n].a.sharding.spec == a_spec and lp[n].b.sharding.spec == b_spec, n

    # Per-device bytes of W: 1/8 under FSDP, 1/4 (the model axis) under TP.
    per_device = {"dp": 1, "fsdp": 8, "tp": 4}[layout]
    for n in NAMES:
        w = lp[n].w
        assert w.addressable_shards[0].data.nbytes * per_device == w.nbytes, n

    x = jax.device_put(data[3], NamedSharding(mesh, x_spec))
    y = jax.device_put(data[4], NamedSharding(mesh, x_spec))
    trainable, frozen = lorax.partition(lp, spec)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(trainable)
    t_shard, o_shard = shardings_of(trainable, mesh), shardings_of(opt_state, mesh)
    step = jax.jit(
        make_step(optimizer),
        in_shardings=(t_shard, shardings_of(frozen, mesh), o_shard, x.sharding, y.sharding),
        out_shardings=(NamedSharding(mesh, P()), t_shard, t_shard, o_shard),
    ).lower(trainable, frozen, opt_state, x, y).compile()
    hlo = step.as_text()
    l1, g1, trainable, opt_state = step(trainable, frozen, opt_state, x, y)
    l2, _, trainable, opt_state = step(trainable, frozen, opt_state, x, y)

    assert_matches_reference((l1, l2), g1, trainable, reference)
    for n in NAMES:  # the factors stay where init_lora put them
        assert trainable[n].a.sharding.is_equivalent_to(lp[n].a.sharding, 2)
        assert trainable[n].b.sharding.is_equivalent_to(lp[n].b.sharding, 2)

    frozen_hlo = frozen_step_hlo(layout, x, params, y)

    # No dense op yields a W-shaped (full or per-shard) result: no W + BA, no dW.
    shapes = weight_shapes(params)
    assert not dense_ops_on(hlo, shapes) - dense_ops_on(frozen_hlo, shapes)

    # Every collective LoRA adds moves a rank-K operand (or a scalar).
    extra = collectives(hlo) - collectives(frozen_hlo)
    bad = [c for c in extra if K not in c[2] and np.prod(c[2], dtype=int) > 1]
    assert not bad, (bad, extra)
    if layout != "fsdp":  # FSDP all-gathers W in both; DP and TP never move W
        assert not any(dims in shapes for _, _, dims in collectives(hlo))


def test_hlo_checks_catch_naive_lora(data):
    """The structural check can fail: materialising W + BA is caught, per shard too."""
    _, _, specs, x_spec = LAYOUTS["tp"]
    mesh = mesh_for("tp")
    params, lp, spec = lora_setup(data, mesh, specs)
    x = jax.device_put(data[3], NamedSharding(mesh, x_spec))
    trainable, frozen = lorax.partition(lp, spec)
    optimizer = optax.sgd(1e-2)
    naive = make_step(optimizer, model_loss=lambda p, x, y: loss(
        {n: lw.materialise() for n, lw in p.items()}, x, y))
    hlo = jax.jit(naive).lower(
        trainable, frozen, optimizer.init(trainable), x, x).compile().as_text()
    frozen_hlo = frozen_step_hlo("tp", x, params, x)
    shapes = weight_shapes(params)
    found = dense_ops_on(hlo, shapes) - dense_ops_on(frozen_hlo, shapes)
    per_shard = {tuple(w.sharding.shard_shape(w.shape)) for w in params.values()}
    assert {dims for _, dims in found} & per_shard
    assert {op for op, _ in found} >= {"dot", "add"}


# -- shard_map -------------------------------------------------------------------------


def megatron_mlp(p, x):
    """Column-parallel up, row-parallel down, one psum: the body sees per-shard weights."""
    h = jax.nn.relu(x @ p["up"])
    return jax.lax.psum(h @ p["down"], "model")


MLP_SPECS = ({"up": COLUMN, "down": ROW}, P("data", None))


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_runs_low_rank_per_shard(data, check_vma):
    mesh = mesh_for("tp")
    w, a, b, x, _ = data
    x = x.reshape(-1, D)
    lp = {n: lorax.LoraWeight(jnp.asarray(w[n]), jnp.asarray(a[n]), jnp.asarray(b[n]), alpha=2.0)
          for n in ("up", "down")}
    f = jax.shard_map(megatron_mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P("data", None),
                      check_vma=check_vma)
    lf = lorax.lora(f, on_materialize="error")

    merged = lorax.merge_params(lp)
    assert_close(lf(lp, x), f(merged, x), rtol=1e-5)
    assert_close(jax.jit(lf)(lp, x), f(merged, x), rtol=1e-5)

    def dense(p):
        return lorax.lora(lambda q: jax.nn.relu(x @ q["up"]) @ q["down"])(p)

    grad_fn = jax.jit(jax.grad(lambda p: jnp.sum(lf(p, x) ** 2))).lower(lp).compile()
    grads = grad_fn(lp)
    ref = jax.grad(lambda p: jnp.sum(dense(p) ** 2))(lp)
    for n in lp:
        for leaf in ("a", "b"):
            # Gradients reach 20-300 (the loss sums 6144 squares): atol is 1e-6 of that.
            assert_close(getattr(grads[n], leaf), getattr(ref[n], leaf),
                         rtol=1e-4, atol=1e-6, err_msg=f"{n}.{leaf}")

    # The staged shard_map takes the factors as operands with the derived specs ...
    jaxpr = jax.make_jaxpr(lf)(lp, x)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    in_specs = {tuple(v.aval.shape): s for v, s in zip(eqn.invars, eqn.params["in_specs"])}
    assert in_specs[(D, F)] == COLUMN and in_specs[(K, F)] == P(None, "model")
    assert in_specs[(D, K)] == P(None, None)
    assert in_specs[(F, D)] == ROW and in_specs[(F, K)] == P("model", None)
    assert in_specs[(K, D)] == P(None, None)
    # ... and its compiled body forms no per-shard W + BA.
    hlo = grad_fn.as_text()
    per_shard = {(D, F // 4), (F // 4, D)}
    assert not dense_ops_on(hlo, per_shard)


def test_shard_map_body_may_close_over_a_lora_weight(data):
    mesh = mesh_for("fsdp")
    w, a, b, x, _ = data
    x = x.reshape(-1, D)
    lw = lorax.LoraWeight(jnp.asarray(w["q"]), jnp.asarray(a["q"]), jnp.asarray(b["q"]))

    def model(lw, x):  # the weight is a constant of the body, replicated
        per_row = jax.shard_map(lambda x: x @ lw, mesh=mesh, in_specs=P("data"),
                                out_specs=P("data"))
        return per_row(x)

    expected = x @ lw.materialize()
    lf = lorax.lora(model, on_materialize="error")
    assert_close(lf(lw, x), expected, rtol=1e-5)
    assert_close(jax.jit(lf)(lw, x), expected, rtol=1e-5)


def test_shard_map_fallback_materialises_under_the_policy(data, monkeypatch):
    mesh = mesh_for("tp")
    w, a, b, x, _ = data
    x = x.reshape(-1, D)
    lp = {n: lorax.LoraWeight(jnp.asarray(w[n]), jnp.asarray(a[n]), jnp.asarray(b[n]))
          for n in ("up", "down")}
    f = jax.shard_map(megatron_mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P("data", None))
    expected = f(lorax.merge_params(lp), x)
    monkeypatch.setattr(_engine, "_shard_map_rule", lambda ops, specs: "a reason")
    with pytest.warns(lorax.LoraMaterializationWarning, match=r"`shard_map` .*a reason"):
        assert_close(lorax.lora(f)(lp, x), expected, rtol=1e-5)
    with pytest.raises(lorax.LoraMaterializationError, match="shard_map"):
        lorax.lora(f, on_materialize="error")(lp, x)


def test_shard_map_returning_a_lora_weight_materialises_it(data):
    mesh = mesh_for("tp")
    w, a, b, _, _ = data
    lw = lorax.LoraWeight(jnp.asarray(w["up"]), jnp.asarray(a["up"]), jnp.asarray(b["up"]))
    f = jax.shard_map(lambda w: w, mesh=mesh, in_specs=COLUMN, out_specs=COLUMN)
    with pytest.warns(lorax.LoraMaterializationWarning, match="leaves the shard_map body"):
        out = lorax.lora(f)(lw)
    # Merged per shard inside the body vs whole outside: XLA may round `w + s * b @ a`
    # differently (a few elements near 0 differed by ~2e-9), hence the atol.
    assert_close(out, lw.materialize(), rtol=1e-6)


def test_factor_specs_follow_the_weight_and_reject_what_has_no_factor_layout():
    # (batch, M, N) -> b: (batch, M, k), a: (batch, k, N)
    assert factor_specs(P("x", "y", "z"), 3, 1, 1) == (P("x", None, "z"), P("x", "y", None))
    assert factor_specs(P("x"), 3, 0, 2, rank_axis="r") == (P("r", None), P("x", None, "r"))
    with pytest.raises(ValueError, match="more entries"):
        factor_specs(P("x", None, None), 2, 0, 1)
    with pytest.raises(ValueError, match="rank_axis 'x' already shards"):
        factor_specs(P(("x", "y"), None), 2, 0, 1, rank_axis="x")
    with pytest.raises(ValueError, match="unreduced"):
        factor_specs(P(None, None, unreduced={"x"}), 2, 0, 1)


# -- with_sharding_constraint ----------------------------------------------------------


def test_sharding_constraint_on_a_lora_weight_constrains_its_factors(data):
    mesh = mesh_for("tp")
    w, a, b, x, _ = data
    x = x.reshape(-1, D)
    lp = {n: lorax.LoraWeight(jnp.asarray(w[n]), jnp.asarray(a[n]), jnp.asarray(b[n]))
          for n in ("up", "down")}

    def model(p, x):
        up = jax.lax.with_sharding_constraint(p["up"], NamedSharding(mesh, COLUMN))
        h = jax.nn.relu(x @ up)
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", "model")))
        down = jax.lax.with_sharding_constraint(p["down"], NamedSharding(mesh, ROW))
        return h @ down

    lf = lorax.lora(model, on_materialize="error")
    assert_close(jax.jit(lf)(lp, x), model(lorax.merge_params(lp), x), rtol=1e-5)
    constrained = {tuple(e.invars[0].aval.shape): e.params["sharding"].spec
                   for e in jax.make_jaxpr(lf)(lp, x).eqns
                   if e.primitive.name == "sharding_constraint"}
    assert constrained == {
        (D, F): COLUMN, (K, F): P(None, "model"), (D, K): P(None, None),
        (F, D): ROW, (F, K): P("model", None), (K, D): P(None, None),
        (x.shape[0], F): P("data", "model"),
    }


# -- parameter lifecycle on sharded weights --------------------------------------------


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_merge_partition_and_optimizer_state_keep_shardings(data, layout):
    _, _, specs, _ = LAYOUTS[layout]
    mesh = mesh_for(layout)
    params, lp, spec = lora_setup(data, mesh, specs)

    trainable, frozen = lorax.partition(lp, spec)
    again = lorax.combine(trainable, frozen)
    for n in NAMES:
        assert again[n].w is lp[n].w and again[n].a is lp[n].a and again[n].b is lp[n].b

    state = lorax.wrap_optimizer(optax.adam(1e-3), spec).init(lp)
    moments = [leaf for leaf in jax.tree.leaves(state) if leaf.ndim == 2]
    assert len(moments) == 2 * 2 * len(NAMES)  # mu and nu for each a and b, nothing for w
    factor_shardings = {(lw.a.shape, lw.a.sharding.spec) for lw in lp.values()} | {
        (lw.b.shape, lw.b.sharding.spec) for lw in lp.values()}
    assert {(m.shape, m.sharding.spec) for m in moments} <= factor_shardings

    merged = lorax.merge_params(lp)
    for n in NAMES:
        assert merged[n].sharding == params[n].sharding, n
        assert_close(merged[n], lp[n].materialize(), rtol=1e-6)  # per shard vs eager
    kept = {n: params[n].addressable_shards[0].data.nbytes for n in NAMES}
    merged = lorax.merge_params(lorax.init_lora(
        {n: params[n] + 0 for n in NAMES}, spec, jax.random.PRNGKey(1)), destructive=True)
    for n in NAMES:
        assert merged[n].sharding == params[n].sharding
        assert merged[n].addressable_shards[0].data.nbytes == kept[n]


def test_adapter_loads_onto_a_sharded_base(data, tmp_path):
    _, _, specs, _ = LAYOUTS["tp"]
    mesh = mesh_for("tp")
    params, lp, spec = lora_setup(data, mesh, specs)
    bias = jax.device_put(np.arange(F, dtype=np.float32), NamedSharding(mesh, P("model")))
    lp, spec = dict(lp, bias=bias), dict(spec, bias=lorax.LORA_FULL)
    path = tmp_path / "adapter.safetensors"
    lorax.save_adapter(path, lp, spec)

    loaded, loaded_spec = lorax.load_adapter(path, dict(params, bias=bias * 0))
    assert loaded["bias"].sharding == bias.sharding
    np.testing.assert_array_equal(loaded["bias"], bias)  # exact: saved bits, loaded back
    for n in NAMES:
        assert loaded[n].w is params[n]
        assert loaded[n].a.sharding.spec == lp[n].a.sharding.spec, n
        assert loaded[n].b.sharding.spec == lp[n].b.sharding.spec, n
        np.testing.assert_array_equal(loaded[n].a, lp[n].a)
        np.testing.assert_array_equal(loaded[n].b, lp[n].b)

    # Onto a LoRA tree: the factors keep that tree's shardings (here a sharded rank
    # axis, rank 4 to split over 'model').
    fsdp = {n: jax.device_put(data[0][n], NamedSharding(mesh, P("data", None)))
            for n in ("q", "up")}
    rank4 = dict.fromkeys(fsdp, 4)
    base = lorax.init_lora(fsdp, rank4, jax.random.PRNGKey(2), rank_axis="model")
    assert base["q"].b.sharding.spec == P("data", "model")
    assert base["q"].a.sharding.spec == P("model", None)
    trained = lorax.init_lora(params, dict.fromkeys(NAMES, 4), jax.random.PRNGKey(3))
    trained = {n: trained[n] for n in fsdp}
    lorax.save_adapter(path, trained, rank4)
    loaded, _ = lorax.load_adapter(path, base)
    for n in fsdp:
        assert loaded[n].a.sharding == base[n].a.sharding
        assert loaded[n].b.sharding == base[n].b.sharding
        np.testing.assert_array_equal(loaded[n].a, trained[n].a)


def test_init_lora_rank_axis_errors_name_the_path(data):
    mesh = mesh_for("tp")
    w = jax.device_put(data[0]["up"], NamedSharding(mesh, COLUMN))
    with pytest.raises(ValueError, match=r"init_lora: .*up.*rank_axis 'model' already shards"):
        lorax.init_lora({"up": w}, {"up": K}, jax.random.PRNGKey(0), rank_axis="model")


def test_save_adapter_gathers_shards_held_by_other_processes(monkeypatch):
    """Multi-host arrays (not fully addressable) are gathered, not read locally."""
    from jax.experimental import multihost_utils

    from lorax import _adapter

    class Remote:  # stands in for a global array whose shards live on other hosts
        is_fully_addressable = False
        is_fully_replicated = False
        shape = (4, 2)

    gathered = []

    def fake_allgather(x, tiled=False):
        gathered.append((x, tiled))
        return np.ones(x.shape, np.float32)

    monkeypatch.setattr(multihost_utils, "process_allgather", fake_allgather)
    remote = Remote()
    out = _adapter._to_host(remote)
    assert gathered == [(remote, True)] and out.shape == (4, 2)

    class Replicated(Remote):
        is_fully_replicated = True

        def addressable_data(self, i):
            return np.full(self.shape, 2.0, np.float32)

    np.testing.assert_array_equal(_adapter._to_host(Replicated()), np.full((4, 2), 2.0))
    assert len(gathered) == 1  # a replicated array needs no collective
