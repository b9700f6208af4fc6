"""Files from strangers: mutated adapter and PEFT files give a `ValueError` naming the
file, or load, and nothing else: no crash, no hang, no allocation beyond the file's
size, no half-applied adapter.

Each example starts from a valid file and applies one mutation: truncation, bit flips,
an edit of a tensor's header entry (offsets past the end, overlapping, negative or huge
shapes, unknown dtypes), or of a JSON field the loader reads (any JSON type); a GGUF
file's header gets bytes or whole 8-byte words overwritten (counts, lengths, dims, offsets
set to 2^31, 2^32+5, 2^63, 2^64-1). Beside the random examples, every number PEFT's config
carries is set to each JSON type, and every 8-byte word of a GGUF header to each of those
four values, each case checked. The thorough profile runs 600 examples per file kind
(`HYPOTHESIS_PROFILE=thorough`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lorax
from lora_testing import gguf_blocks

PARAMS = {"w": np.linspace(-1, 1, 8 * 6, dtype=np.float32).reshape(8, 6),
          "bias": np.zeros(6, np.float32)}
SPEC = {"w": 2, "bias": lorax.LORA_FULL}
THOROUGH = max(settings.default.max_examples, 600 if settings.default.max_examples >= 400 else 0)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)


# The numbers PEFT's config carries (the patterns' values under the saved module's name),
# and numbers that are each wrong somewhere (a negative alpha is not: it scales the update).
PEFT_NUMBERS = ["r", "lora_alpha", "lora_dropout", "rank_pattern", "alpha_pattern"]
ODD_NUMBERS = [0, -1, 2.5, 1.0, 2**70, 10**400, 1e308, float("nan"), float("inf")]


def _lora_params():
    lp = lorax.init_lora({k: jnp.asarray(v) for k, v in PARAMS.items()}, SPEC, jax.random.PRNGKey(0))
    return {**lp, "w": lorax.LoraWeight(lp["w"].w, lp["w"].a, lp["w"].b + 0.1, alpha=2.0)}


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("valid")
    lp = _lora_params()
    lorax.save_adapter(d / "adapter.safetensors", lp, SPEC)
    lorax.save_peft(d / "peft", {"w": lp["w"]}, layout="in_out", base_model_name_or_path="x")
    return {"adapter": (d / "adapter.safetensors").read_bytes(),
            "peft_weights": (d / "peft" / "adapter_model.safetensors").read_bytes(),
            "peft_config": (d / "peft" / "adapter_config.json").read_bytes()}


def _split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header: dict, body: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + body


@st.composite
def mutations(draw, data: bytes):
    kind = draw(st.sampled_from(["truncate", "flip", "tensor", "metadata"]))
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            out[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    header, body = _split(data)
    names = sorted(k for k in header if k != "__metadata__")
    if kind == "tensor":
        name = draw(st.sampled_from(names))
        key = draw(st.sampled_from(["data_offsets", "shape", "dtype"]))
        big = st.integers(-2**40, 2**62)
        header[name][key] = draw({
            "data_offsets": st.lists(st.integers(-8, len(body) + 64) | big, min_size=0, max_size=3),
            "shape": st.lists(st.integers(-3, 12) | big, max_size=4),
            "dtype": st.sampled_from(["F32", "F16", "BF16", "I8", "F64", "Q4", "", "f32"]),
        }[key])
        return _join(header, body)
    meta = header.setdefault("__metadata__", {})
    if "entries" in meta and draw(st.booleans()):
        entries = json.loads(meta["entries"])
        entry = draw(st.sampled_from(entries))
        entry[draw(st.sampled_from(sorted(entry) + ["m_axes"]))] = draw(json_values)
        meta["entries"] = json.dumps(entries)
    else:
        meta[draw(st.sampled_from(sorted(meta) or ["format"]))] = draw(st.text(max_size=12))
    return _join(header, body)


def _loads_or_names_the_file(load, where: str):
    try:
        load()
    except ValueError as err:
        assert where in str(err), f"the error does not name {where!r}: {err}"


@settings(max_examples=THOROUGH or settings.default.max_examples, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_adapter_files(valid_files, tmp_path, data):
    blob = data.draw(mutations(valid_files["adapter"]))
    path = tmp_path / "adapter.safetensors"
    path.write_bytes(blob)
    base = {k: jnp.asarray(v) for k, v in PARAMS.items()}
    _loads_or_names_the_file(lambda: lorax.load_adapter(path, base), os.fspath(path))
    for k, v in PARAMS.items():  # the caller's parameters are never touched
        np.testing.assert_array_equal(base[k], v)


@settings(max_examples=THOROUGH or settings.default.max_examples, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_peft_adapters(valid_files, tmp_path, data):
    d = tmp_path / "peft"
    d.mkdir(exist_ok=True)
    weights, config = valid_files["peft_weights"], valid_files["peft_config"]
    if data.draw(st.booleans()):
        weights = data.draw(mutations(weights))
    else:
        cfg = json.loads(config)
        if data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(cfg)) | st.sampled_from(PEFT_NUMBERS))
            value = data.draw(json_values | st.sampled_from(ODD_NUMBERS))
            in_pattern = key.endswith("_pattern") and data.draw(st.booleans())
            cfg[key] = {"w": value} if in_pattern else value  # a pattern's value, or itself
            config = json.dumps(cfg).encode()
        else:
            config = config[:data.draw(st.integers(0, len(config) - 1))]
    (d / "adapter_model.safetensors").write_bytes(weights)
    (d / "adapter_config.json").write_bytes(config)
    base = {"w": jnp.asarray(PARAMS["w"])}
    _loads_or_names_the_file(lambda: lorax.load_peft(d, base, layout="in_out"), os.fspath(d))


def _finite(value) -> bool:
    if type(value) not in (int, float):  # not bool, str, list, dict, None
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond float's range
        return False


def _fits(key: str, value) -> bool:
    """Whether `value` is a valid `key` for the fuzzed adapter (rank 2, one module `w`)."""
    if key in ("r", "rank_pattern"):
        return type(value) is int and value == 2
    if key == "lora_dropout":
        return _finite(value) and 0 <= value < 1
    return _finite(value)  # an alpha: any finite number


@pytest.mark.parametrize("key", PEFT_NUMBERS)
def test_each_peft_number_set_to_each_json_type(valid_files, tmp_path, key):
    """`null`, `true`, a string, a list, an object, a float, negative, zero and huge numbers
    in each number PEFT's config carries: either the adapter loads (a value that fits) or a
    `ValueError` names the config file and the field, never a `TypeError` from `float()`."""
    d = tmp_path / "peft"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(valid_files["peft_weights"])
    base = {"w": jnp.asarray(PARAMS["w"])}
    field = f"{key}['w']" if key.endswith("_pattern") else key
    for value in [None, True, False, "2", [2], {"w": 2}, 2, *ODD_NUMBERS]:
        cfg = json.loads(valid_files["peft_config"])
        cfg[key] = {"w": value} if key.endswith("_pattern") else value
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        try:
            lp, _ = lorax.load_peft(d, base, layout="in_out")
        except ValueError as err:
            assert not _fits(key, value), f"{key} = {value!r} fits but: {err}"
            assert os.fspath(d) in str(err), f"{key} = {value!r}: no file named: {err}"
            ours = f"{os.fspath(d / 'adapter_config.json')!r}: {field}: expected"
            mismatch = "the config says r = " if type(value) is int and value > 0 else ours
            assert ours in str(err) or mismatch in str(err), f"{key} = {value!r}: {err}"
        else:
            assert _fits(key, value), f"{key} = {value!r} loaded"
            assert isinstance(lp["w"], lorax.LoraWeight) and math.isfinite(lp["w"].alpha)


# -- GGUF: the base file save_gguf_lora reads ------------------------------------------


def _gguf_base(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((8, 32), np.float32))
    w.add_tensor("blk.0.attn_v.weight", gguf.quants.quantize(
        np.ones((8, 32), np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Header words that cannot be true of a small file, each past a limit (int32, uint32, int64).
WORDS = [2**31, 2**32 + 5, 2**63, 2**64 - 1]


@st.composite
def gguf_mutations(draw, data: bytes):
    kind = draw(st.sampled_from(["truncate", "bytes", "word"]))
    if kind == "truncate":
        return data[:draw(st.integers(0, len(data) - 1))]
    out = bytearray(data)
    # Flips in the header (counts, lengths, types, dims, offsets) are what can lie.
    header_end = min(len(data), 600)
    if kind == "word":  # one u64 (a count, length, dim or offset, or parts of two) replaced
        at = draw(st.integers(0, header_end - 8))
        struct.pack_into("<Q", out, at, draw(st.sampled_from(WORDS) | st.integers(0, 2**64 - 1)))
        return bytes(out)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, header_end - 1))
        out[i] = draw(st.integers(0, 255))
    return bytes(out)


@settings(max_examples=THOROUGH or settings.default.max_examples, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_gguf_base_files(tmp_path, data):
    pytest.importorskip("gguf")
    valid = tmp_path / "valid.gguf"
    if not valid.exists():
        _gguf_base(valid)
    path = tmp_path / "base.gguf"
    path.write_bytes(data.draw(gguf_mutations(valid.read_bytes())))
    lp = lorax.init_lora({"layers": {"0": {"mlp": {"down_proj": {"weight": jnp.zeros((8, 32))}}}}},
                         {"layers": {"0": {"mlp": {"down_proj": {"weight": 2}}}}},
                         jax.random.PRNGKey(0))
    out = tmp_path / "adapter.gguf"
    _loads_or_names_the_file(lambda: lorax.save_gguf_lora(
        out, lp, path, layout="out_in", module_name=lambda p, l: "model.layers.0.mlp.down_proj"),
        os.fspath(path))


def _gguf_model(path):
    """A small model file in the block types people download (K-quants, Q5, Q8, F16)."""
    import gguf

    G = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", gguf_blocks("q4_k", (2, 256)), raw_dtype=G.Q4_K)
    w.add_tensor("blk.0.ffn_up.weight", gguf_blocks("q5_0", (2, 64)), raw_dtype=G.Q5_0)
    w.add_tensor("blk.0.ffn_down.weight", gguf_blocks("q6_k", (1, 256)), raw_dtype=G.Q6_K)
    w.add_tensor("output_norm.weight", np.ones(64, np.float16))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()


@settings(max_examples=THOROUGH or settings.default.max_examples, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_gguf_model_files(tmp_path, data):
    """`load_gguf` on a damaged or lying model file: a `ValueError` naming the file, or
    tensors of the shapes the (possibly edited) header states, never a crash."""
    pytest.importorskip("gguf")
    valid = tmp_path / "valid.gguf"
    if not valid.exists():
        _gguf_model(valid)
    path = tmp_path / "model.gguf"
    path.write_bytes(data.draw(gguf_mutations(valid.read_bytes())))
    try:
        tensors, _ = lorax.load_gguf(path)
    except ValueError as err:
        assert os.fspath(path) in str(err), f"the error does not name the file: {err}"
        return
    for x in tensors.values():  # what loaded is whole: its bytes fit its shape
        dense = np.asarray(x.dequantize() if isinstance(x, lorax.QuantizedArray) else x)
        assert dense.shape == tuple(x.shape)


# What a GGUF error names: a tensor, a metadata entry or field, a count, the file's kind.
GGUF_FIELD = re.compile(r"tensor |metadata|count is|version|big-endian|not a GGUF file|"
                        r"general\.alignment|has no '.*' field|: expected |head_count")


def _header_end(path) -> int:
    """Where a GGUF file's data section starts (its header and padding end)."""
    import gguf

    return int(gguf.GGUFReader(path).data_offset)


def _load_model(path, tmp_path):
    tensors, _ = lorax.load_gguf(path)
    for x in tensors.values():  # what loaded is whole: its bytes fit its shape
        dense = np.asarray(x.dequantize() if isinstance(x, lorax.QuantizedArray) else x)
        assert dense.shape == tuple(x.shape)


def _adapter_for(path, tmp_path):
    lp = lorax.init_lora({"w": jnp.zeros((8, 32))}, {"w": 2}, jax.random.PRNGKey(0))
    lorax.save_gguf_lora(tmp_path / "adapter.gguf", lp, path, layout="out_in",
                         module_name=lambda p, l: "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("make, use", [(_gguf_model, _load_model), (_gguf_base, _adapter_for)],
                         ids=["load_gguf", "save_gguf_lora"])
def test_each_header_word_set_to_each_huge_value(tmp_path, make, use):
    """Every 8-byte word of a small GGUF file's header (at every byte, so every field and
    every pair of neighbours) set to 2^31, 2^32+5, 2^63 and 2^64-1: `load_gguf` loads
    whole tensors (`save_gguf_lora` writes an adapter for it) or a `ValueError` names the
    file and the field, never numpy's "Maximum allowed dimension exceeded" or a
    `TypeError`."""
    pytest.importorskip("gguf")
    make(tmp_path / "valid.gguf")
    data, end = (tmp_path / "valid.gguf").read_bytes(), _header_end(tmp_path / "valid.gguf")
    path, escaped, failed = tmp_path / "edited.gguf", [], 0
    for at in range(end - 8 + 1):
        for value in WORDS:
            out = bytearray(data)
            struct.pack_into("<Q", out, at, value)
            path.write_bytes(bytes(out))
            try:
                use(path, tmp_path)
            except ValueError as err:
                failed += 1
                if os.fspath(path) not in str(err) or not GGUF_FIELD.search(str(err)):
                    escaped.append((at, value, str(err)))
            except Exception as err:  # noqa: BLE001 - what escapes is the finding
                escaped.append((at, value, f"{type(err).__name__}: {err}"))
    assert not escaped, f"{len(escaped)} cases escaped, e.g. {escaped[:3]}"
    print(f"{failed} of {4 * (end - 7)} header words rejected")
    assert failed > 0.5 * 4 * (end - 7)  # most words cannot be true (the rest are in names)


def test_the_unmutated_files_load(valid_files, tmp_path):
    """The fuzzed files start valid: unmutated, each loads (so a mutation is what fails)."""
    (tmp_path / "adapter.safetensors").write_bytes(valid_files["adapter"])
    lp, _ = lorax.load_adapter(tmp_path / "adapter.safetensors",
                               {k: jnp.asarray(v) for k, v in PARAMS.items()})
    assert isinstance(lp["w"], lorax.LoraWeight)
    d = tmp_path / "peft"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(valid_files["peft_weights"])
    (d / "adapter_config.json").write_bytes(valid_files["peft_config"])
    lp, _ = lorax.load_peft(d, {"w": jnp.asarray(PARAMS["w"])}, layout="in_out")
    assert isinstance(lp["w"], lorax.LoraWeight)
    pytest.importorskip("gguf")
    _gguf_base(tmp_path / "base.gguf")
    lp = lorax.init_lora({"w": jnp.zeros((8, 32))}, {"w": 2}, jax.random.PRNGKey(0))
    lorax.save_gguf_lora(tmp_path / "a.gguf", lp, tmp_path / "base.gguf", layout="out_in",
                         module_name=lambda p, l: "model.layers.0.mlp.down_proj")
    assert (tmp_path / "a.gguf").stat().st_size > 0
    _gguf_model(tmp_path / "model.gguf")
    tensors, _ = lorax.load_gguf(tmp_path / "model.gguf")
    assert tensors["blk.0.attn_q.weight"].qtype == "q4_k"


# -- Hugging Face checkpoints: load_safetensors ---------------------------------------------

CHECKPOINTS = Path(__file__).resolve().parent.parent / "data" / "checkpoints"
FUZZED_CHECKPOINTS = ["bnb_nf4_dq", "bnb_int8", "fp8_block", "gptq_asym", "awq_gemm",
                      "ct_int4_asym", "ct_fp8_tensor", "bf16_sharded"]


def _checkpoint_copy(case: str, d: Path) -> Path:
    if not d.exists():
        shutil.copytree(CHECKPOINTS / case, d, ignore=shutil.ignore_patterns("reference.*"))
    return d


@st.composite
def checkpoint_mutations(draw, d: Path) -> None:
    """One change to a copied checkpoint: a shard's bytes (as `mutations`), a field of its
    `config.json` or `quantization_config`, or an entry of its index."""
    shards = sorted(d.glob("*.safetensors"))
    kind = draw(st.sampled_from(["shard", "config", "quantization_config", "index"]))
    if kind == "shard" or not (d / "config.json").exists():
        shard = draw(st.sampled_from(shards))
        shard.write_bytes(draw(mutations(shard.read_bytes())))
        return
    path = d / ("model.safetensors.index.json" if kind == "index" else "config.json")
    if not path.exists():
        path = d / "config.json"
    data = json.loads(path.read_text())
    target = data.get("weight_map") if kind == "index" else data.get("quantization_config", data)
    if kind == "config" or not isinstance(target, dict) or not target:
        target = data
    key = draw(st.sampled_from(sorted(target)) | st.sampled_from(["dtype", "group_size", "bits"]))
    target[key] = draw(json_values | st.sampled_from(ODD_NUMBERS) | st.sampled_from(
        ["../outside.safetensors", "/etc/passwd", shards[0].name]))
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("case", FUZZED_CHECKPOINTS)
@settings(max_examples=THOROUGH or settings.default.max_examples, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_hugging_face_checkpoints(tmp_path, case, data):
    """`load_safetensors` on a damaged or lying checkpoint (a real library's, one thing
    changed): a `ValueError` naming a file of the checkpoint, or tensors whose values fit
    their shapes, never another exception."""
    d = Path(tempfile.mkdtemp(dir=tmp_path)) / case  # a fresh copy for every example
    data.draw(checkpoint_mutations(_checkpoint_copy(case, d)))
    try:
        tensors, _ = lorax.load_safetensors(d)
    except ValueError as err:
        assert os.fspath(d) in str(err) or "config.json" in str(err), f"no file named: {err}"
        return
    for x in tensors.values():
        dense = np.asarray(x.dequantize() if isinstance(x, lorax.QuantizedArray) else x)
        assert dense.shape == tuple(x.shape)


@pytest.mark.parametrize("case", FUZZED_CHECKPOINTS)
def test_the_unmutated_checkpoints_load(tmp_path, case):
    tensors, _ = lorax.load_safetensors(_checkpoint_copy(case, tmp_path / case))
    assert tensors
