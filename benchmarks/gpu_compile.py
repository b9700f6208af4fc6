"""Compile a training step for a GPU that is not here: XLA's GPU compiler, deviceless.

With JAX's CUDA plugin installed (`-E cuda13`), JAX compiles for a GPU described by its
properties (`jax.experimental.topologies`), no GPU present. The compiled program is the
one a card would run, so this shows on a CPU machine what XLA:CPU cannot:

- XLA's memory analysis from the GPU compiler (bf16 kept bf16; cuDNN's fused attention):
  the device bytes a step's arguments and temporaries take, and its host arguments;
- the layer loops of a step whose frozen codes are in host memory (`lorax.offload_frozen`):
  how many host-resident stacks each `while` loop reads, and how many one-layer slices
  of them it carries from one iteration to the next, moved to the device one iteration
  ahead (XLA's pipelined host offloading: the next layer's codes cross the host link
  while this layer computes). A loop that carries none moves each layer's codes in the
  iteration that reads them, the computation waiting for the copy.
- the dequantizations that write a dense weight: fusions outside the matrix products that
  read 8-bit or 4-bit codes and write a 16-bit array of a million values or more (a
  weight). None where XLA fuses the dequantization into the product that reads it
  (`qlora-int8-bf16`, `qlora-s4-bf16` under `dequant`: the products read the codes).
- the slices a step copies out of larger arrays (fusions computing a `dynamic-slice`:
  under `lax.scan`, each layer's weights and saved activations), GiB a step, and the
  TFLOP of its matrix products; both counted as often as their loops run, so
  recomputation and any product XLA computes twice are in them.

The step is `benchmarks.offload`'s (`benchmarks.scale`'s Llama Adam step, donated as
`benchmarks.accelerator` donates it). A cell is `MODEL:METHOD:FLAGS[:REMAT[:LAYERS]]`:
FLAGS `default` or XLA flags (compile options) joined by `+`: `pipelined`
(`xla_gpu_enable_pipelined_host_offloading`), `dequant` (`benchmarks._device_step.
DEQUANT_OPTIONS`: XLA's dequantization fusion and the two options it needs), `cublas`
(`xla_gpu_enable_triton_gemm=False`: every product a cuBLAS call), METHOD a
`benchmarks.scale` method, `+host` after it for the frozen weights in
host memory (`lorax.offload_frozen`) and `+state` for Adam's state (`lorax.offload_state`),
REMAT `llama.Config.remat` (`layer`, the default), LAYERS `scan` (the default)
or `unrolled` (`llama.hidden_states`).

    python -m benchmarks.gpu_compile [--target h200] [--memory-gib GIB] [--batch N]
                                     [--cells ...] [--out DIR] [--name NAME]

`--memory-gib`: the card's memory as XLA plans for it (a 24 GB card's, say: XLA's scheduler
starts fewer copies early when memory is short).

Needs the CUDA plugin (`bash scripts/bootstrap.sh -E cuda13`); `CUDA_VISIBLE_DEVICES=-1`
keeps a present GPU out of it. Compiled, not run: the card's peak memory and step time
come from `python -m benchmarks.accelerator` on a card.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

# The plugin checks the CUDA libraries' versions against a GPU's driver at start-up;
# compiling needs no driver.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402

from . import _common as C  # noqa: E402
from ._device_step import DEQUANT_OPTIONS  # noqa: E402

GiB = 2**30

# XLA's description of each card (its `GpuTargetConfig`, as `nvidia-smi` and the CUDA
# device query report it): what the compiler tunes for.
_H100_SXM = dict(core_count=132, memory_bandwidth=3352320000000, clock_rate_ghz=1.98,
                 device_memory_size=84929347584, description="NVIDIA H100 80GB HBM3")
_H200 = dict(core_count=132, memory_bandwidth=4800000000000, clock_rate_ghz=1.98,
             device_memory_size=150754820096, description="NVIDIA H200")
TARGETS = {"h100": _H100_SXM, "h200": _H200}

FLAGS = {"default": {}, "pipelined": {"xla_gpu_enable_pipelined_host_offloading": True},
         # The products read int8 or int4 codes times scales in the weight's dtype
         # (`lorax.quantize(..., scale_dtype=)`).
         "dequant": DEQUANT_OPTIONS,
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

DEFAULT_CELLS = ("llama-3-8b:qlora-nf4:default,llama-3-8b:qlora-nf4+host:default,"
                 "llama-3-8b:qlora-nf4+host:pipelined,llama-3-70b:qlora-nf4:default,"
                 "llama-3-70b:qlora-nf4+host:default,llama-3-70b:qlora-nf4+host:pipelined")


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
    from jax.experimental import topologies
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
    takes them). JAX's compile-only client, reached through its private compiler module:
    the one place here that needs one."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    devices = gpu_devices(target, memory_gib)
    compile_options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    compile_options.env_option_overrides = list(options.items())
    with mlir.make_ir_context():
        module = ir.Module.parse(lowered_text)
        return devices[0].client.compile(module, xc.DeviceList(tuple(devices)), compile_options)


# -- reading the compiled program ------------------------------------------------------------

# A buffer's type, dimensions and layout; `S(5)`: host memory (`E(4)`: 4-bit elements).
_BUFFER = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]\{[0-9,]*(:[^}]*)?\}")


class Loop(NamedTuple):
    name: str
    host_stacks: int  # host-resident arrays (memory space S(5)) the loop reads
    carried_slices: int  # device arrays it carries that are one entry of such a stack
    carried_bytes: int


def loops(hlo_text: str) -> list[Loop]:
    """Every `while` of a compiled module that reads host-resident stacks, with the
    one-entry slices of them it carries on the device (moved one iteration ahead)."""
    out = []
    for m in re.finditer(r"%(while\S*) = \((.*?)\) while\(", hlo_text):
        buffers = [(dtype, tuple(int(d) for d in dims.split(",") if d), "S(5)" in layout)
                   for dtype, dims, layout in _BUFFER.findall(m.group(2))]
        stacks = {(dtype, dims[1:]) for dtype, dims, host in buffers if host and len(dims) > 1}
        if not stacks:
            continue
        carried = [(dtype, dims) for dtype, dims, host in buffers
                   if not host and (dtype, dims) in stacks]
        nbytes = sum(math.ceil(_bits(d) * math.prod(s) / 8) for d, s in carried)
        out.append(Loop(m.group(1), len(stacks), len(carried), nbytes))
    return out


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([0-9,]*)\]\S* ([\w-]+)\((.*?)\)", re.M)


def dense_writes(hlo_text: str, min_values: int = 2**20) -> int:
    """How many fusions write a dequantized weight: a kLoop/kInput fusion (not a matrix
    product's) reading 8- or 4-bit integers and writing a 16-bit float array of at least
    `min_values` values, and no array of `s32` indices (an embedding lookup's rows)."""
    shapes = {m.group(1): (m.group(2), m.group(3)) for m in _INSTRUCTION.finditer(hlo_text)}
    count = 0
    for m in _INSTRUCTION.finditer(hlo_text):
        name, dtype, dims, op, operands = m.groups()
        if op != "fusion" or dtype not in ("bf16", "f16"):
            continue
        if "kind=kCustom" in hlo_text[m.end():hlo_text.find("\n", m.end())]:
            continue
        reads = [shapes.get(o.strip().lstrip("%"), ("", "")) for o in operands.split(",")]
        codes = any(t in ("s8", "u8", "s4", "u4") for t, _ in reads)
        lookup = any(t == "s32" and d for t, d in reads)
        if codes and not lookup and math.prod(int(d) for d in dims.split(",") if d) >= min_values:
            count += 1
    return count


def _bits(hlo_dtype: str) -> int:
    bits = re.search(r"[0-9]+$", hlo_dtype)
    return int(bits.group()) if bits else 8  # (`pred`: a byte)


# An instruction's name and (first) result shape: `%x = bf16[2,3]{1,0} op(` or `%x = (bf16[..`
_RESULT = re.compile(r"^\s*(?:ROOT )?%(\S+) = \(*([a-z]+[0-9]*)\[([0-9,]*)\]", re.M)
# A computation's root: its shape, its op and first operand.
_ROOT = re.compile(r"ROOT %\S+ = ([a-z]+[0-9]*)\[([0-9,]*)\]\S* ([\w-]+)\(%([^,)]+)")


def _shape(dims: str) -> tuple[int, ...]:
    return tuple(int(d) for d in dims.split(",") if d)


def slice_copies_gib(hlo_text: str) -> float:
    """GiB that fusions computing a `dynamic-slice` write in one step: slices copied out
    of a larger array (under `lax.scan`, each layer's weights and saved activations),
    each counted as often as its loop runs. A product that reads a slice in place (XLA's
    dynamic-slice fusion of a cuBLAS call, kind=kCustom) copies none."""
    bodies, runs = C.hlo_executions(hlo_text)
    total = 0
    for name, body in bodies.items():
        for callee in re.findall(r"kind=kLoop, calls=(%[\w.-]+)", body):
            fused = bodies.get(callee, "")
            root = _ROOT.search(fused)
            if root and root.group(3) == "bitcast":  # (a bitcast of the slice is the slice)
                source = re.search(rf"%{re.escape(root.group(4))} = \S+ ([\w-]+)\(", fused)
                sliced = bool(source) and source.group(1) == "dynamic-slice"
            else:
                sliced = bool(root) and root.group(3) == "dynamic-slice"
            if sliced:
                nbytes = math.prod(_shape(root.group(2))) * _bits(root.group(1)) / 8
                total += runs.get(name, 0) * nbytes
    return total / GiB


def products(hlo_text: str) -> Counter:
    """How many times a step runs each matrix product (XLA's `dot`s, cuBLAS calls; cuDNN's
    attention aside), by `(output shape, contracted size)`, each counted as often as its
    computation runs."""
    bodies, runs = C.hlo_executions(hlo_text)
    shapes = {m.group(1): _shape(m.group(3)) for m in _RESULT.finditer(hlo_text)}
    found: Counter = Counter()
    for name, body in bodies.items():
        for m in _RESULT.finditer(body):
            line = body[m.start():body.find("\n", m.end())]
            op = re.search(r"(?:\) | )(dot|custom-call)\(%([^,)]+)", line)
            if not op or (op.group(1) == "custom-call" and "__cublas" not in line):
                continue
            dims = re.search(r'lhs_contracting_dim(?:s=\{|ensions":\[)([0-9",]*)', line)
            lhs = shapes.get(op.group(2), ())
            k = math.prod(lhs[int(d)] for d in re.findall(r"[0-9]+", dims.group(1))) if dims else 0
            found[(_shape(m.group(3)), k)] += runs.get(name, 0)
    return found


def product_tflop(hlo_text: str) -> float:
    """TFLOP of `products`: recomputation and products XLA computes twice included, so
    set against the model's own count."""
    return sum(2 * math.prod(out) * k * n for (out, k), n in products(hlo_text).items()) / 1e12


# -- the step ---------------------------------------------------------------------------------


def lowered_step(model: str, method: str, remat: str = "layer", layers: str = "scan",
                 attention: str = "cudnn", batch: int = 1, seq: int | None = None,
                 **config: Any) -> str:
    """`benchmarks.offload.abstract_step` for `model` and `method` (`+host`: the frozen
    half in host memory; `+state`: Adam's state too, `lorax.offload_state`), `batch`
    windows of `seq` tokens a step (`config`: other `llama.Config` fields), lowered for
    `cuda`, the trainable parameters and optimizer state donated (as
    `benchmarks.accelerator` donates them)."""
    from . import offload as O
    base, *where = method.split("+")
    step, args = O.abstract_step(model, base, "host" in where, remat, layers, attention,
                                 state_on_host="state" in where, batch=batch, seq=seq,
                                 **config)
    jitted = jax.jit(step, in_shardings=jax.tree.map(O._sharding, args), donate_argnums=(0, 2))
    return jitted.trace(*jax.tree.map(O._typed, args)).lower(
        lowering_platforms=("cuda",)).as_text()


def measure(target: str, cell: str, memory_gib: float | None = None,
            batch: int = 1) -> dict[str, Any]:
    model, method, flags, *rest = cell.split(":")
    remat, layers = rest + ["layer", "scan"][len(rest):]
    t0 = time.perf_counter()
    executable = compile_for(lowered_step(model, method, remat, layers, batch=batch), target,
                             options(flags), memory_gib)
    compile_s = time.perf_counter() - t0
    m = executable.get_compiled_memory_stats()
    hlo = executable.hlo_modules()[0].to_string()
    found = loops(hlo)
    memory_gib = memory_gib or TARGETS[target]["device_memory_size"] / GiB
    return dict(target=target, memory_gib=memory_gib, model=model, method=method, flags=flags,
                remat=remat, layers=layers, batch=batch, compile_s=compile_s,
                device_args_gib=m.argument_size_in_bytes / GiB,
                device_temps_gib=m.temp_size_in_bytes / GiB,
                device_peak_gib=(m.argument_size_in_bytes + m.temp_size_in_bytes
                                 + m.output_size_in_bytes - m.alias_size_in_bytes) / GiB,
                host_args_gib=m.host_argument_size_in_bytes / GiB,
                host_temps_gib=m.host_temp_size_in_bytes / GiB,
                host_loops=len(found),
                prefetching_loops=sum(1 for lp in found if lp.carried_slices),
                carried_mib=max((lp.carried_bytes for lp in found), default=0) / 2**20,
                dense_writes=dense_writes(hlo), slice_copies_gib=slice_copies_gib(hlo),
                product_tflop=product_tflop(hlo))


COLUMNS = [("model", "model"), ("method", "method"), ("remat", "remat"), ("layers", "layers"),
           ("batch", "windows"), ("flags", "XLA flags"),
           ("device_peak_gib", "device GiB (XLA)"), ("device_temps_gib", "of it temporaries"),
           ("host_args_gib", "host GiB"), ("host_temps_gib", "host temporaries GiB"),
           ("host_loops", "loops reading host memory"),
           ("prefetching_loops", "of them moving the next layer ahead"),
           ("carried_mib", "next layer in flight, MiB"),
           ("dense_writes", "dequantizations writing a weight"),
           ("slice_copies_gib", "slices copied, GiB a step"),
           ("product_tflop", "matrix products, TFLOP a step"), ("compile_s", "compile s")]
_HOST_COLUMNS = {"host_args_gib", "host_temps_gib", "host_loops", "prefetching_loops",
                 "carried_mib"}


def markdown(rows: list[dict]) -> str:
    """The rows as a table; the host-memory columns only where a step has host arguments."""
    host = any(r["host_args_gib"] or r["host_temps_gib"] for r in rows)
    columns = [(k, t) for k, t in COLUMNS if host or k not in _HOST_COLUMNS]
    head = "| " + " | ".join(title for _, title in columns) + " |"
    lines = [head, "|" + "---|" * len(columns)]
    for r in rows:
        cells = [f"{r[k]:.{0 if k == 'compile_s' else 2}f}" if isinstance(r[k], float)
                 else str(r[k]) for k, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h200", choices=sorted(TARGETS))
    parser.add_argument("--cells", default=DEFAULT_CELLS)
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="the card's memory as XLA plans for it (default: the target's)")
    parser.add_argument("--batch", type=int, default=1,
                        help="windows of the model's sequence length a step (default 1)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="gpu_compile",
                        help="the results' file name, before the target's")
    args = parser.parse_args(argv)
    rows = []
    for cell in args.cells.split(","):
        rows.append(measure(args.target, cell, args.memory_gib, args.batch))
        print(rows[-1], flush=True)
    out = C.out_dir(args.out)
    name = f"{args.name}_{args.target}" + (f"_{args.memory_gib:g}g" if args.memory_gib else "")
    C.write_csv(out / f"{name}.csv", rows)
    memory = f" given {args.memory_gib:g} GiB of memory" if args.memory_gib else ""
    text = markdown(rows) + (f"\nCompiled for an {TARGETS[args.target]['description']}{memory} "
                             f"by jax {jax.__version__}'s CUDA plugin, deviceless.\n")
    (out / f"{name}.md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
