"""Compile a training step for a GPU that is not here: XLA's GPU compiler, deviceless.

With JAX's CUDA plugin installed (`-E cuda13`; `CUDA_VISIBLE_DEVICES=-1` keeps a present
GPU out of it), JAX compiles for a GPU described by its properties, no GPU present: the
program a card would run. Read from it, what XLA:CPU cannot show:

- XLA's device bytes (arguments, temporaries; bf16 kept bf16, cuDNN's attention) and
  host arguments;
- the layer loops of a step whose frozen codes are in host memory: how many host stacks
  each `while` loop reads, and how many one-layer slices of them it carries from one
  iteration to the next (XLA's pipelined host offloading: the next layer's codes cross
  while this layer computes; a loop that carries none waits for each layer's copy);
- the dequantizations that write a dense weight (none where XLA fuses them into the
  product that reads the codes: `qlora-*-bf16` under `dequant`);
- the GiB of slices a step copies out of larger arrays (under `lax.scan`, each layer's
  weights and saved activations) and the TFLOP of its matrix products, each counted as
  often as its loop runs (recomputation included).

A cell is `MODEL:METHOD:FLAGS[:REMAT[:LAYERS]]`: METHOD a `benchmarks._llama` method,
`+host` after it for the frozen weights in host memory (`lorax.offload_frozen`) and
`+state` for Adam's state (`lorax.offload_state`); FLAGS `default` or names of
`benchmarks._cuda.FLAGS` joined by `+` (`pipelined`, `dequant`, `cublas`); REMAT
`llama.Config.remat` (`layer`); LAYERS `scan` or `unrolled`.

    python -m benchmarks.gpu_compile [--target h200] [--memory-gib GIB] [--batch N]
                                     [--cells ...] [--out DIR] [--name NAME]

`--memory-gib`: the card's memory as XLA plans for it (given less, its scheduler starts
fewer copies early). Compiled, not run: a card's peak and step time come from
`python -m benchmarks.accelerator`.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from typing import Any, NamedTuple

import jax

from . import _common as C
from ._cuda import TARGETS, compile_for, options
from ._llama import lowered_step

GiB = 2**30
DEFAULT_CELLS = ("llama-3-8b:qlora-nf4:default,llama-3-8b:qlora-nf4+host:default,"
                 "llama-3-8b:qlora-nf4+host:pipelined,llama-3-70b:qlora-nf4:default,"
                 "llama-3-70b:qlora-nf4+host:default,llama-3-70b:qlora-nf4+host:pipelined")


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
        nbytes = sum(math.ceil(C.bits(d) * math.prod(s) / 8) for d, s in carried)
        out.append(Loop(m.group(1), len(stacks), len(carried), nbytes))
    return out


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([0-9,]*)\]\S* ([\w-]+)\((.*?)\)", re.M)


def _weight_writes(hlo_text: str, min_values: int) -> list[tuple[str, int]]:
    """(dtype, values) of each fusion in `hlo_text` that writes a dequantized weight: a
    kLoop/kInput fusion (not a matrix product's) reading 8- or 4-bit integers and writing
    a 16-bit float array of at least `min_values` values, and no array of `s32` indices
    (an embedding lookup's rows)."""
    shapes = {m.group(1): (m.group(2), m.group(3)) for m in _INSTRUCTION.finditer(hlo_text)}
    found = []
    for m in _INSTRUCTION.finditer(hlo_text):
        name, dtype, dims, op, operands = m.groups()
        if op != "fusion" or dtype not in ("bf16", "f16"):
            continue
        if "kind=kCustom" in hlo_text[m.end():hlo_text.find("\n", m.end())]:
            continue
        reads = [shapes.get(o.strip().lstrip("%"), ("", "")) for o in operands.split(",")]
        codes = any(t in ("s8", "u8", "s4", "u4") for t, _ in reads)
        lookup = any(t == "s32" and d for t, d in reads)
        values = math.prod(int(d) for d in dims.split(",") if d)
        if codes and not lookup and values >= min_values:
            found.append((dtype, values))
    return found


def dense_writes(hlo_text: str, min_values: int = 2**20) -> int:
    """How many fusions of the program write a dequantized weight (`_weight_writes`), each
    once: a layer loop's body counts one layer's."""
    return len(_weight_writes(hlo_text, min_values))


def dense_write_gib(hlo_text: str, min_values: int = 2**20) -> float:
    """GiB those fusions write in one step, each counted as often as its loop runs: the
    same for a step's layers scanned or unrolled."""
    bodies, runs = C.hlo_executions(hlo_text)
    return sum(runs.get(name, 0) * values * C.bits(dtype) / 8 for name, body in bodies.items()
               for dtype, values in _weight_writes(body, min_values)) / GiB


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
                nbytes = math.prod(_shape(root.group(2))) * C.bits(root.group(1)) / 8
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


def measure(target: str, cell: str, memory_gib: float | None = None,
            batch: int = 1) -> dict[str, Any]:
    model, method, flags, *rest = cell.split(":")
    remat, layers = rest + ["layer", "scan"][len(rest):]
    t0 = time.perf_counter()
    executable = compile_for(lowered_step(model, method, remat, layers, batch=batch), target,
                             options(flags), memory_gib)
    compile_s = time.perf_counter() - t0
    m = C.memory_gib(executable.get_compiled_memory_stats())
    hlo = executable.hlo_modules()[0].to_string()
    found = loops(hlo)
    return dict(target=target, memory_gib=memory_gib or TARGETS[target]["device_memory_size"] / GiB,
                model=model, method=method, flags=flags, remat=remat, layers=layers,
                batch=batch, compile_s=compile_s, device_args_gib=m["args"],
                device_temps_gib=m["temps"], device_peak_gib=m["peak"],
                host_args_gib=m["host_args"], host_temps_gib=m["host_temps"],
                host_loops=len(found),
                prefetching_loops=sum(1 for lp in found if lp.carried_slices),
                carried_mib=max((lp.carried_bytes for lp in found), default=0) / 2**20,
                dense_writes=dense_writes(hlo), dense_write_gib=dense_write_gib(hlo),
                slice_copies_gib=slice_copies_gib(hlo),
                product_tflop=product_tflop(hlo))


COLUMNS = [("model", "model"), ("method", "method"), ("remat", "remat"), ("layers", "layers"),
           ("batch", "windows"), ("flags", "XLA flags"),
           ("device_peak_gib", "device GiB (XLA)"), ("device_temps_gib", "of it temporaries"),
           ("host_args_gib", "host GiB"), ("host_temps_gib", "host temporaries GiB"),
           ("host_loops", "loops reading host memory"),
           ("prefetching_loops", "of them moving the next layer ahead"),
           ("carried_mib", "next layer in flight, MiB"),
           ("dense_writes", "dequantizations writing a weight"),
           ("dense_write_gib", "dequantized weights written, GiB a step"),
           ("slice_copies_gib", "slices copied, GiB a step"),
           ("product_tflop", "matrix products, TFLOP a step"), ("compile_s", "compile s")]
_HOST_COLUMNS = {"host_args_gib", "host_temps_gib", "host_loops", "prefetching_loops",
                 "carried_mib"}


def markdown(rows: list[dict]) -> str:
    """The rows as a table; the host-memory columns only where a step has host arguments."""
    host = any(r["host_args_gib"] or r["host_temps_gib"] for r in rows)
    columns = [(k, t) for k, t in COLUMNS if host or k not in _HOST_COLUMNS]
    return C.column_table(rows, columns) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = C.parser(__doc__, rounds=False, quick=False)
    parser.add_argument("--target", default="h200", choices=sorted(TARGETS))
    parser.add_argument("--cells", default=DEFAULT_CELLS)
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="the card's memory as XLA plans for it (default: the target's)")
    parser.add_argument("--batch", type=int, default=1,
                        help="windows of the model's sequence length a step (default 1)")
    parser.add_argument("--name", default="gpu_compile",
                        help="the results' file name, before the target's")
    args = C.parse(parser, argv)
    rows = []
    for cell in args.cells.split(","):
        rows.append(measure(args.target, cell, args.memory_gib, args.batch))
        print(rows[-1], flush=True)
    name = f"{args.name}_{args.target}" + (f"_{args.memory_gib:g}g" if args.memory_gib else "")
    memory = f" given {args.memory_gib:g} GiB of memory" if args.memory_gib else ""
    C.write_table(args.out, name, rows, markdown(rows) + (
        f"\nCompiled for an {TARGETS[args.target]['description']}{memory} "
        f"by jax {jax.__version__}'s CUDA plugin, deviceless.\n"))
    return rows


if __name__ == "__main__":
    main()
