"""Sharded quantized weights (FSDP-QLoRA) on 8 simulated CPU devices.

A `QuantizedArray` made from a sharded weight keeps the weight's layout (codes, scales
and mins split the same way, the blocks whole); its factors get the shardings a dense
weight of that layout gives them; inside a jitted step the *codes* are all-gathered
and dequantized per device, never the dequantized float32 values. Values and factor
gradients equal the single-device step's. `shard_map` and `with_sharding_constraint`
take a `QuantizedArray`, bare or as a `LoraWeight`'s `w`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import lorax
from conftest import assert_close
from lorax._rules import quant as quant_rules
from lora_testing import gguf_blocks

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS from tests/conftest.py)")

L, D, H, K = 2, 256, 512, 8
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "s8": 1, "s32": 4, "pred": 1}


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]), ("fsdp",))


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"up": jax.random.normal(k1, (L, D, H)) / 16,
            "down": jax.random.normal(k2, (L, H, D)) / 23}


SPEC = {"up": lorax.LoraSpec(K, batch_ndim=1), "down": lorax.LoraSpec(K, batch_ndim=1)}


def mlp(p, x):
    def body(h, layer):
        return h + jax.nn.gelu(h @ layer["up"]) @ layer["down"], None

    return jax.lax.scan(jax.checkpoint(body), x, p)[0]


def _loss(trainable, frozen, x):
    y = lorax.lora(mlp, on_materialize="error")(lorax.combine(trainable, frozen), x)
    return jnp.mean(y ** 2)


def _lora_params(params, qtype):
    if qtype != "dense":
        params = lorax.quantize(params, SPEC, qtype)
    return _nudge(lorax.init_lora(params, SPEC, jax.random.PRNGKey(1)))


def _nudge(lp):
    """Non-zero `b`, so the factor path shows in values and in `a`'s gradient."""
    def one(lw):
        if not isinstance(lw, lorax.LoraWeight):
            return lw
        b = lw.b + 0.01 * jax.random.normal(jax.random.PRNGKey(2), lw.b.shape, lw.b.dtype)
        sharded = isinstance(lw.b.sharding, NamedSharding)
        b = jax.device_put(b, lw.b.sharding) if sharded else jnp.asarray(np.asarray(b))
        return lorax.LoraWeight(lw.w, lw.a, b, alpha=lw.alpha)

    return jax.tree.map(one, lp, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))


def _sharded(mesh, spec=P(None, None, "fsdp")):
    return jax.device_put(_params(), NamedSharding(mesh, spec))


def _step(lp, x):
    trainable, frozen = lorax.partition(lp, SPEC)
    return jax.jit(jax.value_and_grad(_loss)), (trainable, frozen, x)


def all_gathers(compiled_text: str) -> list[tuple[str, int]]:
    """`(dtype, bytes)` of every all-gather result in a compiled module."""
    out = []
    for line in compiled_text.splitlines():
        m = re.search(r"= (\(?[^=]*?) all-gather(?:-start)?\(", line)
        if m:
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
                out.append((dtype, n * BYTES.get(dtype, 4)))
    return out


# -- placement ---------------------------------------------------------------------------


@pytest.mark.parametrize("qtype, spec", [
    ("nf4", P(None, None, "fsdp")), ("q4_0", P(None, None, "fsdp")),
    ("int8", P(None, None, "fsdp")), ("q4_0", P(None, "fsdp", None)),  # blocks split 8 ways
])
def test_quantize_keeps_the_weights_sharding_and_factors_follow_it(mesh, qtype, spec):
    params = _sharded(mesh, spec)
    q = lorax.quantize(params, SPEC, qtype)
    for name in ("up", "down"):
        qa = q[name]
        assert qa.sharding.spec == P(*spec) and qa.sharding.mesh == mesh
        # Each device holds 1/8 of the codes (the blocks whole).
        shard = qa.codes.addressable_shards[0].data
        assert shard.size * 8 == qa.codes.size
        assert_close(qa.dequantize(), lorax.QuantizedArray.from_dense(
            np.asarray(params[name]), qtype).dequantize(), rtol=0, atol=0)
    dense = lorax.init_lora(params, SPEC, jax.random.PRNGKey(1))
    lp = lorax.init_lora(q, SPEC, jax.random.PRNGKey(1))
    for name in ("up", "down"):
        assert lp[name].a.sharding == dense[name].a.sharding
        assert lp[name].b.sharding == dense[name].b.sharding


def test_a_sharding_that_splits_blocks_names_the_key_path(mesh):
    # 8 rows of nf4 blocks of 64 along axis -2 (D=256 -> 4 blocks) cannot split 8 ways.
    params = _sharded(mesh, P(None, "fsdp", None))
    with pytest.raises(ValueError, match=r"quantize: 'up': .*splits the block axis .*4 "
                       r"blocks of 64\) 8 ways"):
        lorax.quantize({"up": params["up"]}, {"up": SPEC["up"]}, "nf4")


# -- the step --------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["nf4", "q4_1"])
def test_fsdp_qlora_step_equals_the_single_device_step(mesh, qtype):
    x = jax.random.normal(jax.random.PRNGKey(3), (64, D))
    step, args = _step(_lora_params(_sharded(mesh), qtype),
                       jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
    loss, grads = step(*args)
    step1, args1 = _step(_lora_params(jax.device_put(_params(), jax.devices()[0]), qtype), x)
    loss1, grads1 = step1(*args1)
    assert_close(loss, loss1, rtol=2e-5)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        assert_close(g, g1, rtol=2e-5, atol=1e-7)


def _gathers(mesh, qtype, monkeypatch=None):
    x = jax.ShapeDtypeStruct((1024, D), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    step, args = _step(_lora_params(_sharded(mesh), qtype), x)
    return all_gathers(step.lower(*args).compile().as_text())


def test_fsdp_qlora_gathers_codes_not_dequantized_weights(mesh, monkeypatch):
    shard_set = D * H  # one layer's weight: what a gathered dense copy would hold
    dense = sum(b for _, b in _gathers(mesh, "dense"))
    gathered = _gathers(mesh, "nf4")
    floats = [b for dtype, b in gathered if dtype in ("f32", "bf16", "f16")]
    assert max(floats) < shard_set * 4 / 8  # no float array of a weight's size
    assert any(dtype == "u8" for dtype, _ in gathered)  # the codes are what moves
    ratio = sum(b for _, b in gathered) / dense
    assert ratio <= 0.2, ratio
    # The negative control: dequantize where the shards are, as a plain dot, and let XLA
    # move the values.
    monkeypatch.setattr(quant_rules, "gathered", lambda x, mesh: x)
    monkeypatch.setattr(quant_rules, "_partitioned", lambda plan, x: False)
    jax.clear_caches()  # lorax's jitted rule bodies were traced with the constraint
    control = _gathers(mesh, "nf4")
    assert max(b for dtype, b in control if dtype == "f32") >= shard_set * 4
    assert sum(b for _, b in control) / dense > 0.2


def _stack_copies(text: str) -> list[str]:
    """Copies of a whole `(L, ...)` codes stack in a compiled module."""
    return re.findall(r"= u8\[%d,[^ ]*\{[^}]*\} copy\(" % L, text)


def test_fsdp_qlora_gathers_each_layer_without_relaying_out_the_stack(mesh, monkeypatch):
    """The codes are gathered per layer inside the scan, and no layer-stack copy is made
    to do it (XLA wants the gathered axis outermost; at Llama-3-70B scale a relaid-out
    copy of every layer's codes cost 3.9 GiB per device)."""
    x = jax.ShapeDtypeStruct((1024, D), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    step, args = _step(_lora_params(_sharded(mesh), "nf4"), x)
    assert _stack_copies(step.lower(*args).compile().as_text()) == []
    # The negative control: a plain dot on codes gathered by the same constraint without
    # lorax's reshape.
    monkeypatch.setattr(quant_rules, "gathered", lambda x, mesh: x if mesh is None else
                        jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())))
    monkeypatch.setattr(quant_rules, "_partitioned", lambda plan, x: False)
    jax.clear_caches()
    step, args = _step(_lora_params(_sharded(mesh), "nf4"), x)
    assert _stack_copies(step.lower(*args).compile().as_text()) != []


def test_a_sharded_quantized_table_sliced_through_its_blocks_gathers_codes(mesh, monkeypatch):
    """Vocabulary chunks that cut through the blocks (a chunked loss over a sharded,
    quantized embedding, the activations split by row) move the chunk's codes, not its
    dequantized values; the gradient equals the dense table's."""
    vocab, dim, size = 4096, 256, 1000  # 1000 rows: not whole 64-row blocks
    table = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (vocab, dim)),
                           NamedSharding(mesh, P(None, "fsdp")))
    qa = lorax.QuantizedArray.from_dense(table, "nf4")
    h = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (64, dim)),
                       NamedSharding(mesh, P("fsdp")))

    def loss(t, h):
        def chunk(total, i):
            z = h @ jax.lax.dynamic_slice_in_dim(t, i * size, size).T
            return total + jnp.sum(jnp.exp(z / 16)), None

        return jax.lax.scan(jax.checkpoint(chunk), 0.0, jnp.arange(vocab // size))[0]

    def float_gathers():
        grad = jax.jit(jax.grad(lambda t, h: lorax.lora(loss, on_materialize="error")(t, h),
                                argnums=1))
        text = grad.lower(qa, h).compile().as_text()
        return grad(qa, h), [b for dtype, b in all_gathers(text) if dtype in ("f32", "bf16")]

    g, floats = float_gathers()
    assert max(floats, default=0) < size * dim * 4 / 8, floats
    assert_close(g, jax.grad(loss, argnums=1)(qa.dequantize(), h), rtol=1e-5)
    # The negative control: the cut blocks dequantized where they lie.
    monkeypatch.setattr(quant_rules, "gathered", lambda x, mesh: x)
    jax.clear_caches()
    assert max(float_gathers()[1]) >= size * dim * 4


def test_fsdp_k_quant_blocks_from_a_gguf_file(mesh):
    """GGUF blocks as a file has them (Q4_K), placed by `with_sharding`."""
    rows = gguf_blocks("q4_k", (H, D))  # (out, in) rows, blocks along `in`
    w = lorax.QuantizedArray.from_gguf(rows, "q4_k")  # (in, out) = (D, H)
    placed = w.with_sharding(NamedSharding(mesh, P(None, "fsdp")))
    assert placed.sharding.spec == P(None, "fsdp")
    x = jax.random.normal(jax.random.PRNGKey(3), (64, D))

    spec = {"w": K}

    def f(trainable, frozen, x):
        y = lorax.lora(lambda p, x: x @ p["w"], on_materialize="error")(
            lorax.combine(trainable, frozen), x)
        return jnp.sum(jnp.tanh(y))

    lp = _nudge(lorax.init_lora({"w": placed}, spec, jax.random.PRNGKey(1)))
    lp1 = _nudge(lorax.init_lora({"w": w}, spec, jax.random.PRNGKey(1)))
    assert lp["w"].a.sharding.spec == P(None, "fsdp")
    g = jax.jit(jax.grad(f))(*lorax.partition(lp, spec),
                             jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
    g1 = jax.jit(jax.grad(f))(*lorax.partition(lp1, spec), x)
    assert_close(g["w"].a, g1["w"].a, rtol=2e-5, atol=1e-7)
    assert_close(g["w"].b, g1["w"].b, rtol=2e-5, atol=1e-7)


# -- layout primitives -----------------------------------------------------------------------


@pytest.mark.parametrize("in_lora", [False, True])
def test_shard_map_takes_a_quantized_weight(mesh, in_lora):
    w = jax.random.normal(jax.random.PRNGKey(0), (D, H)) / 16
    qa = lorax.QuantizedArray.from_dense(w, "nf4")
    x = jax.random.normal(jax.random.PRNGKey(3), (16, D))
    p = _nudge(lorax.init_lora({"w": qa}, {"w": K}, jax.random.PRNGKey(1)))["w"] if in_lora else qa

    def body(w, x):  # column-parallel: each device its slice of the output features
        return x @ w

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "fsdp"), P()), out_specs=P(None, "fsdp"))
    y = lorax.lora(f, on_materialize="error")(p, x)
    ref = x @ (lorax.merge_params({"w": p})["w"] if in_lora else qa.dequantize())
    assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_with_sharding_constraint_on_a_quantized_weight(mesh):
    w = jax.random.normal(jax.random.PRNGKey(0), (D, H)) / 16
    lp = _nudge(lorax.init_lora({"w": lorax.QuantizedArray.from_dense(w, "nf4")}, {"w": K},
                                jax.random.PRNGKey(1)))
    x = jax.random.normal(jax.random.PRNGKey(3), (16, D))
    sharding = NamedSharding(mesh, P(None, "fsdp"))

    def f(p, x):
        return x @ jax.lax.with_sharding_constraint(p["w"], sharding)

    y = jax.jit(lorax.lora(f, on_materialize="error"))(lp, x)
    assert_close(y, x @ lorax.merge_params(lp)["w"], rtol=1e-5, atol=1e-6)
    # The bare quantized weight too; its leaves come out laid out as the dense value.
    qa = lorax.QuantizedArray.from_dense(w, "nf4")
    out = jax.jit(lorax.lora(lambda q: jax.lax.with_sharding_constraint(q, sharding) * 1.0,
                             on_materialize="allow"))(qa)
    assert_close(out, qa.dequantize(), rtol=0, atol=0)
