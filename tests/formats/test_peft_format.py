"""save_peft / load_peft: PEFT's keys, shapes and scaling for every layout; errors name the module.

The numpy references below apply an adapter the way PEFT's layers do (Linear:
`W + s·B@A` on torch's `(out, in)` weight; Embedding: `W + s·(B@A).T`; Conv:
`W + s·B ⋆ A`); tests/formats/test_peft_fixtures.py checks the same files against
outputs real PEFT produced.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import lorax
from conftest import assert_close

P = "base_model.model."


def _nudged(lp, seed=1):
    """Non-zero factors everywhere (init_lora's b is zero), as after training."""
    leaves, treedef = jax.tree_util.tree_flatten(lp, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * len(leaves)))
    out = []
    for x in leaves:
        if isinstance(x, lorax.LoraWeight):
            x = lorax.LoraWeight(x.w, x.a + jax.random.normal(next(keys), x.a.shape),
                                 jax.random.normal(next(keys), x.b.shape), alpha=x.alpha)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _read(d):
    return json.load(open(d / "adapter_config.json")), safetensors.numpy.load_file(
        str(d / "adapter_model.safetensors"))


def _peft_scale(config, name, r):
    alpha = config["lora_alpha"]
    for k, v in config["alpha_pattern"].items():
        if k == name or name.endswith("." + k):
            alpha = v
    return alpha / (math.sqrt(r) if config["use_rslora"] else r)


def _torch_effective(w_torch, kind, a, b, s):
    if kind == "linear":
        return w_torch + s * b @ a
    if kind == "embedding":
        return w_torch + s * (b @ a).T
    # conv: B is (out, r, 1, ...), A (r, in, *window)
    return w_torch + s * np.einsum("or,ri...->oi...", b.reshape(b.shape[:2]), a)


# (name, weight shape, spec value, layout, torch view of the weight, torch kind)
CASES = [
    ("dense", (12, 8), lorax.LoraSpec(3), None, lambda w: w.T, "linear"),
    ("dense_general_q", (12, 2, 4), lorax.LoraSpec(3, m_ndim=1), None,
     lambda w: w.reshape(12, 8).T, "linear"),
    ("dense_general_out", (2, 4, 12), lorax.LoraSpec(3, m_ndim=2), "in_out",
     lambda w: w.reshape(8, 12).T, "linear"),
    ("torch_linear", (8, 12), lorax.LoraSpec(3), "out_in", lambda w: w, "linear"),
    ("embedding", (20, 6), lorax.LoraSpec(3), None, lambda w: w, "embedding"),
    ("conv_flax", (3, 3, 4, 5), lorax.LoraSpec(2), "conv_in_out",
     lambda w: w.transpose(3, 2, 0, 1), "conv"),
    ("conv_torch", (5, 4, 3, 3), lorax.LoraSpec(2, m_ndim=1), None, lambda w: w, "conv"),
]
LEAF = {"dense": "kernel", "dense_general_q": "kernel", "dense_general_out": "kernel",
        "torch_linear": "weight", "embedding": "embedding", "conv_flax": "kernel",
        "conv_torch": "weight"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_round_trip_and_peft_semantics(tmp_path, case):
    name, shape, spec_val, layout, torch_view, kind = case
    leaf = LEAF[name]
    w = jax.random.normal(jax.random.PRNGKey(0), shape)
    params = {"enc": {name: {leaf: w}}}
    spec = {"enc": {name: {leaf: spec_val}}}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(2), alpha=6.0))
    lay = None if layout is None else {f"enc/{name}/{leaf}": layout}
    lorax.save_peft(tmp_path, lp, layout=lay, base_model_name_or_path="toy")

    config, tensors = _read(tmp_path)
    module = f"enc.{name}"
    # PEFT's shortest form: the module's own name selects it (and nothing else here).
    assert config["target_modules"] == [name] and config["base_model_name_or_path"] == "toy"
    if kind == "embedding":
        a, b = tensors[P + module + ".lora_embedding_A"], tensors[P + module + ".lora_embedding_B"]
    else:
        a, b = tensors[P + module + ".lora_A.weight"], tensors[P + module + ".lora_B.weight"]
    assert len(tensors) == 2
    s = _peft_scale(config, module, a.shape[0])
    lw = lp["enc"][name][leaf]
    expected = torch_view(np.asarray(lw.materialize()))
    assert_close(_torch_effective(torch_view(np.asarray(w)), kind, a, b, s), expected)

    loaded, spec_out = lorax.load_peft(tmp_path, params, layout=lay)
    got = loaded["enc"][name][leaf]
    assert isinstance(got, lorax.LoraWeight) and got.w is w
    np.testing.assert_array_equal(got.a, lw.a)
    np.testing.assert_array_equal(got.b, lw.b)
    assert got.alpha == lw.alpha and spec_out["enc"][name][leaf].rank == lw.rank


def test_stacked_layers_are_one_module_each(tmp_path):
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 6))
    params = {"layers": {"q": w}, "norm": jnp.ones(8)}
    spec = {"layers": {"q": lorax.LoraSpec(2, batch_ndim=1)}, "norm": 0}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(1), alpha=4.0))
    names = {"layers/q": "model.layers.{layer}.self_attn.q_proj"}
    layout = {"layers/q": "in_out"}
    lorax.save_peft(tmp_path, lp, module_name=names, layout=layout)
    config, tensors = _read(tmp_path)
    assert config["target_modules"] == ["q_proj"]  # every layer's q_proj
    for i in range(3):
        a = tensors[f"{P}model.layers.{i}.self_attn.q_proj.lora_A.weight"]
        b = tensors[f"{P}model.layers.{i}.self_attn.q_proj.lora_B.weight"]
        assert a.shape == (2, 8) and b.shape == (6, 2)
        assert_close(np.asarray(w[i]).T + 2.0 * b @ a, np.asarray(lp["layers"]["q"].materialize()[i]).T)

    # A callable names them the same way.
    lorax.save_peft(tmp_path / "c", lp, layout=layout,
                    module_name=lambda path, layer: f"model.layers.{layer}.self_attn.q_proj")
    assert _read(tmp_path / "c")[1].keys() == tensors.keys()

    loaded, spec_out = lorax.load_peft(tmp_path, params, module_name=names, layout=layout)
    np.testing.assert_array_equal(loaded["layers"]["q"].a, lp["layers"]["q"].a)
    np.testing.assert_array_equal(loaded["layers"]["q"].b, lp["layers"]["q"].b)
    assert spec_out["layers"]["q"] == lorax.LoraSpec(2, 4.0, 1, 1) and spec_out["norm"] == 0


def test_stacked_layers_with_different_ranks_alphas_and_missing_layers(tmp_path):
    """PEFT's rank_pattern / alpha_pattern / layers_to_transform onto one stacked weight."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 8, 6)).astype(np.float32)
    tensors = {}
    for i, r in [(0, 2), (2, 4)]:  # layer 1 not adapted
        tensors[f"{P}layers.{i}.q.lora_A.weight"] = rng.normal(size=(r, 8)).astype(np.float32)
        tensors[f"{P}layers.{i}.q.lora_B.weight"] = rng.normal(size=(6, r)).astype(np.float32)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "rank_pattern": {"layers.2.q": 4},
              "alpha_pattern": {"layers.2.q": 2}, "use_rslora": True, "target_modules": ["q"]}
    tmp_path.mkdir(exist_ok=True)
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    safetensors.numpy.save_file(tensors, str(tmp_path / "adapter_model.safetensors"))

    params = {"layers": {"q": jnp.asarray(w)}}
    loaded, spec = lorax.load_peft(tmp_path, params, layout="in_out",
                                   module_name={"layers/q": "layers.{layer}.q"})
    lw = loaded["layers"]["q"]
    assert lw.rank == 4 and spec["layers"]["q"].batch_ndim == 1
    eff = np.asarray(lw.materialize())
    scales = {0: 4 / math.sqrt(2), 2: 2 / math.sqrt(4)}
    for i in range(3):
        ref = w[i].T
        if i in scales:
            ref = ref + scales[i] * tensors[f"{P}layers.{i}.q.lora_B.weight"] @ tensors[f"{P}layers.{i}.q.lora_A.weight"]
        assert_close(eff[i].T, ref, err_msg=f"layer {i}")


def test_mixed_ranks_and_alphas_go_to_patterns(tmp_path):
    params = {"a": {"kernel": jnp.ones((8, 8))}, "b": {"kernel": jnp.ones((8, 8))},
              "c": {"kernel": jnp.ones((8, 4))}}
    spec = {"a": lorax.LoraSpec(4), "b": lorax.LoraSpec(4), "c": lorax.LoraSpec(2, alpha=3.0)}
    spec = {k: {"kernel": v} for k, v in spec.items()}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(0), alpha=8.0, rslora=False))
    lorax.save_peft(tmp_path, lp)
    config, _ = _read(tmp_path)
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["rank_pattern"] == {"c": 2} and config["alpha_pattern"] == {"c": 3}
    loaded, _ = lorax.load_peft(tmp_path, params)
    for k in "abc":
        assert_close(loaded[k]["kernel"].materialize(), lp[k]["kernel"].materialize())


def test_rank_pattern_keys_match_only_their_module(tmp_path):
    """`layers.1.q` as a regex also matches `layers_1_q`: such a key is escaped."""
    params = {"layers_1_q": jnp.ones((4, 4)), "x": jnp.ones((4, 4)), "layers.1.q": jnp.ones((4, 4))}
    spec = {"layers_1_q": lorax.LoraSpec(3), "x": lorax.LoraSpec(3), "layers.1.q": lorax.LoraSpec(2)}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
    lorax.save_peft(tmp_path, lp, layout="in_out")
    config, _ = _read(tmp_path)
    assert config["r"] == 3 and config["rank_pattern"] == {r"layers\.1\.q": 2}
    loaded, _ = lorax.load_peft(tmp_path, params, layout="in_out")
    assert loaded["layers.1.q"].rank == 2 and loaded["layers_1_q"].rank == 3


def test_rslora_and_quantized_base(tmp_path):
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 32))
    params = {"q": {"kernel": w}}
    spec = {"q": {"kernel": 4}}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(1), alpha=8.0, rslora=True))
    lorax.save_peft(tmp_path, lp)
    config, _ = _read(tmp_path)
    assert config["lora_alpha"] == pytest.approx(8.0 * 2)  # 8/sqrt(4) == 16/4
    qparams = lorax.quantize(params, spec, "int8", min_size=0)
    loaded, _ = lorax.load_peft(tmp_path, qparams)
    lw = loaded["q"]["kernel"]
    assert isinstance(lw.w, lorax.QuantizedArray) and lw.a.dtype == jnp.float32
    assert_close(lw.scale * lw.b @ lw.a, lp["q"]["kernel"].scale * lp["q"]["kernel"].b @ lp["q"]["kernel"].a)


def test_load_does_not_touch_params(tmp_path):
    params = {"q": {"kernel": jnp.ones((4, 4))}}
    lp = _nudged(lorax.init_lora(params, {"q": {"kernel": 2}}, jax.random.PRNGKey(0)))
    lorax.save_peft(tmp_path, lp)
    before = jax.tree_util.tree_map(np.asarray, params)
    loaded, _ = lorax.load_peft(tmp_path, params)
    assert isinstance(params["q"]["kernel"], jax.Array)
    np.testing.assert_array_equal(params["q"]["kernel"], before["q"]["kernel"])
    assert loaded is not params


# ---- errors name the module / key path and what was expected ----

def _saved(tmp_path, params=None, spec=None, **kw):
    params = params or {"model": {"q_proj": {"kernel": jnp.ones((8, 6))}}}
    spec = spec or {"model": {"q_proj": {"kernel": 2}}}
    lp = _nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
    lorax.save_peft(tmp_path, lp, **kw)
    return params


def test_error_wrong_base_names_the_module(tmp_path):
    _saved(tmp_path)
    other = {"model": {"k_proj": {"kernel": jnp.ones((8, 6))}}}
    with pytest.raises(ValueError, match=r"'model\.q_proj'.*no parameter maps to.*model\.k_proj"):
        lorax.load_peft(tmp_path, other)


def test_error_wrong_shape_names_the_module(tmp_path):
    _saved(tmp_path)
    other = {"model": {"q_proj": {"kernel": jnp.ones((8, 7))}}}
    with pytest.raises(ValueError, match=r"module 'model\.q_proj' does not fit 'model/q_proj/kernel' "
                                         r"\(shape \(8, 7\).*lora_A \(2, 8\), lora_B \(6, 2\); "
                                         r"expected lora_A \(2, 8\), lora_B \(7, 2\)"):
        lorax.load_peft(tmp_path, other)


@pytest.mark.parametrize("key, arr, match", [
    ("model.q_proj.lora_magnitude_vector", np.ones(6, np.float32),
     r"'model\.q_proj' has a DoRA magnitude .*use_dora is false"),
    ("model.q_proj.lora_B.bias", np.ones(6, np.float32), r"'model\.q_proj' has a bias on lora_B"),
    ("model.q_proj.lora_C.weight", np.ones((2, 8), np.float32), r"'base_model\.model\.model\.q_proj\.lora_C\.weight' is not a LoRA factor"),
])
def test_error_unknown_tensor_names_the_module(tmp_path, key, arr, match):
    params = _saved(tmp_path)
    tensors = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
    tensors[P + key] = arr
    safetensors.numpy.save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=match):
        lorax.load_peft(tmp_path, params)


@pytest.mark.parametrize("entry, match", [
    ({"use_dora": True}, r"use_dora but module 'model\.q_proj' has no DoRA magnitude"),
    ({"peft_type": "IA3"}, r"peft_type 'IA3'"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save"),
    ({"init_lora_weights": "pissa_niter_4"}, r"changes the base weights"),
    ({"r": 3}, r"module 'model\.q_proj' has rank 2 but the config says r = 3"),
])
def test_error_unread_config_feature(tmp_path, entry, match):
    params = _saved(tmp_path)
    config = json.load(open(tmp_path / "adapter_config.json"))
    config.update(entry)
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    with pytest.raises(ValueError, match=match):
        lorax.load_peft(tmp_path, params)


def test_error_lora_alpha_null_names_the_file_and_the_field(tmp_path):
    """The reported case: `"lora_alpha": null` was a `TypeError` from `float()`."""
    params = _saved(tmp_path)
    config = json.load(open(tmp_path / "adapter_config.json"))
    config["lora_alpha"] = None
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    with pytest.raises(ValueError) as err:
        lorax.load_peft(tmp_path, params)
    assert str(err.value) == (f"load_peft: {str(tmp_path / 'adapter_config.json')!r}: lora_alpha: "
                              "expected a finite number, got null.")


@pytest.mark.parametrize("entry, match", [
    ({"r": 2.0}, r"r: expected an integer >= 1, got 2\.0"),
    ({"r": True}, r"r: expected an integer >= 1, got true"),
    ({"r": 0}, r"r: expected an integer >= 1, got 0"),
    ({"lora_alpha": "16"}, r"lora_alpha: expected a finite number, got \"16\""),
    ({"lora_alpha": [16]}, r"lora_alpha: expected a finite number, got \[16\]"),
    ({"lora_alpha": 10**400}, r"lora_alpha: expected a finite number, got an integer of 1329 bits"),
    ({"lora_alpha": float("nan")}, r"lora_alpha: expected a finite number, got NaN"),
    ({"lora_dropout": 1.0}, r"lora_dropout: expected a number in \[0, 1\), got 1\.0"),
    ({"lora_dropout": -0.1}, r"lora_dropout: expected a number in \[0, 1\), got -0\.1"),
    ({"lora_dropout": None}, r"lora_dropout: expected a number in \[0, 1\), got null"),
    ({"rank_pattern": {"q_proj": 2.5}}, r"rank_pattern\['q_proj'\]: expected an integer >= 1, got 2\.5"),
    ({"alpha_pattern": {"q_proj": {"a": 1}}},
     r"alpha_pattern\['q_proj'\]: expected a finite number, got \{\"a\": 1\}"),
])
def test_error_config_numbers_name_the_file_and_the_field(tmp_path, entry, match):
    params = _saved(tmp_path)
    config = json.load(open(tmp_path / "adapter_config.json"))
    config.update(entry)
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    with pytest.raises(ValueError, match=r"adapter_config\.json': " + match):
        lorax.load_peft(tmp_path, params)


@pytest.mark.parametrize("alpha", [-4, 0])
def test_negative_and_zero_alphas_load_as_written(tmp_path, alpha):
    """An alpha scales the update: negative flips it, zero removes it; both load as lorax
    writes them."""
    params = _saved(tmp_path)
    config = json.load(open(tmp_path / "adapter_config.json"))
    config["lora_alpha"] = alpha
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    loaded, _ = lorax.load_peft(tmp_path, params)
    assert loaded["model"]["q_proj"]["kernel"].alpha == alpha


def test_stacked_layer_with_zero_alpha_and_a_scale_too_large(tmp_path):
    """A stack whose first adapted layer has alpha 0 (its update is zero, the others' are
    not; was a ZeroDivisionError), and one whose scale no float holds."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 8, 6)).astype(np.float32)
    tensors = {}
    for i in (0, 2):
        tensors[f"{P}layers.{i}.q.lora_A.weight"] = rng.normal(size=(2, 8)).astype(np.float32)
        tensors[f"{P}layers.{i}.q.lora_B.weight"] = rng.normal(size=(6, 2)).astype(np.float32)
    safetensors.numpy.save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    params, names = {"layers": {"q": jnp.asarray(w)}}, {"layers/q": "layers.{layer}.q"}
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 0, "alpha_pattern": {"layers.2.q": 3}}
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    eff = np.asarray(lorax.load_peft(tmp_path, params, layout="in_out", module_name=names)[0]
                     ["layers"]["q"].materialize())
    update = tensors[f"{P}layers.2.q.lora_B.weight"] @ tensors[f"{P}layers.2.q.lora_A.weight"]
    for i, ref in enumerate([w[0].T, w[1].T, w[2].T + 1.5 * update]):
        assert_close(eff[i].T, ref, err_msg=f"layer {i}")
    # rsLoRA: the scale 1.7e308 / sqrt(2) is a float, the LoraWeight's alpha (scale · 2) not.
    config.update(lora_alpha=1, alpha_pattern={"layers.2.q": 1.7e308}, use_rslora=True)
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    with pytest.raises(ValueError, match=r"scale for 'layers/q' \(1\.20\d*e\+308 at rank 2, "
                       r"from lora_alpha or alpha_pattern\) is too large"):
        lorax.load_peft(tmp_path, params, layout="in_out", module_name=names)


def test_error_missing_factor(tmp_path):
    params = _saved(tmp_path)
    tensors = safetensors.numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
    del tensors[P + "model.q_proj.lora_B.weight"]
    safetensors.numpy.save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"module 'model\.q_proj' has no lora_B"):
        lorax.load_peft(tmp_path, params)


def test_error_stacked_weight_needs_module_names(tmp_path):
    params = {"layers": {"q": {"kernel": jnp.ones((3, 8, 6))}}}
    spec = {"layers": {"q": {"kernel": lorax.LoraSpec(2, batch_ndim=1)}}}
    with pytest.raises(ValueError, match=r"'layers/q/kernel' \(shape \(3, 8, 6\)\) is a stack.*module_name"):
        _saved(tmp_path, params, spec)
    with pytest.raises(ValueError, match=r"has no '\{layer\}'"):
        _saved(tmp_path, params, spec, module_name={"layers/q/kernel": "layers.q"})


@pytest.mark.parametrize("leaf, shape, spec_val", [
    ("weight", (8, 6), 2),                              # torch Linear or Embedding?
    ("kernel", (2, 4, 6), lorax.LoraSpec(2, m_ndim=2)),  # DenseGeneral out or conv?
    ("table", (8, 6), 2),                               # no framework name at all
])
def test_error_layout_cannot_be_known(tmp_path, leaf, shape, spec_val):
    params = {"m": {leaf: jnp.ones(shape)}}
    with pytest.raises(ValueError, match=rf"cannot tell which side of 'm/{leaf}' .*layout="):
        _saved(tmp_path, params, {"m": {leaf: spec_val}})


def test_error_two_weights_one_module(tmp_path):
    params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4))}
    with pytest.raises(ValueError, match=r"'b'.*'a' both map to module 'x'|'a'.*'b' both map"):
        _saved(tmp_path, params, {"a": 2, "b": 2}, module_name=lambda p, l: "x", layout="in_out")


def test_error_not_an_adapter(tmp_path):
    with pytest.raises(ValueError, match="does not exist; expected a PEFT adapter directory"):
        lorax.load_peft(tmp_path, {"w": jnp.ones((2, 2))})


def test_saved_embedding_base_weight_must_be_the_base(tmp_path):
    """PEFT saves an embedding's base weight with the adapter (save_embedding_layers)."""
    emb = jax.random.normal(jax.random.PRNGKey(0), (20, 6))
    params = {"model": {"embed_tokens": {"embedding": emb}}}
    lp = _nudged(lorax.init_lora(params, {"model": {"embed_tokens": {"embedding": 2}}},
                                 jax.random.PRNGKey(1)))
    lorax.save_peft(tmp_path, lp)
    f = str(tmp_path / "adapter_model.safetensors")
    tensors = safetensors.numpy.load_file(f)
    tensors[P + "model.embed_tokens.base_layer.weight"] = np.asarray(emb)
    safetensors.numpy.save_file(tensors, f)
    loaded, _ = lorax.load_peft(tmp_path, params)
    assert loaded["model"]["embed_tokens"]["embedding"].w is emb

    tensors[P + "model.embed_tokens.base_layer.weight"] = np.asarray(emb) + 1
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(ValueError, match=r"its own base weight for module 'model\.embed_tokens'.*differs"):
        lorax.load_peft(tmp_path, params)


def test_tied_embedding_is_both_modules(tmp_path):
    """A tied embedding is one array used twice: PEFT's embed_tokens and lm_head modules."""
    emb = jax.random.normal(jax.random.PRNGKey(0), (20, 6))
    params = {"embed": emb}
    lp = _nudged(lorax.init_lora(params, {"embed": 3}, jax.random.PRNGKey(1), alpha=5.0))
    names = {"embed": ("model.embed_tokens", "lm_head")}
    layout = {"embed": ("embedding", "out_in")}  # lm_head's torch weight is (vocab, dim)
    lorax.save_peft(tmp_path, lp, module_name=names, layout=layout)
    config, tensors = _read(tmp_path)
    assert config["target_modules"] == ["embed_tokens", "lm_head"]
    lw = lp["embed"]
    eff = np.asarray(lw.materialize())
    s = _peft_scale(config, "lm_head", 3)
    assert_close(_torch_effective(np.asarray(emb), "embedding", tensors[P + "model.embed_tokens.lora_embedding_A"],
                                  tensors[P + "model.embed_tokens.lora_embedding_B"], s), eff)
    assert_close(_torch_effective(np.asarray(emb), "linear", tensors[P + "lm_head.lora_A.weight"],
                                  tensors[P + "lm_head.lora_B.weight"], s), eff)

    loaded, spec = lorax.load_peft(tmp_path, params, module_name=names, layout=layout)
    np.testing.assert_array_equal(loaded["embed"].a, lw.a)
    np.testing.assert_array_equal(loaded["embed"].b, lw.b)

    # An adapter whose two modules differ (trained untied in PEFT) cannot go onto one array.
    f = str(tmp_path / "adapter_model.safetensors")
    tensors[P + "lm_head.lora_B.weight"] = tensors[P + "lm_head.lora_B.weight"] * 1.01
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(ValueError, match=r"'model\.embed_tokens' and 'lm_head' both map to 'embed'.*different"):
        lorax.load_peft(tmp_path, params, module_name=names, layout=layout)
    # Nor one that adapts only one of the two uses.
    del tensors[P + "lm_head.lora_A.weight"], tensors[P + "lm_head.lora_B.weight"]
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(ValueError, match=r"one array used by modules .*adapts \['model\.embed_tokens'\] but not \['lm_head'\]"):
        lorax.load_peft(tmp_path, params, module_name=names, layout=layout)


def test_load_onto_a_lora_tree_replaces_its_factors(tmp_path):
    params = {"q": {"kernel": jax.random.normal(jax.random.PRNGKey(0), (8, 6))}}
    lp = _nudged(lorax.init_lora(params, {"q": {"kernel": 2}}, jax.random.PRNGKey(1)))
    lorax.save_peft(tmp_path, lp)
    fresh = lorax.init_lora(params, {"q": {"kernel": 2}}, jax.random.PRNGKey(5))
    loaded, _ = lorax.load_peft(tmp_path, fresh)
    assert loaded["q"]["kernel"].w is params["q"]["kernel"]
    np.testing.assert_array_equal(loaded["q"]["kernel"].b, lp["q"]["kernel"].b)


def test_factors_that_fit_two_ways_need_a_lora_tree(tmp_path):
    """(4, 1, 4): torch's (out=4, in=4) is axes (4 | 1, 4) or (4, 1 | 4)."""
    w = jnp.ones((4, 1, 4))
    lw = lorax.LoraWeight(w, jnp.ones((2, 4)), jnp.ones((4, 1, 2)))  # m_ndim = 2
    lorax.save_peft(tmp_path, {"x": lw}, layout="in_out")
    with pytest.raises(ValueError, match=r"'x': the factors fit 'x' \(shape \(4, 1, 4\)\) in 2 ways"):
        lorax.load_peft(tmp_path, {"x": w}, layout="in_out")
    target = lorax.LoraWeight(w, jnp.zeros((2, 4)), jnp.zeros((4, 1, 2)))
    loaded, spec = lorax.load_peft(tmp_path, {"x": target}, layout="in_out")
    assert spec["x"].m_ndim == 2
    np.testing.assert_array_equal(loaded["x"].b, lw.b)


def test_target_modules_are_the_shortest_exact_selection(tmp_path):
    """Short names where they select exactly the adapted modules; a longer suffix where a
    short one would also select a weight that carries no LoRA."""
    params = {"enc": {"q_proj": {"kernel": jnp.ones((8, 8))}, "v_proj": {"kernel": jnp.ones((8, 8))}},
              "dec": {"q_proj": {"kernel": jnp.ones((8, 8))}}}
    spec = {"enc": {"q_proj": {"kernel": 2}, "v_proj": {"kernel": 2}},
            "dec": {"q_proj": {"kernel": lorax.LORA_FREEZE}}}
    lorax.save_peft(tmp_path, lorax.init_lora(params, spec, jax.random.PRNGKey(0)))
    config, _ = _read(tmp_path)
    assert config["target_modules"] == ["enc.q_proj", "v_proj"]
    select = lambda name: any(name == t or name.endswith("." + t)  # noqa: E731
                              for t in config["target_modules"])
    assert [select(n) for n in ("enc.q_proj", "enc.v_proj", "dec.q_proj")] == [True, True, False]


@pytest.mark.parametrize("dtype", [jnp.int8, np.int32, "banana"])
def test_error_dtype_that_is_not_floating(tmp_path, dtype):
    """An integer dtype wrote the factors rounded to zeros."""
    with pytest.raises(ValueError, match=r"save_peft: dtype must be one of float32, float16, "
                                         r"bfloat16, float64"):
        _saved(tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()
    _saved(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert _read(tmp_path / "bf16")[1][P + "model.q_proj.lora_A.weight"].dtype.name == "bfloat16"


def test_error_a_file_is_not_an_adapter_directory(tmp_path):
    """load_peft of a file (the safetensors file itself) was a raw NotADirectoryError."""
    params = _saved(tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    with pytest.raises(ValueError, match=r"load_peft: '.*adapter_model\.safetensors' is a file; a "
                                         r"PEFT adapter is a directory holding adapter_config\.json"
                                         r" and adapter_model\.safetensors \(pass '.*', the directory"):
        lorax.load_peft(weights, params)
    with pytest.raises(ValueError, match=r"save_peft: '.*adapter_model\.safetensors' is a file"):
        _saved(weights)
    lorax.load_peft(tmp_path, params)  # the directory loads
