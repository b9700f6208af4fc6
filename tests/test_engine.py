"""The engine's contract with quax, JAX and equinox: tested versions, clear failures outside
them, and `LoraWeight`'s own pytree registration (per-call dispatch cost)."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax
from lorax import _engine

ROOT = Path(__file__).resolve().parents[1]


def test_installed_versions_are_the_tested_ones():
    bad = _engine.unsupported_versions()
    assert not bad, (
        f"lorax is being tested with {bad}, outside the range its private-API use was "
        "tested with (lorax/_engine.py SUPPORTED, pyproject.toml bounds). Test the "
        "internals listed in lorax/_engine.py's docstring against it, then widen both."
    )


def test_dependency_bounds_match_the_engine():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {}
    for dep in deps:
        m = re.fullmatch(r"([\w-]+) \((.*)\)", dep)
        bounds[m.group(1)] = m.group(2)
    for name, (lo, hi) in _engine.SUPPORTED.items():
        assert bounds.get(name) == f">={lo},<{hi}", (name, bounds.get(name))


@pytest.mark.parametrize(
    "versions, bad",
    [({"jax": "0.13.0", "quax": "0.4.6", "equinox": "0.13.8"}, ["jax 0.13.0"]),
     ({"jax": "0.9.2", "quax": "0.5.0rc1", "equinox": "0.13.8"}, ["jax 0.9.2", "quax 0.5.0rc1"]),
     ({"jax": "0.12.0.1", "quax": "0.4.6", "equinox": "0.13.8"}, []),
     ({"jax": "0.10.2", "quax": "0.4.9", "equinox": "0.13.12"}, [])],
)
def test_unsupported_versions_are_named(versions, bad):
    found = _engine.unsupported_versions(versions)
    assert [f.split(" (")[0] for f in found] == bad
    assert all("tested: >=" in f for f in found)


def test_moved_internals_fail_at_import_with_the_versions(monkeypatch):
    """A quax whose private trace module is gone: importing lorax says what to install,
    instead of an AttributeError from inside a trace."""
    import quax._trace

    monkeypatch.delattr(quax._trace, "_QuaxTrace")
    saved = {k: v for k, v in sys.modules.items() if k == "lorax" or k.startswith("lorax.")}
    for k in saved:
        del sys.modules[k]
    try:
        with pytest.raises(ImportError) as info:
            importlib.import_module("lorax")
        msg = str(info.value)
        assert "_QuaxTrace" in msg and f"quax {metadata.version('quax')}" in msg
        assert "jax>=0.10.0,<0.13" in msg and "quax>=0.4.6,<0.5" in msg
    finally:
        for k in [k for k in sys.modules if k == "lorax" or k.startswith("lorax.")]:
            del sys.modules[k]
        sys.modules.update(saved)


# -- pytree registration -----------------------------------------------------------------


def test_lora_weight_has_the_fast_pytree_registration():
    """Canary: if equinox's internals move, LoraWeight silently falls back to equinox's
    registration (correct, ~2x slower per jitted call); this turns that red."""
    assert _engine.fast_pytree(lorax.LoraWeight)


def test_fast_registration_is_a_faithful_pytree():
    lw = lorax.LoraWeight(jnp.ones((4, 3)), a=jnp.ones((2, 3)), b=jnp.zeros((4, 2)), alpha=3.0)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(lw)
    assert [p[-1].name for p, _ in leaves] == ["w", "a", "b"]
    again = jax.tree.unflatten(treedef, [x for _, x in leaves])
    assert type(again) is lorax.LoraWeight and again.alpha == 3.0 and again.w is lw.w
    # Unflattening never runs the constructor's checks: JAX and optax rebuild trees
    # with None, labels and per-leaf statistics.
    norms = jax.tree.map(jnp.linalg.norm, lw)
    assert norms.a.shape == () and norms.alpha == 3.0
    assert jax.tree.unflatten(treedef, [None] * 3).w is None
    # Different alphas are different tree structures (alpha is static).
    other = lorax.LoraWeight(lw.w, lw.a, lw.b, alpha=2.0)
    assert jax.tree.structure(other) != treedef
    # Exact: b == 0, so both merges are exactly w; this checks the pytree through jit.
    np.testing.assert_array_equal(jax.jit(lambda x: x.materialize())(lw), lw.materialize())


def test_constructor_still_checks_shapes():
    with pytest.raises(ValueError, match="factor shapes do not fit"):
        lorax.LoraWeight(jnp.ones((4, 3)), a=jnp.ones((2, 4)), b=jnp.zeros((4, 2)))


def test_constructor_rejects_an_integer_weight_and_rank_0():
    a, b = jnp.full((2, 4), 0.3), jnp.full((8, 2), 0.3)
    # An int32 `w` would truncate the update (x @ w + s * x @ b @ a rounded away).
    for w in (jnp.arange(32, dtype=jnp.int32).reshape(8, 4), np.ones((8, 4), np.int8),
              jnp.ones((8, 4), bool), jax.ShapeDtypeStruct((8, 4), jnp.uint8)):
        with pytest.raises(ValueError, match=r"LoraWeight: w has dtype \w+; LoRA needs a "
                                             "floating-point weight.*QuantizedArray"):
            lorax.LoraWeight(w, a, b)
    with pytest.raises(ValueError, match=r"LoraWeight: the factors have rank 0.*rank >= 1"):
        lorax.LoraWeight(jnp.ones((8, 4)), jnp.ones((0, 4)), jnp.ones((8, 0)))
    for alpha in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="LoraWeight: alpha must be a finite number"):
            lorax.LoraWeight(jnp.ones((8, 4)), a, b, alpha)
    # Floating and quantized bases, and abstract ones, are still weights.
    for w in (jnp.ones((8, 4), jnp.bfloat16), jax.ShapeDtypeStruct((8, 4), jnp.float32),
              lorax.QuantizedArray.from_dense(jnp.ones((8, 4)), "int8")):
        assert lorax.LoraWeight(w, a, b).shape == (8, 4)
    # Trees that only share a LoraWeight's structure never meet the check.
    lw = lorax.LoraWeight(jnp.ones((8, 4)), a, b)
    assert jax.tree.map(lambda x: x.dtype == jnp.float32, lw).w is True
    assert jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.int32), lw).w.dtype == jnp.int32
    assert jax.eval_shape(lambda l: l, lw).w.shape == (8, 4)
    from lorax._weight import unchecked_replace

    assert unchecked_replace(lw, w=None, a=False).w is None
