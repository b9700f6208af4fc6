"""google-tunix's Qwen3 and Llama3 (Flax NNX), unedited, on Hugging Face checkpoints read
by `lorax.load_safetensors`, through lorax (examples/tunix_lorax.py):

- the checkpoint in tunix's model state by tunix's own name maps and einsum layouts,
  bitsandbytes NF4 and FP8 as their codes (relayout never dequantizes: bit for bit the
  same values), gives transformers' logits;
- `lorax.lora(tunix's model, on_materialize="error")` with factors on all seven
  projections: value and factor gradients equal to those on the dequantized weights,
  the compiled step's arguments exactly the codes, factors and batch;
- tunix's own `PeftTrainer` trains lorax's factors (`LoraModel`: `nnx.LoRAParam`).

tunix 0.1.7 rotates with RoPE base 1e6 whatever the config says (and has no `llama3`
rule): the references are transformers' logits on the same checkpoints with that RoPE
(tests/data/tunix, scripts/make_tunix_references.py); the fixtures' own references
(their configs' RoPE) are not what tunix computes, which one test records.

Needs tunix (Python 3.12, jax 0.12): `bash scripts/test-tunix`; skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix", reason="needs google-tunix: run `bash scripts/test-tunix`")

import optax  # noqa: E402
from tunix.sft import metrics_logger, peft_trainer  # noqa: E402

import lorax  # noqa: E402
from examples import tunix_lorax as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODELS, CKPTS = ROOT / "tests" / "data" / "models", ROOT / "tests" / "data" / "checkpoints"
REFS = ROOT / "tests" / "data" / "tunix"
# The fixtures' RoPE is not tunix's: tunix_config warns, as it should, on every load.
pytestmark = pytest.mark.filterwarnings("ignore:tunix 0.1.7")
CASES = {  # name -> (checkpoint directory, load_safetensors options)
    "qwen3": (MODELS / "qwen3", {}),
    "llama3": (MODELS / "llama3", {}),
    "llama3_bnb4": (MODELS / "llama3_bnb4", {}),  # bitsandbytes NF4, double quantization
    "qwen3_nf4": (MODELS / "qwen3", {"quantize": "nf4"}),  # quantized as it is read
    "fp8_block": (CKPTS / "fp8_block", {}),  # FP8 e4m3, 128x128 blocks (DeepSeek-V3 layout)
    "ct_fp8_channel": (CKPTS / "ct_fp8_channel", {}),  # compressed-tensors FP8, per channel
}
SEVEN = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _is_q(x):
    return isinstance(x, lorax.QuantizedArray)


def _dense(tree):
    """`tree` with every QuantizedArray replaced by its float32 value (materialised)."""
    return jax.tree.map(lambda x: x.dequantize(jnp.float32) if _is_q(x) else x, tree, is_leaf=_is_q)


def _projections(state):
    """{(layer, name): weight} for the seven projections of every layer."""
    out = {}
    for i, layer in state["layers"].items():
        for part in layer.values():
            out.update({(i, k): v.get("w", v.get("kernel")) for k, v in part.items() if k in SEVEN})
    return out


def _library_weights(path):
    """The writing library's float32 dequantization of each quantized weight, as the
    format fixture keeps it (reference.safetensors: `<name>.weight`; `@native` aside)."""
    ref, _ = lorax.load_safetensors(path / "reference.safetensors")
    return {k: v for k, v in ref.items() if k.endswith(".weight")}


def _tokens(name, batch=2, length=12):
    if (REFS / f"{name}.npz").exists():
        return jnp.asarray(np.load(REFS / f"{name}.npz")["input_ids"])
    vocab = lorax.load_safetensors(CASES[name][0])[1]["vocab_size"]
    return jax.random.randint(jax.random.PRNGKey(7), (batch, length), 0, vocab)


# Every format fixture of the checkpoint reader that is a whole model (tests/data/checkpoints:
# Llama-shaped, made by bitsandbytes, compressed-tensors, transformers' FP8, GPTQ, AWQ).
FORMATS = {d.name: (d, {}) for d in sorted(CKPTS.iterdir())
           if (d / "config.json").exists() and d.name != "gptq_desc_act"}


# -- the checkpoint in tunix's layout --------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "llama3", "llama3_bnb4"])
def test_logits_equal_transformers(name):
    graphdef, state, _ = tl.load(CASES[name][0])
    ref = np.load(REFS / f"{name}.npz")
    got = jax.jit(lorax.lora(tl.logits_fn(graphdef), on_materialize="error"))(
        state, jnp.asarray(ref["input_ids"]))
    delta = float(np.abs(np.asarray(got) - ref["logits"]).max())
    print(f"{name}: max |logits - transformers'| = {delta:.2e}")
    assert delta <= 1e-4
    if name.endswith("bnb4"):  # every projection is the checkpoint's NF4 codes
        assert all(_is_q(w) and w.qtype == "bnb_nf4" for w in _projections(state).values())


def test_tunix_rope_is_not_the_checkpoints():
    """tunix 0.1.7 ignores `rope_theta` (base 1e6) and Llama 3's `llama3` rule:
    `tunix_config` warns, and the logits are not those of the fixtures' own config."""
    for name in ("qwen3", "llama3"):
        tensors, hf = lorax.load_safetensors(MODELS / name)
        with pytest.warns(UserWarning, match="RoPE base 1e6"):
            graphdef, state, _ = tl.tunix_state(tensors, hf)
        ref = np.load(MODELS / name / "reference.npz")
        got = jax.jit(lorax.lora(tl.logits_fn(graphdef)))(state, jnp.asarray(ref["input_ids"]))
        assert np.abs(np.asarray(got) - ref["logits"]).max() > 0.1


@pytest.mark.parametrize("name", sorted({**CASES, **FORMATS}))
def test_codes_in_tunix_layout_are_the_checkpoints_values(name):
    """Each quantized weight, relaid into tunix's layout on its codes, dequantizes bit for
    bit to the checkpoint's own dequantized weight in that layout (and to the writing
    library's dequantization, where the fixture keeps it)."""
    path, options = {**CASES, **FORMATS}[name]
    tensors, hf = lorax.load_safetensors(path, **options)
    _, state, cfg = tl.tunix_state(tensors, hf)
    dense = tl.tunix_state({k: _dense(v) for k, v in tensors.items()}, hf)[1]
    got, want = jax.tree.leaves(state, is_leaf=_is_q), jax.tree.leaves(dense)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(_dense(g)), np.asarray(w))
    if (path / "reference.safetensors").exists():  # the writing library's dequantization
        ref = _library_weights(path)
        lib = tl.tunix_state({**tensors, **ref}, hf)[1]
        for g, w in zip(got, jax.tree.leaves(lib, is_leaf=_is_q), strict=True):
            if _is_q(g):
                np.testing.assert_array_equal(np.asarray(g.dequantize(w.dtype)), np.asarray(w))
    n_q = sum(_is_q(w) for w in _projections(state).values())
    assert n_q == (0 if name in ("qwen3", "llama3", "bf16_sharded") else 7 * cfg.num_layers)


def test_gptq_act_order_is_refused_by_name():
    """GPTQ act-order keeps its rows in stored order (a `RowOrdered` around the codes):
    no other layout of those codes reads the same, so the load says which weight."""
    tensors, hf = lorax.load_safetensors(CKPTS / "gptq_desc_act")
    with pytest.raises(ValueError, match=r"_proj.weight -> layers.0.*RowOrdered"):
        tl.tunix_state(tensors, hf)


@pytest.mark.parametrize("name", ["fp8_block", "bnb_nf4_dq", "gptq_asym", "awq_gemm"])
def test_logits_on_codes_equal_the_writing_librarys_weights(name):
    """tunix's model on the codes against tunix's model on the writing library's own
    float32 dequantization of them (the fixture's reference.safetensors)."""
    tensors, hf = lorax.load_safetensors(CKPTS / name)
    ref = _library_weights(CKPTS / name)
    assert ref and all(r.dtype == jnp.float32 for r in ref.values())
    graphdef, state, _ = tl.tunix_state(tensors, hf)
    lib_state = tl.tunix_state({**tensors, **ref}, hf)[1]
    f = jax.jit(lorax.lora(tl.logits_fn(graphdef), on_materialize="error"))
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, hf["vocab_size"])
    got, want = np.asarray(f(state, tokens)), np.asarray(f(lib_state, tokens))
    delta = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"{name}: max |logits(codes) - logits(library's weights)| / max = {delta:.1e}")
    assert delta <= 1e-5


@pytest.mark.parametrize("qtype,options", [
    ("nf4", {}), ("bnb_nf4", {"double_quant": True}), ("bnb_fp4", {}), ("fp8_e4m3", {}),
    ("int8", {}), ("bnb_int8", {}), ("int4_zp", {"block_size": 32}), ("s4", {"block_size": 32}),
])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_relayout_is_bit_exact(qtype, options, head_dim):
    """torch's (out, in) weights into tunix's q (embed, heads, head_dim), o (heads,
    head_dim, embed) and MLP (in, out) layouts, on the codes; bit for bit."""
    heads, embed = 8, 256
    key = jax.random.PRNGKey(head_dim)
    for torch_shape, new in [((heads * head_dim, embed), (embed, heads, head_dim)),
                             ((embed, heads * head_dim), (heads, head_dim, embed)),
                             ((embed, 2 * embed), None)]:
        q = lorax.QuantizedArray.from_dense(jax.random.normal(key, torch_shape), qtype, axis=-1,
                                            **options)
        r = tl.relayout(q, (1, 0), new)
        want = q.dequantize(jnp.float32).T
        want = want if new is None else want.reshape(new)
        np.testing.assert_array_equal(np.asarray(r.dequantize(jnp.float32)), np.asarray(want))
        assert r.qtype == q.qtype and r.nbytes <= q.nbytes + 4 * r.scales.size


def test_double_quantization_follows_whole_head_splits():
    """Llama / Qwen's head_dim 128 with blocks of 64: the q/k/v split falls on whole
    groups of 256 scales, which stay double-quantized; o_proj's blocks regroup and its
    scales are expanded (exactly)."""
    w = jax.random.normal(jax.random.PRNGKey(0), (4 * 128, 512))
    q = lorax.QuantizedArray.from_dense(w, "bnb_nf4", axis=-1, double_quant=True)
    qkv = tl.relayout(q, (1, 0), (512, 4, 128))
    # The same bytes, but for the offset (one float32 per group row) repeated per head.
    assert qkv.scale_scales is not None and qkv.nbytes == q.nbytes + 4 * (4 - 1)
    q_o = lorax.QuantizedArray.from_dense(w.T, "bnb_nf4", axis=-1, double_quant=True)
    o = tl.relayout(q_o, (1, 0), (4, 128, 512))
    assert o.scale_scales is None and o.scales.dtype == jnp.float32
    for got, src, shape in ((qkv, q, (512, 4, 128)), (o, q_o, (4, 128, 512))):
        np.testing.assert_array_equal(np.asarray(got.dequantize()),
                                      np.asarray(src.dequantize().T.reshape(shape)))


def test_relayout_refuses_what_blocks_cannot_take():
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 64))
    gguf = lorax.QuantizedArray.from_dense(w, "q4_0", axis=-1)  # fixed blocks of 32
    with pytest.raises(ValueError, match="cannot be cut"):
        tl.relayout(gguf, (1, 0), (4, 16, 64))
    with pytest.raises(ValueError, match="merges axes"):
        tl.relayout(lorax.QuantizedArray.from_dense(w, "nf4", axis=-1), None, (4096, 1))


# -- lorax.lora over tunix's model ----------------------------------------------------------


def _lora(name, rank=4):
    """tunix's model from a checkpoint with rank-`rank` factors on the seven projections
    (both factors random: b = 0 would zero a's gradient), as `(loss, trainable, frozen,
    tokens, spec, graphdef)`."""
    graphdef, state, _ = tl.load(CASES[name][0], **CASES[name][1])
    tokens = _tokens(name)
    spec = lorax.simple_spec(state, targets=tl.PROJECTIONS, rank=rank)
    spec = lorax.infer_layout(tl.logits_fn(graphdef), state, spec, tokens)
    trainable, frozen = lorax.partition(lorax.init_lora(state, spec, jax.random.PRNGKey(0)), spec)
    leaves, treedef = jax.tree.flatten(trainable)
    trainable = treedef.unflatten([0.1 * jax.random.normal(jax.random.PRNGKey(i), x.shape, x.dtype)
                                   for i, x in enumerate(leaves)])
    logits = lorax.lora(tl.logits_fn(graphdef), on_materialize="error")

    def loss(trainable, frozen, tokens):
        lg = jax.nn.log_softmax(logits(lorax.combine(trainable, frozen), tokens)[:, :-1])
        return -jnp.mean(jnp.take_along_axis(lg, tokens[:, 1:, None], axis=-1))

    return loss, trainable, frozen, tokens, spec, graphdef


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", ["llama3_bnb4", "qwen3_nf4", "fp8_block"])
def test_lora_step_on_codes(name):
    loss, trainable, frozen, tokens, spec, _ = _lora(name)
    assert sum(isinstance(s, lorax.LoraSpec) for s in jax.tree.leaves(spec)) == 7 * len(
        frozen["layers"])
    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(trainable, frozen, tokens)
    # The same step on the materialised (dequantized, float32) weights.
    value_d, grads_d = step(trainable, _dense(frozen), tokens)
    np.testing.assert_allclose(value, value_d, rtol=1e-5)
    worst = max(float(jnp.abs(g - d).max() / jnp.abs(d).max())
                for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_d), strict=True))
    assert worst <= 1e-5, worst
    # The compiled step's arguments are the codes (and scales), the factors and the batch.
    args = step.lower(trainable, frozen, tokens).compile().memory_analysis().argument_size_in_bytes
    codes = sum(w.nbytes for w in jax.tree.leaves(frozen, is_leaf=_is_q) if _is_q(w))
    dense_args = step.lower(trainable, _dense(frozen), tokens).compile().memory_analysis()
    print(f"{name}: step arguments {args} B = factors {_nbytes(trainable)} + frozen "
          f"{_nbytes(frozen)} (quantized {codes}) + batch {tokens.nbytes}; dequantized "
          f"{dense_args.argument_size_in_bytes} B; worst relative gradient delta {worst:.1e}")
    assert args == _nbytes(trainable) + _nbytes(frozen) + tokens.nbytes
    # One SGD step lowers the loss.
    updated = jax.tree.map(lambda p, g: p - 0.5 * g, trainable, grads)
    assert float(jax.jit(loss)(updated, frozen, tokens)) < float(value)


@pytest.mark.parametrize("name", ["llama3_bnb4", "qwen3"])
def test_peft_trainer_trains_lorax_factors(name, tmp_path):
    _, trainable, frozen, tokens, spec, graphdef = _lora(name)
    model = tl.LoraModel(graphdef, lorax.combine(trainable, frozen), spec)
    base_before = [np.asarray(v[...]) for v in model.base]
    options = metrics_logger.MetricsLoggerOptions(log_dir=str(tmp_path))
    config = peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=3,
                                         metrics_logging_options=options)
    trainer = peft_trainer.PeftTrainer(model, optax.adam(1e-2), config)
    trainer = trainer.with_gen_model_input_fn(
        lambda x: tl.model_inputs(x.input_tokens, x.input_mask))
    batch = peft_trainer.TrainingInput(input_tokens=tokens, input_mask=jnp.ones(tokens.shape, bool))
    trainer.train([batch] * 3)
    losses = np.asarray(trainer.metrics_logger.get_metric_history("", "loss", "train"))
    print(f"{name}: PeftTrainer losses {losses}")
    assert trainer._lora_enabled and len(losses) == 3 and (np.diff(losses) < 0).all()
    for before, v in zip(base_before, model.base, strict=True):  # the base (codes) is left alone
        np.testing.assert_array_equal(before, np.asarray(v[...]))
