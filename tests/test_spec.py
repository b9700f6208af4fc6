"""simple_spec targeting, per-pattern ranks, summaries, and spec/param mismatches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import lorax


def _attn_params():
    z = jnp.zeros
    return {
        "layer_0": {"attn": {"query": z((16, 16)), "key": z((16, 16)), "value": z((16, 16)),
                             "out": z((16, 16))},
                    "mlp": {"up": z((16, 64)), "down": z((64, 16))}, "norm": jnp.ones(16)},
        "embed": z((100, 16)),
        "step": jnp.zeros((3, 3), jnp.int32),
    }


def test_targets_regex_picks_paths():
    spec = lorax.simple_spec(_attn_params(), targets=r"attn/(query|value)$", rank=4)
    assert spec["layer_0"]["attn"] == {"query": 4, "key": 0, "value": 4, "out": 0}
    assert spec["layer_0"]["mlp"] == {"up": 0, "down": 0}
    assert spec["embed"] == 0 and spec["step"] == 0


def test_targets_dict_gives_per_pattern_rank_and_alpha():
    spec = lorax.simple_spec(
        _attn_params(),
        targets={r"attn/": lorax.LoraSpec(8, alpha=16.0), r"mlp/up": 2},
        tune_vectors=True,
    )
    assert spec["layer_0"]["attn"]["key"] == lorax.LoraSpec(8, alpha=16.0)
    assert spec["layer_0"]["mlp"] == {"up": 2, "down": 0}
    assert spec["layer_0"]["norm"] == lorax.LORA_FULL
    lp = lorax.init_lora(_attn_params(), spec, jax.random.PRNGKey(0), alpha=1.0)
    assert lp["layer_0"]["attn"]["key"].alpha == 16.0
    assert lp["layer_0"]["mlp"]["up"].alpha == 1.0 and lp["layer_0"]["mlp"]["up"].rank == 2


def test_integer_leaves_are_never_targeted():
    spec = lorax.simple_spec(_attn_params(), decision_fn=lambda p, w: 2)
    assert spec["step"] == lorax.LORA_FREEZE


def test_targets_and_decision_fn_are_exclusive():
    with pytest.raises(ValueError, match="either"):
        lorax.simple_spec(_attn_params(), decision_fn=lambda p, w: 2, targets="q", rank=2)
    with pytest.raises(ValueError, match="rank"):
        lorax.simple_spec(_attn_params(), targets="query")


def test_summary_counts_and_line():
    params = _attn_params()
    spec = lorax.simple_spec(params, targets=r"query|value", rank=4, tune_vectors=True)
    s = lorax.summary(params, spec)
    total = sum(x.size for x in jax.tree.leaves(params))
    assert (s.n_lora, s.n_full, s.n_frozen) == (2, 1, 6)
    assert s.trainable == 2 * 4 * (16 + 16) + 16 and s.total == total
    assert s.base_bytes == sum(x.nbytes for x in jax.tree.leaves(params)) and s.quantized == 0
    line = str(s)
    assert "\n" not in line and f"{s.trainable:,}" in line and "%" in line and "MiB" in line
    # The same numbers after init, counted from the LoraWeights themselves.
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    assert lorax.summary(lp, spec) == s


def test_spec_tree_mismatch_names_the_path():
    params = _attn_params()
    spec = lorax.simple_spec(params)
    del spec["layer_0"]["mlp"]["down"]
    with pytest.raises(ValueError, match="layer_0/mlp/down"):
        lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    spec = lorax.simple_spec(params)
    spec["extra"] = 3
    with pytest.raises(ValueError, match="extra"):
        lorax.init_lora(params, spec, jax.random.PRNGKey(0))


_CONSUMERS = {
    "quantize": lambda p, s: lorax.quantize(p, s, "nf4", min_size=1),
    "init_lora": lambda p, s: lorax.init_lora(p, s, jax.random.PRNGKey(0)),
    "wrap_optimizer": lambda p, s: lorax.wrap_optimizer(optax.adam(1e-3), s).init(p),
    "partition": lorax.partition,
    "split_lora_params": lorax.split_lora_params,
    "summary": lorax.summary,
}


@pytest.mark.parametrize("consumer", sorted(_CONSUMERS))
@pytest.mark.parametrize("bad", ["nf4", 1.5, True, -2])
def test_a_value_that_is_no_spec_value_names_its_path(consumer, bad):
    # Each consumer would otherwise read it as "LoRA", "full" or "frozen": wrap_optimizer
    # trained a leaf marked "nf4", quantize left it dense.
    params = {"attn": {"q": jnp.ones((64, 64)), "k": jnp.ones((64, 64))}}
    spec = {"attn": {"q": 4, "k": bad}}
    with pytest.raises(ValueError, match=rf"{consumer}: spec value at 'attn/k' must be"):
        _CONSUMERS[consumer](params, spec)


def test_a_qtype_where_the_spec_goes_says_so():
    w = jnp.ones((64, 64))
    with pytest.raises(ValueError, match=r"'<root>'.*got 'nf4' \(lorax.quantize takes the spec"):
        lorax.quantize(w, "nf4")


def test_numpy_integer_ranks_are_spec_values():
    import numpy as np

    params = {"q": jnp.ones((16, 16)), "n": jnp.ones(16)}
    spec = {"q": np.int64(4), "n": np.int8(lorax.LORA_FULL)}
    lp = lorax.init_lora(params, spec, jax.random.PRNGKey(0))
    assert lp["q"].a.shape == (4, 16)
    assert lorax.summary(params, spec).n_full == 1


def test_tune_vectors_counts_axes_longer_than_one():
    """Haiku's BatchNorm keeps `(1, 1, 1, C)` scale/offset: vectors, whatever their ndim.
    A `(1, C)` leaf has no matrix to factor either; `(2, C)` does."""
    params = {"bn": {"scale": jnp.ones((1, 1, 1, 8)), "offset": jnp.zeros((1, 1, 1, 8))},
              "row": jnp.ones((1, 8)), "w": jnp.ones((2, 8))}
    spec = lorax.simple_spec(params, decision_fn=lambda path, w: 1, tune_vectors=True)
    assert spec == {"bn": {"scale": lorax.LORA_FULL, "offset": lorax.LORA_FULL},
                    "row": lorax.LORA_FULL, "w": 1}
    frozen = lorax.simple_spec(params, decision_fn=lambda path, w: 1)
    assert frozen["bn"] == {"scale": lorax.LORA_FREEZE, "offset": lorax.LORA_FREEZE}


def test_simple_spec_refuses_what_would_freeze_everything_silently():
    params = {"attn": {"query": jnp.zeros((8, 8))}, "norm": jnp.ones(8)}
    with pytest.raises(ValueError, match="`rank=` is the value for `targets=`"):
        lorax.simple_spec(params, rank=4)
    with pytest.raises(ValueError, match=r"targets 'q_proj' matched no weight matrix.*attn/query"):
        lorax.simple_spec(params, targets="q_proj", rank=4)
    with pytest.raises(ValueError, match=r"target '\(' is not a regular expression"):
        lorax.simple_spec(params, targets="(", rank=4)
    with pytest.raises(ValueError, match="the value for target 'query' must be an int rank"):
        lorax.simple_spec(params, targets={"query": "4"})
    with pytest.raises(TypeError, match="tune_vectors must be True or False"):
        lorax.simple_spec(params, tune_vectors="yes")
    # a list of targets of which one matches is a model's usual list
    assert lorax.simple_spec(params, targets=["q_proj", "query"], rank=4)["attn"]["query"] == 4


@pytest.mark.parametrize("value", ["2", None, 2.5, -3, True])
def test_simple_spec_names_a_decision_fns_bad_value(value):
    with pytest.raises(ValueError, match=rf"decision_fn returned {value!r} for 'w'"):
        lorax.simple_spec({"w": jnp.zeros((4, 4))}, lambda path, arr: value)


@pytest.mark.parametrize("params, spec, match", [
    ((jnp.zeros((4, 4)), jnp.zeros(4)), [2, 0], r"Expected list, got \('·', '·'\)"),
    ({0: jnp.zeros((4, 4))}, {"0": 2}, "Dict key mismatch"),
])
def test_a_spec_with_other_containers_is_named(params, spec, match):
    """Same path strings, other containers: refused before any tree operation fails."""
    with pytest.raises(ValueError, match=rf"init_lora: the spec's containers do not match.*{match}"):
        lorax.init_lora(params, spec, jax.random.PRNGKey(0))


@pytest.mark.parametrize("spec, match", [
    ({"w": lorax.LoraSpec(2, m_ndim=5), "bias": 0}, "summary: 'w' has shape"),
    ({"w": 2, "bias": 2}, "summary: 'bias' has shape"),  # init_lora refuses it too
])
def test_summary_refuses_what_init_lora_refuses(spec, match):
    params = {"w": jnp.zeros((8, 4)), "bias": jnp.zeros(4)}
    with pytest.raises(ValueError, match=match):
        lorax.summary(params, spec)
    with pytest.raises(ValueError, match=match.replace("summary", "init_lora")):
        lorax.init_lora(params, spec, jax.random.PRNGKey(0))
