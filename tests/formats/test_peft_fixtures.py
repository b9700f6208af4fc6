"""save_peft / load_peft against files and outputs real PEFT produced, without torch.

tests/data/peft/ holds a tiny Llama (torch names, f32), adapters PEFT saved, an adapter
lorax saved that PEFT then loaded, and the logits torch + PEFT gave for each
(tests/formats/test_peft_real.py writes them with LORAX_WRITE_PEFT_FIXTURES=1 and checks
they still hold). Here the model is `examples/shakespeare/llama.py` — plain JAX with
stacked `(layers, in, out)` kernels, nothing like the per-layer Flax tree the export
fixture was made from — so these check the `module_name` templates and layouts a
scanned model needs, both ways:

- import: PEFT's adapter (rsLoRA; per-kind and per-layer ranks and alphas; with and
  without the embedding layers' base weights) -> `load_peft` -> PEFT's logits;
- export: the same adapter lorax exported from the Flax tree, restacked for llama.py
  -> `save_peft` -> the same tensors and config PEFT loaded, and PEFT's logits;
- negative controls: a wrong layout, scale or layer numbering is far outside the
  tolerance, so the comparisons above can fail.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy

import lorax

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "peft"
TOL = 1e-4  # max |logits difference| with torch's: the same f32 model, JAX vs torch
BASE_NAME = "lorax-tests/tiny-llama"

# llama.py key path -> torch module name.
NAMES = {
    "layers/q": "model.layers.{layer}.self_attn.q_proj",
    "layers/k": "model.layers.{layer}.self_attn.k_proj",
    "layers/v": "model.layers.{layer}.self_attn.v_proj",
    "layers/o": "model.layers.{layer}.self_attn.o_proj",
    "layers/gate": "model.layers.{layer}.mlp.gate_proj",
    "layers/up": "model.layers.{layer}.mlp.up_proj",
    "layers/down": "model.layers.{layer}.mlp.down_proj",
    "embed": "model.embed_tokens",
    "lm_head": "lm_head",
}
# llama.py's kernels are x @ w (in, out); its embedding a (vocab, dim) table. Leaves
# named 'q', 'embed', ... say nothing, so the layout is given for each.
LAYOUT = {path: "in_out" for path in NAMES} | {"embed": "embedding"}
# llama.py layer key -> the torch module (under model.layers.<i>.) it comes from.
TORCH_LAYER = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
               "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj",
               "up": "mlp.up_proj", "down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def llama():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.shakespeare import llama

    return llama


@pytest.fixture(scope="module")
def model(llama):
    """`(cfg, llama.py params, torch state dict, input ids, jitted logits fns)`."""
    c = json.loads((DATA / "config.json").read_text())
    assert c["head_dim"] == c["hidden_size"] // c["num_attention_heads"]
    assert not c["tie_word_embeddings"] and not c["attention_bias"] and not c["mlp_bias"]
    cfg = llama.Config(n_layers=c["num_hidden_layers"], dim=c["hidden_size"],
                       hidden=c["intermediate_size"], n_heads=c["num_attention_heads"],
                       n_kv_heads=c["num_key_value_heads"], rope_theta=c["rope_theta"],
                       norm_eps=c["rms_norm_eps"], vocab=c["vocab_size"])
    state = safetensors.numpy.load_file(str(DATA / "base.safetensors"))

    def layer(i, key):
        w = state[f"model.layers.{i}.{TORCH_LAYER[key]}.weight"]
        return w if w.ndim == 1 else w.T  # torch Linear (out, in) -> llama.py (in, out)

    params = {
        "embed": state["model.embed_tokens.weight"],
        "layers": {key: np.stack([layer(i, key) for i in range(cfg.n_layers)]) for key in TORCH_LAYER},
        "final_norm": state["model.norm.weight"],
        "lm_head": state["lm_head.weight"].T,
    }
    ids = np.load(DATA / "input_ids.npy")
    base = jax.jit(lambda p, t: llama.logits(cfg, p, t))
    lora = jax.jit(lorax.lora(lambda p, t: llama.logits(cfg, p, t), on_materialize="error"))
    return cfg, params, state, ids, base, lora


def flax_tree(state, n_layers):
    """The base as `FlaxLlamaForCausalLM`'s param tree (the tree lorax_made was trained on)."""
    def linear(name):
        return {"kernel": state[name + ".weight"].T}

    layers = {str(i): {
        "input_layernorm": {"weight": state[f"model.layers.{i}.input_layernorm.weight"]},
        "post_attention_layernorm": {"weight": state[f"model.layers.{i}.post_attention_layernorm.weight"]},
        "self_attn": {p: linear(f"model.layers.{i}.self_attn.{p}")
                      for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "mlp": {p: linear(f"model.layers.{i}.mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj")},
    } for i in range(n_layers)}
    return {"model": {"embed_tokens": {"embedding": state["model.embed_tokens.weight"]},
                      "layers": layers, "norm": {"weight": state["model.norm.weight"]}},
            "lm_head": linear("lm_head")}


def restack(flax_lp, params):
    """A lorax adapter on the Flax tree as the same adapter on llama.py's stacked tree."""
    layers = flax_lp["model"]["layers"]
    n = len(layers)
    out = dict(params, layers=dict(params["layers"]))
    for key, torch_name in TORCH_LAYER.items():
        if "norm" in key:
            continue
        group, proj = torch_name.split(".")
        lws = [layers[str(i)][group][proj]["kernel"] for i in range(n)]
        assert len({lw.alpha for lw in lws}) == 1
        out["layers"][key] = lorax.LoraWeight(params["layers"][key], a=np.stack([lw.a for lw in lws]),
                                              b=np.stack([lw.b for lw in lws]), alpha=lws[0].alpha)
    emb, head = flax_lp["model"]["embed_tokens"]["embedding"], flax_lp["lm_head"]["kernel"]
    out["embed"] = lorax.LoraWeight(params["embed"], a=emb.a, b=emb.b, alpha=emb.alpha)
    out["lm_head"] = lorax.LoraWeight(params["lm_head"], a=head.a, b=head.b, alpha=head.alpha)
    return out


def max_diff(x, y) -> float:
    return float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max())


def report(what, diff):
    print(f"\n[peft-fixtures] {what}: max |diff| = {diff:.3g}")


def read(directory):
    return (json.loads((pathlib.Path(directory) / "adapter_config.json").read_text()),
            safetensors.numpy.load_file(str(pathlib.Path(directory) / "adapter_model.safetensors")))


def test_llama_py_base_matches_torch(model):
    _, params, _, ids, base, _ = model
    want = np.load(DATA / "base_logits.npy")
    diff = max_diff(base(params, ids), want)
    report("llama.py base vs torch", diff)
    assert diff <= TOL
    # The adapters' effect is far larger than the tolerance (the comparisons below can fail).
    for f in ("peft_made_logits.npy", "lorax_made_logits.npy"):
        assert max_diff(np.load(DATA / f), want) > 1000 * TOL


# ---------------------------------------------------------------- import

@pytest.mark.parametrize("adapter", ["peft_made", "peft_made_with_base_layers"])
def test_import_peft_made_onto_stacked_llama(model, adapter):
    cfg, params, _, ids, _, lora = model
    config, tensors = read(DATA / adapter)
    assert config["use_rslora"] and config["rank_pattern"] and config["alpha_pattern"]
    assert any(k.endswith(".base_layer.weight") for k in tensors) == (adapter != "peft_made")

    lp, spec = lorax.load_peft(DATA / adapter, params, module_name=NAMES, layout=LAYOUT)
    assert spec["layers"]["q"] == lorax.LoraSpec(4, spec["layers"]["q"].alpha, 1, 1)
    assert lp["layers"]["v"].rank == 2 and lp["embed"].rank == 4
    # rank_pattern {"layers.1.mlp.down_proj": 6}: layer 0's rank-4 factors are zero-padded.
    down = lp["layers"]["down"]
    assert down.rank == 6 and not np.asarray(down.a[0, 4:]).any() and np.asarray(down.a[1, 4:]).any()
    # Per-layer scales (alpha_pattern on layer 0's q) are folded into each layer's b.
    q = lp["layers"]["q"]
    for i, alpha in enumerate([16, 8]):
        name = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        torch_delta = alpha / np.sqrt(4) * tensors[name + ".lora_B.weight"] @ tensors[name + ".lora_A.weight"]
        np.testing.assert_allclose(np.asarray(q.materialize()[i] - q.w[i]).T, torch_delta,
                                   rtol=1e-5, atol=1e-6)

    diff = max_diff(lora(lp, ids), np.load(DATA / "peft_made_logits.npy"))
    report(f"import {adapter} onto llama.py vs PEFT", diff)
    assert diff <= TOL


# ---------------------------------------------------------------- export

@pytest.fixture(scope="module")
def lorax_made(model):
    """The adapter in lorax's format, on the Flax tree and restacked for llama.py."""
    cfg, params, state, *_ = model
    flax_lp, _ = lorax.load_adapter(DATA / "lorax_made.safetensors",
                                            flax_tree(state, cfg.n_layers))
    return flax_lp, restack(flax_lp, params)


def test_export_flax_tree_reproduces_the_files_peft_loaded(lorax_made, tmp_path):
    flax_lp, _ = lorax_made
    lorax.save_peft(tmp_path, flax_lp, base_model_name_or_path=BASE_NAME)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / f).read_bytes() == (DATA / "lorax_made" / f).read_bytes(), f


def test_export_stacked_llama_matches_what_peft_loaded(model, lorax_made, tmp_path):
    cfg, params, _, ids, _, lora = model
    _, lp = lorax_made
    want = np.load(DATA / "lorax_made_logits.npy")
    diff = max_diff(lora(lp, ids), want)
    report("llama.py with the restacked lorax_made adapter vs PEFT", diff)
    assert diff <= TOL

    lorax.save_peft(tmp_path, lp, module_name=NAMES, layout=LAYOUT, base_model_name_or_path=BASE_NAME)
    config, tensors = read(tmp_path)
    ref_config, ref_tensors = read(DATA / "lorax_made")
    assert tensors.keys() == ref_tensors.keys()
    for k in ref_tensors:
        assert tensors[k].dtype == ref_tensors[k].dtype, k
        np.testing.assert_array_equal(tensors[k], ref_tensors[k], err_msg=k)
    for field in ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "peft_type",
                  "task_type", "base_model_name_or_path"):
        assert config[field] == ref_config[field], field
    assert set(config["target_modules"]) == set(ref_config["target_modules"])
    # save_peft sorts its tensors: the stacked tree's file is the Flax tree's, byte for byte.
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / f).read_bytes() == (DATA / "lorax_made" / f).read_bytes(), f

    # And back: PEFT's files of it onto llama.py give PEFT's logits.
    back, _ = lorax.load_peft(tmp_path, params, module_name=NAMES, layout=LAYOUT)
    diff = max_diff(lora(back, ids), want)
    report("llama.py with load_peft(lorax_made) vs PEFT", diff)
    assert diff <= TOL


# ---------------------------------------------------------------- negative controls

def test_control_wrong_layout_on_import(model):
    """q is square (64, 64): torch's (out, in) read as llama.py's (in, out) fits but is wrong."""
    _, params, _, ids, _, lora = model
    want = np.load(DATA / "peft_made_logits.npy")
    lp, _ = lorax.load_peft(DATA / "peft_made", params, module_name=NAMES,
                            layout=LAYOUT | {"layers/q": "out_in"})
    diff = max_diff(lora(lp, ids), want)
    report("control: q loaded with layout='out_in'", diff)
    assert diff > 100 * TOL


def test_control_wrong_scale_on_import(model, tmp_path):
    """The same factors without use_rslora (alpha / r instead of alpha / sqrt(r))."""
    _, params, _, ids, _, lora = model
    shutil.copytree(DATA / "peft_made", tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["use_rslora"] = False
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    lp, _ = lorax.load_peft(tmp_path / "a", params, module_name=NAMES, layout=LAYOUT)
    diff = max_diff(lora(lp, ids), np.load(DATA / "peft_made_logits.npy"))
    report("control: use_rslora dropped", diff)
    assert diff > 100 * TOL


def test_control_wrong_layout_or_layer_order_on_export(model, lorax_made, tmp_path):
    cfg, params, _, ids, _, lora = model
    _, lp = lorax_made
    want = np.load(DATA / "lorax_made_logits.npy")
    _, ref = read(DATA / "lorax_made")
    n = cfg.n_layers

    def reversed_layers(path, layer):
        return NAMES[path] if layer is None else NAMES[path].format(layer=n - 1 - layer)

    cases = {
        "q exported with layout='out_in'": (NAMES, LAYOUT | {"layers/q": "out_in"}),
        "layers numbered in reverse": (reversed_layers, LAYOUT),
    }
    for what, (names, layout) in cases.items():
        d = tmp_path / what.replace(" ", "_")
        lorax.save_peft(d, lp, module_name=names, layout=layout)
        _, tensors = read(d)
        assert tensors.keys() == ref.keys()
        assert any(not np.array_equal(tensors[k], ref[k]) for k in ref), what
        # What PEFT would run from these files: read back with the right names and layout.
        back, _ = lorax.load_peft(d, params, module_name=NAMES, layout=LAYOUT)
        diff = max_diff(lora(back, ids), want)
        report(f"control: {what}", diff)
        assert diff > 100 * TOL, what
