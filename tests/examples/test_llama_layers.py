"""The main job's Llama with its layers unrolled (a list of per-layer weights) against the
stacked layers under `lax.scan`: the same values and gradients, through lorax (LoRA and
QLoRA) too, and, in the compiled step, no per-layer weight sliced out of a stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lorax
from benchmarks.layers import weight_slices
from conftest import assert_close
from examples.shakespeare import llama
from lora_testing import tiny_llama

# Shapes no activation or other buffer of the step has, so a slice of this shape in the
# compiled program is a layer's weight taken out of its stack.
DIM, HIDDEN, LAYERS = 48, 80, 3


def _model(remat: str):
    cfg, params = tiny_llama(jax.random.PRNGKey(0), n_layers=LAYERS, dim=DIM, hidden=HIDDEN,
                             n_heads=4, n_kv_heads=2, vocab=64)
    windows = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, cfg.vocab)
    return cfg._replace(remat=remat), params, windows


def _restacked(layers_grads):
    """Per-layer gradients stacked back along the layer axis, to compare with the scan's."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers_grads)


def test_unstack_layers_makes_a_list_of_the_slices_and_leaves_the_input_alone():
    _, params, _ = _model("layer")
    before = jax.tree.map(np.asarray, params)
    flat = llama.unstack_layers(params)
    assert isinstance(flat["layers"], list) and len(flat["layers"]) == LAYERS
    for i, layer in enumerate(flat["layers"]):
        jax.tree.map(lambda a, s: np.testing.assert_array_equal(a, s[i]), layer, params["layers"])
    assert flat["embed"] is params["embed"]
    jax.tree.map(np.testing.assert_array_equal, params, before)
    again = llama.unstack_layers(flat)["layers"]  # already a list: the same layers
    assert len(again) == LAYERS and all(a is b for a, b in zip(again, flat["layers"]))


def test_unstack_layers_names_a_leaf_without_the_layer_axis():
    _, params, _ = _model("layer")
    params["layers"]["mlp_norm"] = params["layers"]["mlp_norm"][0]  # (dim,): not stacked
    with pytest.raises(ValueError, match=r"layers\['mlp_norm'\]: 48, layers\['o'\]: 3"):
        llama.unstack_layers(params)


# The other remat choices are slow (CI time): test_llama_attention checks that each gives
# remat "layer"'s values and gradients.
@pytest.mark.parametrize("remat", ["layer", *(pytest.param(r, marks=pytest.mark.slow)
                                              for r in ("none", "dots"))])
def test_unrolled_layers_give_the_scanned_values_and_gradients(remat):
    cfg, params, windows = _model(remat)
    value_and_grad = jax.jit(jax.value_and_grad(lambda p: llama.loss(cfg, p, windows)))
    value, grads = value_and_grad(params)
    u_value, u_grads = value_and_grad(llama.unstack_layers(params))
    assert_close(u_value, value, rtol=1e-6)
    u_grads = dict(u_grads, layers=_restacked(u_grads["layers"]))
    jax.tree.map(lambda u, s: assert_close(u, s, rtol=1e-5), u_grads, grads)


def _lora_step(trainable, frozen, cfg, windows):
    """Loss and factor gradients of the lorax step."""
    apply = lorax.lora(lambda p, w: llama.loss(cfg, p, w))
    return jax.jit(jax.value_and_grad(lambda t: apply(lorax.combine(t, frozen), windows)))(trainable)


def _partitioned(params, qtype, batch_ndim):
    spec = lorax.simple_spec(params, targets=r"/(q|k|v|o|gate|up|down)$",
                             rank=lorax.LoraSpec(4, batch_ndim=batch_ndim))
    # Blocks along each matrix's input axis: the same codes stacked or per layer.
    params = lorax.quantize(params, spec, qtype, block_size=16, min_size=0) if qtype else params
    return lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(2)), spec)


@pytest.mark.parametrize("qtype", [None, "nf4"])
def test_unrolled_layers_under_lorax_give_the_scanned_values_and_factor_gradients(qtype):
    cfg, params, windows = _model("layer")
    trainable, frozen = _partitioned(params, qtype, 1)
    # `b` non-zero too, so the factors' gradients depend on every part of the rule.
    trainable = jax.tree.map(lambda x: x + 0.01, trainable)
    u_trainable, u_frozen = _partitioned(llama.unstack_layers(params), qtype, 0)
    # The same factors as the stacked ones, layer by layer.
    u_trainable["layers"] = [jax.tree.map(lambda u, s: s[i], u, trainable["layers"])
                             for i, u in enumerate(u_trainable["layers"])]
    if qtype:  # nothing dense is left of the layers' matrices in either
        assert not [x for x in jax.tree.leaves(u_frozen["layers"]) if x.ndim == 2
                    and jnp.issubdtype(x.dtype, jnp.floating) and x.size >= DIM * DIM]
    value, grads = _lora_step(trainable, frozen, cfg, windows)
    u_value, u_grads = _lora_step(u_trainable, u_frozen, cfg, windows)
    assert_close(u_value, value, rtol=1e-6)
    restacked = _restacked(u_grads["layers"])
    jax.tree.map(lambda u, s: assert_close(u, s, rtol=1e-5), restacked, grads["layers"])


def _slices_of_weight_shape(params, spec) -> int:
    """The compiled lorax Adam step's slices, copies and dynamic slices whose result is a
    layer's matrix with a unit layer axis: weights taken out of a stack."""
    trainable, frozen = lorax.partition(lorax.init_lora(params, spec, jax.random.PRNGKey(2)), spec)
    cfg, _, windows = _model("none")
    apply = lorax.lora(lambda p, w: llama.loss(cfg, p, w))
    opt = optax.adam(1e-3)

    def step(trainable, state):
        grads = jax.grad(lambda t: apply(lorax.combine(t, frozen), windows))(trainable)
        updates, state = opt.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state

    text = jax.jit(step).lower(trainable, opt.init(trainable)).compile().as_text()
    kv = DIM // 2  # 4 heads, 2 of them key/value heads
    return weight_slices(text, {(DIM, DIM), (DIM, kv), (DIM, HIDDEN), (HIDDEN, DIM)})


def test_the_unrolled_step_reads_each_layer_s_weights_where_they_lie():
    _, params, _ = _model("none")
    target = r"/(q|k|v|o|gate|up|down)$"
    spec = lorax.simple_spec(params, targets=target, rank=lorax.LoraSpec(4, batch_ndim=1))
    # The control: under `lax.scan`, each layer's 7 matrices are sliced out of their stacks.
    assert _slices_of_weight_shape(params, spec) >= 7
    unrolled = llama.unstack_layers(params)
    u_spec = lorax.simple_spec(unrolled, targets=target, rank=lorax.LoraSpec(4, batch_ndim=0))
    assert _slices_of_weight_shape(unrolled, u_spec) == 0
