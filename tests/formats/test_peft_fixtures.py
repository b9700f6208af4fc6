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
  tolerance, so the comparisons above can fail;
- tied embeddings (tests/data/peft/tied/): llama.py's default tied model (no 'lm_head':
  the logits use `embed.T`) with a LoRA on 'embed', exported to PEFT's embed_tokens
  *and* lm_head modules, what PEFT gave for it on the tied torch model, and back.
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from examples.shakespeare import serve  # noqa: E402  (its HF module names for llama.py)
TOL = 1e-4  # max |logits difference| with torch's: the same f32 model, JAX vs torch
BASE_NAME = "lorax-tests/tiny-llama"

# llama.py key path -> torch module name.
NAMES = {
    **serve.HF_MODULES,  # the main job's stacked kernels -> HF Llama modules
    "embed": "model.embed_tokens",
    "lm_head": "lm_head",
}
# llama.py's kernels are x @ w (in, out); its embedding a (vocab, dim) table. Leaves
# named 'q', 'embed', ... say nothing, so the layout is given for each.
LAYOUT = {path: "in_out" for path in NAMES} | {"embed": "embedding"}
# A tied embedding is one array, two torch modules: the lookup (an Embedding) and lm_head
# (a Linear, torch weight (vocab, dim), i.e. the table itself as (out, in)).
TIED = DATA / "tied"
TIED_NAMES = {
    "layers/q": NAMES["layers/q"],
    "layers/down": NAMES["layers/down"],
    "embed": ("model.embed_tokens", "lm_head"),
}
TIED_LAYOUT = {"layers/q": "in_out", "layers/down": "in_out", "embed": ("embedding", "out_in")}
# llama.py layer key -> the torch module (under model.layers.<i>.) it comes from.
TORCH_LAYER = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
               "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj",
               "up": "mlp.up_proj", "down": "mlp.down_proj"}


def llama_py():
    """examples/shakespeare/llama.py."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.shakespeare import llama

    return llama


def llama_from_torch(c: dict, state: dict):
    """`(llama.Config, params)` for llama.py from a transformers Llama config dict and torch
    state dict. Tied (`tie_word_embeddings`): no 'lm_head' key, so `llama.logits` uses
    `params['embed'].T` — one array for the lookup and the output projection."""
    llama = llama_py()
    assert c["head_dim"] == c["hidden_size"] // c["num_attention_heads"]
    assert not c["attention_bias"] and not c["mlp_bias"]
    cfg = llama.Config(n_layers=c["num_hidden_layers"], dim=c["hidden_size"],
                       hidden=c["intermediate_size"], n_heads=c["num_attention_heads"],
                       n_kv_heads=c["num_key_value_heads"], rope_theta=c["rope_theta"],
                       norm_eps=c["rms_norm_eps"], vocab=c["vocab_size"])

    def layer(i, key):
        w = np.asarray(state[f"model.layers.{i}.{TORCH_LAYER[key]}.weight"])
        return w if w.ndim == 1 else w.T  # torch Linear (out, in) -> llama.py (in, out)

    params = {
        "embed": np.asarray(state["model.embed_tokens.weight"]),
        "layers": {key: np.stack([layer(i, key) for i in range(cfg.n_layers)]) for key in TORCH_LAYER},
        "final_norm": np.asarray(state["model.norm.weight"]),
    }
    if not c["tie_word_embeddings"]:
        params["lm_head"] = np.asarray(state["lm_head.weight"]).T
    return cfg, params


@pytest.fixture(scope="module")
def llama():
    return llama_py()


@pytest.fixture(scope="module")
def model(llama):
    """`(cfg, llama.py params, torch state dict, input ids, jitted logits fns)`."""
    c = json.loads((DATA / "config.json").read_text())
    assert not c["tie_word_embeddings"]
    state = safetensors.numpy.load_file(str(DATA / "base.safetensors"))
    cfg, params = llama_from_torch(c, state)
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


# ---------------------------------------------------------------- tied embeddings

@pytest.fixture(scope="module")
def tied_model(llama):
    """The tied tiny Llama: tied/config.json on the shared base weights (its lm_head.weight,
    the untied model's, is not used: the tied lm_head is the embedding table)."""
    c = json.loads((TIED / "config.json").read_text())
    assert c["tie_word_embeddings"]
    cfg, params = llama_from_torch(c, safetensors.numpy.load_file(str(DATA / "base.safetensors")))
    assert "lm_head" not in params  # llama.logits: h @ embed.T
    ids = np.load(DATA / "input_ids.npy")
    lora = jax.jit(lorax.lora(lambda p, t: llama.logits(cfg, p, t), on_materialize="error"))
    base = jax.jit(lambda p, t: llama.logits(cfg, p, t))
    lp, spec = lorax.load_adapter(TIED / "lorax_made.safetensors", params)
    return cfg, params, ids, base, lora, lp, spec


def test_tied_export_reproduces_what_peft_loaded(tied_model, tmp_path):
    cfg, params, ids, base, lora, lp, spec = tied_model
    assert spec["embed"] == lorax.LoraSpec(4, 8.0, batch_ndim=0, m_ndim=1)
    assert spec["layers"]["q"] == lorax.LoraSpec(4, 8.0, batch_ndim=1, m_ndim=1)
    base_logits = np.load(TIED / "base_logits.npy")
    want = np.load(TIED / "lorax_made_logits.npy")
    diff = max_diff(base(params, ids), base_logits)
    report("tied llama.py base vs tied torch", diff)
    assert diff <= TOL
    diff = max_diff(lora(lp, ids), want)
    report("tied llama.py with lorax_made vs PeftModel on the tied torch model", diff)
    assert diff <= TOL
    assert max_diff(want, base_logits) > 1000 * TOL

    lorax.save_peft(tmp_path, lp, module_name=TIED_NAMES, layout=TIED_LAYOUT,
                    base_model_name_or_path=BASE_NAME)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / f).read_bytes() == (TIED / "lorax_made" / f).read_bytes(), f
    config, tensors = read(tmp_path)
    assert "lm_head" in config["target_modules"] and "embed_tokens" in config["target_modules"]
    # One update, two modules: lm_head's Linear factors are the embedding's, transposed.
    p = "base_model.model."
    np.testing.assert_array_equal(tensors[p + "lm_head.lora_A.weight"],
                                  tensors[p + "model.embed_tokens.lora_embedding_B"].T)
    np.testing.assert_array_equal(tensors[p + "lm_head.lora_B.weight"],
                                  tensors[p + "model.embed_tokens.lora_embedding_A"].T)


def test_tied_control_embedding_module_only(tied_model, tmp_path):
    """Exported to embed_tokens alone, the output projection misses its update: what PEFT
    runs from those files (the lookup adapted, lm_head plain) is far from the tied logits."""
    cfg, params, ids, _, lora, lp, _ = tied_model
    lorax.save_peft(tmp_path, lp, module_name=TIED_NAMES | {"embed": ("model.embed_tokens",)},
                    layout=TIED_LAYOUT | {"embed": ("embedding",)})
    config, _ = read(tmp_path)
    assert "lm_head" not in config["target_modules"]
    untied = dict(params, lm_head=params["embed"].T)  # torch's lm_head: the same table, unadapted
    back, _ = lorax.load_peft(tmp_path, untied, module_name=NAMES, layout=LAYOUT)
    assert not isinstance(back["lm_head"], lorax.LoraWeight)
    diff = max_diff(lora(back, ids), np.load(TIED / "lorax_made_logits.npy"))
    report("control: tied embedding exported to embed_tokens only", diff)
    assert diff > 100 * TOL


def test_tied_import_round_trips(tied_model, tmp_path):
    cfg, params, ids, _, lora, lp, spec = tied_model
    back, back_spec = lorax.load_peft(TIED / "lorax_made", params, module_name=TIED_NAMES,
                                      layout=TIED_LAYOUT)
    assert back_spec == spec
    for path in (("embed",), ("layers", "q"), ("layers", "down")):
        got, ref = back, lp
        for k in path:
            got, ref = got[k], ref[k]
        assert got.alpha == ref.alpha, path
        np.testing.assert_allclose(np.asarray(got.a), np.asarray(ref.a), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(got.b), np.asarray(ref.b), rtol=1e-6, atol=1e-7)
    diff = max_diff(lora(back, ids), np.load(TIED / "lorax_made_logits.npy"))
    report("tied llama.py with load_peft(tied/lorax_made) vs PEFT", diff)
    assert diff <= TOL

    # The untied adapter PEFT made (independent embed_tokens and lm_head factors) does not
    # fit one array...
    names = NAMES | {"embed": ("model.embed_tokens", "lm_head")}
    layout = LAYOUT | {"embed": ("embedding", "out_in")}
    del names["lm_head"], layout["lm_head"]
    with pytest.raises(ValueError, match="different updates"):
        lorax.load_peft(DATA / "peft_made", params, module_name=names, layout=layout)
    # ... nor does the tied adapter with lm_head's factors dropped (half the tie).
    config, tensors = read(TIED / "lorax_made")
    config["target_modules"].remove("lm_head")
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if ".lm_head." not in k},
                                str(tmp_path / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"adapts \['model.embed_tokens'\] but not \['lm_head'\]"):
        lorax.load_peft(tmp_path, params, module_name=TIED_NAMES, layout=TIED_LAYOUT)
