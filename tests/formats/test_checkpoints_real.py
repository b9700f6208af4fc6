"""The checkpoint fixtures in tests/data/checkpoints against the libraries that define them.

Runs in the optional env `.tools/ckpt-ref` (`bash scripts/test-checkpoints`, which checks the
imports first): torch, transformers 5, bitsandbytes, compressed-tensors and AutoAWQ's files next
to the lorax dev env. The main environment has no torch, so the module skips there.

Each fixture's `reference.safetensors` is what lorax's reader is held to, bit for bit; these
tests make sure it can't drift from what the libraries compute:
- recomputed: every case's reference, recomputed from the COMMITTED checkpoint files by the
  reference library (bitsandbytes' dequantize_4bit / int8_vectorwise_dequant, compressed-tensors'
  compressors, transformers' FP8 dequantization, AutoAWQ's dequantize_gemm, transformers'
  from_pretrained for the dense case; gptqmodel's dequantization as transcribed in
  scripts/make_checkpoints.py), is bit-identical to the committed one;
- rederived: the same references follow from the committed files by the formats' plain
  formulas in numpy (make_checkpoints.py's verify_* functions);
- regenerated: scripts/make_checkpoints.py, run again into a temporary directory with the
  pinned libraries, writes every committed file byte for byte (checkpoint, references, JSON);
- loaded: transformers' own loaders read the bitsandbytes and compressed-tensors checkpoints
  back to the references' native values (a bare model.safetensors, having no config.json for
  from_pretrained, through bitsandbytes' Params4bit.from_prequantized instead).

lorax's side (its reader against these references) is tested in the main env, without torch.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("bitsandbytes")
pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

# transformers' notice that the checkpoint's own quantization_config wins over the one passed
# (only its `dequantize` flag is taken, which is the point).
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "checkpoints"

# scripts/ is no package: the generator is loaded from its file (registered first, as its
# dataclasses look their module up).
_spec = importlib.util.spec_from_file_location("make_checkpoints",
                                               ROOT / "scripts" / "make_checkpoints.py")
mc = sys.modules["make_checkpoints"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mc)

CASES = list(mc.CASES)
REFERENCE_JSON_KEYS = ["case", "format", "made_by", "writer", "reference", "quantized", "notes"]


def assert_same_tensors(actual: dict, expected: dict) -> None:
    """Same names, dtypes, shapes and bytes (NaN- and signed-zero-exact)."""
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        got = actual[name]
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), name
        got_bytes = got.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(got_bytes, want.contiguous().view(-1).view(torch.uint8)), name


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("checkpoints")
    mc.build(out)
    return out


def test_every_case_is_committed():
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_reference_recomputed_from_committed_files(case):
    committed = load_file(DATA / case / "reference.safetensors")
    assert_same_tensors(mc.CASES[case].reference(DATA / case), committed)


@pytest.mark.parametrize("case", CASES)
def test_reference_rederived_with_numpy(case):
    mc.CASES[case].verify(DATA / case, load_file(DATA / case / "reference.safetensors"))


@pytest.mark.parametrize("case", CASES)
def test_reference_layout(case):
    """reference.json's fields; float32 (out, in) references, named as the logical weights."""
    info = json.loads((DATA / case / "reference.json").read_text())
    assert list(info) == REFERENCE_JSON_KEYS and info["case"] == case
    ref = load_file(DATA / case / "reference.safetensors")
    if not info["quantized"]:  # the dense case: the whole state dict, in its own dtype
        assert sorted(ref) == sorted(mc.read_checkpoint(DATA / case))
        return
    assert sorted(k for k in ref if "@" not in k) == sorted(info["quantized"])
    assert all(k.removesuffix("@native") in ref for k in ref)
    expected_shapes = mc.CASES[case].bare_shapes
    if expected_shapes is not None:  # a lone model.safetensors: nothing else beside the refs
        assert sorted(p.name for p in (DATA / case).iterdir()) == [
            "model.safetensors", "reference.json", "reference.safetensors"]
    else:  # sized by the checkpoint's own config.json
        config = json.loads((DATA / case / "config.json").read_text())
        dims = {k: config[k] for k in mc.MODEL}
        expected_shapes = {n: tuple(p.shape) for n, p in mc.tiny_llama(dims).state_dict().items()}
    for name in info["quantized"]:
        assert ref[name].dtype == torch.float32 and tuple(ref[name].shape) == expected_shapes[name]


@pytest.mark.parametrize("case", CASES)
def test_regenerated_byte_for_byte(case, regenerated):
    committed = sorted(p.name for p in (DATA / case).iterdir())
    assert sorted(p.name for p in (regenerated / case).iterdir()) == committed
    for name in committed:
        assert (regenerated / case / name).read_bytes() == (DATA / case / name).read_bytes(), name


BNB4 = [c for c in CASES if c.startswith("bnb_") and c != "bnb_int8"]
# transformers' loader needs a config.json (the model class and its quantization_config), which
# a bare model.safetensors doesn't have; those cases go through bitsandbytes' own loader instead.
BNB4_BARE = [c for c in BNB4 if mc.CASES[c].bare_shapes is not None]
BNB4_PRETRAINED = [c for c in BNB4 if c not in BNB4_BARE]


@pytest.mark.parametrize("case", BNB4_PRETRAINED)
def test_transformers_loads_bnb4_to_native(case):
    """transformers' bnb loader on the committed files, dequantized by transformers' own helper
    (what `model.dequantize()` runs), gives the native references."""
    from bitsandbytes.nn import Params4bit
    from transformers import AutoModelForCausalLM
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    model = AutoModelForCausalLM.from_pretrained(DATA / case, device_map="cpu")
    ref = load_file(DATA / case / "reference.safetensors")
    modules = dict(model.named_modules())
    for name in mc.quantized_names():
        weight = modules[name.removesuffix(".weight")].weight
        assert isinstance(weight, Params4bit)
        assert_same_tensors({name: dequantize_bnb_weight(weight)}, {name: ref[name + "@native"]})


@pytest.mark.parametrize("case", BNB4_BARE)
def test_bitsandbytes_loads_bare_bnb4_to_native(case):
    """The part of that loader that needs no config: Params4bit.from_prequantized (what
    transformers' bnb quantizer builds each weight with) on the committed tensors, dequantized by
    transformers' helper, gives the native references."""
    from bitsandbytes.nn import Params4bit
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    tensors = mc.read_checkpoint(DATA / case)
    ref = load_file(DATA / case / "reference.safetensors")
    for name in mc.CASES[case].bare_shapes:
        stats = {k: v for k, v in tensors.items() if k.startswith(name + ".")}
        weight = Params4bit.from_prequantized(tensors[name], stats, device="cpu")
        assert_same_tensors({name: dequantize_bnb_weight(weight)}, {name: ref[name + "@native"]})


CT = [c for c in CASES if c.startswith("ct_")]


@pytest.mark.parametrize("case", CT)
def test_transformers_loads_compressed_tensors_to_native(case):
    """transformers' compressed-tensors loader, decompressing on load, gives the native
    references (so config.json's quantization_config is read as written)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        DATA / case, quantization_config=CompressedTensorsConfig(dequantize=True))
    ref = load_file(DATA / case / "reference.safetensors")
    state = model.state_dict()
    assert_same_tensors({n: state[n] for n in mc.quantized_names()},
                        {n: ref[n + "@native"] for n in mc.quantized_names()})
