"""The main job's Llama on a mesh of Explicit axes (`jax.make_mesh`'s default), through
lorax: FSDP (weights stored split, regathered per layer with `reshard`), Megatron's tensor
parallelism (row-parallel products told their `out_sharding`) and both on a 2 x 4 mesh, on
8 simulated devices. Values and factor gradients equal one device's on the materialised
weights; the factors keep their types through the step; QLoRA's codes stay codes."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import lorax
from conftest import assert_close
from examples.shakespeare import llama
from lora_testing import tiny_llama

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS from tests/conftest.py)")

RANK = 4
ADAPTED = llama.COLUMN + llama.ROW
# layout: (mesh shape, axis names, Layout, how weights are stored: name -> spec of a
# stacked (layers, in, out) kernel).
LAYOUTS = {
    "fsdp": ((8,), ("fsdp",), llama.Layout(batch="fsdp"), lambda n: P(None, None, "fsdp")),
    "tp": ((8,), ("tp",), llama.Layout(tp="tp"),
           lambda n: P(None, None, "tp") if n in llama.COLUMN else P(None, "tp", None)),
    "fsdp-tp": ((2, 4), ("fsdp", "tp"), llama.Layout(batch="fsdp", tp="tp"),
                lambda n: P(None, "fsdp", "tp") if n in llama.COLUMN else P(None, "tp", "fsdp")),
}


def _model():
    cfg, params = tiny_llama(jax.random.PRNGKey(0), n_layers=2, dim=64, hidden=128,
                             n_heads=8, n_kv_heads=8, vocab=64)
    windows = jax.random.randint(jax.random.PRNGKey(1), (8, 17), 0, cfg.vocab)
    return cfg, params, windows


def _spec(params, dora=False):
    """Rank `RANK` on the seven projections (one adapter per layer), the rest frozen."""
    return lorax.simple_spec(params, targets=r"/(q|k|v|o|gate|up|down)$",
                             rank=lorax.LoraSpec(RANK, batch_ndim=1, dora=dora))


def _stored(path, x, layout):
    """How `layout` stores a parameter: kernels as `LAYOUTS` says; under FSDP norms and
    the embedding split along their last axis."""
    key = jax.tree_util.keystr(path)
    name = key.split("'")[-2]
    if "layers" in key and name in ADAPTED:
        return LAYOUTS[layout][3](name)
    return P(*[None] * (x.ndim - 1), "fsdp") if "fsdp" in LAYOUTS[layout][1] else P()


def _lora(params, mesh=None, qtype=None):
    """`quantize` with `qtype` "nf4" (QLoRA), then `init_lora` ("dora": DoRA) (on `mesh`:
    the factors placed from the weights), `b` made nonzero so no gradient is trivially
    zero; the values are drawn the same on any mesh."""
    dora = qtype == "dora"
    qtype = None if dora else qtype
    if qtype:
        # Blocks of 8: over TP x8 the row-parallel o has 64 / 8 inputs a device.
        params = lorax.quantize(params, _spec(params), qtype, block_size=8)
    lp = lorax.init_lora(params, _spec(params, dora), jax.random.PRNGKey(2))
    for i, name in enumerate(ADAPTED):
        w = lp["layers"][name]
        b = 0.1 * jax.random.normal(jax.random.PRNGKey(3 + i), w.b.shape)
        b = b if mesh is None else jax.device_put(b, w.b.sharding)
        lp["layers"][name] = eqx.tree_at(lambda w: w.b, w, b)
    return lp


def _step(cfg, frozen, windows):
    apply = lorax.lora(lambda p, w: llama.loss(cfg, p, w), on_materialize="error")
    return jax.value_and_grad(lambda t: apply(lorax.combine(t, frozen), windows))


@pytest.fixture(scope="module")
def reference():
    cfg, params, windows = _model()
    steps = {}
    for qtype in (None, "nf4", "dora"):  # one device, each method
        spec = _spec(params, qtype == "dora")
        trainable, frozen = lorax.partition(_lora(params, qtype=qtype), spec)
        steps[qtype] = jax.jit(lambda t: _step(cfg, frozen, windows)(t))(trainable)
    return steps


# One case per method by default (each layout in one of them); the rest are slow.
SLOW = pytest.mark.slow
@pytest.mark.parametrize(("layout", "qtype"), [
    pytest.param("fsdp", None, marks=SLOW), pytest.param("tp", None, marks=SLOW),
    ("fsdp-tp", None), pytest.param("fsdp", "nf4", marks=SLOW), ("tp", "nf4"),
    ("fsdp", "dora"), pytest.param("tp", "dora", marks=SLOW)])
def test_llama_under_explicit_axes_matches_one_device(layout, qtype, reference):
    shape, names, lay, _ = LAYOUTS[layout]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    cfg, params, windows = _model()
    cfg = cfg._replace(layout=lay)
    placed = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, NamedSharding(mesh, _stored(path, x, layout))), params)
    with jax.set_mesh(mesh):
        lp = _lora(placed, mesh, qtype)
        if qtype == "nf4":  # the codes typed as their weight is stored
            q = lp["layers"]["q"].w
            assert isinstance(q, lorax.QuantizedArray)
            assert q.sharding.spec == LAYOUTS[layout][3]("q")
        trainable, frozen = lorax.partition(lp, _spec(params, qtype == "dora"))
        w = jax.device_put(windows, NamedSharding(mesh, P(lay.batch)))
        value, grads = jax.jit(lambda t, w: _step(cfg, frozen, w)(t))(trainable, w)
    for name in ADAPTED:  # gradients typed as the factors they belong to
        for part in ("a", "b"):
            assert (getattr(grads["layers"][name], part).sharding.spec
                    == getattr(trainable["layers"][name], part).sharding.spec)
    ref_value, ref_grads = reference[qtype]
    assert_close(value, ref_value, rtol=1e-5)
    parts = ("a", "b", "m") if qtype == "dora" else ("a", "b")
    for name in ADAPTED:
        for part in parts:
            assert_close(getattr(grads["layers"][name], part),
                         getattr(ref_grads["layers"][name], part), rtol=1e-5, atol=1e-7)
