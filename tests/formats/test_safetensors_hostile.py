"""Checkpoints from strangers: `lorax.load_safetensors` refuses shard names that leave the
directory and gives a `ValueError` naming the file, the tensor and the field for every
companion tensor, quant_state or quantization_config that disagrees with the weight.

Each case copies a fixture the real libraries wrote (tests/data/checkpoints) and changes
one thing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import lorax
from lora_testing import read_safetensors_all, write_safetensors

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "checkpoints"
Q = "model.layers.0.self_attn.q_proj."


def _copy(tmp_path: Path, case: str) -> Path:
    dst = tmp_path / case
    shutil.copytree(FIXTURES / case, dst)
    for extra in ("reference.safetensors", "reference.json"):
        (dst / extra).unlink()
    return dst


def _shard_of(d: Path, name: str) -> Path:
    index = d / "model.safetensors.index.json"
    if index.exists():
        return d / json.loads(index.read_text())["weight_map"][name]
    return d / "model.safetensors"


def _edit(d: Path, name: str, fn) -> None:
    """Rewrite the shard holding `name` with `fn(tensors)` applied."""
    shard = _shard_of(d, name)
    tensors = read_safetensors_all(shard)
    fn(tensors)
    write_safetensors(shard, tensors)


def _config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _index(d: Path, fn) -> None:
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    fn(index)
    path.write_text(json.dumps(index))


def _refused(d: Path, *parts: str) -> None:
    with pytest.raises(ValueError) as err:
        lorax.load_safetensors(d)
    for p in parts:
        assert p in str(err.value), (p, str(err.value))


# -- the container ---------------------------------------------------------------------------


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../x"])
def test_a_shard_outside_the_directory_is_refused(tmp_path, shard):
    d = _copy(tmp_path, "bf16_sharded")
    (tmp_path / "outside.safetensors").write_bytes(b"")
    _index(d, lambda ix: ix["weight_map"].update({Q + "weight": shard}))
    _refused(d, "not inside", repr(shard))


def test_a_symlink_pointing_out_is_refused(tmp_path):
    d = _copy(tmp_path, "bf16_sharded")
    victim = _shard_of(d, Q + "weight")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(victim, outside)
    os.symlink(outside, victim)
    _refused(d, "not inside", victim.name)


def test_a_hugging_face_cache_snapshot_loads_through_its_symlinks(tmp_path):
    """The Hub's cache keeps a snapshot's files as symlinks to `../../blobs/<hash>`: that
    is the one place outside the directory they may point to."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted((FIXTURES / "bf16_sharded").iterdir())):
        if f.name.startswith("reference"):
            continue
        shutil.copy(f, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f.name)
    tensors, config = lorax.load_safetensors(snap)
    assert config["model_type"] == "llama" and len(tensors) > 5
    victim = snap / "model-00001-of-00005.safetensors"  # a symlink out of the repository
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(victim, outside)
    victim.unlink()
    os.symlink(outside, victim)
    _refused(snap, "not inside", victim.name)


def test_the_index_must_put_each_tensor_where_it_is(tmp_path):
    d = _copy(tmp_path, "bf16_sharded")
    names = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    other = next(s for s in names.values() if s != names[Q + "weight"])
    _index(d, lambda ix: ix["weight_map"].update({Q + "weight": other}))
    _refused(d, Q + "weight", other, "does not hold it")


@pytest.mark.parametrize("weight_map", [[], "x", {"a": 3}])
def test_an_index_of_the_wrong_types_is_refused(tmp_path, weight_map):
    d = _copy(tmp_path, "bf16_sharded")
    _index(d, lambda ix: ix.update(weight_map=weight_map))
    _refused(d, "model.safetensors.index.json", "weight_map")


def test_a_shard_that_is_not_safetensors_is_refused(tmp_path):
    d = _copy(tmp_path, "bf16_sharded")
    shard = _shard_of(d, Q + "weight")
    shard.write_bytes(shard.read_bytes()[:100])
    _refused(d, shard.name, "not a readable safetensors file")


@pytest.mark.parametrize("qc, field", [({"quant_method": "hqq"}, "quant_method 'hqq'"),
                                       ({"quant_method": 4}, "quant_method"),
                                       ("nf4", "quantization_config")])
def test_an_unknown_or_mistyped_quantization_config_is_refused(tmp_path, qc, field):
    d = _copy(tmp_path, "bnb_nf4")
    _config(d, lambda c: c.update(quantization_config=qc))
    _refused(d, "config.json", field)


# -- bitsandbytes ---------------------------------------------------------------------------------


def _quant_state(d: Path, fn, kind: str = "nf4") -> None:
    name = Q + f"weight.quant_state.bitsandbytes__{kind}"

    def edit(t):
        qs = json.loads(bytes(t[name]).decode())
        fn(qs)
        t[name] = np.frombuffer(json.dumps(qs).encode(), np.uint8).copy()
    _edit(d, name, edit)


@pytest.mark.parametrize("key, value, field", [
    ("blocksize", "64", "blocksize"), ("shape", [64], "shape"), ("shape", None, "shape"),
    ("quant_type", "fp4", "quant_type"), ("dtype", "int8", "dtype"),
    ("nested_blocksize", 128, "nested_blocksize"), ("nested_offset", "x", "nested_offset"),
])
def test_a_mistyped_quant_state_names_its_field(tmp_path, key, value, field):
    d = _copy(tmp_path, "bnb_nf4_dq")
    _quant_state(d, lambda qs: qs.update({key: value}))
    _refused(d, Q + "weight.quant_state.bitsandbytes__nf4", field)


def test_a_quant_state_that_is_not_json_is_refused(tmp_path):
    d = _copy(tmp_path, "bnb_nf4")
    name = Q + "weight.quant_state.bitsandbytes__nf4"
    _edit(d, name, lambda t: t.update({name: np.frombuffer(b"{nope", np.uint8).copy()}))
    _refused(d, name, "not JSON")


def test_bnb_blocks_that_cross_rows_are_refused(tmp_path):
    d = _copy(tmp_path, "bnb_nf4")
    _quant_state(d, lambda qs: qs.update(blocksize=qs["shape"][1] * 2))
    _refused(d, Q + "weight", "not a multiple of the blocksize")


def test_a_gptq_config_of_other_bits_is_refused(tmp_path):
    d = _copy(tmp_path, "gptq_sym")
    _config(d, lambda c: c["quantization_config"].update(bits=8))
    _refused(d, "config.json", "bits is 8")


# -- every format's companion tensors --------------------------------------------------------

# (case, the companion changed, how, what the error says besides its file and tensor)
COMPANIONS = [
    ("bnb_nf4_dq", "weight.absmax", lambda x: x[:-1], "expected shape"),
    ("bnb_nf4_dq", "weight", lambda x: x[:-2], "holds"),
    ("bnb_nf4_dq", "weight.quant_map", lambda x: x * 2, "code book"),
    ("bnb_nf4_dq", "weight.nested_quant_map", lambda x: x[::-1].copy(), "dynamic map"),
    ("bnb_nf4_dq", "weight.nested_absmax", lambda x: x.astype(np.float16), "expected dtype float32"),
    ("bnb_int8", "SCB", lambda x: x[:-1], "expected shape"),
    ("fp8_block", "weight_scale_inv", lambda x: x[:, :1], "expected shape"),
    ("fp8_block", "weight", lambda x: x.astype(np.float16), "float8_e4m3fn"),
    ("gptq_asym", "scales", lambda x: x[:-1], "expected shape"),
    ("gptq_asym", "qzeros", lambda x: x[:, :-1], "expected shape"),
    ("gptq_asym", "g_idx", lambda x: np.maximum(x, 1), "expected each of the 2 groups"),
    ("awq_gemm", "qzeros", lambda x: x[:-1], "expected shape"),
    # (weight_shape disagrees with the codes: the error names the codes and the shape)
    ("ct_int4_asym", "weight_shape", lambda x: x * 2, "weight_packed' (weight_packed): expected "
                                                      "int32 (out, in/8)"),
    ("ct_int4_asym", "weight_scale", lambda x: x[:-1], "weight_scale' (weight_scale): expected"),
    ("ct_int4_asym", "weight_zero_point", lambda x: x[:, :-1],
     "weight_zero_point' (weight_zero_point): expected shape"),
]


@pytest.mark.parametrize("case, suffix, change, field", COMPANIONS,
                         ids=[f"{c[0]}-{c[1]}" for c in COMPANIONS])
def test_companions_that_disagree_are_refused(tmp_path, case, suffix, change, field):
    """Each names the file and the tensor (`Q...`), and the field as `field` says."""
    d = _copy(tmp_path, case)
    _edit(d, Q + suffix, lambda t: t.update({Q + suffix: change(t[Q + suffix])}))
    _refused(d, Q, field)
