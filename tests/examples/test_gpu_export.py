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
