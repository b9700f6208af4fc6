"""`benchmarks.gpu_compile`: the training step compiled for a GPU with no GPU present.

Reading a compiled module's loops is checked everywhere. Compiling needs JAX's CUDA
plugin (`bash scripts/bootstrap.sh -E cuda13`), which CI's CPU environment does not
install: those tests run where it is (`CUDA_VISIBLE_DEVICES=-1 python -m pytest
tests/test_benchmarks_gpu_compile.py` in such an environment, GPU or not).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import lorax

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _cuda as X  # noqa: E402
from benchmarks import _llama as L  # noqa: E402
from benchmarks import gpu_compile as G  # noqa: E402
from benchmarks import scale as S  # noqa: E402

# A compiled while loop as XLA prints it: one host stack of codes (memory space S(5)), the
# next entry's slice of it carried on the device, and a stack of scales with no slice.
_PIPELINED = (
    "  %while.4 = (s32[], bf16[1,64,256]{2,1,0}, u8[2,256,64,32]{3,2,1,0:S(5)}, "
    "u8[256,64,32]{2,1,0}, f32[2,256]{1,0:S(5)}) while(%tuple.1), condition=%c, body=%b\n")
_WAITING = (
    "  %while.9 = (s32[], bf16[1,64,256]{2,1,0}, u8[2,256,64,32]{3,2,1,0:S(5)}) "
    "while(%tuple.2), condition=%c2, body=%b2\n")
_NO_HOST = "  %while.1 = (s32[], bf16[1,64,256]{2,1,0}) while(%tuple.3), condition=%c3, body=%b3\n"
# 4-bit elements (`E(4)`) beside the memory space: a stack of int4 codes, its slice carried.
_INT4 = ("  %while.7 = (s32[], s4[2,256,4,64]{3,2,1,0:E(4)S(5)}, s4[256,4,64]{2,1,0:E(4)}) "
         "while(%tuple.4), condition=%c4, body=%b4\n")


def test_loops_counts_the_next_entry_carried_on_the_device():
    found = G.loops(_PIPELINED + _WAITING + _NO_HOST + _INT4)
    assert found == [G.Loop("while.4", 2, 1, 256 * 64 * 32),
                     G.Loop("while.9", 1, 0, 0),
                     G.Loop("while.7", 1, 1, 256 * 4 * 64 // 2)]


# Compiled fusions as XLA prints them: a weight dequantized from int8 codes, the rows an
# embedding lookup dequantizes, a matrix product reading the codes itself, and a small one.
_FUSIONS = """\
  %codes = s8[32,1024,1024]{2,1,0} parameter(0)
  %scales = bf16[32,1024,16]{2,1,0} parameter(1)
  %emb = s8[64,4096]{1,0} parameter(2)
  %small = s8[8,8]{1,0} parameter(3)
  %tokens = s32[1,512]{1,0} parameter(4)
  %i = s32[] parameter(5)
  %loop_multiply_fusion = bf16[1024,1024]{1,0} fusion(%codes, %scales, %i), kind=kLoop, calls=%fm, metadata={}
  %loop_gather_fusion = bf16[512,4096]{1,0} fusion(%emb, %tokens), kind=kLoop, calls=%fl, metadata={}
  %gemm_fusion = bf16[2048,1024]{1,0} fusion(%x, %codes, %scales), kind=kCustom, calls=%g2, metadata={}
  ROOT %loop_convert_fusion = bf16[8,8]{1,0} fusion(%small), kind=kLoop, calls=%fc, metadata={}
"""


def test_dense_writes_counts_weights_not_lookups_products_or_small_arrays():
    assert G.dense_writes(_FUSIONS) == 1
    assert G.dense_writes(_FUSIONS, min_values=64) == 2


# One layer's weight dequantized in a 4-iteration loop's body, the output layer's once after.
_DEQUANT_LOOP = """\
%body (t: (s32[], s8[4,1024,1024])) -> (s32[], s8[4,1024,1024]) {
  %t = (s32[], s8[4,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %codes = s8[4,1024,1024]{2,1,0} get-tuple-element(%t), index=1
  %w = bf16[1024,1024]{1,0} fusion(%codes, %i), kind=kLoop, calls=%dq
  ROOT %out = (s32[], s8[4,1024,1024]{2,1,0}) tuple(%i, %codes)
}

ENTRY %main (init: (s32[], s8[4,1024,1024]), emb: u8[2048,1024]) -> bf16[2048,2048] {
  %init = (s32[], s8[4,1024,1024]{2,1,0}) parameter(0)
  %emb = u8[2048,1024]{1,0} parameter(1)
  %loop = (s32[], s8[4,1024,1024]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %head = bf16[2048,2048]{1,0} fusion(%emb), kind=kLoop, calls=%dq2
}
"""


def test_dense_write_gib_counts_a_loops_dequantization_as_often_as_it_runs():
    assert G.dense_writes(_DEQUANT_LOOP) == 2  # each fusion once, as the program holds it
    assert G.dense_write_gib(_DEQUANT_LOOP) * 2**30 == 4 * 1024 * 1024 * 2 + 2048 * 2048 * 2
    assert G.dense_write_gib(_FUSIONS) == 0  # no entry computation: nothing runs


# A compiled module with a 4-iteration loop: a weight's slice copied out of its stack (a
# bitcast of the slice), an activation's slice at a reversed index (async), a slice scaled
# on the way (a computation, not a copy), one product as an XLA `dot`, one as a cuBLAS call
# reading the slice, cuDNN's attention (not counted); once more outside the loop, a slice.
_LOOP_MODULE = """\
%slice_w (p0: bf16[4,8,16], p1: s32[]) -> bf16[8,16] {
  %p0 = bf16[4,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,8,16}
  ROOT %b = bf16[8,16]{1,0} bitcast(%ds)
}

%reversed (p0.1: f32[4,32], p1.1: s32[]) -> f32[1,32] {
  %p0.1 = f32[4,32]{1,0} parameter(0)
  %p1.1 = s32[] parameter(1)
  %three = s32[] constant(3)
  %i.1 = s32[] subtract(%three, %p1.1)
  %zero.1 = s32[] constant(0)
  ROOT %ds.1 = f32[1,32]{1,0} dynamic-slice(%p0.1, %i.1, %zero.1), dynamic_slice_sizes={1,32}
}

%scaled (p0.2: bf16[4,8,16], p1.2: s32[]) -> bf16[1,8,16] {
  %p0.2 = bf16[4,8,16]{2,1,0} parameter(0)
  %p1.2 = s32[] parameter(1)
  %zero.2 = s32[] constant(0)
  %ds.2 = bf16[1,8,16]{2,1,0} dynamic-slice(%p0.2, %p1.2, %zero.2, %zero.2), dynamic_slice_sizes={1,8,16}
  ROOT %m = bf16[1,8,16]{2,1,0} multiply(%ds.2, %ds.2)
}

%product (p0.3: bf16[2,8], p1.3: bf16[8,16]) -> bf16[2,16] {
  %p0.3 = bf16[2,8]{1,0} parameter(0)
  %p1.3 = bf16[8,16]{1,0} parameter(1)
  ROOT %d = bf16[2,16]{1,0} dot(%p0.3, %p1.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], bf16[4,8,16], f32[4,32], bf16[2,8])) -> (s32[], bf16[4,8,16], f32[4,32], bf16[2,8]) {
  %t = (s32[], bf16[4,8,16]{2,1,0}, f32[4,32]{1,0}, bf16[2,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = bf16[4,8,16]{2,1,0} get-tuple-element(%t), index=1
  %a = f32[4,32]{1,0} get-tuple-element(%t), index=2
  %x = bf16[2,8]{1,0} get-tuple-element(%t), index=3
  %s = bf16[8,16]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice_w
  %start = ((f32[4,32]{1,0}, s32[]), f32[1,32]{1,0}, u32[]) fusion-start(%a, %i), kind=kLoop, calls=%reversed
  %sc = bf16[1,8,16]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%scaled
  %g = bf16[2,16]{1,0} fusion(%x, %s), kind=kCustom, calls=%product
  %cb = (bf16[2,16]{1,0}, s8[64]{0}) custom-call(%x, %s), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %attn = (bf16[2,16]{1,0}, u8[0]{0}) custom-call(%x, %s), custom_call_target="__cudnn$fmhaSoftmax"
  ROOT %out = (s32[], bf16[4,8,16]{2,1,0}, f32[4,32]{1,0}, bf16[2,8]{1,0}) tuple(%i, %w, %a, %x)
}

ENTRY %main (init: (s32[], bf16[4,8,16], f32[4,32], bf16[2,8])) -> bf16[8,16] {
  %init = (s32[], bf16[4,8,16]{2,1,0}, f32[4,32]{1,0}, bf16[2,8]{1,0}) parameter(0)
  %loop = (s32[], bf16[4,8,16]{2,1,0}, f32[4,32]{1,0}, bf16[2,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %w.1 = bf16[4,8,16]{2,1,0} get-tuple-element(%loop), index=1
  %i.2 = s32[] get-tuple-element(%loop), index=0
  ROOT %last = bf16[8,16]{1,0} fusion(%w.1, %i.2), kind=kLoop, calls=%slice_w
}
"""


def test_slice_copies_count_each_copy_as_often_as_its_loop_runs():
    per_iteration = 8 * 16 * 2 + 32 * 4  # the weight's slice, the activation's
    assert G.slice_copies_gib(_LOOP_MODULE) * 2**30 == 4 * per_iteration + 8 * 16 * 2


def test_products_count_dots_and_cublas_calls_as_often_as_their_loop_runs():
    assert G.product_tflop(_LOOP_MODULE) * 1e12 == 4 * 2 * (2 * 2 * 16 * 8)


def test_products_of_a_compiled_scan_and_its_gradient():
    """XLA's program for a scanned stack of products (on this machine's backend): the
    forward's products once a layer, the gradient's three times."""
    def f(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()

    ws, x = jnp.ones((5, 96, 96)), jnp.ones((64, 96))
    one = 2 * 64 * 96 * 96
    for fn, products in ((f, 5), (jax.grad(f), 15)):
        hlo = jax.jit(fn).lower(ws, x).compile().as_text()
        assert G.product_tflop(hlo) * 1e12 == products * one


def test_flags_combine_and_an_unknown_one_is_named():
    both = X.options("pipelined+dequant")
    assert both == {**X.FLAGS["pipelined"], **X.FLAGS["dequant"]} and X.options("default") == {}
    with pytest.raises(ValueError, match="'fused'"):
        X.options("pipelined+fused")


def test_target_configs_name_their_card():
    for target, facts in X.TARGETS.items():
        text = X.target_config(target)
        assert f"core_count: {facts['core_count']}" in text
        assert f'device_description_str: "{facts["description"]}"' in text


def _has_cuda_plugin() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:  # (the plugins' namespace)
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None
               for v in (12, 13))


needs_plugin = pytest.mark.skipif(not _has_cuda_plugin(),
                                  reason="JAX's CUDA plugin is not installed (-E cuda13)")


def _one_layer_of_host_stacks_mib() -> float:
    cfg = L.config("tiny", "cudnn", "layer")
    abstract, spec = L.build(cfg, "qlora-nf4", jnp.bfloat16)
    frozen = lorax.offload_frozen(lorax.partition(abstract, spec)[1])
    stacks = [x for x in jax.tree_util.tree_leaves(frozen["layers"])
              if getattr(x.sharding, "memory_kind", None) == "pinned_host" and x.ndim >= 2]
    return sum(math.prod(x.shape[1:]) * jnp.dtype(x.dtype).itemsize for x in stacks) / 2**20


@needs_plugin
def test_pipelined_host_offloading_moves_the_next_layer_in_both_passes():
    default = G.measure("h200", "tiny:qlora-nf4+host:default")
    pipelined = G.measure("h200", "tiny:qlora-nf4+host:pipelined")
    # The forward layer loop, the backward one, and the output layer's two chunk loops.
    assert default["host_loops"] == pipelined["host_loops"] == 4
    assert default["prefetching_loops"] == 0
    assert pipelined["prefetching_loops"] == 2
    # What is in flight is one layer's frozen codes and scales, every stack's slice.
    assert pipelined["carried_mib"] == pytest.approx(_one_layer_of_host_stacks_mib())
    assert pipelined["host_args_gib"] == default["host_args_gib"] > 0


@needs_plugin
def test_a_barrier_on_the_recomputation_keeps_the_backward_loop_waiting(monkeypatch):
    # The control: the example's scanned layer under `prevent_cse=True`.
    remat = L.LLAMA.remat
    monkeypatch.setattr(L.LLAMA, "remat", lambda cfg, fn, **_: remat(cfg, fn))
    assert G.measure("h200", "tiny:qlora-nf4+host:pipelined")["prefetching_loops"] == 1


@needs_plugin
def test_gpu_compile_writes_its_table(tmp_path):
    rows = G.main(["--cells", "tiny:qlora-nf4:default,tiny:qlora-nf4+host:pipelined",
                   "--out", str(tmp_path)])
    assert [r["method"] for r in rows] == ["qlora-nf4", "qlora-nf4+host"]
    on_device, host = rows
    assert host["device_args_gib"] < on_device["device_args_gib"]
    md = (tmp_path / "gpu_compile_h200.md").read_text()
    assert "| tiny | qlora-nf4+host | layer | scan | 1 | pipelined |" in md
    assert (tmp_path / "gpu_compile_h200.csv").exists()


@needs_plugin
def test_the_optimizer_state_in_host_memory_leaves_the_device_arguments():
    host = G.measure("h200", "tiny:qlora-nf4+host:default")
    state = G.measure("h200", "tiny:qlora-nf4+host+state:default")
    cfg = L.config("tiny", "cudnn", "layer")
    trainable = lorax.partition(*L.build(cfg, "qlora-nf4", jnp.bfloat16))[0]
    moments = 2 * sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                      for x in jax.tree_util.tree_leaves(trainable))  # Adam's mu and nu
    assert (host["device_args_gib"] - state["device_args_gib"]) * G.GiB == pytest.approx(
        moments + 4, abs=64)  # (+ the step count)
    assert (state["host_args_gib"] - host["host_args_gib"]) * G.GiB == pytest.approx(
        moments + 4, abs=64)


@needs_plugin
def test_memory_gib_is_the_memory_xla_plans_for():
    assert "device_memory_size: 25769803776" in X.target_config("h200", 24)
    row = G.measure("h200", "tiny:qlora-nf4+host:pipelined", memory_gib=24)
    assert row["memory_gib"] == 24 and row["prefetching_loops"] == 2


def _dequantizations(scale_dtype, flags: str, qtype: str = "int8", block_size: int = 64) -> int:
    """Weights written by dequantizations in the compiled QLoRA step of one projection
    (values and the factors' and input's gradients)."""
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    params = jax.eval_shape(lambda w: lorax.init_lora(lorax.quantize(
        {"w": w}, {"w": 8}, qtype, block_size=block_size, scale_dtype=scale_dtype), {"w": 8},
        jax.random.PRNGKey(0)), w)
    trainable, frozen = lorax.partition(params, {"w": 8})

    def step(t, f, x):
        def loss(t, x):
            y = lorax.lora(lambda p, x: x @ p["w"])(lorax.combine(t, f), x)
            return jnp.sum(y.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(t, x)
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    text = jax.jit(step).trace(trainable, frozen, x).lower(lowering_platforms=("cuda",)).as_text()
    executable = X.compile_for(text, "h200", X.options(flags))
    return G.dense_writes(executable.hlo_modules()[0].to_string(), min_values=2**20)


@needs_plugin
@pytest.mark.parametrize("qtype,block_size", [("int8", 64), ("s4", 64), ("s4", 32)])
def test_codes_with_scales_in_the_weight_dtype_are_read_by_the_products_themselves(qtype, block_size):
    # The forward product and the input's gradient each read the codes: no weight written.
    # (jaxlib 0.10's XLA fuses the input gradient's product only.)
    newer = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 11)
    assert _dequantizations(jnp.bfloat16, "dequant", qtype, block_size) == (0 if newer else 1)
    # Controls: float32 scales (a float32 product, cast), or no flag: both products'
    # weights are written first.
    assert _dequantizations(None, "dequant", qtype, block_size) == 2
    assert _dequantizations(jnp.bfloat16, "default", qtype, block_size) == 2


@needs_plugin
def test_int4_stacks_are_not_laid_out_again_for_the_backward_product(monkeypatch):
    # The 8B step's stacked int4 codes, whole, would be 1.8 GiB of copies (gate/up and
    # down): the tiny model's stacks are what is checked here, with XLA's relayout as the
    # control.
    cfg = L.config("tiny", "cudnn", "layer")
    abstract, spec = L.build(cfg, "qlora-s4-bf16", jnp.bfloat16)
    codes = [x for x in jax.tree_util.tree_leaves(lorax.partition(abstract, spec)[1])
             if x.dtype == jnp.int4 and x.ndim == 4]
    stack = max(math.prod(x.shape) for x in codes) // 2  # bytes, packed
    kept = G.measure("h200", "tiny:qlora-s4-bf16:dequant")
    monkeypatch.setitem(X.FLAGS, "relayout", {
        **X.FLAGS["dequant"], "xla_gpu_experimental_pack_dot_operands_along_k_dimension": True})
    relaid = G.measure("h200", "tiny:qlora-s4-bf16:relayout")
    assert kept["dense_writes"] == relaid["dense_writes"] == 0
    assert (relaid["device_temps_gib"] - kept["device_temps_gib"]) * G.GiB >= stack


# Collectives as XLA:GPU prints them, asynchronous: a `-start` has the shape
# `((operands), results)`; as XLA:CPU prints them, one instruction with its result.
_GPU_COLLECTIVES = """\
ENTRY %main {
  %ag = ((bf16[2048,1024]{0,1}), bf16[2048,8192]{0,1}) all-gather-start(%p), dimensions={1}
  %agd = bf16[2048,8192]{0,1} all-gather-done(%ag)
  %two = ((s32[1,2048]{1,0}, s32[1,2048]{1,0}), (s32[8,2048]{1,0}, s32[8,2048]{1,0})) all-gather-start(%a, %b)
  %ar = ((f32[]), f32[]) all-reduce-start(%l), to_apply=%add
  %ard = f32[] all-reduce-done(%ar)
  %cpu = f32[64,128]{1,0} all-gather(%q), dimensions={0}
  %rs = f32[8,128]{1,0} reduce-scatter(%r), dimensions={0}
}
"""


def test_collective_bytes_count_what_an_async_start_makes_not_its_operands():
    got = S.collective_bytes(_GPU_COLLECTIVES)
    assert got["all-gather"] == 2048 * 8192 * 2 + 2 * 8 * 2048 * 4 + 64 * 128 * 4
    assert got["all-reduce"] == 4 and got["reduce-scatter"] == 8 * 128 * 4


def test_collective_bytes_count_a_tuple_of_six_or_more():
    # XLA writes `/*index=5*/` before a tuple's sixth shape; its `=` once hid the op.
    shapes = ", ".join(["f32[2,4]{1,0}"] * 5 + ["/*index=5*/f32[2,4]{1,0}"])
    text = f"ENTRY %main () -> f32[] {{\n  %ar = ({shapes}) all-reduce(%a), to_apply=%add\n}}\n"
    assert S.collective_bytes(text)["all-reduce"] == 6 * 2 * 4 * 4


@needs_plugin
def test_scale_compiles_for_one_and_for_eight_gpus(tmp_path):
    rows = S.main(["--quick", "--target", "h100", "--methods", "qlora-nf4", "--dtypes", "bf16",
                   "--layouts", "1,fsdp-batch", "--out", str(tmp_path)])
    one, fsdp = rows
    assert (one["layout"], fsdp["layout"], fsdp["batch"]) == ("1 device", "FSDP x8", "8x64")
    assert fsdp["args_gib"] < one["args_gib"] / 4  # codes, factors and moments split 8 ways
    assert fsdp["all-gather_gib"] > 0 and "all-gather_gib" not in one
    md = (tmp_path / "scale_h100.md").read_text()
    assert "Compiled for one and for 8 NVIDIA H100 80GB HBM3 (on one host)" in md
    assert not (tmp_path / "scale.md").exists()  # the CPU's table is left alone


@needs_plugin
def test_cublas_products_read_stacked_weights_in_place_and_redo_the_saved_ones():
    """What docs/gpu.md says of the scanned Llama-3-8B step compiled for an H200: XLA's
    Triton GEMMs read a copy of each layer's weights, forward and backward; as cuBLAS calls
    they read them in place (remat `layer`: the same products), but with remat `dots` a
    product whose output is saved runs twice (gate and up at least)."""
    n, d, f, h, kv, seq = L.MODELS["llama-3-8b"]
    hd = d // h
    layer_weights = 2 * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f)  # bf16 bytes
    run = {c: G.measure("h200", f"llama-3-8b:lora:{c}") for c in
           ("default:layer", "cublas:layer", "default:dots", "cublas:dots")}
    copied = run["default:layer"]["slice_copies_gib"] - run["cublas:layer"]["slice_copies_gib"]
    assert copied * 2**30 == pytest.approx(2 * n * layer_weights)  # both passes, every layer
    assert run["cublas:layer"]["product_tflop"] == pytest.approx(
        run["default:layer"]["product_tflop"])
    again = run["cublas:dots"]["product_tflop"] - run["default:dots"]["product_tflop"]
    assert again * 1e12 >= 0.99 * n * 2 * (2 * seq * d * f)


@needs_plugin
def test_remat_offload_keeps_every_layers_input_in_host_memory():
    n, d, *_, seq = L.MODELS["tiny"]
    layer = G.measure("h200", "tiny:qlora-nf4:default:layer", batch=2)
    offload = G.measure("h200", "tiny:qlora-nf4:default:offload", batch=2)
    kept = 2 * n * seq * d * 2  # both windows' bf16 layer inputs, every layer
    assert (layer["host_temps_gib"], offload["host_temps_gib"] * 2**30) == (0, kept)
    # Both layer loops move the next layer's input while the current one computes.
    assert offload["batch"] == 2 and offload["prefetching_loops"] == 2
    assert offload["carried_mib"] * 2**20 == 2 * seq * d * 2
