"""Keras 3 (JAX backend) and KerasHub backbones through `model.stateless_call`, unmodified.

The trainable variables go in as a dict keyed by variable path (so targets read like
`"dense/kernel"`), the non-trainable ones as Keras keeps them; `training=True` returns
the updated BatchNorm statistics too, and those are compared with the reference as well.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")

import lorax  # noqa: E402

from .harness import check_lora_model  # noqa: E402

if keras.backend.backend() != "jax":
    pytest.skip("Keras runs another backend in this process", allow_module_level=True)


@pytest.fixture(autouse=True)
def _seeded():
    """Keras draws each model's initial weights from a process-wide seed that is random
    unless set: unseeded, 1 fresh process in 12 drew a mixed-bfloat16 model whose loss did
    not fall in three steps. Every test here builds the same model in every run."""
    keras.utils.set_random_seed(0)


def keras_apply(model, training=False):
    """`(apply, params)`: a pure function of the trainable variables, by path."""
    trainable, others = model.trainable_variables, [v.value for v in model.non_trainable_variables]

    def apply(params, x):
        out, new_others = model.stateless_call([params[v.path] for v in trainable], others, x,
                                               training=training)
        return (out, new_others) if training else out

    return apply, {v.path: v.value for v in trainable}


def test_functional_model():
    inp = keras.Input((6,))
    out = keras.layers.Dense(4)(keras.layers.Dense(8, activation="relu")(inp))
    apply, params = keras_apply(keras.Model(inp, out))
    check_lora_model(apply, params, (jnp.ones((3, 6)),), "kernel", expected_lora=2)


def test_sequential_conv_batchnorm_in_training_mode():
    model = keras.Sequential([
        keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
        keras.layers.ReLU(), keras.layers.Flatten(), keras.layers.Dense(5)])
    apply, params = keras_apply(model, training=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 3))
    check_lora_model(apply, params, (x,), "kernel", expected_lora=2)


def test_mixed_bfloat16_policy():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        inp = keras.Input((6,))
        out = keras.layers.Dense(4)(keras.layers.Dense(8, activation="relu")(inp))
        model = keras.Model(inp, out)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    apply, params = keras_apply(model)
    assert all(v.dtype == jnp.float32 for v in params.values())  # f32 variables, bf16 compute
    out = check_lora_model(apply, params, (jnp.ones((3, 6)),), "kernel", expected_lora=2,
                           rtol=2e-2, atol=2e-2)
    assert lorax.lora(apply)(out, jnp.ones((3, 6))).dtype == jnp.bfloat16


# -- KerasHub ----------------------------------------------------------------------------

IDS = {"token_ids": jnp.array([[1, 5, 9, 3, 0, 0]]),
       "padding_mask": jnp.array([[1, 1, 1, 1, 0, 0]])}


def _hub():
    return pytest.importorskip("keras_hub", reason="keras-hub is installed by scripts/test "
                               "(pip install --no-deps keras-hub)")


def test_keras_hub_gemma_backbone():
    """Gemma's (heads, embed, head_dim) q/k/v kernels get PEFT's factorisation."""
    hub = _hub()
    backbone = hub.models.GemmaBackbone(
        vocabulary_size=32, num_layers=2, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8)
    apply, params = keras_apply(backbone)
    lp = check_lora_model(apply, params, (IDS,), "kernel", rank=2, expected_lora=14, eager=False)
    q = lp["decoder_block_0/attention/query/kernel"]
    assert q.w.shape == (4, 16, 8) and q.m_axes == (-2,)
    assert q.b.shape == (16, 2) and q.a.shape == (2, 4, 8)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_keras_hub_gpt2_and_llama_backbones(name):
    hub = _hub()
    backbone = {
        "gpt2": lambda: hub.models.GPT2Backbone(
            vocabulary_size=32, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
            max_sequence_length=8),
        "llama": lambda: hub.models.LlamaBackbone(
            vocabulary_size=32, num_layers=2, num_query_heads=4, num_key_value_heads=2,
            hidden_dim=16, intermediate_dim=32),
    }[name]()
    apply, params = keras_apply(backbone)
    check_lora_model(apply, params, (IDS,), "kernel", rank=2,
                     expected_lora={"gpt2": 12, "llama": 14}[name])
