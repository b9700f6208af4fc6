"""Compiling for a GPU that is not here: XLA's GPU compiler through JAX's CUDA plugin
(`-E cuda13`), the card described by its properties (`jax.experimental.topologies`), and
the XLA options the benchmarks compile with on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

# The plugin checks the CUDA libraries' versions against a GPU's driver at start-up;
# compiling needs no driver.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

from jax._src import compiler  # noqa: E402  (JAX's compile-only client: no public API)
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lib import xla_client as xc  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax.experimental import topologies  # noqa: E402

from ._llama import DEQUANT_OPTIONS  # noqa: E402

GiB = 2**30

# XLA's description of each card (its `GpuTargetConfig`, as `nvidia-smi` and the CUDA
# device query report it): what the compiler tunes for.
TARGETS = {
    "h100": dict(core_count=132, memory_bandwidth=3352320000000, clock_rate_ghz=1.98,
                 device_memory_size=84929347584, description="NVIDIA H100 80GB HBM3"),
    "h200": dict(core_count=132, memory_bandwidth=4800000000000, clock_rate_ghz=1.98,
                 device_memory_size=150754820096, description="NVIDIA H200"),
}

FLAGS = {"default": {}, "pipelined": {"xla_gpu_enable_pipelined_host_offloading": True},
         "dequant": DEQUANT_OPTIONS,  # the products read int8 or int4 codes
         # Every product through cuBLAS (no Triton GEMM fusions): XLA's dynamic-slice
         # fusion then lets a product read its layer's slice of a stacked weight in place.
         "cublas": {"xla_gpu_enable_triton_gemm": False}}


def options(flags: str) -> dict[str, Any]:
    """The compile options of FLAGS (`default`, or names of `FLAGS` joined by `+`)."""
    out: dict[str, Any] = {}
    for name in flags.split("+"):
        if name not in FLAGS:
            raise ValueError(f"XLA flags {flags!r}: {name!r} is not one of {sorted(FLAGS)}")
        out.update(FLAGS[name])
    return out


def target_config(target: str, memory_gib: float | None = None) -> str:
    """The text `GpuTargetConfig` of a Hopper card in `TARGETS`, its memory `memory_gib`
    if given (XLA's scheduler plans for the card's memory: given less, it starts fewer
    copies early)."""
    t = dict(TARGETS[target])
    if memory_gib:
        t["device_memory_size"] = int(memory_gib * GiB)
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {t['core_count']}
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {t['memory_bandwidth']} l2_cache_size: 52428800
  clock_rate_ghz: {t['clock_rate_ghz']} device_memory_size: {t['device_memory_size']}
  shared_memory_per_block_optin: 232448 cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 13 }}
device_description_str: "{t['description']}"
"""


def gpu_devices(target: str, memory_gib: float | None = None, count: int = 1) -> list[Any]:
    """`count` compile-only devices of `target` on one host (no GPU needed; the CUDA
    plugin is)."""
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{count}",
            target_config=target_config(target, memory_gib))
    except Exception as e:  # (no plugin: "Unknown backend", or NotImplementedError)
        raise RuntimeError("compiling for a GPU needs JAX's CUDA plugin "
                           "(bash scripts/bootstrap.sh -E cuda13)") from e
    return list(topology.devices)


def compile_for(lowered_text: str, target: str, options: dict[str, Any],
                memory_gib: float | None = None) -> Any:
    """The XLA executable of a StableHLO module lowered for `cuda`, compiled for `target`
    with `options` (XLA debug options, as `jax.jit(...).lower(...).compile(compiler_options=)`
    takes them)."""
    devices = gpu_devices(target, memory_gib)
    compile_options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    compile_options.env_option_overrides = list(options.items())
    with mlir.make_ir_context():
        module = ir.Module.parse(lowered_text)
        return devices[0].client.compile(module, xc.DeviceList(tuple(devices)), compile_options)
