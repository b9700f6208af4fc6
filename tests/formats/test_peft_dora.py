"""save_peft / load_peft with DoRA: PEFT's `use_dora` and `lora_magnitude_vector`.

The numpy reference applies an adapter the way PEFT's DoRA layers do
(peft/tuners/lora/dora.py): `V = W + s·ΔW` on torch's view of the weight, the norm
per output feature over the rest (Linear: per row of `(out, in)`; Embedding: per
feature over the vocabulary; Conv: per output channel), the weight `mag / ||V|| · V`.
tests/formats/test_peft_real.py checks the same files against real PEFT.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import lorax
from conftest import assert_close
from test_peft_format import CASES, LEAF, P, _peft_scale, _read, _torch_effective

# Which factor the input meets first in each case's layout (torch's (out, in) weights: a).
INPUT_FACTOR = {"torch_linear": "a", "conv_torch": "a"}


def _nudged_dora(lp, seed=1):
    """Non-zero factors and a magnitude away from ||w||, as after training."""
    leaves, treedef = jax.tree_util.tree_flatten(lp, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 3 * len(leaves)))
    out = []
    for x in leaves:
        if isinstance(x, lorax.DoraWeight):
            x = lorax.DoraWeight(x.w, x.a + jax.random.normal(next(keys), x.a.shape),
                                 0.3 * jax.random.normal(next(keys), x.b.shape),
                                 x.m * jax.random.uniform(next(keys), x.m.shape, minval=0.5, maxval=1.5),
                                 alpha=x.alpha)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _peft_dora(w_torch, kind, a, b, mag, s):
    """PEFT's DoRA weight in torch's view (float64)."""
    v = _torch_effective(w_torch.astype(np.float64), kind, a.astype(np.float64), b.astype(np.float64), s)
    if kind == "linear":
        norm = np.linalg.norm(v, axis=1)                       # (out,)
        return (mag / norm)[:, None] * v
    if kind == "embedding":
        norm = np.linalg.norm(v, axis=0)                       # (dim,): over the vocabulary
        return (mag / norm)[None, :] * v
    norm = np.linalg.norm(v.reshape(v.shape[0], -1), axis=1)   # (out,)
    g = mag.reshape(-1) / norm
    return g.reshape(-1, *([1] * (v.ndim - 1))) * v


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dora_round_trip_and_peft_semantics(tmp_path, case):
    name, shape, spec_val, layout, torch_view, kind = case
    leaf = LEAF[name]
    spec_val = lorax.LoraSpec(spec_val.rank, m_ndim=spec_val.m_ndim, dora=True,
                              input_factor=INPUT_FACTOR.get(name, "b"))
    w = jax.random.normal(jax.random.PRNGKey(0), shape)
    params = {"enc": {name: {leaf: w}}}
    spec = {"enc": {name: {leaf: spec_val}}}
    lp = _nudged_dora(lorax.init_lora(params, spec, jax.random.PRNGKey(2), alpha=6.0))
    lay = None if layout is None else {f"enc/{name}/{leaf}": layout}
    lorax.save_peft(tmp_path, lp, layout=lay)

    config, tensors = _read(tmp_path)
    module = f"enc.{name}"
    assert config["use_dora"] is True
    if kind == "embedding":
        a, b = tensors[P + module + ".lora_embedding_A"], tensors[P + module + ".lora_embedding_B"]
    else:
        a, b = tensors[P + module + ".lora_A.weight"], tensors[P + module + ".lora_B.weight"]
    mag = tensors[P + module + ".lora_magnitude_vector"]
    assert len(tensors) == 3
    out = {"linear": b.shape[0], "embedding": shape[1], "conv": b.shape[0]}[kind]
    assert mag.shape == ((1, out, 1, 1) if kind == "conv" else (out,))
    lw = lp["enc"][name][leaf]
    s = _peft_scale(config, module, a.shape[0])
    expected = torch_view(np.asarray(lw.materialize()))
    assert_close(_peft_dora(torch_view(np.asarray(w)), kind, a, b, mag, s), expected)
    assert np.abs(expected - torch_view(np.asarray(w))).max() > 0.1  # not the base

    loaded, spec_out = lorax.load_peft(tmp_path, params, layout=lay)
    got = loaded["enc"][name][leaf]
    assert isinstance(got, lorax.DoraWeight) and got.w is w
    for field in ("a", "b", "m"):
        np.testing.assert_array_equal(getattr(got, field), getattr(lw, field))
    assert got.alpha == lw.alpha
    assert spec_out["enc"][name][leaf].dora and spec_out["enc"][name][leaf].input_factor == \
        spec_val.input_factor


def test_dora_stacked_layers_and_a_layer_left_out(tmp_path):
    """Per-layer modules with their own ranks onto a stacked weight; a layer the adapter
    leaves out gets m = ||w||, so it is unchanged."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 8, 6)).astype(np.float32)          # (layers, in, out)
    tensors = {}
    for i, r in [(0, 2), (2, 4)]:
        tensors[f"{P}layers.{i}.q.lora_A.weight"] = rng.normal(size=(r, 8)).astype(np.float32)
        tensors[f"{P}layers.{i}.q.lora_B.weight"] = rng.normal(size=(6, r)).astype(np.float32)
        tensors[f"{P}layers.{i}.q.lora_magnitude_vector"] = rng.uniform(1, 3, size=6).astype(np.float32)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "rank_pattern": {"layers.2.q": 4},
              "use_dora": True, "target_modules": ["q"]}
    json.dump(config, open(tmp_path / "adapter_config.json", "w"))
    safetensors.numpy.save_file(tensors, str(tmp_path / "adapter_model.safetensors"))

    names = {"layers/q": "layers.{layer}.q"}
    loaded, spec = lorax.load_peft(tmp_path, {"layers": {"q": jnp.asarray(w)}}, layout="in_out",
                                   module_name=names)
    dw = loaded["layers"]["q"]
    assert isinstance(dw, lorax.DoraWeight) and dw.m.shape == (3, 1, 6)
    assert spec["layers"]["q"] == lorax.LoraSpec(4, 8.0, 1, 1, dora=True, input_factor="b")  # alpha = s_0 · k
    eff = np.asarray(dw.materialize())
    for i, r in [(0, 2), (1, None), (2, 4)]:
        if r is None:
            ref = w[i].T
        else:
            ref = _peft_dora(w[i].T, "linear", tensors[f"{P}layers.{i}.q.lora_A.weight"],
                             tensors[f"{P}layers.{i}.q.lora_B.weight"],
                             tensors[f"{P}layers.{i}.q.lora_magnitude_vector"], 4 / r)
        assert_close(eff[i].T, ref, err_msg=f"layer {i}")

    # And back: the same per-layer tensors (layer 1 now has its m = ||w|| and zero factors).
    lorax.save_peft(tmp_path / "out", loaded, module_name=names, layout="in_out")
    _, back = _read(tmp_path / "out")
    np.testing.assert_allclose(back[f"{P}layers.2.q.lora_magnitude_vector"],
                               tensors[f"{P}layers.2.q.lora_magnitude_vector"])
    np.testing.assert_allclose(back[f"{P}layers.1.q.lora_magnitude_vector"],
                               np.linalg.norm(w[1], axis=0), rtol=1e-6)


def _dora_tree(spec_val, shape=(8, 6), leaf="kernel"):
    params = {"q": {leaf: jax.random.normal(jax.random.PRNGKey(0), shape)}}
    return params, _nudged_dora(lorax.init_lora(params, {"q": {leaf: spec_val}}, jax.random.PRNGKey(1)))


def test_error_dora_and_plain_weights_in_one_adapter(tmp_path):
    params = {"q": {"kernel": jnp.ones((8, 6))}, "k": {"kernel": jnp.ones((8, 6))}}
    lp = lorax.init_lora(params, {"q": {"kernel": lorax.LoraSpec(2, dora=True)},
                                  "k": {"kernel": 2}}, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"\['q'\] are DoRA weights and \['k'\] are not.*use_dora"):
        lorax.save_peft(tmp_path, lp)


def test_error_dora_magnitude_on_the_input_side(tmp_path):
    """A torch-layout (out, in) weight whose magnitude was built for x @ w (per column)."""
    _, lp = _dora_tree(lorax.LoraSpec(2, dora=True), leaf="weight")
    with pytest.raises(ValueError, match=r"'q/weight' is a DoraWeight with its magnitude on 'a'.*"
                                         r"layout 'out_in' has the output on 'b'"):
        lorax.save_peft(tmp_path, lp, layout="out_in")


def test_error_tied_dora_weight(tmp_path):
    params = {"embed": jax.random.normal(jax.random.PRNGKey(0), (20, 6))}
    lp = lorax.init_lora(params, {"embed": lorax.LoraSpec(3, dora=True)}, jax.random.PRNGKey(1))
    with pytest.raises(ValueError, match=r"'embed' is a DoraWeight used by 2 torch modules"):
        lorax.save_peft(tmp_path, lp, module_name={"embed": ("model.embed_tokens", "lm_head")},
                        layout={"embed": ("embedding", "out_in")})


def test_error_dora_magnitude_shape(tmp_path):
    params, lp = _dora_tree(lorax.LoraSpec(2, dora=True))
    lorax.save_peft(tmp_path, lp)
    f = str(tmp_path / "adapter_model.safetensors")
    tensors = safetensors.numpy.load_file(f)
    tensors[P + "q.lora_magnitude_vector"] = np.ones(5, np.float32)
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(ValueError, match=r"module 'q': its DoRA magnitude has shape \(5,\); 'q/kernel' "
                                         r"\(shape \(8, 6\), layout 'in_out'\) needs \(6,\)"):
        lorax.load_peft(tmp_path, params)
    del tensors[P + "q.lora_A.weight"], tensors[P + "q.lora_B.weight"]
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(ValueError, match=r"module 'q' has a DoRA magnitude .* but no LoRA factors"):
        lorax.load_peft(tmp_path, params)


def test_dora_onto_a_quantized_base(tmp_path):
    """The missing-layer norm and the loaded weight use the quantized base as it is."""
    w = jax.random.normal(jax.random.PRNGKey(0), (2, 64, 32))
    qw = lorax.QuantizedArray.from_dense(w, "int8")
    spec = {"q": lorax.LoraSpec(2, batch_ndim=1, dora=True)}
    lp = _nudged_dora(lorax.init_lora({"q": qw}, spec, jax.random.PRNGKey(1)))
    names = {"q": "layers.{layer}.q"}
    lorax.save_peft(tmp_path, lp, module_name=names, layout="in_out")
    loaded, _ = lorax.load_peft(tmp_path, {"q": qw}, module_name=names, layout="in_out")
    assert loaded["q"].w is qw
    assert_close(np.asarray(loaded["q"].materialize()), np.asarray(lp["q"].materialize()))
