"""save_peft's `target_modules`: the shortest list that selects exactly the adapted modules
under PEFT's rule; load_peft reads every form PEFT writes.

PEFT (tuners_utils.check_target_module_exists) matches every name of the torch model's
`named_modules()` (containers included): a string is a regex that must match the whole
name, a list selects a name equal to an entry or ending with `"." + entry`.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax

PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
        "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
        "down": "mlp.down_proj"}


def peft_selects(target_modules, name):
    """PEFT's rule for one module name."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return name in target_modules or any(name.endswith("." + t) for t in target_modules)


def llama_modules(n_layers, prefix="model"):
    """Every name in a transformers Llama's `named_modules()` (containers included)."""
    names = ["", prefix, f"{prefix}.embed_tokens", f"{prefix}.layers", f"{prefix}.norm",
             f"{prefix}.rotary_emb", "lm_head"]
    for i in range(n_layers):
        layer = f"{prefix}.layers.{i}"
        names += [layer, f"{layer}.self_attn", f"{layer}.mlp", f"{layer}.mlp.act_fn",
                  f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
        names += [f"{layer}.{p}" for p in PROJ.values()]
    return names


def selected(config, modules):
    return {n for n in modules if peft_selects(config["target_modules"], n)}


def _nudged(lp):
    """Non-zero b (init_lora's is zero), so a round trip shows the factors."""
    return jax.tree.map(lambda x: lorax.LoraWeight(x.w, x.a, x.b + 1.0, alpha=x.alpha)
                        if isinstance(x, lorax.LoraWeight) else x, lp,
                        is_leaf=lambda x: isinstance(x, lorax.LoraWeight))


def stacked_llama(n_layers=3, d=8, vocab=16):
    """The main job's kind of model: stacked (layers, in, out) kernels, norms, embedding."""
    key = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    layers = {p: jax.random.normal(next(key), (n_layers, d, d)) for p in PROJ}
    layers |= {"attn_norm": jnp.ones((n_layers, d)), "mlp_norm": jnp.ones((n_layers, d))}
    return {"embed": jax.random.normal(next(key), (vocab, d)), "layers": layers,
            "final_norm": jnp.ones(d), "lm_head": jax.random.normal(next(key), (d, vocab))}


def _assert_round_trip(d, params, lp, **kw):
    loaded, spec = lorax.load_peft(d, params, **kw)
    is_lw = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    want = jax.tree_util.tree_flatten_with_path(lp, is_leaf=is_lw)[0]
    got = jax.tree_util.tree_leaves(loaded, is_leaf=is_lw)
    assert len(want) == len(got)
    for (path, x), y in zip(want, got):
        assert is_lw(x) == is_lw(y), path  # adapted exactly where it was
        if is_lw(x):
            np.testing.assert_allclose(y.materialize(), x.materialize(), rtol=1e-5, atol=1e-5)


def test_every_layer_seven_projections_are_seven_short_names(tmp_path):
    """The main job's adapter: every layer's q, k, v, o, gate, up, down (210 modules for
    SmolLM2's 30 layers) is PEFT's seven short names."""
    params = stacked_llama()
    spec = jax.tree.map(lambda _: lorax.LORA_FREEZE, params)
    spec["layers"] |= {p: lorax.LoraSpec(2, batch_ndim=1) for p in PROJ}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(1)))
    names = {f"layers/{p}": f"model.layers.{{layer}}.{m}" for p, m in PROJ.items()}
    lorax.save_peft(tmp_path, lp, module_name=names, layout="in_out")
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert config["target_modules"] == sorted(m.split(".")[-1] for m in PROJ.values())
    modules = llama_modules(3)
    assert selected(config, modules) == {f"model.layers.{i}.{m}" for i in range(3)
                                         for m in PROJ.values()}
    _assert_round_trip(tmp_path, params, lp, module_name=names, layout="in_out")


def layered_llama(n_layers=3, d=8):
    """A Hugging Face Flax-style tree: one subtree per layer, default names are torch's."""
    key = iter(jax.random.split(jax.random.PRNGKey(0), 8 * n_layers))
    layer = lambda: {  # noqa: E731
        "self_attn": {p.split(".")[-1]: {"kernel": jax.random.normal(next(key), (d, d))}
                      for p in PROJ.values() if p.startswith("self_attn")},
        "mlp": {p.split(".")[-1]: {"kernel": jax.random.normal(next(key), (d, d))}
                for p in PROJ.values() if p.startswith("mlp")},
        "input_layernorm": {"weight": jnp.ones(d)}}
    return {"model": {"layers": {str(i): layer() for i in range(n_layers)},
                      "norm": {"weight": jnp.ones(d)}}}


def test_some_layers_only_is_a_mix_that_selects_no_unadapted_module(tmp_path):
    """q and v in layers 1 and 2 only, down in every layer: down by its short name, q and v
    by the shortest suffix that leaves layer 0 out; no unadapted module is selected."""
    params = layered_llama()
    spec = jax.tree.map(lambda _: lorax.LORA_FREEZE, params)
    for i in ("1", "2"):
        for p in ("q_proj", "v_proj"):
            spec["model"]["layers"][i]["self_attn"][p]["kernel"] = 2
    for i in ("0", "1", "2"):
        spec["model"]["layers"][i]["mlp"]["down_proj"]["kernel"] = 2
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(1)))
    lorax.save_peft(tmp_path, lp)
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert config["target_modules"] == ["1.self_attn.q_proj", "1.self_attn.v_proj",
                                        "2.self_attn.q_proj", "2.self_attn.v_proj", "down_proj"]
    adapted = {f"model.layers.{i}.self_attn.{p}" for i in (1, 2) for p in ("q_proj", "v_proj")}
    adapted |= {f"model.layers.{i}.mlp.down_proj" for i in range(3)}
    assert selected(config, llama_modules(3)) == adapted
    # A 12-layer model: layer 1's entry does not reach layer 11 (PEFT's "." before it).
    assert not peft_selects(config["target_modules"], "model.layers.11.self_attn.q_proj")
    _assert_round_trip(tmp_path, params, lp)


def test_a_stacked_frozen_weight_is_every_layer_module(tmp_path):
    """The encoder's q adapted, the decoder's stacked q frozen (named by a {layer} template):
    every layer's full name is needed, since each shorter suffix is also a decoder layer's."""
    w = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8))
    params = {"enc": {"q": w}, "dec": {"q": w + 1}}
    spec = {"enc": {"q": lorax.LoraSpec(2, batch_ndim=1)}, "dec": {"q": lorax.LORA_FREEZE}}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(1)))
    names = {"enc/q": "encoder.layers.{layer}.q_proj", "dec/q": "decoder.layers.{layer}.q_proj"}
    lorax.save_peft(tmp_path, lp, module_name=names, layout="in_out")
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert config["target_modules"] == ["encoder.layers.0.q_proj", "encoder.layers.1.q_proj"]
    modules = [f"{s}.layers.{i}.q_proj" for s in ("encoder", "decoder") for i in range(2)]
    assert selected(config, modules) == set(modules[:2])
    _assert_round_trip(tmp_path, params, lp, module_name=names, layout="in_out")


def test_a_container_of_other_modules_is_not_selected(tmp_path):
    """A Linear `model.mlp` adapted while a layer has an `mlp` block (a torch container,
    holding the frozen `fc`): `mlp` alone would select the container too."""
    params = {"model": {"mlp": {"kernel": jnp.ones((8, 8))},
                        "layers": {"0": {"mlp": {"fc": {"kernel": jnp.ones((8, 8))}}}}}}
    spec = jax.tree.map(lambda _: 0, params)
    spec["model"]["mlp"]["kernel"] = 2
    lorax.save_peft(tmp_path, lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert config["target_modules"] == ["model.mlp"]
    modules = ["", "model", "model.mlp", "model.layers", "model.layers.0", "model.layers.0.mlp",
               "model.layers.0.mlp.fc"]
    assert selected(config, modules) == {"model.mlp"}
    assert selected({"target_modules": ["mlp"]}, modules) != {"model.mlp"}  # the check can fail


def test_a_module_no_list_can_single_out_is_a_regex(tmp_path):
    """A top-level Linear `mlp` and a layer's `mlp` block: every list entry that selects
    `mlp` also selects `layers.0.mlp`, so target_modules is a regex of the full names."""
    params = {"mlp": {"kernel": jnp.ones((8, 8))},
              "layers": {"0": {"mlp": {"fc": {"kernel": jnp.ones((8, 8))}}}}}
    spec = jax.tree.map(lambda _: 0, params)
    spec["mlp"]["kernel"] = 2
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
    lorax.save_peft(tmp_path, lp)
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert isinstance(config["target_modules"], str)
    assert selected(config, ["", "mlp", "layers", "layers.0", "layers.0.mlp",
                             "layers.0.mlp.fc"]) == {"mlp"}
    _assert_round_trip(tmp_path, params, lp)


def test_negative_control_the_check_sees_an_unadapted_module(tmp_path):
    """The selection check can fail: naive short names select layer 0's q_proj, which the
    partially adapted model leaves out; and save_peft only knows the modules it is given
    (the adapted subtree alone gets the short names)."""
    modules = llama_modules(3)
    adapted = {f"model.layers.{i}.self_attn.q_proj" for i in (1, 2)}
    assert selected({"target_modules": ["q_proj"]}, modules) != adapted
    assert "model.layers.0.self_attn.q_proj" in selected({"target_modules": ["q_proj"]}, modules)
    params = layered_llama()
    sub = {"model": {"layers": {i: {"self_attn": {"q_proj": params["model"]["layers"][i]
                                                  ["self_attn"]["q_proj"]}} for i in ("1", "2")}}}
    lorax.save_peft(tmp_path, lorax.init_lora(sub, jax.tree.map(lambda _: 2, sub),
                                              jax.random.PRNGKey(0)))
    config = json.load(open(tmp_path / "adapter_config.json"))
    assert config["target_modules"] == ["q_proj"]


@pytest.mark.parametrize("form", ["short", "full", "regex", "all-linear"])
def test_load_reads_every_target_modules_form(tmp_path, form):
    """PEFT writes short names, full names or a regex (or "all-linear"): load_peft takes the
    modules from the tensors, so each form loads the same adapter."""
    params = layered_llama(n_layers=2)
    spec = jax.tree.map(lambda _: lorax.LORA_FREEZE, params)
    for i in ("0", "1"):
        spec["model"]["layers"][i]["self_attn"]["q_proj"]["kernel"] = 2
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(1)))
    lorax.save_peft(tmp_path, lp)
    config = json.load(open(tmp_path / "adapter_config.json"))
    full = [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    config["target_modules"] = {"short": ["q_proj"], "full": full,
                                "regex": r"model\.layers\.\d+\.self_attn\.q_proj",
                                "all-linear": "all-linear"}[form]
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    _assert_round_trip(tmp_path, params, lp)
