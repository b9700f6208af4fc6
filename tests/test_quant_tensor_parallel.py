"""Tensor-parallel QLoRA on 8 simulated CPU devices: a quantized weight is used where it
lies (`lorax/_rules/quant_partitioned.py`).

A 4-layer scanned MLP (D 512, H 1024, rank 16), `up` split along its output axis and
`down` along its input axis (column- then row-parallel, Megatron's layout, whole NF4
blocks on every device), the compiled Adam step's collectives read from the HLO: with
activations replicated the step moves what the dense tensor-parallel step moves and no
codes; on a 2 x 4 (`fsdp`, `tp`) mesh with FSDP on the other weight axis the codes are
gathered along `fsdp` only. The controls (the plain dot on codes gathered whole, as
lorax did before) fail the same checks. Values and factor gradients equal one device's.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import lorax
from conftest import assert_close
from lorax._rules import quant as quant_rules
from lorax._sharding import split_contraction

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS from tests/conftest.py)")

L, D, H, R = 4, 512, 1024, 16
SPEC = {"up": lorax.LoraSpec(R, batch_ndim=1), "down": lorax.LoraSpec(R, batch_ndim=1)}
BYTES = {"f32": 4, "bf16": 2, "u8": 1, "s8": 1, "s32": 4, "pred": 1}
TP = (("tp",), P(None, None, "tp"), P(None, "tp", None), P())  # mesh axes, up, down, x
FSDP_TP = (("fsdp", "tp"), P(None, "fsdp", "tp"), P(None, "tp", "fsdp"), P("fsdp"))


def _mesh(axes):
    devices = np.array(jax.devices()[:8])
    return Mesh(devices.reshape(2, 4) if len(axes) == 2 else devices, axes)


def mlp(p, x):
    def body(h, layer):
        return h + jax.nn.gelu(h @ layer["up"]) @ layer["down"], None

    return jax.lax.scan(jax.checkpoint(body), x, p)[0]


def _lora_params(layout, qtype, devices=None, block_size=None):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"up": jax.random.normal(k1, (L, D, H)) / 22,
              "down": jax.random.normal(k2, (L, H, D)) / 32}
    if layout is not None:
        mesh = _mesh(layout[0])
        params = {k: jax.device_put(v, NamedSharding(mesh, s))
                  for (k, v), s in zip(params.items(), layout[1:3])}
    if qtype != "dense":  # "nf4-dq": QLoRA's double-quantized absmax values
        params = lorax.quantize(params, SPEC, qtype.split("-")[0], double_quant=qtype == "nf4-dq",
                                block_size=block_size)
    lp = lorax.init_lora(params, SPEC, jax.random.PRNGKey(1))
    # Non-zero `b` (on `b`'s own layout), so the factor path shows in values and in
    # `a`'s gradient.
    return jax.tree.map(lambda lw: lorax.LoraWeight(lw.w, lw.a, jax.device_put(
        lw.b + 0.01 * jax.random.normal(k3, lw.b.shape), lw.b.sharding), alpha=lw.alpha),
        lp, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))


def _x(layout, shape=(64, D)):
    x = jax.random.normal(jax.random.PRNGKey(3), shape)
    return x if layout is None else jax.device_put(x, NamedSharding(_mesh(layout[0]), layout[3]))


def _loss(trainable, frozen, x):
    return jnp.mean(lorax.lora(mlp, on_materialize="error")(lorax.combine(trainable, frozen), x) ** 2)


@functools.lru_cache(maxsize=None)
def _dense_collectives(layout):
    return collectives(_adam_step_hlo(layout, "dense"))


def _adam_step_hlo(layout, qtype):
    trainable, frozen = lorax.partition(_lora_params(layout, qtype), SPEC)
    opt = optax.adam(1e-3)

    def step(trainable, frozen, state, x):
        loss, grads = jax.value_and_grad(_loss)(trainable, frozen, x)
        updates, state = opt.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state, loss

    args = (trainable, frozen, opt.init(trainable), _x(layout))
    return jax.jit(step).lower(*args).compile().as_text()


def collectives(text: str) -> dict[str, list[tuple[str, int]]]:
    """`(dtype, bytes)` of every collective's result in a compiled module, by kind (the
    layer loop's body counted once: both steps compared have the same loop)."""
    out: dict[str, list] = {"all-gather": [], "all-reduce": [], "reduce-scatter": [],
                            "all-to-all": [], "collective-permute": []}
    for line in text.splitlines():
        for kind in out:
            m = re.search(r"= (\(?[^=]*?) %s(?:-start)?\(" % kind, line)
            if m:
                for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
                    out[kind].append((dtype, n * BYTES.get(dtype, 4)))
    return out


def _total(c: dict) -> int:
    return sum(b for kind in c.values() for _, b in kind)


def test_tensor_parallel_qlora_moves_what_the_dense_step_moves():
    dense = _dense_collectives(TP)
    nf4 = collectives(_adam_step_hlo(TP, "nf4"))
    assert dense["all-gather"] == [] and dense["all-reduce"]  # the dense TP step's own
    assert nf4["all-gather"] == []  # no codes, scales or factors gathered
    assert _total(nf4) <= 1.5 * _total(dense), (_total(nf4), _total(dense))


def test_tensor_parallel_control_gathers_the_codes(monkeypatch):
    """The control: the plain dot on codes gathered whole (lorax before) moves every
    layer's codes, and fails the bound above."""
    dense = _dense_collectives(TP)
    monkeypatch.setattr(quant_rules, "_partitioned", lambda plan, x: False)
    jax.clear_caches()
    control = collectives(_adam_step_hlo(TP, "nf4"))
    assert any(dtype == "u8" for dtype, _ in control["all-gather"])
    assert _total(control) > 1.5 * _total(dense)


def _u8_gathers(text: str) -> list[int]:
    return [b for dtype, b in collectives(text)["all-gather"] if dtype == "u8"]


def test_fsdp_by_tp_gathers_codes_along_fsdp_only(monkeypatch):
    """2 x 4 mesh: each gathered block of codes is a quarter of the layer's (split along
    `tp`, whole along `fsdp`); all-gather bytes are <= 0.2x the dense step's and no float
    array the size of a weight shard crosses devices."""
    layer_codes = D * H // 2  # nf4: half a byte a value
    shard = D * H // 8 * 4  # one device's float32 slice of one layer's weight
    dense = _dense_collectives(FSDP_TP)
    text = _adam_step_hlo(FSDP_TP, "nf4")
    nf4 = collectives(text)
    assert sorted(set(_u8_gathers(text))) == [layer_codes // 4]
    floats = [b for dtype, b in nf4["all-gather"] if dtype in ("f32", "bf16")]
    assert max(floats) < shard
    ratio = sum(b for _, b in nf4["all-gather"]) / sum(b for _, b in dense["all-gather"])
    assert ratio <= 0.2, ratio
    # The control gathers whole layers of codes (along `tp` too).
    monkeypatch.setattr(quant_rules, "_partitioned", lambda plan, x: False)
    jax.clear_caches()
    assert max(_u8_gathers(_adam_step_hlo(FSDP_TP, "nf4"))) == layer_codes


@pytest.mark.parametrize("layout", [TP, FSDP_TP], ids=["tp", "fsdp-x-tp"])
@pytest.mark.parametrize("qtype", ["nf4", "nf4-dq", "q4_1"])  # q4_1: blocks with mins
def test_tensor_parallel_values_and_gradients_equal_one_devices(layout, qtype):
    trainable, frozen = lorax.partition(_lora_params(layout, qtype), SPEC)
    loss, grads = jax.jit(jax.value_and_grad(_loss))(trainable, frozen, _x(layout))
    one = lorax.partition(jax.device_put(_lora_params(None, qtype), jax.devices()[0]), SPEC)
    loss1, grads1 = jax.jit(jax.value_and_grad(_loss))(*one, _x(None))
    assert_close(loss, loss1, rtol=2e-5)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        assert_close(g, g1, rtol=2e-5, atol=1e-7)


def test_int8_columns_cut_by_tp_suggest_a_block_size_that_works():
    """int8's default block is a whole column: row-parallel `down` (its input axis split
    8 ways) would cut it. The error names the block sizes that fit, and with one the
    tensor-parallel step equals one device's."""
    down = jax.device_put(jnp.ones((L, H, D)), NamedSharding(_mesh(TP[0]), TP[2]))
    with pytest.raises(ValueError, match=r"quantize: 'down': .*\(axis -2, 1 blocks of 1024\) "
                       r"8 ways.*or quantize with a block_size that divides 128\."):
        lorax.quantize({"down": down}, {"down": SPEC["down"]}, "int8")
    trainable, frozen = lorax.partition(_lora_params(TP, "int8", block_size=128), SPEC)
    assert frozen["down"].w.block_size == 128
    loss, grads = jax.jit(jax.value_and_grad(_loss))(trainable, frozen, _x(TP))
    one = _lora_params(None, "int8", block_size=128)
    loss1, grads1 = jax.jit(jax.value_and_grad(_loss))(*lorax.partition(one, SPEC), _x(None))
    assert_close(loss, loss1, rtol=2e-5)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        assert_close(g, g1, rtol=2e-5, atol=1e-7)


def test_shard_map_over_a_tensor_parallel_layout_sees_each_devices_codes():
    """Megatron's MLP written per device: the body gets each device's `up` columns and
    `down` rows as codes (an eighth of the layer's), the row-parallel sum a `psum`."""
    lp = _lora_params(TP, "nf4")
    layer = jax.tree.map(lambda v: v[0], lp)  # layer 0 of every leaf, codes included

    def body(p, x):
        return jax.lax.psum(jax.nn.gelu(x @ p["up"]) @ p["down"], "tp")

    specs = {"up": P(None, "tp"), "down": P("tp", None)}
    f = jax.shard_map(body, mesh=_mesh(("tp",)), in_specs=(specs, P()), out_specs=P())
    x = _x(None, (16, D))
    g = lorax.lora(f, on_materialize="error")
    jaxpr = jax.make_jaxpr(g)(layer, x).jaxpr
    inner = next(e for e in jaxpr.eqns if e.primitive.name == "shard_map").params["jaxpr"]
    codes = sorted(v.aval.shape for v in inner.invars if v.aval.dtype == jnp.uint8)
    # `up` (storage: output rows, blocks of the input) split by rows, `down` by blocks.
    assert codes == sorted([(H // 8, D // 64, 32), (D, H // 64 // 8, 32)])
    merged = lorax.merge_params(layer)
    assert_close(g(layer, x), jax.nn.gelu(x @ merged["up"]) @ merged["down"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_spec, w_spec, expected", [
    # column-parallel, activations replicated: the weight stays split, so does the output
    ((None, None), ("tp", None), ((None, None), ("tp", None), (None, "tp"), ())),
    # row-parallel: the activation follows the weight's split, partial sums reduced
    ((None, None), (None, "tp"), ((None, "tp"), (None, "tp"), (None, None), ("tp",))),
    # FSDP: the activation's batch axis is gathered out of the weight
    (("fsdp", None), ("fsdp", None), (("fsdp", None), (None, None), ("fsdp", None), ())),
    # FSDP x TP: `fsdp` gathered, `tp` kept
    (("fsdp", None), ("tp", "fsdp"), (("fsdp", None), ("tp", None), ("fsdp", "tp"), ())),
    # an activation split along an axis the weight keeps elsewhere gives it up
    ((None, "tp"), ("tp", None), ((None, None), ("tp", None), (None, "tp"), ())),
])
def test_split_contraction_decides_per_mesh_axis(x_spec, w_spec, expected):
    # x: (B=0, K=1); W storage: (N=2, K=1); out: (B, N)
    assert split_contraction(x_spec, w_spec, (0, 1), (2, 1), (0, 2)) == expected


def test_a_vmap_around_lora_on_a_tensor_parallel_layout():
    """The partitioned op has no batching rule; under `vmap` the codes are gathered whole
    instead, with the same values."""
    layer = jax.tree.map(lambda v: v[0], _lora_params(TP, "nf4"))
    f = lorax.lora(lambda p, x: jax.nn.gelu(x @ p["up"]) @ p["down"], on_materialize="error")
    xs = _x(None, (3, 16, D))
    y = jax.jit(jax.vmap(f, in_axes=(None, 0)))(layer, xs)
    merged = lorax.merge_params(layer)
    assert_close(y, jax.nn.gelu(xs @ merged["up"]) @ merged["down"], rtol=1e-5, atol=1e-6)
