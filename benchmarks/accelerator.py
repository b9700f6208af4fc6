"""Real training steps on whatever device is present: lorax against hand-written LoRA, full
fine-tuning and the PyTorch stacks, at Llama-3 shapes, each cell in a process of its own.

The model is `benchmarks._llama`'s (bf16 base and activations, float32 factors and Adam
moments), its parameters random values made on the device (a quantized base as random
codes and small positive scales: nothing dense is made first). A lorax cell is

    MODEL:METHOD:BATCH:REMAT:ATTENTION[:LAYERS][@NAME]    e.g. llama-3-8b:lora:1:none:auto

- METHOD: one of `METHODS` (`benchmarks._llama`'s: `qlora-bnb_nf4` is bitsandbytes'
  layout, as `lorax.load_safetensors` reads Unsloth's `*-bnb-4bit` checkpoints), `hand`
  (LoRA written by hand into the same model code) or `full` (bf16 Adam moments); `+host`
  after a `lora`/`qlora` one: its frozen weights made in host memory
  (`lorax.offload_frozen`), each layer's moved in when it is read, on a GPU with
  `HOST_XLA_FLAGS` (`--host-xla-flags`);
- BATCH: windows of the model's 2048 tokens; REMAT, ATTENTION: `llama.Config`'s (`auto`:
  cuDNN's fused attention on a GPU); LAYERS: `scan` (stacked under `lax.scan`, the
  default) or `unrolled` (per-layer weights: no slice copied out of a stack);
- `@NAME`: XLA flags of `CELL_XLA_FLAGS` added for that cell (`@cublas`).

The PyTorch cells: `peft:MODEL:BATCH:eager|compiled:on|off` (PyTorch + PEFT,
`benchmarks/_peft.py`; the last field: gradient checkpointing), and the stacks users pick
for speed (`benchmarks/_torch_anchors.py`): `liger:MODEL:BATCH:eager|compiled:on|off`
(PEFT + Liger-Kernel) and `unsloth:MODEL:BATCH:16bit|nf4:unsloth|on|off` (Unsloth's LoRA
or QLoRA; its host-offloaded checkpointing, transformers', or none). `--cells anchors`:
those beside the lorax cells they are compared with (`ANCHOR_CELLS`).

Every stack trains on the same tokens (`benchmarks._batch`) from norm weights at one, and
each row has its first and last loss (lorax's is bf16: steps of 1/16 near 12). A cell's
process holds its own device peak (`peak_bytes_in_use`, `torch.cuda.max_memory_allocated`;
`XLA_PYTHON_CLIENT_PREALLOCATE=false` unless set). Per cell: median step time after two
warm-up steps, tokens/s, MFU (over the bf16 matrix rate measured in the same run, and
over the datasheet's where the device is known), peak device memory, XLA's
`memory_analysis()`, compile time. `--trace CELLS`: one step of those lorax cells profiled,
the device's kernel time summed by kind into `accelerator_traces.json`.

Model FLOPs per token, PaLM's accounting for a model whose weights are frozen: with N the
parameters of the matrix products (the seven projections of every layer and the tied
output layer; the embedding lookup is free), `4N + 12 L d T` (forward `2N + 4 L d T`,
activation gradients `2N + 8 L d T`, attention over the whole `T x T` square), and
`6N + 12 L d T` for full fine-tuning (the weight gradients too); recomputation not counted.

    python -m benchmarks.accelerator [--quick] [--cells C1,C2,...|pending|anchors] [--steps N]
                                     [--deadline SECONDS] [--trace CELLS|all] [--out DIR]
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, NamedTuple

from . import _common as C
from ._batch import MODELS, vocab
from ._llama import LAYER_LOOPS

GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent
# Dense bf16 matrix rate by the vendor's datasheet (SXM parts), TFLOP/s.
DATASHEET_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L4": 121.0}
METHODS = ("lora", "qlora-nf4", "qlora-bnb_nf4", "qlora-int8", "qlora-int8-bf16",
           "qlora-s4-bf16", "qlora-q4_k", "hand", "full")
DEFAULT_CELLS = (
    "llama-3-8b:lora:1:layer:chunked", "llama-3-8b:lora:1:layer:auto",
    "llama-3-8b:lora:1:dots:auto", "llama-3-8b:lora:1:none:auto",
    "llama-3-8b:hand:1:none:auto", "llama-3-8b:hand:1:layer:auto",
    "llama-3-8b:qlora-nf4:1:layer:auto", "llama-3-8b:qlora-nf4:1:none:auto",
    "llama-3-8b:qlora-int8:1:layer:auto", "llama-3-8b:qlora-int8-bf16:1:layer:auto",
    "llama-3-8b:qlora-s4-bf16:1:layer:auto", "llama-3-8b:qlora-q4_k:1:layer:auto",
    "llama-3-8b:full:1:layer:auto",
    "llama-3-8b:lora:4:none:auto", "llama-3-8b:lora:4:dots:auto",
    "llama-3-8b:lora:1:none:auto:unrolled", "llama-3-8b:lora:1:dots:auto:unrolled",
    "llama-3-8b:hand:1:none:auto:unrolled", "llama-3-8b:qlora-nf4:1:none:auto:unrolled",
    "llama-3-8b:lora:4:none:auto:unrolled",
    "llama-3-70b:qlora-nf4:1:layer:auto",
    "llama-3-8b:qlora-nf4+host:1:layer:auto", "llama-3-70b:qlora-nf4+host:1:layer:auto",
    "llama-3-8b:qlora-nf4+host:1:offload:auto",
    "llama-3.2-1b:lora:1:none:auto", "llama-3.2-1b:qlora-nf4:1:layer:auto",
    "peft:llama-3-8b:1:eager:on", "peft:llama-3-8b:1:eager:off",
    "peft:llama-3-8b:1:compiled:on", "peft:llama-3-8b:1:compiled:off",
    "peft:llama-3-8b:4:eager:off",
)
# What the open questions still need from a card, most wanted first (`--cells pending`),
# each ratio's two sides in the same run. Measured on an H200 already
# (benchmarks/results/accelerator_recipes.md and the tables beside it): PyTorch + PEFT
# compiled beside lorax's fastest steps at 1 and 4 windows, scanned and unrolled, the
# `cublas` cells, host offload, the QLoRA formats against LoRA, and bitsandbytes' NF4
# layout (1.012x dense LoRA: benchmarks/results/accelerator_anchors.md).
PENDING_CELLS = (
    # QLoRA unrolled took 1.155x dense LoRA unrolled (another command on the same card),
    # where scanned it took 1.027x: both layer loops beside dense LoRA's, in one run
    "llama-3-8b:qlora-nf4:1:dots:auto:unrolled", "llama-3-8b:qlora-nf4:1:dots:auto",
    "llama-3-8b:lora:1:dots:auto:unrolled", "llama-3-8b:lora:1:dots:auto",
    "llama-3-8b:hand:1:dots:auto:unrolled", "llama-3-8b:hand:1:dots:auto",
    "llama-3-8b:lora:1:none:auto:unrolled", "llama-3-8b:lora:1:none:auto",
    "llama-3-8b:qlora-nf4+host:1:offload:auto", "llama-3-8b:qlora-nf4+host:1:layer:auto",
    "llama-3-8b:qlora-nf4:1:layer:auto",
)
# The PyTorch stacks users pick for speed beside lorax's LoRA and QLoRA steps at 1 x 2048
# (issue 52), most wanted first (`--cells anchors`; `scripts/card-anchors` runs them after
# the context tries, in what is left of one card call): lorax LoRA and QLoRA at remat
# `layer` (Unsloth's QLoRA held 5.56 GiB, lorax's at remat `layer` 5.45: the no-more-memory
# comparison in one run), Unsloth 16-bit without checkpointing (the fastest PyTorch row)
# and Unsloth QLoRA, PEFT + Liger-Kernel; lorax's fastest QLoRA (remat `dots`); the 4 x 2048
# pair; the rest of the earlier run; then Liger compiled and the PEFT + `torch.compile`
# anchor already measured (0.188 s), whose first steps compile for minutes.
ANCHOR_CELLS = (
    "llama-3-8b:lora:1:dots:auto", "llama-3-8b:qlora-nf4:1:layer:auto",
    "unsloth:llama-3-8b:1:16bit:off", "unsloth:llama-3-8b:1:nf4:unsloth",
    "liger:llama-3-8b:1:eager:off", "llama-3-8b:qlora-nf4:1:dots:auto",
    "llama-3-8b:lora:4:dots:auto", "unsloth:llama-3-8b:4:16bit:off",
    "unsloth:llama-3-8b:1:16bit:unsloth", "llama-3-8b:qlora-bnb_nf4:1:dots:auto",
    "liger:llama-3-8b:1:compiled:off", "peft:llama-3-8b:1:compiled:off",
)
# Each method family, remat choice and attention path at least once (CI's smoke run).
QUICK_CELLS = ("tiny:lora:1:layer:auto", "tiny:qlora-nf4:1:none:auto", "tiny:hand:1:dots:auto",
               "tiny:qlora-s4-bf16:1:layer:auto",
               "tiny:full:1:layer:xla", "tiny:qlora-nf4+host:1:none:auto",
               "tiny:lora:1:none:auto:unrolled", "tiny:hand:1:none:auto:unrolled",
               "tiny:lora:1:layer:auto@cublas", "peft:tiny:1:eager:off")


# XLA flags a cell adds by name (`CELL@NAME`), after the run's own `XLA_FLAGS`, in its
# process: what the flags do to a step, measured beside the same cell without them.
CELL_XLA_FLAGS = {
    # Every product through cuBLAS, none as a Triton GEMM fusion: XLA's dynamic-slice fusion
    # then reads each layer's slice of a stacked weight in place, where a Triton GEMM reads
    # a copy (`benchmarks.gpu_compile`, cell flags `cublas`; docs/gpu.md).
    "cublas": "--xla_gpu_enable_triton_gemm=false",
}


# The PyTorch cells, `STACK:MODEL:BATCH:A:B`: A's and B's values, and the modules the stack
# imports (a cell whose modules are not installed is listed as not run).
TORCH_STACKS = {
    "peft": (("eager", "compiled"), ("on", "off"), ("torch", "transformers", "peft")),
    "liger": (("eager", "compiled"), ("on", "off"),
              ("torch", "transformers", "peft", "liger_kernel")),
    "unsloth": (("16bit", "nf4"), ("unsloth", "on", "off"),
                ("torch", "transformers", "peft", "unsloth", "unsloth_zoo", "trl")),
}
MODEL_NAMES = tuple(MODELS)


def is_torch(text: str) -> bool:
    """A PyTorch cell (or row's method: `peft-eager`, `liger-compiled-nockpt`, ...)."""
    return text.split(":")[0].split("-")[0] in TORCH_STACKS


def torch_cell(text: str) -> tuple[str, str, int, str, str]:
    """`STACK:MODEL:BATCH:A:B` as (stack, model, batch, a, b), or a ValueError saying what
    such a cell takes."""
    if "@" in text:
        raise ValueError(f"cell {text!r}: XLA flags (`@NAME`) are for lorax's cells")
    parts = text.split(":")
    stack = parts[0]
    if stack not in TORCH_STACKS or len(parts) != 5:
        raise ValueError(f"cell {text!r}: a PyTorch cell is STACK:MODEL:BATCH:A:B with STACK "
                         f"one of {tuple(TORCH_STACKS)}")
    a_values, b_values, _ = TORCH_STACKS[stack]
    _, model, batch, a, b = parts
    if model not in MODEL_NAMES or not batch.isdigit() or int(batch) < 1 or (
            a not in a_values or b not in b_values):
        raise ValueError(f"cell {text!r}: expected {stack}:MODEL:BATCH:{'|'.join(a_values)}:"
                         f"{'|'.join(b_values)} with MODEL one of {MODEL_NAMES} and BATCH >= 1")
    return stack, model, int(batch), a, b


class Cell(NamedTuple):
    model: str
    method: str
    batch: int
    remat: str
    attention: str
    layers: str = "scan"
    xla: str = ""  # a name in `CELL_XLA_FLAGS`, or none

    @classmethod
    def parse(cls, text: str) -> "Cell":
        spec, _, xla = text.partition("@")
        parts = spec.split(":")
        base = parts[1].removesuffix("+host") if len(parts) in (5, 6) else ""
        host_ok = base == parts[1] or base.startswith(("lora", "qlora"))
        if (len(parts) not in (5, 6) or base not in METHODS or not host_ok
                or parts[5:] not in ([], *([x] for x in LAYER_LOOPS))):
            raise ValueError(f"cell {text!r}: expected MODEL:METHOD:BATCH:REMAT:ATTENTION"
                             f"[:LAYERS][@FLAGS] with METHOD one of {METHODS} (`+host` after "
                             f"a lora or qlora one) and LAYERS one of {LAYER_LOOPS}")
        if "@" in text and xla not in CELL_XLA_FLAGS:
            raise ValueError(f"cell {text!r}: @{xla} is not one of {sorted(CELL_XLA_FLAGS)}")
        layers = parts[5] if len(parts) == 6 else "scan"
        return cls(parts[0], parts[1], int(parts[2]), parts[3], parts[4], layers, xla)

    def __str__(self) -> str:
        spec = ":".join(str(v) for v in (self[:6] if self.layers != "scan" else self[:5]))
        return spec + (f"@{self.xla}" if self.xla else "")


# -- model FLOPs -------------------------------------------------------------------------------


def matmul_params(model: str) -> int:
    """N: the parameters of the matrix products (seven projections a layer, the tied
    output layer)."""
    n, d, f, h, kv, _ = MODELS[model]
    hd = d // h
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    return n * per_layer + vocab(model) * d


def flops_per_token(model: str, method: str, seq: int) -> float:
    """Model FLOPs per token (the module docstring's accounting)."""
    n_layers, d = MODELS[model][:2]
    n = matmul_params(model)
    return (6 if method == "full" else 4) * n + 12 * n_layers * d * seq


# -- the runner: one cell per process ----------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_in_process(args: list[str], timeout: float,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m benchmarks.<args>` (`env`: variables to set for it) and return its
    `RESULT {json}` line, or an error row with the output's last lines."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                           timeout=timeout, env={**_child_env(), **(env or {})}, cwd=ROOT)
        out, err, code = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, err, code = _text(e.stdout), _text(e.stderr), f"timed out after {timeout:.0f} s"
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = " | ".join((err or out).strip().splitlines()[-6:])
    return {"error": f"exit {code}: {tail}"[-1500:], "wall_s": time.perf_counter() - t0}


def _text(b: Any) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def torch_missing(text: str = "peft:") -> str:
    """Which of a PyTorch cell's modules do not import here ('' if none; by default
    PyTorch + PEFT's)."""
    stack = text.split(":")[0]
    needs = TORCH_STACKS[stack][2] + (("bitsandbytes",) if ":nf4:" in text else ())
    return ", ".join(m for m in needs if importlib.util.find_spec(m) is None)


def cell_args(text: str, steps: int, trace_dir: Path | None) -> list[str]:
    if is_torch(text):
        stack, model, batch, a, b = torch_cell(text)
        head = ["benchmarks._peft"] if stack == "peft" else ["benchmarks._torch_anchors", stack]
        args = [*head, model, "--batch", str(batch), "--steps", str(steps)]
        if stack == "unsloth":
            return args + ["--quant", a, "--checkpointing", b]
        return args + (["--compile"] if a == "compiled" else []) + (
            ["--no-checkpointing"] if b == "off" else [])
    Cell.parse(text)  # a bad cell fails here, before any process starts
    return ["benchmarks._device_step", text, "--steps", str(steps)] + (
        ["--trace", str(trace_dir)] if trace_dir else [])


def host_caps(text: str) -> dict[str, float]:
    """`--host-cap`'s `MODEL=GIB,...` as {model: GiB}."""
    caps = {}
    for item in filter(None, text.split(",")):
        model, _, gib = item.partition("=")
        try:
            caps[model] = float(gib)
        except ValueError:
            raise ValueError(f"--host-cap {item!r}: expected MODEL=GIB, e.g. llama-3-70b=22") from None
    return caps


# What a `+host` cell is compiled with on a GPU (`--host-xla-flags`): with XLA's command
# buffers (CUDA graphs) on, each layer's moved codes and its computation took turns, with
# them off the copies run beside the layers' work (on an H200, Llama-3-70B: 1.905 s a step
# against 2.723 s; docs/qlora.md, "Overlap").
HOST_XLA_FLAGS = "--xla_gpu_enable_command_buffer= --xla_gpu_enable_pipelined_host_offloading=true"


def cap_env(text: str, caps: dict[str, float], ceiling: dict[str, Any],
            host_flags: str = "") -> dict[str, str]:
    """For a `+host` cell: whose model has a cap, the allocator's share of the card that
    holds it to that many GiB (what a smaller card would have), as the variable JAX reads;
    on a GPU, `host_flags` after the run's own `XLA_FLAGS`. Nothing where the card is
    unknown (the CPU)."""
    model, method = (text.split(":") + [""])[:2]
    total = ceiling.get("device_memory_gib")
    if not (method.endswith("+host") and total):
        return {}
    env = {"XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), host_flags)))
           } if host_flags and ceiling.get("platform") == "gpu" else {}
    if model in caps:
        name = "XLA_CLIENT_MEM_FRACTION" if "XLA_CLIENT_MEM_FRACTION" in os.environ else (
            "XLA_PYTHON_CLIENT_MEM_FRACTION")
        env[name] = f"{min(caps[model] / total, 1.0):.4f}"
    return env


def cell_xla_env(text: str, env: dict[str, str]) -> dict[str, str]:
    """`XLA_FLAGS` for a cell that names flags (`...@cublas`): `env`'s (else the run's),
    then the cell's `CELL_XLA_FLAGS`; nothing for a cell that names none."""
    name = text.partition("@")[2]
    if not name:
        return {}
    own = env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    return {"XLA_FLAGS": " ".join(filter(None, (own, CELL_XLA_FLAGS[name])))}


def ceiling_tflops(timeout: float = 120) -> dict[str, Any]:
    """The device's bf16 matrix rate, measured (`benchmarks._device_step --ceiling`)."""
    return run_in_process(["benchmarks._device_step", "--ceiling"], timeout)


def fused_attention_works(steps: int) -> bool:
    """A tiny lorax step through cuDNN's attention: does it compile and run here? (If
    not, every `auto` cell would fail the same way.)"""
    row = run_in_process(cell_args("tiny:lora:1:none:cudnn", steps, None), 180)
    if "error" in row:
        print(f"[accelerator] cuDNN attention probe: {row['error']}", flush=True)
    return "error" not in row


def timeout_for(text: str) -> float:
    if is_torch(text) and ":compiled:" in text:
        return 420  # torch.compile's first step: ~2 minutes at 8B
    if text.startswith("unsloth:"):
        return 300  # the first one saves the random model Unsloth loads (16 GB at 8B)
    # An unrolled loop compiles every layer: ~30 s for 8B on a CPU, against ~4 under scan.
    unrolled = not is_torch(text) and Cell.parse(text).layers == "unrolled"
    return 420 if "70b" in text or unrolled else 240


def least_for(text: str) -> float:
    """Seconds a cell needs left before the deadline to start: 45, or for a compiled
    PyTorch cell, whose first step compiles for minutes, 200 (less would be spent on a
    cell stopped before its first step ends)."""
    return 200 if is_torch(text) and ":compiled:" in text else 45


def with_rates(row: dict[str, Any], ceiling: dict[str, Any]) -> dict[str, Any]:
    """MFU over the measured matrix rate and over the datasheet's (where known)."""
    if "tokens_per_s" not in row:
        return row
    method = "full" if row.get("method") == "full" else "lora"
    tflops = row["tokens_per_s"] * flops_per_token(row["model"], method, row["seq"]) / 1e12
    row["model_tflops"] = tflops
    if ceiling.get("ceiling_tflops"):
        row["mfu"] = tflops / ceiling["ceiling_tflops"]
    sheet = next((v for k, v in DATASHEET_TFLOPS.items() if k in str(row.get("device", ""))), None)
    if sheet:
        row["mfu_datasheet"] = tflops / sheet
    return row


def quantized(method: str) -> bool:
    """A method whose frozen weights are quantized (lorax's `qlora-*`, Unsloth's `nf4`)."""
    return method.startswith("qlora") or "-nf4" in method


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`vs_peft`: tokens/s over the fastest PyTorch + PEFT cell of the same model and batch;
    `vs_torch`: over the fastest PyTorch cell of any stack (PEFT, Liger, Unsloth) of the
    same model, batch and kind of base (quantized or not), where one beside PEFT ran;
    `vs_lora` (QLoRA, hand-written): step time over dense lorax LoRA's, same remat,
    attention and layers; `vs_hand` (lorax LoRA): over hand-written LoRA's; `vs_device` (a
    `+host` method): over the same method's with every weight on the device."""
    ok = [r for r in rows if "tokens_per_s" in r]
    for r in ok:
        key = (r["model"], r["batch"])
        peft = [p["tokens_per_s"] for p in ok if p["method"].startswith("peft") and
                (p["model"], p["batch"]) == key]
        if peft and not is_torch(r["method"]):
            r["vs_peft"] = r["tokens_per_s"] / max(peft)
        anchors = [p for p in ok if is_torch(p["method"]) and (
            p["model"], p["batch"], quantized(p["method"])) == (*key, quantized(r["method"]))]
        # (Only where a stack beside PEFT ran: with PEFT's rows alone it is `vs_peft`.)
        if any(not p["method"].startswith("peft") for p in anchors) and not is_torch(r["method"]):
            r["vs_torch"] = r["tokens_per_s"] / max(p["tokens_per_s"] for p in anchors)
        how = lambda p: (p["remat"], p["attention"], p.get("layers") or "scan",  # noqa: E731
                         p.get("xla") or "")
        same = lambda m: next((p["step_s"] for p in ok if p["method"] == m and (  # noqa: E731
            p["model"], p["batch"], *how(p)) == (*key, *how(r))), None)
        if r["method"].endswith("+host"):
            name, ref = "vs_device", same(r["method"].removesuffix("+host"))
        else:
            name = "vs_lora" if r["method"] != "lora" else "vs_hand"
            ref = same("lora") if r["method"].startswith("qlora") or r["method"] == "hand" else (
                same("hand") if r["method"] == "lora" else None)
        if ref:
            r[name] = r["step_s"] / ref
    return rows


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    f = lambda r, k, fmt: format(r[k], fmt) if isinstance(r.get(k), (int, float)) else ""  # noqa: E731
    flags = run_flags(rows)
    # Columns a table shows only where a row has them (a run from before them renders as it did).
    anchors = any(is_torch(str(r.get("method", ""))) and not str(r["method"]).startswith("peft")
                  for r in rows)
    losses = any(isinstance(r.get("first_loss"), (int, float)) for r in rows)
    extra = (["vs fastest PyTorch"] if anchors else []) + (
        ["first loss", "last loss"] if losses else [])
    header = ["model", "batch", "method", "remat", "attention", "s/step", "tokens/s", "MFU",
              "vs fastest PEFT", "vs dense / hand", "peak GiB", "XLA GiB", "compile s", *extra]
    table = C.md_table(header, [
        [r["model"], f"{r['batch']}x{r.get('seq', '')}", _method(r, flags), r.get("remat", ""),
         _attention(r), f(r, "step_s", ".3f"), f(r, "tokens_per_s", ",.0f"),
         f(r, "mfu_datasheet", ".1%") or f(r, "mfu", ".1%"), f(r, "vs_peft", ".2f"),
         f(r, "vs_lora", ".3f") or f(r, "vs_hand", ".3f") or f(r, "vs_device", ".3f"),
         f(r, "peak_gib", ".2f"), f(r, "xla_peak_gib", ".2f"), f(r, "compile_s", ".0f"),
         *([f(r, "vs_torch", ".2f")] if anchors else []),
         *([f(r, "first_loss", ".3f"), f(r, "last_loss", ".3f")] if losses else [])]
        if not r.get("error") else [r.get("cell", "?"), "", "", "", "",
                                    "error: " + str(r["error"])[:200], *[""] * (len(header) - 6)]
        for r in rows])
    rates = [r["model_tflops"] / r["mfu"] for r in rows if isinstance(r.get("mfu"), (int, float))]
    sheet = any(isinstance(r.get("mfu_datasheet"), (int, float)) for r in rows)
    return [table, "", "MFU: model FLOPs per token (`benchmarks/accelerator.py`) x tokens/s over "
            + ("the datasheet's dense bf16 rate (989.4 TFLOP/s for an H100 or H200 SXM)" if sheet
               else "the bf16 matrix rate measured on the same device in the same run")
            + (f"; the rate measured in the same run ({statistics.median(rates):.0f} TFLOP/s, "
               "8192-cube bf16 products) is in the CSV's `mfu` column." if rates else ".")
            + " *vs dense / hand*: step time over dense lorax LoRA's (QLoRA, hand-written), "
            "over hand-written LoRA's (lorax LoRA), or over the same method's with every weight "
            "on the device (`+host`: frozen weights in host memory), same batch, remat, "
            "attention, layers (*unrolled*: per-layer weights, no `lax.scan`) and cell "
            "flags (`@NAME`)."
            + (" *vs fastest PyTorch*: tokens/s over the fastest PyTorch row (PEFT, PEFT + "
               "Liger-Kernel, Unsloth) of the same model and batch on the same kind of base "
               "(bf16, or quantized: lorax's QLoRA against Unsloth's NF4)." if anchors else "")
            + (" *first / last loss*: the first and the last step's, every stack on the same "
               "tokens (`benchmarks._batch`); lorax's is bf16 (steps of 0.0625 near 12), "
               "PyTorch's float32." if losses else "")]


def _method(r: dict[str, Any], flags: str = "") -> str:
    """The method's label; `flags`: the run's XLA flags, named where a row's differ."""
    cap = f" (card held to {r['mem_cap_gib']:g} GiB)" if r.get("mem_cap_gib") else ""
    own = str(r.get("xla_flags") or "")
    note = "" if set(own.split()) == set(flags.split()) or is_torch(str(r["method"])) else (
        f", XLA flags: {_flag_words(own)}")
    return (f"{r['method']}, unrolled" if r.get("layers") == "unrolled" else str(r["method"])) + (
        cap + note)


_FLAG_WORDS = {"--xla_gpu_enable_command_buffer=": "command buffers off",
               "--xla_gpu_enable_pipelined_host_offloading=true": "pipelined host offloading",
               CELL_XLA_FLAGS["cublas"]: "every product through cuBLAS"}


def _flag_words(flags: str) -> str:
    return " + ".join(_FLAG_WORDS.get(f, f"`{f}`") for f in sorted(flags.split())) or "none"


def run_flags(rows: list[dict[str, Any]]) -> str:
    """The XLA flags every one of `rows` ran with; '' where they differ (a `+host` cell
    adds its own), so each row names its own."""
    flags = {" ".join(sorted(str(r.get("xla_flags") or "").split())) for r in rows
             if not r.get("error") and not is_torch(str(r.get("method", "")))}
    return flags.pop() if len(flags) == 1 else ""


def _attention(r: dict[str, Any]) -> str:
    used = r.get("attention_used", "")
    return f"{r.get('attention', '')} ({used})" if used and used != r.get("attention") else str(
        r.get("attention", ""))


def write_tables(out: Path, run: str = "", name: str = "accelerator") -> None:
    """`NAME.md` and `.png` from `NAME.csv` (what `--plot-only` redraws; another NAME: a
    table assembled from several commands' outputs, `results/gpu_raw/*/assemble.py`)."""
    rows = C.read_csv(out / f"{name}.csv")
    facts = {k: next((r[k] for r in rows if r.get(k) not in (None, "")), "")
             for k in ("device", "platform", "jax", "torch", "peft", "transformers",
                       "liger_kernel", "unsloth", "unsloth_zoo", "bitsandbytes", "triton")}
    facts["xla_flags"] = run_flags(rows)
    facts["run"] = run or "cells in processes of their own"
    lines = "\n".join(f"- **{k}**: {v}" for k, v in facts.items() if v)
    (out / f"{name}.md").write_text("\n".join(
        [*markdown(rows), "", "<details markdown><summary>Device and run</summary>", "", lines,
         "", "</details>"]) + "\n")
    C.replot(out, name, plot)


COLORS = {"lora": "C0", "hand": "0.55", "full": "C3", "peft": "C1", "qlora": "C2",
          "liger": "C4", "unsloth": "C5"}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Tokens/s of every measured cell of the most-measured model, one bar each, colored
    by method family; the fastest PyTorch + PEFT cell of each batch drawn as a line."""
    rows = [r for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    if not rows:
        return
    model = max({r["model"] for r in rows}, key=lambda m: sum(r["model"] == m for r in rows))
    rows = sorted((r for r in rows if r["model"] == model), key=lambda r: (r["batch"], r["tokens_per_s"]))
    fig, axes = C.small_multiples(1, 1, panel_height=0.45 * len(rows) + 0.8)
    ax, flags = axes[0][0], run_flags(rows)
    label = lambda r: textwrap.fill(f"{_method(r, flags)} {r['batch']}x{r['seq']}" + (  # noqa: E731
        f", remat {r['remat']}, {r.get('attention_used') or r['attention']}"
        if not is_torch(str(r["method"])) else ""), 60)
    family = lambda r: next(k for k in COLORS if str(r["method"]).startswith(k))  # noqa: E731
    ax.barh(range(len(rows)), [r["tokens_per_s"] for r in rows],
            color=[COLORS[family(r)] for r in rows])
    ax.set_yticks(range(len(rows)), [label(r) for r in rows], fontsize=7)
    for batch in sorted({r["batch"] for r in rows}):
        peft = [r["tokens_per_s"] for r in rows if r["batch"] == batch and family(r) == "peft"]
        if peft:
            ax.axvline(max(peft), color="C1", ls=":", lw=1)
    ax.set_xlabel(f"tokens/s, {model} ({rows[0].get('device', '')})")
    C.save(fig, path)


def write(out: Path, rows: list[dict[str, Any]], clock: C.Clock) -> None:
    rows = with_ratios([dict(r) for r in rows])
    C.write_csv(out / "accelerator.csv", [{k: v for k, v in r.items() if k != "trace"} for r in rows])
    traces = {r["cell"]: r["trace"] for r in rows if "trace" in r}
    if traces:
        (out / "accelerator_traces.json").write_text(json.dumps(traces, indent=1))
    write_tables(out, f"{clock.elapsed:.0f} s, cells in processes of their own")


def run_cells(cells: list[str], args: Any, out: Path, clock: C.Clock) -> list[dict[str, Any]]:
    """Each cell in a process of its own, the results written after every cell (a run cut
    short keeps what it measured)."""
    steps = args.steps or (3 if args.quick else 8)
    caps = host_caps(args.host_cap)
    trace_dir = args.trace_dir or out / "traces"
    # The matrix rate needs a process of its own; a CPU smoke run has no use for it.
    ceiling = {} if args.quick else ceiling_tflops()
    traced = set(cells) if args.trace == "all" else set(filter(None, args.trace.split(",")))
    clock.log(f"matrix rate: {ceiling}")
    if ceiling.get("platform") == "gpu" and not args.no_probe and not fused_attention_works(steps):
        cells = [c.replace(":auto", ":chunked") for c in cells]
        traced = {c.replace(":auto", ":chunked") for c in traced}
        clock.log("cuDNN attention failed on this GPU: the cells run the query chunks")
    rows: list[dict[str, Any]] = []
    for text in cells:
        left = (args.deadline or float("inf")) - clock.elapsed
        if left < least_for(text) or (is_torch(text) and torch_missing(text)):
            why = "past the deadline" if left < least_for(text) else (
                f"{torch_missing(text)} not installed")
            rows.append({"cell": text, "error": f"not run: {why}"})
            write(out, rows, clock)
            continue
        trace = trace_dir if text in traced and not is_torch(text) else None
        env = cap_env(text, caps, ceiling, args.host_xla_flags)
        env.update(cell_xla_env(text, env))
        row = run_in_process(cell_args(text, steps, trace), min(timeout_for(text), left), env)
        cap = {"mem_cap_gib": caps[text.split(":")[0]]} if any("FRACTION" in k for k in env) else {}
        rows.append(with_rates({"cell": text, **cap, **row}, ceiling))
        clock.log(f"{text}: " + (f"{row['step_s']:.4f} s/step, {row['tokens_per_s']:,.0f} tok/s, "
                                 f"peak {row.get('peak_gib', 0):.2f} GiB" if "step_s" in row
                                 else row.get("error", "")[-400:]))
        write(out, rows, clock)
    return with_ratios(rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = C.parser(__doc__, rounds=False, plot=True)
    p.add_argument("--cells", default=None,
                   help="comma-separated cells, or `pending` or `anchors` (default: the table)")
    p.add_argument("--steps", type=int, default=None, help="steps per cell (2 of them warm-up)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds: start no cell that could run past this")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the cuDNN attention probe (known to work on this device)")
    p.add_argument("--host-cap", default="",
                   help="MODEL=GIB,...: run that model's `+host` cells with the allocator held "
                        "to GIB of the card (e.g. llama-3-70b=22: a 24 GB card's room)")
    p.add_argument("--host-xla-flags", default=HOST_XLA_FLAGS,
                   help="XLA flags added for the `+host` cells on a GPU (default: command "
                        "buffers off, pipelined host offloading on; '' for none)")
    p.add_argument("--trace", default="", help="cells (or 'all') to profile one step of")
    p.add_argument("--trace-dir", type=Path, default=None, help="where profiles go (default: OUT/traces)")
    args = p.parse_args(argv)
    out, clock = C.out_dir(args.out), C.Clock("accelerator")
    if args.plot_only:
        write_tables(out)
        return C.read_csv(out / "accelerator.csv")
    named = {"pending": PENDING_CELLS, "anchors": ANCHOR_CELLS}
    cells = (list(named[args.cells]) if args.cells in named else args.cells.split(",")
             if args.cells else list(QUICK_CELLS if args.quick else DEFAULT_CELLS))
    for text in cells:
        cell_args(text, 1, None)  # a bad cell fails here, before anything runs
    host_caps(args.host_cap)
    return run_cells(cells, args, out, clock)


if __name__ == "__main__":
    main()
