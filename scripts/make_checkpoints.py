"""Real Hugging Face checkpoint fixtures for lorax's safetensors reader (tests/data/checkpoints).

    .tools/ckpt-ref/bin/python scripts/make_checkpoints.py [OUT_DIR [CASE ...]]

OUT_DIR defaults to tests/data/checkpoints; CASEs (default all) are the names below. The env is
the one scripts/test-checkpoints builds (pinned torch, transformers, bitsandbytes,
compressed-tensors, accelerate, and AutoAWQ installed with --no-deps).

Writes one directory per case. Each holds the checkpoint as its writer left it (`config.json`
plus `model.safetensors`, or shards and `model.safetensors.index.json`; for bnb_nf4_dq_wide a
bare `model.safetensors` alone), `reference.safetensors`
(every quantized weight under its logical name, e.g. `model.layers.0.self_attn.q_proj.weight`,
dequantized by the reference library to float32 in torch's `(out, in)` layout, plus the library's
own-dtype result under `<name>@native` where that is not float32; for the dense case every tensor
of the state dict) and `reference.json` (format, library versions, the writer and reference calls).
Everything is seeded: a second run writes the same bytes (tests/formats/test_checkpoints_real.py
checks that, and recomputes each reference from the committed files with the library).

The model is a tiny random `LlamaForCausalLM` (`MODEL`: one layer, so that every fixture holds
all seven projections and the float32 references keep the cases under 3 MB); quantized cases
quantize those seven `nn.Linear`s, leaving embeddings, norms and `lm_head` dense, as the real
tools do.

Cases, their writer -> reference:
- bf16_sharded: `LlamaForCausalLM.save_pretrained(max_shard_size=...)` (shards + index)
  -> the model's `state_dict()` (bf16, as torch had it).
- bnb_nf4_dq, bnb_nf4, bnb_fp4_dq, bnb_fp4: `from_pretrained(bf16_sharded,
  BitsAndBytesConfig(load_in_4bit=True, ...), device_map="cpu").save_pretrained` (what Unsloth's
  `*-bnb-4bit` repos are) -> `bitsandbytes.functional.dequantize_4bit(weight, QuantState.from_dict)`
  with the quant state's dtype set to float32 (native: its stored bfloat16).
- bnb_int8: the same with `load_in_8bit=True` -> `bitsandbytes.functional.int8_vectorwise_dequant`.
- bnb_nf4_dq_wide (no Llama: one (96, 256) weight, so 4 blocks per row and 2 nested absmax
  groups, plus a dense bf16 norm, in a bare model.safetensors without config.json):
  `bitsandbytes.nn.Linear4bit` with `Params4bit(w_bf16, ...).to("cpu")` (`quantize_4bit`, NF4,
  double quant) and its `state_dict()` (`quant_state.as_dict(packed=True)`), `save_file`
  -> `dequantize_4bit` as for the bnb 4-bit cases above.
- fp8_block (DeepSeek-V3 / Qwen3-FP8 layout, its own `FP8_MODEL` with partial 128-blocks on both
  axes): transformers' `Fp8Quantize` (the op its FP8 save path runs) on the weight zero-padded to
  whole blocks, cropped back -> transformers' `_dequantize_fp8_weight(..., torch.float32)`.
- ct_fp8_channel, ct_fp8_tensor, ct_int4_group, ct_int4_asym, ct_int8_channel:
  compressed-tensors' `apply_quantization_config`, min-max qparams from its `calculate_qparams`
  (what llm-compressor's weight observer does), `ModelCompressor.compress_model`,
  `save_pretrained`, `ModelCompressor.update_config` -> the format's compressor `decompress`.
- gptq_sym, gptq_asym, gptq_desc_act: gptqmodel 7.7.0 can't be installed next to torch 2.13 (it
  requires torch>=2.14.1) and its modules can't be imported alone, so its RTN parameters
  (`Quantizer.find_params`), packing (`PackableQuantLinear.pack_original`), v2->v1 qzeros
  conversion (`convert_gptq_v2_to_v1_format_module`) and dequantization
  (`convert_gptq_v1_to_v2_format_module` + `PackableQuantLinear.dequantize_weight`) are
  transcribed below (the `gptq_*` functions) and checked against the original weight.
- awq_gemm: AutoAWQ 0.2.9's own `WQLinear_GEMM.from_linear` (its installed files, loaded without
  the package's model imports) on `pseudo_quantize_tensor`'s output (transcribed: it is a method of
  the calibration class) -> AutoAWQ's `awq.utils.packing_utils.dequantize_gemm`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "checkpoints"
SEED = 0

# As small as the writers allow (the float32 references dominate the fixtures' size): every input
# width a multiple of 64 (bitsandbytes' CPU dequantize_4bit mis-blocks rows whose length is not a
# multiple of its blocksize), every output width a multiple of 32 (AutoAWQ's from_linear packs
# out // 32 * 4 words). k/v (32 x 64) are the non-square ones.
MODEL = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=16)
# 136 = 128 + 8 and 16 < 128: q/o get 2 x 2 scale grids with partial blocks on both axes,
# gate/up/k/v 1 x 2, down 2 x 1.
FP8_MODEL = dict(hidden_size=136, intermediate_size=16, num_hidden_layers=1,
                 num_attention_heads=17, num_key_value_heads=1, head_dim=8, vocab_size=16)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 32  # GPTQ / AWQ / compressed-tensors int4 group size
FP8_BLOCK = 128
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
GPTQMODEL_VERSION = "7.7.0"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's nibble order within an int32 (for notes)

Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Case:
    """One fixture: `make` writes the checkpoint and returns reference.json's fields;
    `reference` recomputes the reference tensors from the files with the library."""

    name: str
    format: str
    make: Callable[[Path, Path], dict]  # (case_dir, dense_dir) -> reference.json fields
    reference: Callable[[Path], Tensors]
    verify: Callable[[Path, Tensors], None]  # independent re-derivation (numpy)
    # Set for a bare `model.safetensors` (no config.json): there is no model config to derive
    # the quantized weights' (out, in) shapes from, so the case declares them.
    bare_shapes: dict[str, tuple[int, int]] | None = None


# --------------------------------------------------------------------------------------------
# shared helpers


def versions(*dists: str) -> dict[str, str]:
    names = ("torch", "transformers", "safetensors", *dists)
    return {d: importlib.metadata.version(d) for d in names}


def llama_config(dims: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**dims, max_position_embeddings=64, tie_word_embeddings=False,
                       dtype="bfloat16")


def tiny_llama(dims: dict = MODEL):
    """A seeded random bfloat16 Llama. Every tensor is drawn here, in name order, so the values
    don't depend on transformers' init code; norms are drawn too (not all ones)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(dims))
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.state_dict().items()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    return model.to(torch.bfloat16).eval()


def quantized_names(dims: dict = MODEL) -> list[str]:
    return [f"model.layers.{i}.{p}.weight"
            for i in range(dims["num_hidden_layers"]) for p in PROJECTIONS]


def read_checkpoint(case_dir: Path) -> Tensors:
    """Every tensor of the checkpoint, through the index when it is sharded."""
    index = case_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    out: Tensors = {}
    for file in files:
        with safe_open(case_dir / file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def submodule(tensors: Tensors, weight_name: str) -> Tensors:
    """The tensors of one module, keyed by their local names (`weight`, `weight_scale`, ...)."""
    prefix = weight_name.removesuffix("weight")
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def save_checkpoint(case_dir: Path, tensors: Tensors, model, quantization_config: dict) -> None:
    """A hand-assembled checkpoint, laid out as `save_pretrained` lays one out: its
    config.json (plus the quantization_config the tool adds) and one model.safetensors."""
    case_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, case_dir / "model.safetensors",
              metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # as model.save_pretrained sets it
    model.config.save_pretrained(case_dir)
    path = case_dir / "config.json"
    config = json.loads(path.read_text()) | {"quantization_config": quantization_config}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_projection(name: str) -> bool:
    return any(name.endswith(f".{p}.weight") for p in PROJECTIONS)


def dense_tensors(model) -> Tensors:
    """The tensors the quantizers leave dense (embeddings, norms, lm_head)."""
    return {k: v for k, v in model.state_dict().items() if not is_projection(k)}


def with_native(f32: torch.Tensor, native: torch.Tensor, name: str) -> Tensors:
    """`name` in float32, plus `name@native` where the library's own result has another dtype."""
    out = {name: f32.float().contiguous()}
    if native.dtype != torch.float32:
        out[f"{name}@native"] = native.contiguous()
    return out


def assert_bits_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert a.tobytes() == b.tobytes(), f"{what}: not bit-identical"


def to_np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def native_rounds_f32(ref: Tensors) -> bool:
    """Whether every `@native` tensor is exactly its float32 reference rounded to its dtype."""
    natives = [k for k in ref if k.endswith("@native")]
    return all(torch.equal(ref[k], ref[k.removesuffix("@native")].to(ref[k].dtype))
               for k in natives)


# --------------------------------------------------------------------------------------------
# bf16_sharded


def make_bf16_sharded(case_dir: Path, _dense_dir: Path) -> dict:
    model = tiny_llama()
    # ~50 KB of bf16: 16 KB shards give >= 3 files and an index.
    model.save_pretrained(case_dir, max_shard_size="16KB")
    return {"writer": "transformers.LlamaForCausalLM.save_pretrained(dir, max_shard_size='16KB')",
            "reference": "model.state_dict() (every tensor, as torch had it: bfloat16)",
            "quantized": [], "made_by": versions(),
            "notes": ("seeded random tiny Llama, all tensors bfloat16; weights 0.05 N(0, 1), "
                      "norms 1 + 0.1 N(0, 1)")}


def reference_bf16_sharded(case_dir: Path) -> Tensors:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(case_dir, dtype=torch.bfloat16)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def verify_bf16_sharded(case_dir: Path, ref: Tensors) -> None:
    stored = read_checkpoint(case_dir)
    assert sorted(stored) == sorted(ref)
    assert all(torch.equal(stored[k], ref[k]) and stored[k].dtype == ref[k].dtype for k in ref)
    assert torch.equal(ref["lm_head.weight"], tiny_llama().state_dict()["lm_head.weight"])
    shards = json.loads((case_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) >= 3, "want at least 3 shards"


# --------------------------------------------------------------------------------------------
# bitsandbytes


def make_bnb(case_dir: Path, dense_dir: Path, config_kwargs: dict, writer: str) -> dict:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(**config_kwargs)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=config,
                                                 device_map="cpu")
    model.save_pretrained(case_dir)
    return {"writer": writer, "made_by": versions("bitsandbytes", "accelerate"),
            "quantized": quantized_names()}


def bnb4_case(name: str, quant_type: str, double_quant: bool) -> Case:
    kwargs = dict(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                  bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=torch.bfloat16)
    writer = (f"AutoModelForCausalLM.from_pretrained(bf16_sharded, quantization_config="
              f"BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='{quant_type}', "
              f"bnb_4bit_use_double_quant={double_quant}, bnb_4bit_compute_dtype=torch.bfloat16),"
              f" device_map='cpu').save_pretrained(dir)")

    def make(case_dir: Path, dense_dir: Path) -> dict:
        meta = make_bnb(case_dir, dense_dir, kwargs, writer)
        meta["reference"] = ("bitsandbytes.functional.dequantize_4bit(weight, quant_state) with "
                             "quant_state = QuantState.from_dict(<the module's tensors>) and "
                             "quant_state.dtype = torch.float32; @native: its stored dtype "
                             "(bfloat16)")
        meta["notes"] = BNB4_NOTES
        return meta

    return Case(name, f"bitsandbytes-{quant_type}", make, reference_bnb4, verify_bnb4)


BNB4_NOTES = (
    "weight: uint8 (out*in/2, 1), the row-major (out, in) codes, two per byte, the FIRST element "
    "in the HIGH nibble. Blocks of 64 consecutive elements of that flat order share absmax. "
    "quant_state.bitsandbytes__<type>: uint8 bytes of a JSON object (quant_type, blocksize, dtype, "
    "shape; with double quant also nested_blocksize, nested_dtype, nested_offset). Double quant: "
    "absmax is uint8 codes into nested_quant_map (256 entries), absmax_f32 = nested_quant_map[code]"
    " * nested_absmax[i // nested_blocksize] + nested_offset (float32 ops in that order). float32 "
    "reference = quant_map[code] * absmax_f32 (one float32 multiply); checked bit for bit against "
    "that numpy formula. @native is that product rounded to bfloat16. In these fixtures every row "
    "(in_features 64) is exactly one block and every weight has <= 64 absmax, so one nested block.")


def bnb4_quant_state(module: Tensors):
    from bitsandbytes.functional import QuantState

    # from_dict pops from its argument and wants keys local to the weight (absmax, quant_map...).
    state = {k.removeprefix("weight."): v for k, v in module.items() if k != "weight"}
    return QuantState.from_dict(state, device=torch.device("cpu"))


def dequantize_bnb4(tensors: Tensors, names: list[str]) -> Tensors:
    """bitsandbytes' dequantize_4bit of each named weight: float32 plus its stored dtype."""
    from bitsandbytes.functional import dequantize_4bit

    out: Tensors = {}
    for name in names:
        module = submodule(tensors, name)
        native = dequantize_4bit(module["weight"], bnb4_quant_state(module))
        state = bnb4_quant_state(module)
        state.dtype = torch.float32  # the kernel then writes code * absmax in float32
        out |= with_native(dequantize_4bit(module["weight"], state), native, name)
    return out


def reference_bnb4(case_dir: Path) -> Tensors:
    return dequantize_bnb4(read_checkpoint(case_dir), quantized_names())


def rederive_bnb4(tensors: Tensors, ref: Tensors, names: list[str]) -> None:
    """The references, bit for bit, from the stored codes by the format's formula in numpy
    (flat row-major blocks; the nested absmax group is i // nested_blocksize)."""
    for name in names:
        m = {k: v.numpy() for k, v in submodule(tensors, name).items()}
        qs_key = next(k for k in m if k.startswith("weight.quant_state."))
        qs = json.loads(bytes(m[qs_key]).decode())
        packed = m["weight"].reshape(-1)
        codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(-1)  # high nibble first
        absmax = m["weight.absmax"]
        if "nested_offset" in qs:
            nested = m["weight.nested_absmax"][np.arange(absmax.size) // qs["nested_blocksize"]]
            offset = np.float32(qs["nested_offset"])
            absmax = (m["weight.nested_quant_map"][absmax] * nested) + offset
        want = m["weight.quant_map"][codes] * np.repeat(absmax, qs["blocksize"])[: codes.size]
        assert_bits_equal(want.reshape(qs["shape"]), ref[name].numpy(), name)
        assert ref[name + "@native"].dtype == getattr(torch, qs["dtype"])


def verify_bnb4(case_dir: Path, ref: Tensors) -> None:
    rederive_bnb4(read_checkpoint(case_dir), ref, quantized_names())
    dense = tiny_llama().state_dict()
    for name in quantized_names():  # 4-bit: within a block's absmax of the original
        err = (ref[name] - dense[name].float()).abs().max()
        assert err < 0.6 * dense[name].float().abs().max(), (name, err)


# bnb_nf4_dq_wide: one Linear4bit weight with several blocks per row and two nested groups, in
# a bare model.safetensors. The tiny Llama's rows are exactly one 64-block and each weight has
# < 256 absmax (one nested group), so a reader that mis-indexes blocks within a row or nested
# groups would pass those cases; this one has 4 blocks per row and 384 absmax (2 nested groups of
# 256, the second partial), and no config.json, so formats must be told from the tensors alone.
WIDE_NAME = "model.layers.0.mlp.up_proj.weight"
WIDE_SHAPE = (96, 256)  # (out, in)
WIDE_NORM = "model.norm.weight"  # a dense tensor next to the quantized one
# Per-block scales within a row and a row ramp: the 4 blocks of a row and the 2 nested groups
# get clearly different absmax / nested_absmax, so a swapped index changes the values.
WIDE_BLOCK_SCALES = (1.0, 0.25, 2.0, 0.5)


def wide_source() -> Tensors:
    """The seeded bfloat16 weight and norm the case quantizes / stores."""
    gen = torch.Generator().manual_seed(SEED)
    out_features, in_features = WIDE_SHAPE
    noise = torch.randn(WIDE_SHAPE, generator=gen, dtype=torch.float32)
    rows = 1 + torch.arange(out_features, dtype=torch.float32)[:, None] / 48
    assert in_features == 64 * len(WIDE_BLOCK_SCALES)  # one scale per 64-block of a row
    blocks = torch.tensor(WIDE_BLOCK_SCALES).repeat_interleave(64)[None, :]
    norm = 1 + 0.1 * torch.randn((in_features,), generator=gen, dtype=torch.float32)
    return {WIDE_NAME: (0.05 * noise * rows * blocks).to(torch.bfloat16),
            WIDE_NORM: norm.to(torch.bfloat16)}


def make_bnb_nf4_dq_wide(case_dir: Path, _dense_dir: Path) -> dict:
    from bitsandbytes.nn import Linear4bit, Params4bit

    source = wide_source()
    out_features, in_features = WIDE_SHAPE
    linear = Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.bfloat16,
                        compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8)
    # What transformers' bnb loader does per weight: Params4bit(...).to(device) runs
    # functional.quantize_4bit (Params4bit._quantize); state_dict() then runs
    # Linear4bit._save_to_state_dict (weight + quant_state.as_dict(packed=True)).
    linear.weight = Params4bit(source[WIDE_NAME], requires_grad=False, blocksize=64,
                               compress_statistics=True, quant_type="nf4",
                               quant_storage=torch.uint8, module=linear).to("cpu")
    tensors = dict(linear.state_dict(prefix=WIDE_NAME.removesuffix("weight")))
    tensors[WIDE_NORM] = source[WIDE_NORM]
    case_dir.mkdir(parents=True, exist_ok=True)
    # save_pretrained's metadata, but no config.json: a bare file.
    save_file({k: v.contiguous() for k, v in tensors.items()}, case_dir / "model.safetensors",
              metadata={"format": "pt"})
    return {"writer": ("bitsandbytes.nn.Linear4bit(256, 96, bias=False, compute_dtype="
                       "torch.bfloat16, compress_statistics=True, quant_type='nf4') with weight "
                       "Params4bit(w_bf16, blocksize=64, compress_statistics=True, quant_type="
                       "'nf4', quant_storage=torch.uint8).to('cpu') (= functional.quantize_4bit("
                       "w_bf16, blocksize=64, compress_statistics=True, quant_type='nf4')); "
                       "state_dict(prefix=...) (Linear4bit._save_to_state_dict: weight + "
                       "quant_state.as_dict(packed=True)) plus a dense bfloat16 model.norm.weight"
                       ", safetensors.torch.save_file(..., metadata={'format': 'pt'}); no "
                       "config.json"),
            "reference": ("bitsandbytes.functional.dequantize_4bit(weight, quant_state) with "
                          "quant_state = QuantState.from_dict(<the module's tensors>) and "
                          "quant_state.dtype = torch.float32; @native: its stored dtype "
                          "(bfloat16)"),
            "made_by": versions("bitsandbytes"), "quantized": [WIDE_NAME],
            "notes": WIDE_NOTES}


WIDE_NOTES = (
    "a bare model.safetensors (no config.json): one bitsandbytes NF4 double-quant weight "
    f"{WIDE_NAME} of (out, in) = (96, 256) plus a dense bfloat16 {WIDE_NORM} (256,). Layout as in "
    "bnb_nf4_dq (weight uint8 (12288, 1), high nibble first; absmax uint8 (384,), quant_map "
    "float32 (16,), nested_absmax float32 (2,), nested_quant_map float32 (256,), "
    "quant_state.bitsandbytes__nf4 uint8 JSON), but each row is 4 blocks of 64 (block b of the "
    "flat row-major order covers row b // 4, columns 64 * (b % 4) ...) and the 384 absmax form 2 "
    "nested groups of 256 (the second holds 128), with different nested_absmax. Source: seeded "
    "bfloat16 0.05 N(0, 1) * (1 + row / 48) * (1, 0.25, 2, 0.5)[column // 64]; norm 1 + "
    "0.1 N(0, 1). float32 reference = quant_map[code] * (nested_quant_map[absmax[i]] * "
    "nested_absmax[i // 256] + nested_offset), checked bit for bit in numpy; @native is it "
    "rounded to bfloat16.")


def reference_bnb_nf4_dq_wide(case_dir: Path) -> Tensors:
    return dequantize_bnb4(read_checkpoint(case_dir), [WIDE_NAME])


def verify_bnb_nf4_dq_wide(case_dir: Path, ref: Tensors) -> None:
    tensors = read_checkpoint(case_dir)
    assert sorted(p.name for p in case_dir.iterdir() if p.name.startswith("model")) == [
        "model.safetensors"] and not (case_dir / "config.json").exists()
    prefix, (out_features, in_features) = WIDE_NAME + ".", WIDE_SHAPE
    qs_tensor = tensors[prefix + "quant_state.bitsandbytes__nf4"]
    assert qs_tensor.dtype == torch.uint8 and qs_tensor.ndim == 1
    layout = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items() if v is not qs_tensor}
    blocks = out_features * in_features // 64
    assert layout == {WIDE_NAME: (torch.uint8, (out_features * in_features // 2, 1)),
                      prefix + "absmax": (torch.uint8, (blocks,)),
                      prefix + "quant_map": (torch.float32, (16,)),
                      prefix + "nested_absmax": (torch.float32, (math.ceil(blocks / 256),)),
                      prefix + "nested_quant_map": (torch.float32, (256,)),
                      WIDE_NORM: (torch.bfloat16, (in_features,))}, layout
    assert (blocks, blocks % 256) == (384, 128), "want 2 nested groups, the second partial"
    qs = json.loads(bytes(qs_tensor.numpy()).decode())
    assert (qs["quant_type"], qs["blocksize"], qs["dtype"], qs["shape"], qs["nested_blocksize"]) \
        == ("nf4", 64, "bfloat16", list(WIDE_SHAPE), 256), qs
    nested = tensors[prefix + "nested_absmax"]
    assert nested[0] != nested[1], "the two nested groups should differ"
    rederive_bnb4(tensors, ref, [WIDE_NAME])
    source = wide_source()
    assert torch.equal(tensors[WIDE_NORM], source[WIDE_NORM])
    # NF4 rounds within half its widest gap (0.152 of the block's absmax); the 8-bit nested
    # absmax adds up to ~11% here (its small blocks sit far below nested_absmax).
    w = source[WIDE_NAME].float().reshape(-1, 64)
    err = (ref[WIDE_NAME].reshape(-1, 64) - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert err.max() < 0.3, err.max()
    assert native_rounds_f32(ref)


def make_bnb_int8(case_dir: Path, dense_dir: Path) -> dict:
    writer = ("AutoModelForCausalLM.from_pretrained(bf16_sharded, quantization_config="
              "BitsAndBytesConfig(load_in_8bit=True), device_map='cpu').save_pretrained(dir)")
    meta = make_bnb(case_dir, dense_dir, dict(load_in_8bit=True), writer)
    meta["reference"] = "bitsandbytes.functional.int8_vectorwise_dequant(weight, SCB) (float32)"
    meta["notes"] = (
        "per module: weight int8 (out, in); SCB float32 (out,) = the row's absmax; weight_format "
        "uint8 scalar 0 (row-major). Dequant (bnb's default kernel): weight * SCB[:, None] in "
        "float32, THEN * 7.874015718698502e-3 (float32(1/127)): two roundings, checked bit for bit "
        "against that numpy formula (dividing by 127 instead differs in ~5% of these). float32 is "
        "bnb's own dtype here, so no @native. bnb's config records bnb_4bit_* defaults too.")
    return meta


def reference_bnb_int8(case_dir: Path) -> Tensors:
    from bitsandbytes.functional import int8_vectorwise_dequant

    tensors = read_checkpoint(case_dir)
    return {name: int8_vectorwise_dequant(tensors[name], submodule(tensors, name)["SCB"])
            for name in quantized_names()}


def verify_bnb_int8(case_dir: Path, ref: Tensors) -> None:
    tensors = read_checkpoint(case_dir)
    for name in quantized_names():
        w, scb = tensors[name].numpy(), submodule(tensors, name)["SCB"].numpy()
        want = (w.astype(np.float32) * scb[:, None]) * np.float32(7.874015718698502e-3)
        assert_bits_equal(want, ref[name].numpy(), name)
        assert int(submodule(tensors, name)["weight_format"]) == 0


# --------------------------------------------------------------------------------------------
# fp8_block (DeepSeek-V3 / Qwen3-FP8)


def fp8_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own FP8 block quantizer (`Fp8Quantize`, the op its FP8 models are saved
    with). It passes weights that aren't whole blocks through unquantized, so it gets the weight
    zero-padded to whole blocks (zeros change no block's amax) and the codes are cropped back."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    quantizer = types.SimpleNamespace(
        quantization_config=FineGrainedFP8Config(weight_block_size=(FP8_BLOCK, FP8_BLOCK)))
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(
        weight, (0, -cols % FP8_BLOCK, 0, -rows % FP8_BLOCK))
    out = Fp8Quantize(quantizer)._quantize_one("w.weight", padded)
    return out["w.weight"][:rows, :cols].contiguous(), out["w.weight_scale_inv"]


def make_fp8_block(case_dir: Path, _dense_dir: Path) -> dict:
    model = tiny_llama(FP8_MODEL)
    state = model.state_dict()
    tensors = dense_tensors(model)
    for name in quantized_names(FP8_MODEL):
        codes, scale_inv = fp8_quantize(state[name])
        tensors[name] = codes
        tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale_inv
    save_checkpoint(case_dir, tensors, model, FP8_QUANTIZATION_CONFIG)
    return {
        "writer": ("transformers.integrations.finegrained_fp8.Fp8Quantize(FineGrainedFP8Config("
                   "weight_block_size=(128, 128)))._quantize_one on each projection zero-padded to "
                   "whole 128x128 blocks (it leaves non-divisible weights unquantized), codes "
                   "cropped back; safetensors.torch.save_file + config.json by hand"),
        "reference": ("transformers.integrations.finegrained_fp8._dequantize_fp8_weight(weight, "
                      "weight_scale_inv, [128, 128], torch.float32)"),
        "made_by": versions(), "quantized": quantized_names(FP8_MODEL),
        "notes": FP8_NOTES}


FP8_NOTES = (
    "own config (hidden 136, 17 heads of 8, intermediate 16): weight float8_e4m3fn (out, in), "
    "weight_scale_inv float32 (ceil(out/128), ceil(in/128)); the last block row/column is partial. "
    "scale_inv = 1 / (448 / block amax) in float32. float32 reference = float32(code) * "
    "scale_inv of its block (one float32 multiply, one rounding), checked bit for bit against "
    "numpy. No @native: transformers' CPU "
    "load path (Fp8Dequantize: the float32 product .to(bfloat16)) refuses partial blocks, and "
    "_dequantize_fp8_weight in bfloat16 rounds the scale to bfloat16 first.")


def reference_fp8_block(case_dir: Path) -> Tensors:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    tensors = read_checkpoint(case_dir)
    return {name: _dequantize_fp8_weight(tensors[name],
                                         submodule(tensors, name)["weight_scale_inv"],
                                         [FP8_BLOCK, FP8_BLOCK], torch.float32)
            for name in quantized_names(FP8_MODEL)}


def verify_fp8_block(case_dir: Path, ref: Tensors) -> None:
    tensors, dense = read_checkpoint(case_dir), tiny_llama(FP8_MODEL).state_dict()
    for name in quantized_names(FP8_MODEL):
        codes = to_np32(tensors[name])
        scale = submodule(tensors, name)["weight_scale_inv"].numpy()
        rows, cols = codes.shape
        assert scale.shape == (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
        full = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
        assert_bits_equal(codes * full, ref[name].numpy(), name)
        # e4m3 steps are 32 scales apart at the top of its range: error <= 16 scales.
        err = (ref[name] - dense[name].float()).abs() / torch.from_numpy(full)
        assert err.max() <= 16 + 1e-3, (name, err.max())  # (scale_inv = 1 / (448 / amax))


# --------------------------------------------------------------------------------------------
# compressed-tensors (as llm-compressor writes it)

# Schemes of llm-compressor's presets (compressed_tensors.quantization.quant_scheme), group size
# 32 where grouped; the comment is the preset each follows.
CT_SCHEMES = {
    "ct_fp8_channel": ("FP8_DYNAMIC", {}),  # fp8 per-channel weights, dynamic per-token inputs
    "ct_fp8_tensor": ("FP8", {}),  # fp8 per-tensor weights, static per-tensor input_scale
    "ct_int4_group": ("W4A16", {"group_size": GROUP}),
    "ct_int4_asym": ("W4A16_ASYM", {"group_size": GROUP}),
    "ct_int8_channel": ("W8A16", {"strategy": "channel", "group_size": None}),  # pack-quantized
    # W8A8: the int-quantized format (an int8 `weight` and its `weight_scale`, unpacked).
    "ct_int8_intq": ("W8A8", {}),
}


def ct_scheme(case: str):
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    preset, weight_updates = CT_SCHEMES[case]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_updates:
        scheme.weights = QuantizationArgs(**(scheme.weights.model_dump() | weight_updates))
    return scheme


def ct_min_max(x: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The min-max observer's statistics for the args' strategy (llm-compressor's MinMax)."""
    if args.strategy == "group":
        x = x.unflatten(-1, (-1, args.group_size))
        return x.amin(-1), x.amax(-1)
    if args.strategy == "channel":
        return x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return x.amin().reshape(1), x.amax().reshape(1)


def ct_input_ranges(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Static input scales need activations: a forward pass on seeded token ids, recording each
    Linear input's range (llm-compressor's static_minmax observer over one batch)."""
    ranges, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            def record(_module, args, name=name) -> None:
                ranges[name] = (args[0].amin(), args[0].amax())

            hooks.append(module.register_forward_pre_hook(record))
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        model(torch.randint(0, MODEL["vocab_size"], (2, 16), generator=gen))
    for hook in hooks:
        hook.remove()
    return ranges


def ct_calibrate(model, input_ranges: dict) -> None:
    """Fill each quantized module's weight (and static input) qparams with compressed-tensors'
    own calculate_qparams, as llm-compressor's observers do."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight_range = ct_min_max(module.weight.data, scheme.weights)
        scale, zero = calculate_qparams(*weight_range, scheme.weights)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
        if hasattr(module, "input_scale"):
            lo, hi = (t.reshape(1) for t in input_ranges[name])
            module.input_scale.data.copy_(calculate_qparams(lo, hi, scheme.input_activations)[0])
        module.quantization_status = QuantizationStatus.FROZEN


def make_ct(case_dir: Path, case: str) -> dict:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = tiny_llama()
    input_ranges = ct_input_ranges(model)
    config = QuantizationConfig(config_groups={"group_0": ct_scheme(case)}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    ct_calibrate(model, input_ranges)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(case_dir)
    compressor.update_config(case_dir)
    preset, weight_updates = CT_SCHEMES[case]
    compressor_class = {"pack-quantized": "PackedQuantizationCompressor",
                        "float-quantized": "FloatQuantizationCompressor",
                        "int-quantized": "IntQuantizationCompressor",
                        }[compressor.quantization_config.format]
    return {"writer": ("compressed_tensors: apply_quantization_config(model, QuantizationConfig("
                       f"config_groups={{'group_0': preset_name_to_scheme('{preset}', ['Linear'])"
                       f" with weights {weight_updates or 'as is'}}}, ignore=['lm_head'])); "
                       "qparams = calculate_qparams(min, max) (llm-compressor's min-max observer);"
                       " ModelCompressor.from_pretrained_model(model).compress_model(model); "
                       "model.save_pretrained(dir); compressor.update_config(dir)"),
            "reference": (f"compressed_tensors {compressor_class}.decompress(<module tensors>, "
                          "scheme from config.json); float32: weight_scale cast to float32 first; "
                          "@native: as stored (bfloat16 scales)"),
            "made_by": versions("compressed-tensors"), "quantized": quantized_names(),
            "notes": CT_NOTES}


CT_NOTES = (
    "dequant = (q - zero_point) * weight_scale; q - zp and the bfloat16 scale are exact in float32,"
    " so the float32 product is exact (checked bit for bit against numpy); @native is that "
    "product rounded to bfloat16. pack-quantized: weight_packed int32 (out, ceil(in*bits/32)), "
    "32 consecutive elements of a row in exactly `bits` words (bit i*bits of the row's group of 32)"
    ", stored unsigned as q + 2**(bits-1) (4-bit: 8 per word, low nibble first; 8-bit: 4 bytes per "
    "word, low byte first); weight_shape int64 [out, in]; weight_scale (out, in/group) or (out, 1);"
    " asymmetric weight_zero_point is int32 packed the same way along dim 0 (ceil(out*bits/32), "
    "groups), signed zero points + 2**(bits-1). float-quantized: weight float8_e4m3fn (out, in), "
    "weight_scale bfloat16 (out, 1) or (1,). The FP8 per-tensor case is static (llm-compressor's "
    "FP8 preset): each projection has input_scale bfloat16 (1,) from one calibration batch.")


def ct_scheme_from_config(case_dir: Path):
    from compressed_tensors.quantization import QuantizationConfig

    qc = json.loads((case_dir / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(
        {k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
    (scheme,) = config.config_groups.values()
    return scheme, scheme.format or config.format


def reference_ct(case_dir: Path) -> Tensors:
    from compressed_tensors.compressors import BaseCompressor

    scheme, fmt = ct_scheme_from_config(case_dir)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors, out = read_checkpoint(case_dir), {}
    for name in quantized_names():
        module = submodule(tensors, name)
        native = compressor.decompress(module, scheme)["weight"]
        f32 = module | {"weight_scale": module["weight_scale"].float()}
        out |= with_native(compressor.decompress(f32, scheme)["weight"], native, name)
    return out


def unpack_ct(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """compressed-tensors' pack_to_int32, undone for 4 and 8 bits (whole values per word)."""
    per_word = 32 // bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(per_word) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], -1)[..., :count] - (1 << (bits - 1))


def verify_ct(case_dir: Path, ref: Tensors) -> None:
    scheme, fmt = ct_scheme_from_config(case_dir)
    args, tensors, dense = scheme.weights, read_checkpoint(case_dir), tiny_llama().state_dict()
    for name in quantized_names():
        m = submodule(tensors, name)
        out, cols = dense[name].shape
        q = (unpack_ct(m["weight_packed"].numpy(), args.num_bits, cols) if fmt == "pack-quantized"
             else to_np32(m["weight"]))
        scale = to_np32(m["weight_scale"])
        zero = (unpack_ct(m["weight_zero_point"].numpy().T, args.num_bits, out).T
                if "weight_zero_point" in m else np.zeros_like(scale))
        if args.strategy == "group":
            scale, zero = (np.repeat(t, args.group_size, axis=1) for t in (scale, zero))
        want = (q.astype(np.float32) - zero.astype(np.float32)) * scale
        assert_bits_equal(want.astype(np.float32), ref[name].numpy(), name)
        # int: half a step, plus the bfloat16 roundings of x / scale + zp (quantize runs in the
        # weight's dtype: a quarter step at 127); e4m3: 16 steps of the scale at the top of its
        # range, plus the clamp at 448 where the bfloat16 scale rounded below amax / 448
        bound = 0.5 + 2 ** (args.num_bits - 8) if args.type == "int" else 16.0 + 448 * 2**-8
        err = (ref[name] - dense[name].float()).abs() / torch.from_numpy(scale)
        assert err.max() <= bound + 1e-3, (name, err.max())
    assert native_rounds_f32(ref)


def ct_case(name: str) -> Case:
    return Case(name, "compressed-tensors", lambda case_dir, _dense: make_ct(case_dir, name),
                reference_ct, verify_ct)


# --------------------------------------------------------------------------------------------
# GPTQ (gptqmodel 7.7.0, transcribed; see the module docstring)

GPTQ_MAXQ = 15  # 4 bits


def gptq_find_params(x: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gptqmodel.quantization.quantizer.Quantizer.find_params (per row of x, no mse search)."""
    tmp = torch.zeros(x.shape[0])
    xmin_raw, xmax_raw = torch.aminmax(x, dim=1)
    xmin, xmax = torch.minimum(xmin_raw, tmp), torch.maximum(xmax_raw, tmp)
    if sym:
        xmax = torch.maximum(torch.abs(xmin), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both_zero = xmax == 0 if sym else (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(both_zero, xmin - 1, xmin), torch.where(both_zero, xmax + 1, xmax)
    scale = (xmax - xmin) / GPTQ_MAXQ
    zero = (torch.full_like(scale, (GPTQ_MAXQ + 1) / 2) if sym else torch.round(-xmin / scale))
    return scale, zero


def gptq_g_idx(in_features: int, desc_act: bool) -> torch.Tensor:
    """Group of each input column. desc_act quantizes columns in a permuted order (GPTQ sorts by
    the Hessian diagonal; a seeded permutation here), so g_idx is not monotone."""
    order = torch.arange(in_features)
    if desc_act:
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(SEED))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // GROUP).to(torch.int32)
    return g_idx


def gptq_pack(values: np.ndarray, axis: int) -> torch.Tensor:
    """pack_original's 4-bit loops: 8 values per int32 along `axis`, value j at bits 4j."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8) << (4 * np.arange(8, dtype=np.uint32))
    packed = np.bitwise_or.reduce(v, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(packed, -1, axis)).view(np.int32))


def gptq_quantize(w: torch.Tensor, sym: bool, desc_act: bool) -> Tensors:
    """RTN per group, packed as PackableQuantLinear.pack_original does, v1 qzeros on disk."""
    g_idx = gptq_g_idx(w.shape[1], desc_act)
    params = [gptq_find_params(w[:, g_idx == g], sym) for g in range(int(g_idx.max()) + 1)]
    scales = torch.stack([s for s, _ in params])  # (groups, out), float32 as pack gets it
    zeros = torch.stack([z for _, z in params])
    gi = g_idx.long()
    int_weight = torch.round((w + (zeros * scales)[gi].T) / scales[gi].T).clamp_(0, GPTQ_MAXQ)
    qzeros_v2 = gptq_pack(zeros.to(torch.int32).numpy(), axis=1)
    return {"qweight": gptq_pack(int_weight.to(torch.int32).T.numpy(), axis=0),
            # convert_gptq_v2_to_v1_format_module: checkpoint_format "gptq" stores zero - 1,
            # subtracted from the whole packed word (a zero of 0 would borrow from the next).
            "qzeros": qzeros_v2 - 0b00010001000100010001000100010001,
            "scales": scales.to(torch.float16), "g_idx": g_idx}


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor) -> torch.Tensor:
    """convert_gptq_v1_to_v2_format_module (bits 4) + PackableQuantLinear.dequantize_weight
    (bits 4, int32 words, num_itr 1). Returns (in, out) in scales' dtype, as gptqmodel does."""
    qzeros = qzeros + 0b00010001000100010001000100010001
    wf = torch.tensor(list(range(0, 32, 4)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 8),
                                      wf.unsqueeze(0)).to(torch.int8)
    zeros = torch.bitwise_and(zeros, GPTQ_MAXQ).reshape(qzeros.shape[0], -1)[:, :scales.shape[1]]
    weight = torch.bitwise_and(torch.bitwise_right_shift(
        qweight.unsqueeze(1).expand(-1, 8, -1), wf.unsqueeze(-1)).to(torch.int8), GPTQ_MAXQ)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


def gptq_quantization_config(sym: bool, desc_act: bool) -> dict:
    """The fields gptqmodel 7.7's GPTQConfig.to_dict writes (meta trimmed to its main keys)."""
    return {"bits": 4, "group_size": GROUP, "desc_act": desc_act, "sym": sym, "lm_head": False,
            "method": "gptq", "quant_method": "gptq", "format": "gptq", "checkpoint_format": "gptq",
            "pack_dtype": "int32",
            "meta": {"quantizer": [f"gptqmodel:{GPTQMODEL_VERSION}"],
                     "uri": "https://github.com/modelcloud/gptqmodel", "damp_percent": 0.05,
                     "damp_auto_increment": 0.01, "static_groups": False, "true_sequential": True,
                     "mse": 0.0, "act_group_aware": False}}


def make_gptq(case_dir: Path, sym: bool, desc_act: bool) -> dict:
    model = tiny_llama()
    tensors, state = dense_tensors(model), model.state_dict()
    for name in quantized_names():
        prefix = name.removesuffix("weight")
        q = gptq_quantize(state[name].float(), sym, desc_act)
        tensors |= {prefix + k: v for k, v in q.items()}
    quant = gptq_quantization_config(sym, desc_act)
    save_checkpoint(case_dir, tensors, model, quant)
    (case_dir / "quantize_config.json").write_text(json.dumps(quant, indent=2) + "\n")
    return {"writer": ("gptqmodel 7.7.0 layout, transcribed (scripts/make_checkpoints.py "
                       "gptq_quantize: Quantizer.find_params RTN per group, pack_original, "
                       "convert_gptq_v2_to_v1_format_module); save_file + config.json + "
                       "quantize_config.json as gptqmodel's save_quantized writes them"),
            "reference": ("gptqmodel 7.7.0's dequantization transcribed (gptq_dequantize: "
                          "convert_gptq_v1_to_v2_format_module + PackableQuantLinear."
                          "dequantize_weight), transposed to (out, in); float32: scales cast to "
                          "float32; @native: float16 scales, as gptqmodel computes"),
            "made_by": versions() | {"gptqmodel": f"{GPTQMODEL_VERSION} (source, transcribed)"},
            "quantized": quantized_names(), "notes": GPTQ_NOTES}


GPTQ_NOTES = (
    "per module: qweight int32 (in/8, out): 8 input rows per word, row 8r+j at bits 4j; qzeros "
    "int32 (groups, out/8): 8 output columns per word, column 8c+j at bits 4j, holding zero - 1 "
    "(checkpoint_format 'gptq' = v1; sym zeros are 8, stored 7 = 0x77777777 words); scales "
    "float16 (groups, out); g_idx int32 (in,) = group of each input row. Dequant: W[i, o] = "
    "scales[g_idx[i], o] * (q[i, o] - (z[g_idx[i], o] + 1)); transposed to (out, in) here. The +1 "
    "is gptqmodel's whole-word add of 0x11111111 (no zero of 0 occurs in these fixtures, so it "
    "equals a per-nibble +1). @native: float16 (float16 scale * small int, one rounding); float32:"
    " exact. Dense tensors bfloat16. quantize_config.json repeats config.json's "
    "quantization_config, as gptqmodel writes both.")


def reference_gptq(case_dir: Path) -> Tensors:
    tensors, out = read_checkpoint(case_dir), {}
    for name in quantized_names():
        m = submodule(tensors, name)
        args = (m["qweight"], m["qzeros"], m["scales"], m["g_idx"])
        native = gptq_dequantize(*args).T
        f32 = gptq_dequantize(m["qweight"], m["qzeros"], m["scales"].float(), m["g_idx"]).T
        out |= with_native(f32, native, name)
    return out


def verify_gptq(case_dir: Path, ref: Tensors) -> None:
    quant = json.loads((case_dir / "config.json").read_text())["quantization_config"]
    tensors, dense = read_checkpoint(case_dir), tiny_llama().state_dict()
    for name in quantized_names():
        m = {k: v.numpy() for k, v in submodule(tensors, name).items()}
        words = m["qweight"].astype(np.int64) & 0xFFFFFFFF
        q = (words[:, None, :] >> (4 * np.arange(8))[None, :, None]) & 15
        q = q.reshape(-1, words.shape[1])
        zwords = m["qzeros"].astype(np.int64) & 0xFFFFFFFF
        z = ((zwords[..., None] >> (4 * np.arange(8))) & 15).reshape(zwords.shape[0], -1) + 1
        assert (z <= GPTQ_MAXQ).all() and (z >= 1).all(), "a zero of 0 would borrow across nibbles"
        assert quant["sym"] == bool((z == 8).all())
        g = m["g_idx"]
        want = m["scales"].astype(np.float32)[g] * (q - z[g]).astype(np.float32)
        assert_bits_equal(want.T, ref[name].numpy(), name)
        assert (np.diff(g) >= 0).all() != quant["desc_act"]
        step = torch.from_numpy(m["scales"].astype(np.float32)[g].T)
        err = (ref[name] - dense[name].float()).abs() / step  # RTN: half a step (+ fp16 scale)
        assert err.max() <= 0.5 + 1e-2, (name, err.max())
    assert native_rounds_f32(ref)


def gptq_case(name: str, sym: bool, desc_act: bool) -> Case:
    return Case(name, "gptq", lambda case_dir, _dense: make_gptq(case_dir, sym, desc_act),
                reference_gptq, verify_gptq)


# --------------------------------------------------------------------------------------------
# AWQ (AutoAWQ 0.2.9, GEMM)


@contextlib.contextmanager
def autoawq() -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    """AutoAWQ's `awq/modules/linear/gemm.py` and `awq/utils/packing_utils.py`, from its installed
    files. `import awq` would import its model zoo (written for transformers 4.x), so its parent
    packages are stubbed for the duration (triton's import fails, as on any CPU box)."""
    spec = importlib.util.find_spec("awq")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("needs AutoAWQ's files: pip install --no-deps autoawq==0.2.9")
    root = Path(spec.submodule_search_locations[0])
    saved = {k: v for k, v in sys.modules.items() if k == "awq" or k.startswith("awq.")}
    try:
        for package in ("awq", "awq.utils", "awq.modules", "awq.modules.linear"):
            stub = types.ModuleType(package)
            stub.__path__ = [str(root.joinpath(*package.split(".")[1:]))]
            sys.modules[package] = stub
        for name in ("awq.utils.module", "awq.utils.utils", "awq.utils.packing_utils",
                     "awq.modules.linear.gemm"):
            file = root.joinpath(*name.split(".")[1:]).with_suffix(".py")
            module_spec = importlib.util.spec_from_file_location(name, file)
            sys.modules[name] = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(sys.modules[name])
        yield sys.modules["awq.modules.linear.gemm"], sys.modules["awq.utils.packing_utils"]
    finally:
        for k in [k for k in sys.modules if k == "awq" or k.startswith("awq.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def awq_pseudo_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AwqQuantizer.pseudo_quantize_tensor (zero_point=True, w_bit=4), transcribed."""
    shape = w.shape
    w = w.reshape(-1, GROUP)
    max_val, min_val = w.amax(dim=1, keepdim=True), w.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / 15
    zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
    w = (torch.clamp(torch.round(w / scales) + zeros, 0, 15) - zeros) * scales
    return w.reshape(shape), scales.view(shape[0], -1), zeros.view(shape[0], -1)


def make_awq(case_dir: Path, _dense_dir: Path) -> dict:
    # AutoAWQ loads (here: the same bf16 weights) and saves models in float16.
    model = tiny_llama().to(torch.float16)
    model.config.dtype = torch.float16
    tensors, state = dense_tensors(model), model.state_dict()
    with autoawq() as (gemm, _):
        for name in quantized_names():
            linear = torch.nn.Linear(*state[name].shape[::-1], bias=False, dtype=torch.float16)
            # AwqQuantizer._apply_quant: fake-quantize in float16, then pack the (in, out) params.
            linear.weight.data, scales, zeros = awq_pseudo_quantize(state[name])
            q = gemm.WQLinear_GEMM.from_linear(linear, 4, GROUP, False, scales.t().contiguous(),
                                               zeros.t().contiguous())
            prefix = name.removesuffix("weight")
            tensors |= {prefix + k: getattr(q, k) for k in ("qweight", "qzeros", "scales")}
    quant = {"quant_method": "awq", "zero_point": True, "group_size": GROUP, "bits": 4,
             "version": "gemm", "modules_to_not_convert": None}
    save_checkpoint(case_dir, tensors, model, quant)
    return {"writer": ("AutoAWQ 0.2.9: awq.modules.linear.gemm.WQLinear_GEMM.from_linear(linear, "
                       "4, 32, False, scales.T, zeros.T) on AwqQuantizer.pseudo_quantize_tensor's "
                       "float16 output (transcribed; RTN, no activation-aware scale search); "
                       "save_file + config.json with AwqConfig.to_transformers_dict()"),
            "reference": ("AutoAWQ 0.2.9: awq.utils.packing_utils.dequantize_gemm(qweight, "
                          "qzeros, scales, 4, 32), transposed to (out, in); float32: scales cast "
                          "to float32; @native: float16 scales"),
            "made_by": versions("autoawq"), "quantized": quantized_names(), "notes": AWQ_NOTES}


AWQ_NOTES = (
    f"per module: qweight int32 (in, out/8), packed along the OUTPUT: word c of row i holds "
    f"column 8c + {list(AWQ_ORDER)}[k] at bits 4k (k = 0..7); qzeros int32 (in/32, out/8) packed "
    "the same way, holding the zero itself (no -1); scales float16 (in/32, out). Dequant: "
    "W[i, o] = scales[i // 32, o] * (q[i, o] - z[i // 32, o]); transposed to (out, in) here. "
    "Every tensor is float16 (AutoAWQ's dtype: the bfloat16 model cast to float16), config "
    "dtype float16. AutoAWQ's from_linear can't pack out_features < 32 (it sizes qweight as "
    "out // 32 * 4).")


def reference_awq(case_dir: Path) -> Tensors:
    tensors, out = read_checkpoint(case_dir), {}
    with autoawq() as (_, packing_utils):
        for name in quantized_names():
            m = submodule(tensors, name)
            native = packing_utils.dequantize_gemm(m["qweight"], m["qzeros"], m["scales"], 4, GROUP)
            f32 = packing_utils.dequantize_gemm(m["qweight"], m["qzeros"], m["scales"].float(), 4,
                                                GROUP)
            out |= with_native(f32.T, native.T, name)
    return out


def verify_awq(case_dir: Path, ref: Tensors) -> None:
    tensors, dense = read_checkpoint(case_dir), tiny_llama().state_dict()
    order = np.argsort(AWQ_ORDER)  # nibble k holds column AWQ_ORDER[k]

    def unpack(words: np.ndarray) -> np.ndarray:
        nibbles = ((words.astype(np.int64)[..., None] & 0xFFFFFFFF) >> (4 * np.arange(8))) & 15
        return nibbles[..., order].reshape(words.shape[0], -1)

    for name in quantized_names():
        m = {k: v.numpy() for k, v in submodule(tensors, name).items()}
        q, z = unpack(m["qweight"]), np.repeat(unpack(m["qzeros"]), GROUP, axis=0)
        scale = np.repeat(m["scales"].astype(np.float32), GROUP, axis=0)
        assert_bits_equal((scale * (q - z).astype(np.float32)).T, ref[name].numpy(), name)
        err = (ref[name] - dense[name].float()).abs() / torch.from_numpy(scale.T)
        assert err.max() <= 0.5 + 1e-2, (name, err.max())
    assert native_rounds_f32(ref)


# --------------------------------------------------------------------------------------------
# driver

CASES: dict[str, Case] = {c.name: c for c in [
    Case("bf16_sharded", "dense-bf16", make_bf16_sharded, reference_bf16_sharded,
         verify_bf16_sharded),
    bnb4_case("bnb_nf4_dq", "nf4", True), bnb4_case("bnb_nf4", "nf4", False),
    bnb4_case("bnb_fp4_dq", "fp4", True), bnb4_case("bnb_fp4", "fp4", False),
    Case("bnb_nf4_dq_wide", "bitsandbytes-nf4-dq", make_bnb_nf4_dq_wide,
         reference_bnb_nf4_dq_wide, verify_bnb_nf4_dq_wide, bare_shapes={WIDE_NAME: WIDE_SHAPE}),
    Case("bnb_int8", "bitsandbytes-int8", make_bnb_int8, reference_bnb_int8, verify_bnb_int8),
    Case("fp8_block", "fp8-block", make_fp8_block, reference_fp8_block, verify_fp8_block),
    *[ct_case(name) for name in CT_SCHEMES],
    gptq_case("gptq_sym", sym=True, desc_act=False),
    gptq_case("gptq_asym", sym=False, desc_act=False),
    gptq_case("gptq_desc_act", sym=True, desc_act=True),
    Case("awq_gemm", "awq-gemm", make_awq, reference_awq, verify_awq),
]}


def write_reference(case_dir: Path, case: Case, meta: dict) -> None:
    ref = case.reference(case_dir)
    case.verify(case_dir, ref)
    save_file(ref, case_dir / "reference.safetensors", metadata={"format": "pt"})
    info = {"case": case.name, "format": case.format, "made_by": meta["made_by"],
            "writer": meta["writer"], "reference": meta["reference"],
            "quantized": meta["quantized"], "notes": meta["notes"]}
    (case_dir / "reference.json").write_text(json.dumps(info, indent=2) + "\n")


def build(out_dir: Path, names: list[str] | None = None) -> None:
    """Writes the named cases (all by default) into out_dir; the dense checkpoint the bnb cases
    load is out_dir/bf16_sharded, built first when missing."""
    names = names or list(CASES)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # no thread-count-dependent reductions in the written bytes
    dense_dir = out_dir / "bf16_sharded"
    if "bf16_sharded" not in names and not dense_dir.exists():
        names = ["bf16_sharded", *names]
    for name in sorted(names, key=lambda n: n != "bf16_sharded"):
        case, case_dir = CASES[name], out_dir / name
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # never leave half a case behind
            staging = Path(tmp) / name
            meta = case.make(staging, dense_dir)
            write_reference(staging, case, meta)
            if case_dir.exists():
                for old in case_dir.iterdir():
                    old.unlink()
                case_dir.rmdir()
            staging.rename(case_dir)
        print(f"{name}: {sum(f.stat().st_size for f in case_dir.iterdir()) / 1024:.0f} KiB")


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0]) if argv else DEFAULT_OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    build(out_dir, argv[1:] or None)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
