"""The accelerator recipe lowers for a GPU on a machine without one: `jax.export` of the
Llama QLoRA training step (lorax, Adam, bf16) for the `cuda` platform, with each attention
path that runs without cuDNN and each remat choice. (cuDNN's own attention call needs
cuDNN present to lower: it is checked on a card by `benchmarks.accelerator`.)"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import export

import lorax

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import scale  # noqa: E402


def _exported_step(attention: str, remat: str) -> export.Exported:
    cfg = scale.config("tiny", attention=attention, remat=remat)
    params, spec = scale.build(cfg, "qlora-nf4", jnp.bfloat16)
    trainable, frozen = lorax.partition(params, spec)
    optimizer = optax.adam(1e-4)
    state = jax.eval_shape(optimizer.init, trainable)
    apply = lorax.lora(lambda p, w: scale.LLAMA.loss(cfg, p, w))

    def step(trainable, frozen, state, windows):
        value, grads = jax.value_and_grad(lambda t: apply(lorax.combine(t, frozen), windows))(trainable)
        updates, state = optimizer.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state, value

    windows = jax.ShapeDtypeStruct((1, 65), jnp.int32)
    return export.export(jax.jit(step), platforms=["cuda"])(trainable, frozen, state, windows)


@pytest.mark.parametrize("attention, remat", [("chunked", "layer"), ("xla", "dots"), ("xla", "none")])
def test_the_qlora_step_exports_for_cuda(attention, remat):
    exported = _exported_step(attention, remat)
    assert exported.platforms == ("cuda",)
    text = exported.mlir_module()
    assert "stablehlo.while" in text  # the layers stay one scanned loop
    # The frozen base crosses as codes: uint8 arguments, no bf16 weight-sized input.
    ins = [str(a.dtype) for a in exported.in_avals]
    assert "uint8" in ins


# -- the recipe's remat in the layer loop: no barrier -------------------------------------------
#
# `jax.checkpoint(prevent_cse=True)` puts an optimization barrier on the recomputation's
# inputs, a layer's slices of the frozen stacks among them. XLA's pipelined host
# offloading (which moves the next layer's host-resident codes in while this layer
# computes) does not cross it: the backward loop, behind the barrier, then waits for each
# layer's copy (benchmarks/gpu_compile.py shows it compiled for a GPU). Under `lax.scan`
# the barrier is not needed; unrolled layers keep it (XLA would otherwise merge the
# recomputation with the forward pass and keep every layer's activations).


def _barriers(layers: str) -> int:
    """Optimization barriers in the tiny Llama QLoRA gradient exported for `cuda`."""
    cfg = scale.config("tiny", attention="xla", remat="layer")
    params, spec = scale.build(cfg, "qlora-nf4", jnp.bfloat16, layers)
    trainable, frozen = lorax.partition(params, spec)
    apply = lorax.lora(lambda p, w: scale.LLAMA.loss(cfg, p, w))
    grad = jax.grad(lambda t, f, w: apply(lorax.combine(t, f), w))
    windows = jax.ShapeDtypeStruct((1, 65), jnp.int32)
    exported = export.export(jax.jit(grad), platforms=["cuda"])(trainable, frozen, windows)
    return exported.mlir_module().count("stablehlo.optimization_barrier")


def test_the_scanned_layers_recompute_without_a_barrier_and_unrolled_ones_keep_it(monkeypatch):
    assert _barriers("scan") == 0
    # One per unrolled layer's recomputation (tiny: 2 layers).
    assert _barriers("unrolled") >= scale.config("tiny").n_layers
    # The control: the scanned layer under a barrier-keeping checkpoint is counted.
    remat = scale.LLAMA.remat
    monkeypatch.setattr(scale.LLAMA, "remat", lambda cfg, fn, **_: remat(cfg, fn))
    assert _barriers("scan") >= 1
