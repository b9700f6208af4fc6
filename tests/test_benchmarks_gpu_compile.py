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


def test_loops_counts_the_next_entry_carried_on_the_device():
    found = G.loops(_PIPELINED + _WAITING + _NO_HOST)
    assert found == [G.Loop("while.4", 2, 1, 256 * 64 * 32),
                     G.Loop("while.9", 1, 0, 0)]


def test_target_configs_name_their_card():
    for target, facts in G.TARGETS.items():
        text = G.target_config(target)
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
    cfg = S.config("tiny", "cudnn", "layer")
    abstract, spec = S.build(cfg, "qlora-nf4", jnp.bfloat16)
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
    remat = S.LLAMA.remat
    monkeypatch.setattr(S.LLAMA, "remat", lambda cfg, fn, **_: remat(cfg, fn))
    assert G.measure("h200", "tiny:qlora-nf4+host:pipelined")["prefetching_loops"] == 1


@needs_plugin
def test_gpu_compile_writes_its_table(tmp_path):
    rows = G.main(["--cells", "tiny:qlora-nf4:default,tiny:qlora-nf4+host:pipelined",
                   "--out", str(tmp_path)])
    assert [r["method"] for r in rows] == ["qlora-nf4", "qlora-nf4+host"]
    on_device, host = rows
    assert host["device_args_gib"] < on_device["device_args_gib"]
    md = (tmp_path / "gpu_compile_h200.md").read_text()
    assert "| tiny | qlora-nf4+host | layer | scan | pipelined |" in md
    assert (tmp_path / "gpu_compile_h200.csv").exists()


@needs_plugin
def test_the_optimizer_state_in_host_memory_leaves_the_device_arguments():
    host = G.measure("h200", "tiny:qlora-nf4+host:default")
    state = G.measure("h200", "tiny:qlora-nf4+host+state:default")
    cfg = S.config("tiny", "cudnn", "layer")
    trainable = lorax.partition(*S.build(cfg, "qlora-nf4", jnp.bfloat16))[0]
    moments = 2 * sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                      for x in jax.tree_util.tree_leaves(trainable))  # Adam's mu and nu
    assert (host["device_args_gib"] - state["device_args_gib"]) * G.GiB == pytest.approx(
        moments + 4, abs=64)  # (+ the step count)
    assert (state["host_args_gib"] - host["host_args_gib"]) * G.GiB == pytest.approx(
        moments + 4, abs=64)


@needs_plugin
def test_memory_gib_is_the_memory_xla_plans_for():
    assert "device_memory_size: 25769803776" in G.target_config("h200", 24)
    row = G.measure("h200", "tiny:qlora-nf4+host:pipelined", memory_gib=24)
    assert row["memory_gib"] == 24 and row["prefetching_loops"] == 2
