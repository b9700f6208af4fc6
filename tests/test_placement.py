"""Frozen weights in host memory (`lorax.offload_frozen`): the step's values are the
all-on-device step's, bit for bit, and the program exported for `cuda` moves one layer's
codes per loop iteration, never a whole stack.

XLA:CPU computes with host-placed arrays as with any other (its host and device memory
are one), so the values are checked here, and where the program moves data is read from
the same step exported for `cuda` (`benchmarks.offload.placements`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lorax
from benchmarks import offload as O
from benchmarks import scale as S
from lorax import _engine, _placement

HOST = "pinned_host"


def _kinds(tree):
    return {jax.tree_util.keystr(p): x.sharding.memory_kind
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


# -- offload_frozen --------------------------------------------------------------------------


def test_offload_frozen_moves_the_frozen_leaves_and_nothing_else():
    key = jax.random.PRNGKey(0)
    dense = {"q": jax.random.normal(key, (2, 64, 32)), "d": jax.random.normal(key, (64, 32)),
             "e": jax.random.normal(key, (128, 64)), "norm": jnp.ones(32)}
    spec = {"q": lorax.LoraSpec(4, batch_ndim=1), "d": 4, "e": 0, "norm": 0}
    params = lorax.quantize(dense, {"q": spec["q"], "d": 0, "e": 4, "norm": 0}, "nf4")
    params = lorax.init_lora(params, spec, key)
    before = jax.tree_util.tree_map(np.asarray, params)
    out = lorax.offload_frozen(params)
    kinds = _kinds(out)
    frozen = {k: v for k, v in kinds.items() if ".w" in k or k.startswith("['e']")}
    assert frozen and set(frozen.values()) == {HOST}, kinds
    assert {v for k, v in kinds.items() if k not in frozen} == {"device"}, kinds
    assert "['q'].w.codes" in kinds and "['d'].w" in kinds and "['e'].codes" in kinds
    # New arrays: the caller's own are untouched and still usable.
    assert set(_kinds(params).values()) == {"device"}
    jax.tree_util.tree_map(np.testing.assert_array_equal, before,
                           jax.tree_util.tree_map(np.asarray, params))
    jax.tree_util.tree_map(np.testing.assert_array_equal, before,
                           jax.tree_util.tree_map(np.asarray, out))


def test_offload_frozen_takes_a_frozen_half_and_abstract_shapes():
    spec = {"w": lorax.LoraSpec(4, batch_ndim=1)}
    params = lorax.init_lora({"w": jnp.ones((2, 16, 8))}, spec, jax.random.PRNGKey(0))
    _, frozen = lorax.partition(params, spec)
    assert _kinds(lorax.offload_frozen(frozen)) == {"['w'].w": HOST}
    abstract = lorax.offload_frozen(jax.eval_shape(lambda: params))
    assert abstract["w"].w.sharding.memory_kind == HOST
    assert abstract["w"].a.sharding is None


def test_offload_frozen_keeps_each_array_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    spec = jax.sharding.PartitionSpec(None, "fsdp")
    w = jax.device_put(jnp.ones((2, 16, 8)), jax.sharding.NamedSharding(mesh, spec))
    params = lorax.init_lora({"w": w}, {"w": lorax.LoraSpec(4, batch_ndim=1)},
                             jax.random.PRNGKey(0))
    moved = lorax.offload_frozen(params)["w"].w
    assert moved.sharding == jax.sharding.NamedSharding(mesh, spec, memory_kind=HOST)


# -- the step: values ------------------------------------------------------------------------


def _mlp_model(remat: bool):
    def model(p, x):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w["up"]) @ w["down"], None
        step = jax.checkpoint(layer) if remat else layer
        return jnp.mean(lax.scan(step, x, p["layers"])[0] ** 2)
    return model


def _mlp_params(qtype: str | None):
    key = jax.random.PRNGKey(0)
    layers = {"up": 0.05 * jax.random.normal(key, (3, 128, 256)),
              "down": 0.05 * jax.random.normal(jax.random.fold_in(key, 1), (3, 256, 128))}
    spec = {"layers": {k: lorax.LoraSpec(4, batch_ndim=1) for k in layers}}
    params = {"layers": layers}
    if qtype is not None:
        params = lorax.quantize(params, spec, qtype, double_quant=qtype == "nf4")
    params = lorax.init_lora(params, spec, jax.random.fold_in(key, 2))
    # Non-zero `b`, so the factors' gradients depend on the base's values too.
    params = jax.tree_util.tree_map(
        lambda lw: lorax.LoraWeight(lw.w, lw.a, 0.1 * jnp.ones_like(lw.b), lw.alpha),
        params, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))
    return params, spec


def _grads(model, params, spec, x):
    trainable, frozen = lorax.partition(params, spec)
    loss = lambda t, f: lorax.lora(model)(lorax.combine(t, f), x)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss))(trainable, frozen)


@pytest.mark.parametrize("remat", [False, True], ids=["no-remat", "remat"])
@pytest.mark.parametrize("qtype", ["nf4", "int8", "q4_0", None],
                         ids=["nf4-double", "int8", "q4_0", "dense"])
def test_offloaded_step_equals_the_on_device_step_bit_for_bit(qtype, remat):
    params, spec = _mlp_params(qtype)
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 128))
    model = _mlp_model(remat)
    on_device = _grads(model, params, spec, x)
    offloaded = _grads(model, lorax.offload_frozen(params), spec, x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, offloaded, on_device)
    assert float(on_device[0]) > 0
    # The offloaded step does move its weights (XLA:CPU then computes the same values).
    trainable, frozen = lorax.partition(lorax.offload_frozen(params), spec)
    jaxpr = jax.make_jaxpr(lambda t, f: lorax.lora(model)(lorax.combine(t, f), x))(trainable, frozen)
    assert "devices=(MemorySpace.Device,)" in str(jaxpr)


# Without remat the residuals' path is the MLP tests' (above); here it only adds compiles.
@pytest.mark.parametrize("remat", ["layer", pytest.param("none", marks=pytest.mark.slow)])
def test_llama_qlora_step_with_host_codes_equals_the_on_device_step(remat):
    # The example Llama (the recipe the docs show), a tiny one: its seven projections
    # and the tied embedding are nf4 codes with double quantization, in host memory.
    cfg = S.LLAMA.Config(2, 128, 256, 4, 2, 5e5, 1e-5, 512, attention="xla", remat=remat)
    on_device = O.llama_step_values(cfg, "qlora-nf4", offload=False)
    offloaded = O.llama_step_values(cfg, "qlora-nf4", offload=True)
    jax.tree_util.tree_map(np.testing.assert_array_equal, offloaded, on_device)
    assert np.isfinite(float(on_device[0]))


@pytest.mark.slow  # CI time: the card script's check, ~25 s on 2 cores
def test_the_card_s_value_check_compares_the_two_placements(monkeypatch):
    # `python -m benchmarks.offload --check` (scripts/card runs it under XLA's pipelined
    # host offloading): the same comparison, on the default device.
    result = O.check_values()
    assert result["bit_for_bit"] and result["finite"]
    assert result["codes_relative_difference"] == 0.0
    assert result["codes_and_state_relative_difference"] == 0.0
    # The control: gradients off by one per cent are found and fail the run.
    values = O.llama_step_values

    def off(cfg, method, offload, state_on_host=False):
        loss, grads, new = values(cfg, method, offload, state_on_host)
        return loss, jax.tree_util.tree_map(lambda g: g * (1 + 1e-2 * offload), grads), new

    monkeypatch.setattr(O, "llama_step_values", off)
    assert O.check_values()["max_relative_difference"] == pytest.approx(1e-2, rel=1e-2)
    with pytest.raises(SystemExit, match="changed the step's values"):
        O.main(["--check"])


# -- the step: where it moves data -----------------------------------------------------------


def _stack_slices(frozen) -> set:
    """The per-layer shapes of the host-placed layer stacks."""
    return {tuple(x.shape[1:]) for x in jax.tree_util.tree_leaves(frozen["layers"])
            if x.ndim >= 2}


def _check_streaming(args, moves, stacks: set, stack_shapes: set) -> None:
    """Each layer stack in host memory moves one layer's slice per loop iteration, inside
    the loop body; no move is as large as a whole stack."""
    assert any(a.memory_kind == HOST for a in args), "no argument is in host memory"
    in_loop = {m.shape for m in moves if m.in_loop and m.to == "device"}
    missing = {s for s in stacks if s not in in_loop and len(s) >= 2}
    assert not missing, f"layer slices never moved inside a loop: {missing}"
    whole = [m for m in moves if m.shape in stack_shapes]
    assert not whole, f"whole stacks moved: {whole}"
    # (Vectors are left out: the embedding's own double-quantization offsets, moved
    # whole where the output layer reads them, have a layer slice's shape.)
    outside = [m for m in moves if not m.in_loop and m.shape in stacks and len(m.shape) >= 2]
    assert not outside, f"layer slices moved outside any loop: {outside}"


@pytest.mark.parametrize("remat", ["layer", "none"])
def test_exported_step_moves_one_layer_per_iteration(remat):
    cfg = S.config("tiny", "xla", remat)
    abstract, spec = S.build(cfg, "qlora-nf4", jnp.bfloat16)
    _, frozen = lorax.partition(abstract, spec)
    stacks = _stack_slices(frozen)
    stack_shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(frozen["layers"])
                    if x.ndim >= 3}
    exported = O.exported_step("tiny", remat=remat)
    args, moves = O.placements(exported.mlir_module())
    host = sum(a.nbytes for a in args if a.memory_kind == HOST)
    # Every quantized weight's codes and scales, the tied embedding's too; nothing else.
    quantized = [x for x in jax.tree_util.tree_leaves(
        frozen, is_leaf=lambda x: isinstance(x, lorax.QuantizedArray))
        if isinstance(x, lorax.QuantizedArray)]
    assert len(quantized) == 8
    assert host == sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                       for x in jax.tree_util.tree_leaves(quantized))
    _check_streaming(args, moves, stacks, stack_shapes)
    # The backward pass moves each layer again (`test_remat_moves_...`: how often).
    codes = max(stacks, key=np.prod)
    assert sum(m.shape == codes and m.in_loop for m in moves) >= 2


def _moves_of_the_codes(remat: str) -> dict:
    """Per shape of a layer's codes: the places in the step's loops that move one (each
    rule's body traced anew, so two projections of one shape count twice)."""
    abstract, spec = S.build(S.config("tiny", "xla", remat), "qlora-nf4", jnp.bfloat16)
    codes = {s for s in _stack_slices(lorax.partition(abstract, spec)[1]) if len(s) == 3}
    with _engine.trace_uncached():
        _, moves = O.placements(O.exported_step("tiny", remat=remat).mlir_module())
    return {s: sum(m.shape == s and m.in_loop for m in moves) for s in codes}


def test_remat_moves_each_layer_no_more_often_than_no_remat(monkeypatch):
    # Per-layer remat recomputes each layer in the backward pass; the layer's gradient
    # reads the recomputation's moved copy, so each layer's codes move once per pass.
    layer = _moves_of_the_codes("layer")
    assert layer == _moves_of_the_codes("none")
    # The control: a gradient keeping the host leaves moves them beside the recomputation.
    monkeypatch.setattr(_engine, "_recomputes", lambda policy: False)
    control = _moves_of_the_codes("layer")
    assert all(control[s] >= n for s, n in layer.items()) and sum(control.values()) > sum(
        layer.values())


def _dense_moves(policy) -> int:
    """Moves of one layer's dense `up` weight in the loops of the offloaded MLP's gradient,
    each layer under `jax.checkpoint(policy=policy)`."""
    params, spec = _mlp_params(None)
    trainable, frozen = lorax.partition(lorax.offload_frozen(params), spec)
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)

    def model(p, x):
        layer = jax.checkpoint(lambda h, w: (h + jax.nn.gelu(h @ w["up"]) @ w["down"], None),
                               policy=policy)
        return jnp.mean(lax.scan(layer, x, p["layers"])[0] ** 2)

    loss = lambda t, f, x: lorax.lora(model)(lorax.combine(t, f), x)  # noqa: E731
    with _engine.trace_uncached():
        exported = O.export_for_cuda(jax.grad(loss), trainable, frozen, x)
    return sum(m.shape == (128, 256) and m.in_loop for m in O.placements(exported.mlir_module())[1])


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_with_no_batch_dims_saveable])
def test_a_dense_host_weight_under_remat_moves_once_per_pass(policy, monkeypatch):
    # Forward, and backward: the gradient reads the recomputation's copy (with `dots`,
    # nothing of the layer's forward pass is recomputed but the move).
    assert _dense_moves(policy) == 2
    if policy is None:  # the control: the product recomputing its own move, nested
        monkeypatch.setattr(_engine, "_recomputes", lambda policy: False)
        assert _dense_moves(policy) == 3


def test_only_a_policy_saving_neither_moves_nor_the_name_recomputes_them():
    P = jax.checkpoint_policies
    for policy in (None, P.nothing_saveable, P.dots_with_no_batch_dims_saveable,
                   P.save_only_these_names("layer_input"),
                   P.save_and_offload_only_these_names(  # the example Llama's remat="offload"
                       names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
                       offload_src="device", offload_dst="pinned_host")):
        assert _engine._recomputes(policy), policy
    for policy in (P.everything_saveable, P.save_anything_except_these_names(_engine.RECOMPUTED),
                   P.save_only_these_names(_engine.RECOMPUTED), lambda prim, *a, **k: k["x"]):
        assert not _engine._recomputes(policy), policy


def test_the_streaming_check_fails_a_step_that_moves_whole_stacks():
    # The negative control: the same step with the frozen tree moved to the device first.
    cfg = S.config("tiny", "xla", "layer")
    abstract, spec = S.build(cfg, "qlora-nf4", jnp.bfloat16)
    trainable, frozen = lorax.partition(abstract, spec)
    frozen = lorax.offload_frozen(frozen)
    windows = jax.ShapeDtypeStruct((1, 65), jnp.int32)
    apply = lorax.lora(lambda p, w: S.LLAMA.loss(cfg, p, w), on_materialize="allow")

    def step(t, f, w):
        f = jax.device_put(f, jax.memory.Space.Device)
        return jax.grad(lambda t: apply(lorax.combine(t, f), w))(t)

    exported = O.export_for_cuda(step, trainable, frozen, windows)
    found_args, moves = O.placements(exported.mlir_module())
    stack_shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(frozen["layers"])
                    if x.ndim >= 3}
    assert any(m.shape in stack_shapes and not m.in_loop for m in moves)
    with pytest.raises(AssertionError, match="never moved inside a loop"):
        _check_streaming(found_args, moves, _stack_slices(frozen), stack_shapes)


def test_a_dense_host_weight_is_not_saved_on_the_device_for_the_backward_pass(monkeypatch):
    # Without remat, the backward pass needs each layer's weight. It reads the host stack
    # again; a moved copy saved per layer would stack every layer's weight on the device.
    params, spec = _mlp_params(None)
    trainable, frozen = lorax.partition(lorax.offload_frozen(params), spec)
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    model = _mlp_model(remat=False)

    def stacked_device_copies() -> list:
        loss = lambda t, f, x: lorax.lora(model)(lorax.combine(t, f), x)  # noqa: E731
        with _engine.trace_uncached():  # no rule body traced before the patch is reused
            exported = O.export_for_cuda(jax.grad(loss), trainable, frozen, x)
        text = exported.mlir_module()
        return [s for s in ("tensor<3x128x256xf32>", "tensor<3x256x128xf32>")
                if f"-> {s}" in text]

    assert stacked_device_copies() == []
    # Control: moving the weight without recomputing the move saves the copies.
    monkeypatch.setattr("lorax._rules.dot.read_frozen",
                        lambda product, w, *ops: product(_placement.on_device(w), *ops))
    assert stacked_device_copies() != []


def test_remat_offload_keeps_each_layer_input_in_host_memory():
    # The example Llama's `remat="offload"`: each layer's saved input is moved out to host
    # memory inside the forward loop and back inside the backward loop (values: as "layer",
    # tests/examples/test_llama_attention.py).
    exported = O.exported_step("tiny", remat="offload", offload=False)
    _, moves = O.placements(exported.mlir_module())
    seq, dim = S.MODELS["tiny"][-1], S.MODELS["tiny"][1]
    act = (1, seq, dim)
    assert {(m.to, m.in_loop) for m in moves if m.shape == act} == {(HOST, True), ("device", True)}
    assert all(m.shape == act for m in moves if m.to == HOST)
    layer = O.exported_step("tiny", remat="layer", offload=False)
    assert O.placements(layer.mlir_module())[1] == []


def test_fsdp_sharded_codes_in_host_memory_equal_the_on_device_step():
    # Each device holds its shard of every layer's codes in host memory; the partitioned
    # contraction (gathering codes along `fsdp`) reads them once moved.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    key = jax.random.PRNGKey(0)
    layers = {"up": 0.05 * jax.random.normal(key, (3, 128, 256)),
              "down": 0.05 * jax.random.normal(jax.random.fold_in(key, 1), (3, 256, 128))}
    layers = jax.device_put(layers, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        None, None, "fsdp")))
    spec = {"layers": {k: lorax.LoraSpec(4, batch_ndim=1) for k in layers}}
    params = lorax.init_lora(lorax.quantize({"layers": layers}, spec, "nf4", double_quant=True),
                             spec, jax.random.fold_in(key, 2))
    x = jax.device_put(jax.random.normal(key, (8, 128)),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    model = _mlp_model(remat=True)
    offloaded = lorax.offload_frozen(params)
    codes = offloaded["layers"]["up"].w.codes.sharding
    assert codes.memory_kind == HOST and codes.spec == params["layers"]["up"].w.codes.sharding.spec
    jax.tree_util.tree_map(np.testing.assert_array_equal, _grads(model, offloaded, spec, x),
                           _grads(model, params, spec, x))


def test_a_layer_indexed_in_a_fori_loop_moves_that_layer_only():
    # Not a scan: `w[i]` of a host stack in a `fori_loop` body. The slice is cut where the
    # stack lives and moved where the contraction reads it, inside the loop.
    params, spec = _mlp_params("int8")

    def model(p, x):
        def body(i, h):
            w = jax.tree.map(lambda s: s[i], p["layers"],
                             is_leaf=lambda v: isinstance(v, lorax.LoraWeight))
            return h + jax.nn.gelu(h @ w["up"]) @ w["down"]
        return jnp.mean(lax.fori_loop(0, 3, body, x) ** 2)

    x = jax.random.normal(jax.random.PRNGKey(3), (8, 128))
    offloaded = lorax.offload_frozen(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, _grads(model, offloaded, spec, x),
                           _grads(model, params, spec, x))
    trainable, frozen = lorax.partition(offloaded, spec)
    loss = lambda t, f, x: lorax.lora(model, on_materialize="error")(lorax.combine(t, f), x)  # noqa: E731
    exported = O.export_for_cuda(jax.value_and_grad(loss), trainable, frozen, x)
    _, moves = O.placements(exported.mlir_module())
    codes = {tuple(lw.w.codes.shape) for lw in frozen["layers"].values()}
    moved = {m.shape for m in moves if m.dtype == "i8"}
    assert moved == {s[1:] for s in codes}  # one layer's codes, never the stack
    assert all(m.in_loop for m in moves)


def test_offload_frozen_leaves_a_trainable_half_alone_and_rejects_unknown_memory():
    spec = {"w": 4}
    params = lorax.init_lora({"w": jnp.ones((16, 8))}, spec, jax.random.PRNGKey(0))
    trainable, _ = lorax.partition(params, spec)
    assert set(_kinds(lorax.offload_frozen(trainable)).values()) == {"device"}
    with pytest.raises(ValueError, match=r"memory_kind 'pinned_hots' is not a memory .*'pinned_host'"):
        lorax.offload_frozen(params, memory_kind="pinned_hots")


# -- offload_state: the optimizer state in host memory -------------------------------------------


def _training(optimizer, steps: int = 3):
    """Losses, factors and state kinds of `steps` jitted Adam steps of the offloaded MLP."""
    params, spec = _mlp_params("nf4")
    trainable, frozen = lorax.partition(lorax.offload_frozen(params), spec)
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 128))
    loss = lambda t: lorax.lora(_mlp_model(True))(lorax.combine(t, frozen), x)  # noqa: E731

    @jax.jit
    def step(t, state):
        value, grads = jax.value_and_grad(loss)(t)
        updates, state = optimizer.update(grads, state, t)
        return optax.apply_updates(t, updates), state, value

    state, losses, kinds = optimizer.init(trainable), [], []
    for _ in range(steps):
        trainable, state, value = step(trainable, state)
        losses.append(value)
        kinds.append({x.sharding.memory_kind for x in jax.tree_util.tree_leaves(state)})
    return losses, trainable, kinds


def test_offload_state_keeps_the_state_in_host_memory_and_the_optimizer_s_values():
    adam = optax.adam(1e-2)
    losses, trainable, kinds = _training(lorax.offload_state(adam))
    ref_losses, ref_trainable, ref_kinds = _training(adam)
    np.testing.assert_array_equal(losses, ref_losses)
    jax.tree_util.tree_map(np.testing.assert_array_equal, trainable, ref_trainable)
    assert losses[-1] < losses[0]
    assert kinds == [{HOST}] * 3 and HOST not in set().union(*ref_kinds)
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(trainable)} == {"device"}


def test_offload_state_moves_the_state_in_and_out_of_the_exported_step():
    params, spec = _mlp_params(None)
    trainable, frozen = lorax.partition(params, spec)
    optimizer = lorax.offload_state(optax.adam(1e-2))
    state = optimizer.init(trainable)
    x = jax.random.normal(jax.random.PRNGKey(3), (8, 128))

    def step(t, state):
        grads = jax.grad(lambda t: lorax.lora(_mlp_model(True))(lorax.combine(t, frozen), x))(t)
        updates, state = optimizer.update(grads, state, t)
        return optax.apply_updates(t, updates), state

    args, moves = O.placements(O.export_for_cuda(step, trainable, state).mlir_module())
    moments = 2 * sum(x.nbytes for x in jax.tree_util.tree_leaves(trainable))  # mu and nu
    assert sum(a.nbytes for a in args if a.memory_kind == HOST) == moments + 4  # + count
    factor_shapes = {x.shape for x in jax.tree_util.tree_leaves(trainable)}
    for to in ("device", HOST):  # each moment moved in, and the new one out
        assert {m.shape for m in moves if m.to == to and not m.in_loop} >= factor_shapes, to
