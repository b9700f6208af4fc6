"""The longest context one card trains: Llama-3-8B QLoRA, batch 1, compile-only search and
the card's confirming step.

The job is `benchmarks._llama`'s step (Llama-3-8B, QLoRA nf4 with double
quantization, rank 16 on the seven projections, bf16, Adam, one window) at long lengths,
with the recipe for them (`RECIPE`, all `llama.Config` fields):

- cuDNN's fused attention: memory linear in the sequence (the time is not: L^2);
- the chunked loss (`llama.tied_loss`): the `(L, vocab)` logits never whole;
- remat `offload`: each layer's kept input (L x 4096 bf16, 8 KiB a token) moved to host
  memory in the forward loop and back in the backward loop;
- `mlp_chunk`: the MLP's `(L, 14336)` gate and up outputs made 8192 tokens at a time
  (without it they are 70% of the step's temporaries).

**The search** (`python -m benchmarks.context`) compiles the step for a card with no card
here (`benchmarks._cuda`: XLA's GPU compiler, deviceless; jax[cuda13]) and reads
XLA's `memory_analysis()`: device bytes = arguments + temporaries + outputs - aliased
(donated) outputs; the host bytes (the offloaded inputs: host temporaries, plus any
host arguments) apart. A length fits a budget when its device bytes are at most the
budget less `--margin` (5%). First the per-layer check: the step with 2 layers and with
32 at two lengths (same temporaries: the per-layer peak does not grow with depth; linear
in the length); then for each budget a search on multiples of `--step` tokens from a
linear prediction through those two lengths (`search`: each next length on the line through
the nearest two tried, a bisection where that does not close in) finds the largest length
that fits. Each compile also says whether any buffer of the program holds whole `(L, vocab)`
logits, and its largest top-level buffer. Written to `<out>/<name>.{csv,md}`.

    CUDA_VISIBLE_DEVICES=-1 python -m benchmarks.context [--budgets h200=139,h100=78]
        [--margin 0.05] [--step 2048] [--out DIR] [--name gpu_compile_context_h200]

**The card's confirming step** (`--confirm SEQ`) runs on a GPU, within `--seconds`:
a model of `--layers` (2) Llama-3-8B layers at SEQ tokens with the attention banded to
`--window` tokens (cuDNN's sliding window: the same buffers as causal attention, so the
same memory as compiled above, for a fraction of the L^2 time), compiled there, its
`memory_analysis()`, then steps: their time, the card's `peak_bytes_in_use`, first and
last loss; then, if the time is left, the same model with causal attention at `--short`
tokens, for the rate of causal attention. It prints one `RESULT {json}` line, also when
its time runs out (what it has measured so far, `"phase"` saying where it stopped), and
a derived 32-layer step time and tokens/s at SEQ (marked `derived`).

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=.99 \\
        python -m benchmarks.context --confirm 1376256 --seconds 170

**Unsloth's longest context** (`--unsloth GIB`, on a GPU with Unsloth installed: `bash
scripts/card-anchors` with `UNSLOTH_CONTEXT=GIB`) is found the same way: Unsloth's QLoRA
step on `--layers` layers, each length a process of its own with the card held to GIB
less what the other layers' weights and state add (`addback_gib`), from Unsloth's
published 342,733 tokens (`bracket_search`), into `<out>/context_unsloth.{csv,md}`.

**lorax beside Unsloth** (`--versus GIB`, on a GPU with Unsloth installed; the first part of
`bash scripts/card-anchors`): both held to the same card size the same way (`--layers`
layers, GIB less the other layers' share), the tries that decide whether lorax's longest
is at least `TARGET` (1.25) times Unsloth's, within `--seconds`: lorax's confirming step
at `--lorax-seq` (819,200), Unsloth at that over 1.25, then Unsloth at its published
figure, into `<out>/context_versus.{csv,md}`, rewritten after every try.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import lorax

from . import _common as C
from . import _llama as L
from ._batch import MODELS, RANK, layer_weights
from ._cuda import compile_for, options

GiB = 2**30
MODEL, METHOD, FLAGS = "llama-3-8b", "qlora-nf4", "default"
RECIPE = dict(remat="offload", attention="cudnn", mlp_chunk=8192)
BUDGETS = "h200=139,h100=78"  # GiB a process can use: an H200 (140.4 GiB), an H100 80GB (79.1)
ANCHORS = (131_072, 262_144)  # the per-layer check's lengths, and the prediction's
VOCAB = 128_256
LAYERS = 32
# XLA's defaults, not the host-offload recipe's pipelining (docs/gpu.md): moving the next
# layer's input in while this one computes keeps a second (L, 4096) input on the device
# (compiled, 26.2 GiB of temporaries at 262,144 tokens against 21.1), and at these lengths
# a layer computes for seconds where its input crosses in a fraction of one.


# -- the search ---------------------------------------------------------------------------------


def predicted(rows: list[dict[str, Any]], limit_gib: float) -> int:
    """The length at which the device bytes reach `limit_gib`, on the line through the two
    longest of `rows` (device bytes linear in the length)."""
    (s0, p0), (s1, p1) = sorted((r["seq"], r["device_gib"]) for r in rows)[-2:]
    slope = (p1 - p0) / (s1 - s0)
    return int(s1 + (limit_gib - p1) / slope)


def search(device_gib: Callable[[int], float], limit: float, guess: int, step: int,
           tries: int = 24) -> int | None:
    """The largest multiple of `step` whose `device_gib` is at most `limit`, device bytes
    growing with the length: from `guess`, each next length on the line through the two
    nearest lengths tried (device bytes nearly linear in the length), kept inside the
    bracket of the longest fitting and the shortest failing length (its middle once a
    length forced next to an end of it has not closed it). None if nothing fits (or
    `tries` run out)."""
    known: dict[int, float] = {}
    seq, crawled, bisect = max(step, round(guess / step) * step), False, False
    for _ in range(tries):
        known[seq] = device_gib(seq)
        fit = [s for s, v in known.items() if v <= limit]
        over = [s for s, v in known.items() if v > limit]
        lo, hi = max(fit, default=None), min(over, default=None)
        if lo is not None and hi is not None and hi - lo <= step:
            return lo
        if hi is not None and hi <= step:
            return None
        near = sorted(known, key=lambda s: abs(known[s] - limit))[:2]
        if len(near) == 2 and known[near[0]] != known[near[1]]:
            (s0, v0), (s1, v1) = ((s, known[s]) for s in near)
            line = s0 + (limit - v0) * (s1 - s0) / (v1 - v0)
        else:  # one length tried: double it or halve it
            line = 2 * seq if known[seq] <= limit else seq / 2
        nxt = int(line // step) * step
        if lo is not None and hi is not None:
            # The last length was forced next to an end of the bracket (the line's guess was
            # outside it) and did not close it: the line crawls, bisect from here on.
            bisect = bisect or crawled
            if bisect:
                nxt = (lo + hi) // 2 // step * step
            crawled = not bisect and not lo + step < nxt < hi - step
            nxt = min(max(nxt, lo + step), hi - step)
        elif lo is not None:
            nxt = max(nxt, lo + step)
        else:
            nxt = max(step, min(nxt, hi - step))
        seq = nxt
    return None


def logits_whole(hlo_text: str, seq: int, vocab: int = VOCAB) -> bool:
    """Whether any array of a compiled program has both a `seq` and a `vocab` axis."""
    for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]+)\]", hlo_text):
        axes = {int(d) for d in dims.split(",") if d}
        if seq in axes and vocab in axes:
            return True
    return False


def largest_buffer(hlo_text: str) -> tuple[str, float]:
    """The largest device array an instruction of a compiled program writes outside
    fusions (a buffer, not a value inside a kernel; host memory, `S(5)`, aside), and its
    GiB."""
    bodies, _ = C.hlo_executions(hlo_text)
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.-]+)", hlo_text))
    best = ("", 0.0)
    for name, body in bodies.items():
        if name in fused:
            continue
        for dtype, dims, layout in re.findall(
                r"^\s*(?:ROOT )?%\S+ = ([a-z]+[0-9]*)\[([0-9,]*)\](\{[^}]*\})?", body, re.M):
            if "S(5)" in layout:
                continue
            nbytes = math.prod(int(d) for d in dims.split(",") if d) * C.bits(dtype) / 8
            if nbytes > best[1]:
                best = (f"{dtype}[{dims}]", nbytes)
    return best[0], best[1] / GiB


def measure(seq: int, n_layers: int = LAYERS, target: str = "h200",
            **config: Any) -> dict[str, Any]:
    """XLA's memory analysis of the step at `seq` tokens, compiled for `target` (no card)."""
    cfg = dict(RECIPE, **config)
    remat, attention = cfg.pop("remat"), cfg.pop("attention")
    t0 = time.perf_counter()
    text = L.lowered_step(MODEL, METHOD, remat, "scan", attention, seq=seq, n_layers=n_layers,
                          **cfg)
    executable = compile_for(text, target, options(FLAGS))
    compile_s = time.perf_counter() - t0
    hlo = executable.hlo_modules()[0].to_string()
    buffer, buffer_gib = largest_buffer(hlo)
    return dict(target=target, seq=seq, layers=n_layers, mlp_chunk=cfg.get("mlp_chunk"),
                **_analysis(executable.get_compiled_memory_stats()),
                largest_buffer=buffer, largest_buffer_gib=buffer_gib,
                logits_whole=logits_whole(hlo, seq), compile_s=compile_s)


def _analysis(memory: Any) -> dict[str, float]:
    m = C.memory_gib(memory)
    return dict(args_gib=m["args"], temps_gib=m["temps"], outputs_gib=m["outputs"],
                aliased_gib=m["aliased"], device_gib=m["peak"], host_gib=m["host"])


def run_search(budgets: dict[str, float], margin: float, step: int, log: Callable[[str], None],
               measure: Callable[..., dict[str, Any]] = measure) -> tuple[list, dict]:
    """The per-layer check, then each budget's bisection. (rows, {target: found length})."""
    rows: list[dict[str, Any]] = []
    cache: dict[tuple, dict[str, Any]] = {}

    def row(seq: int, layers: int, target: str, budget: float, why: str) -> dict[str, Any]:
        if (seq, layers, target) not in cache:
            r = measure(seq, layers, target)
            cache[seq, layers, target] = r
            log(f"{target} {layers} layers {seq}: {r['device_gib']:.2f} GiB device "
                f"({r['temps_gib']:.2f} temporaries), {r['host_gib']:.2f} GiB host, "
                f"{r['compile_s']:.0f} s")
        r = dict(cache[seq, layers, target], budget_gib=budget, limit_gib=budget * (1 - margin),
                 why=why)
        r["fits"] = r["device_gib"] <= r["limit_gib"]
        rows.append(r)
        return r

    found = {}
    for target, budget in budgets.items():
        anchors = [row(s, n, target, budget, "per-layer check" if n < LAYERS else "anchor")
                   for s in ANCHORS for n in ((2, LAYERS) if target == "h200" else (LAYERS,))]
        guess = predicted([r for r in anchors if r["layers"] == LAYERS], budget * (1 - margin))
        log(f"{target}: {budget:g} GiB less {margin:.0%}: predicted {guess} tokens")
        found[target] = search(
            lambda s: row(s, LAYERS, target, budget, "search")["device_gib"],
            budget * (1 - margin), guess, step)
        log(f"{target}: the longest fitting length is {found[target]}")
    return rows, found


COLUMNS = [("target", "card"), ("budget_gib", "budget GiB"), ("why", "compiled for"),
           ("layers", "layers"), ("seq", "tokens"), ("args_gib", "arguments GiB"),
           ("temps_gib", "temporaries GiB"), ("outputs_gib", "outputs GiB"),
           ("aliased_gib", "aliased GiB"), ("device_gib", "device GiB"),
           ("host_gib", "host GiB (offloaded)"), ("largest_buffer", "largest buffer"),
           ("largest_buffer_gib", "its GiB"), ("logits_whole", "logits whole"),
           ("fits", "fits"), ("compile_s", "compile s")]


def markdown(rows: list[dict[str, Any]], found: dict[str, int | None], margin: float) -> str:
    lines = [C.column_table(rows, COLUMNS), ""]
    for target, seq in found.items():
        match = [r for r in rows if r["target"] == target and r["seq"] == seq
                 and r["layers"] == LAYERS]
        if seq is None or not match:
            lines.append(f"- {target}: no length fits.")
            continue
        r = match[0]
        lines.append(
            f"- **{target}, {r['budget_gib']:g} GiB less {margin:.0%} "
            f"({r['limit_gib']:.1f} GiB): {seq:,} tokens.** Device {r['device_gib']:.2f} GiB = "
            f"arguments {r['args_gib']:.2f} + temporaries {r['temps_gib']:.2f} + outputs "
            f"{r['outputs_gib']:.2f} - aliased {r['aliased_gib']:.2f}; host (the 32 layers' "
            f"offloaded inputs) {r['host_gib']:.2f} GiB.")
    lines += ["", f"Recipe: {MODEL} {METHOD} (double quantization), rank 16 on q, k, v, o, gate, "
              f"up, down, batch 1, bf16, Adam, remat `{RECIPE['remat']}`, attention "
              f"`{RECIPE['attention']}`, `mlp_chunk={RECIPE['mlp_chunk']}`, the chunked loss; "
              f"XLA flags `{FLAGS}`. Compiled deviceless (`python -m benchmarks.context`)."]
    return "\n".join(lines) + "\n"


# -- the card's confirming step -------------------------------------------------------------------


class Deadline:
    """A run's time limit: `left()` seconds, and a watchdog that prints `result` as it is
    (`phase`: where the time ran out) and ends the process when the time is up."""

    def __init__(self, seconds: float, result: dict[str, Any]):
        self.t0, self.seconds, self.result = time.perf_counter(), seconds, result
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def _expire(self) -> None:
        with self.lock:
            self.result["timed_out"] = True
            emit(self.result)
            os._exit(3)

    def finish(self) -> None:
        with self.lock:
            self.timer.cancel()
            self.result["timed_out"] = False
            emit(self.result)


def emit(result: dict[str, Any]) -> None:
    result["elapsed_s"] = round(time.perf_counter() - result.get("_t0", time.perf_counter()), 1)
    for _ in range(5):  # (the watchdog's thread: the main one may be changing `result`)
        try:
            text = json.dumps({k: v for k, v in result.items() if not k.startswith("_")},
                              default=str)
            break
        except RuntimeError:
            time.sleep(0.05)
    else:
        text = json.dumps({"phase": result.get("phase"), "error": "result unreadable"})
    print("RESULT " + text, flush=True)


def _memory(key: str) -> float:
    return (jax.devices()[0].memory_stats() or {}).get(key, 0) / GiB


def host_peak_gib() -> float:
    """The process's peak resident host memory (VmHWM), GiB."""
    try:
        text = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) / 2**20
    except (OSError, AttributeError):
        return 0.0


def card_step(seq: int, n_layers: int, window: int | None, model: str = MODEL,
              seed: int = 0) -> tuple:
    """(compiled Adam step, its arguments, its memory analysis) of the recipe with
    `n_layers` layers of `model` at `seq` tokens on this device: random nf4 codes, norms at
    1, a repeated random sequence as the window (so the loss falls). Attention `auto`:
    cuDNN's on a GPU (as the search compiles it), query chunks elsewhere (a CPU test)."""
    cfg = L.config(model, "auto", RECIPE["remat"])._replace(
        n_layers=n_layers, mlp_chunk=RECIPE["mlp_chunk"], window=window)
    abstract, spec = L.build(cfg, METHOD, jnp.bfloat16)
    trainable, frozen = lorax.partition(L.materialise(abstract, seed), spec)
    optimizer = optax.adam(1e-3)
    state = optimizer.init(trainable)
    period = jax.random.randint(jax.random.PRNGKey(seed + 1), (4096,), 0, cfg.vocab)
    windows = jnp.tile(period, -(-(seq + 1) // 4096))[None, : seq + 1]
    args = (trainable, frozen, state, windows)
    jax.block_until_ready(args)
    t0 = time.perf_counter()
    compiled = jax.jit(L.adam_step(L.lora_loss(cfg), optimizer), donate_argnums=(0, 2)).lower(
        *args).compile()
    compile_s = time.perf_counter() - t0
    analysis = dict(_analysis(compiled.memory_analysis()), compile_s=round(compile_s, 1),
                    attention=L.LLAMA._attention_implementation(
                        cfg.attention, jnp.zeros((1, 1, cfg.n_heads, cfg.hd), jnp.bfloat16)))
    return compiled, list(args), analysis


def run_steps(compiled: Any, args: list, steps: int, deadline: Deadline, out: dict[str, Any],
              reserve: float = 5.0) -> None:
    """Up to `steps` steps, another only if the last one's time is left (and `reserve`);
    each step's time and loss written into `out` as it ends."""
    out.update(step_s=[], losses=[])
    for i in range(steps):
        if i and deadline.left() < out["step_s"][-1] + reserve:
            break
        t0 = time.perf_counter()
        args[0], args[2], value = compiled(*args)
        out["losses"].append(round(float(jax.block_until_ready(value)), 4))
        out["step_s"].append(round(time.perf_counter() - t0, 3))
        out["peak_gib"] = round(_memory("peak_bytes_in_use"), 3)


def attention_tflop(seq: int, n_layers: int, dim: int = 4096, window: int | None = None) -> float:
    """TFLOP of a step's attention products (causal, or banded to `window`): QK^T and PV,
    forward, the forward again under remat, and flash attention's backward pass (2.5 times
    the forward's: the scores recomputed)."""
    pairs = seq * seq / 2 if window is None else seq * min(window, seq)
    return 4 * dim * pairs * n_layers * (1 + 1 + 2.5) / 1e12


def linear_tflop(seq: int, n_layers: int) -> float:
    """TFLOP of a LoRA step's other products: the projections (forward, the forward again
    under remat, the backward's input gradients) and the output layer (forward, its
    recomputation, the input gradient)."""
    per_layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    return (2 * 3 * per_layer * n_layers + 2 * 3 * VOCAB * 4096) * seq / 1e12


def derived(long: dict[str, Any], short: dict[str, Any] | None, seq: int, short_seq: int,
            n_layers: int, window: int) -> dict[str, Any]:
    """The 32-layer step at `seq` with causal attention, derived: the banded run's rate for
    the other products, and causal attention at the short run's rate (or, without one, at
    the banded run's overall rate), each scaled by its TFLOP."""
    t_long = min(long["step_s"][1:] or long["step_s"])
    rest = linear_tflop(seq, n_layers) + attention_tflop(seq, n_layers, window=window)
    rate = rest / t_long  # TFLOP/s of the banded step
    att_rate = rate
    if short and short.get("step_s"):
        t_short = min(short["step_s"][1:] or short["step_s"])
        t_att = t_short - linear_tflop(short_seq, n_layers) / rate
        if t_att > 0:
            att_rate = attention_tflop(short_seq, n_layers) / t_att
    step = (linear_tflop(seq, LAYERS) / rate + attention_tflop(seq, LAYERS) / att_rate)
    return dict(derived=True, layers=LAYERS, seq=seq, step_s=round(step, 1),
                tokens_per_s=round(seq / step, 1), linear_tflops_per_s=round(rate, 1),
                attention_tflops_per_s=round(att_rate, 1))


def confirm(seq: int, n_layers: int, window: int, short_seq: int, steps: int,
            seconds: float, model: str = MODEL) -> dict[str, Any]:
    """The card's confirming run (the module docstring's); prints its `RESULT` line."""
    result: dict[str, Any] = dict(_t0=time.perf_counter(), seq=seq, layers=n_layers,
                                  window=window, phase="start")
    deadline = Deadline(seconds, result)
    result.update(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  bytes_limit_gib=round(_memory("bytes_limit"), 2),
                  xla_flags=os.environ.get("XLA_FLAGS", ""))
    try:
        _confirm_phases(result, deadline, seq, n_layers, window, short_seq, steps, model)
    except Exception as e:  # (an out-of-memory error is a result too)
        result["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    deadline.finish()
    return result


def _confirm_phases(result: dict[str, Any], deadline: Deadline, seq: int, n_layers: int,
                    window: int, short_seq: int, steps: int, model: str) -> None:
    long: dict[str, Any] = dict(seq=seq, window=window)
    result["banded"] = long
    result["phase"] = "banded: setup and compile"
    compiled, args, long["memory_analysis"] = card_step(seq, n_layers, window, model)
    result["phase"] = "banded: steps"
    run_steps(compiled, args, steps, deadline, long)
    long.update(tokens_per_s=round(seq / min(long["step_s"]), 1), host_peak_gib=host_peak_gib())
    del compiled, args
    short: dict[str, Any] | None = None
    guess = 60 + 2 * attention_tflop(short_seq, n_layers) / 400
    if short_seq and deadline.left() > guess:  # (`--short 0`: no causal run)
        short = dict(seq=short_seq, window=None)
        result["causal"] = short
        result["phase"] = "causal: setup and compile"
        compiled, args, short["memory_analysis"] = card_step(short_seq, n_layers, None, model)
        result["phase"] = "causal: steps"
        run_steps(compiled, args, steps, deadline, short)
        short["tokens_per_s"] = round(short_seq / min(short["step_s"]), 1)
    result["phase"] = "done"
    result["derived_32_layers"] = derived(long, short, seq, short_seq, n_layers, window)


# -- Unsloth's longest context, on the card -----------------------------------------------------

UNSLOTH_CLAIM = 342_733  # Llama 3.1 8B QLoRA on one 80 GB card, Unsloth's published figure
UNSLOTH_COLUMNS = [("seq", "tokens"), ("layers", "layers"), ("memory_gib", "card held to GiB"),
                   ("fits", "fits"), ("peak_gib", "peak GiB"), ("step_s", "s/step"),
                   ("tokens_per_s", "tokens/s"), ("try_s", "try s"), ("error", "error")]


def addback_gib(n_layers: int, model: str = MODEL) -> float:
    """GiB the model's other layers (beyond `n_layers`) add to a QLoRA step, from the shapes,
    the same for lorax and Unsloth: NF4 codes (half a byte a weight) with double-quantized
    scales (one byte a 64-weight block, a float32 a 256 blocks), float32 rank-16 factors
    with their gradient and Adam's two states (16 bytes an element). Derived, not measured."""
    n, d, f, h, kv, _ = MODELS[model]
    factors = RANK * (2 * (d + d) + 2 * (d + kv * (d // h)) + 3 * (d + f))
    per_layer = layer_weights(model) * (0.5 + 1 / 64 + 4 / (64 * 256)) + 16 * factors
    return max(0, n - n_layers) * per_layer / GiB


def bracket_search(fits: Callable[[int], bool | None], guess: int, step: int,
                   tolerance: float = 0.05, tries: int = 8) -> tuple[int | None, int | None]:
    """(the longest length found to fit, the shortest found not to), both multiples of
    `step`: from `guess`, x1.5 up while it fits or down while it does not, then halving
    the bracket until it is within `tolerance` of its lower end. `fits` returns None when
    no time is left: the search ends with what it has."""
    lo, hi, seq = None, None, max(step, round(guess / step) * step)
    for _ in range(tries):
        ok = fits(seq)
        if ok is None:
            break
        lo, hi = (max(lo or 0, seq), hi) if ok else (lo, min(hi or seq, seq))
        if lo is not None and hi is not None:
            if hi - lo <= max(step, tolerance * lo):
                break
            seq = (lo + hi) // 2 // step * step
        elif lo is not None:
            seq = int(lo * 1.5) // step * step
        elif hi <= step:
            break
        else:
            seq = max(step, int(hi / 1.5) // step * step)
    return lo, hi


def run_try(cmd: list[str], timeout: float, env: dict[str, str] | None = None
            ) -> tuple[dict[str, Any] | None, str, float]:
    """(the `RESULT {json}` row a process printed last, or None; its error text, "timed out"
    when it outlasted `timeout`; seconds it took)."""
    t0 = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err = run.stdout, run.stderr if run.returncode else ""
    except subprocess.TimeoutExpired as e:
        out, err = e.stdout if isinstance(e.stdout, str) else "", "timed out"
    line = next((x for x in out.splitlines()[::-1] if x.startswith("RESULT ")), None)
    return (json.loads(line[7:]) if line else None), err, round(time.perf_counter() - t0, 1)


def unsloth_try(seq: int, n_layers: int, memory_gib: float, steps: int, timeout: float,
                model: str = MODEL) -> dict[str, Any]:
    """One Unsloth QLoRA step at `seq` tokens in a process of its own
    (`benchmarks._torch_anchors`), the card held to `memory_gib`: its row, `fits` True,
    False (out of memory) or None (timed out or failed otherwise: `error` says which)."""
    cmd = [sys.executable, "-m", "benchmarks._torch_anchors", "unsloth", model, "--quant", "nf4",
           "--checkpointing", "unsloth", "--steps", str(steps), "--seq", str(seq),
           "--layers", str(n_layers), "--memory-gib", f"{memory_gib:.2f}"]
    printed, err, took = run_try(cmd, timeout)
    row = printed or dict(error=(err or "no result")[-300:])
    row.update(seq=seq, layers=n_layers, memory_gib=memory_gib, try_s=took)
    # Out of memory says the length does not fit; a try that timed out or failed otherwise
    # says nothing about it (None: the search ends there, the row keeps the error).
    error = row.get("error")
    row["fits"] = (False if error == "out of memory" else
                   None if error or printed is None or not row.get("finite") else True)
    for key, _ in UNSLOTH_COLUMNS:  # a try that printed no row has only its error
        row.setdefault(key, None)
    return row


def unsloth_search(limit_gib: float, seconds: float, n_layers: int, steps: int,
                   guess: int = UNSLOTH_CLAIM, step: int = 8192, model: str = MODEL,
                   attempt: Callable[..., dict[str, Any]] = unsloth_try) -> dict[str, Any]:
    """Unsloth's longest QLoRA context on a card of `limit_gib`, the way `--confirm` finds
    lorax's: a model of `n_layers` layers, the card held to `limit_gib` less the other
    layers' weights and state (`addback_gib`), tries while `seconds` last."""
    t0, rows = time.perf_counter(), []
    cap = limit_gib - addback_gib(n_layers, model)

    def fits(seq: int) -> bool | None:
        left = seconds - (time.perf_counter() - t0)
        if rows and left < 1.2 * max(r["try_s"] for r in rows):
            return None
        rows.append(attempt(seq, n_layers, cap, steps, max(left, 1.0), model))
        verdict = {True: "fits", False: "does not fit", None: "unknown"}[rows[-1]["fits"]]
        print(f"unsloth {seq} tokens: {verdict} ({rows[-1].get('error') or 'ok'}), "
              f"{rows[-1]['try_s']} s", flush=True)
        return rows[-1]["fits"]

    lo, hi = bracket_search(fits, guess, step)
    return dict(rows=rows, longest=lo, shortest_failing=hi, cap_gib=round(cap, 2),
                addback_gib=round(limit_gib - cap, 2), limit_gib=limit_gib, layers=n_layers,
                model=model)


def unsloth_markdown(found: dict[str, Any]) -> str:
    lines = [C.column_table(found["rows"], UNSLOTH_COLUMNS), ""]
    lo, hi = found["longest"], found["shortest_failing"]
    lines.append(
        f"- **Unsloth, {found['limit_gib']:g} GiB: {lo:,} tokens fit**" if lo else
        f"- **Unsloth, {found['limit_gib']:g} GiB: no length tried fits**")
    lines[-1] += (f" ({hi:,} did not)." if hi else
                  " (no length failed before the time ran out: a lower bound)." if lo else
                  ".") + (
        f" Run on {found['layers']} layers with the card held to {found['cap_gib']:.2f} GiB: "
        f"{found['limit_gib']:g} less {found['addback_gib']:.2f} GiB, the other "
        f"{MODELS[found['model']][0] - found['layers']} layers of {found['model']}: their NF4 "
        f"codes, scales, factors and AdamW state "
        f"(derived from the shapes). Unsloth QLoRA (bitsandbytes NF4), its host-offloading "
        f"checkpointing, rank 16 on the seven projections, batch 1. Unsloth's published "
        f"figure: {UNSLOTH_CLAIM:,}.")
    return "\n".join(lines) + "\n"


# -- lorax beside Unsloth, on one card size ------------------------------------------------------

TARGET = 1.25  # issue 52's: lorax's longest context at least 1.25x Unsloth's, same card
# 100 x 8192: the recipe compiled for 78 GiB fits 821,248 tokens at 32 layers (the search
# above); on the H200 the card's own plan was larger than the deviceless one by under 10%.
LORAX_SEQ = 819_200
OOM = re.compile(r"RESOURCE_EXHAUSTED|out of memory", re.IGNORECASE)
VERSUS_COLUMNS = [("stack", "stack"), *UNSLOTH_COLUMNS[:3], ("limit_gib", "allocator's limit GiB"),
                  *UNSLOTH_COLUMNS[3:]]


def card_gib() -> float | None:
    """The card's memory in GiB (`nvidia-smi`: no CUDA context made here), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0]) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def lorax_try(seq: int, n_layers: int, memory_gib: float, steps: int, timeout: float,
              model: str = MODEL, window: int = 4096) -> dict[str, Any]:
    """One run of the card's confirming step (`--confirm`: attention banded to `window`,
    cuDNN's same buffers as causal) at `seq` tokens in a process of its own, JAX held to
    `memory_gib` of the card (`XLA_PYTHON_CLIENT_MEM_FRACTION`, preallocated, as such a
    step needs): its row, `fits` as `unsloth_try`'s (XLA's `RESOURCE_EXHAUSTED`: False)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="true")
    total = card_gib()
    if total:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(memory_gib / total, 1.0):.4f}"
    cmd = [sys.executable, "-m", "benchmarks.context", "--confirm", str(seq), "--layers",
           str(n_layers), "--window", str(window), "--short", "0", "--steps", str(steps),
           "--seconds", f"{max(timeout - 15, 5):.0f}", "--model", model]
    printed, err, took = run_try(cmd, timeout, env)
    result = printed or {}
    banded = result.get("banded") or {}
    error = result.get("error") or ("" if printed else err or "no result")
    losses = banded.get("losses") or []
    if not error and losses and not all(math.isfinite(v) for v in losses):
        error = "loss not finite"  # (a step that ran but says nothing of the length)
    fits = False if OOM.search(error) else None if error or not losses else True
    return dict(stack="lorax", seq=seq, layers=n_layers, memory_gib=memory_gib,
                limit_gib=result.get("bytes_limit_gib"), fits=fits,
                peak_gib=banded.get("peak_gib"), step_s=min(banded.get("step_s") or [math.nan]),
                tokens_per_s=banded.get("tokens_per_s"), try_s=took,
                error=error[-300:] or None, losses=losses,
                derived_32_layers=result.get("derived_32_layers"))


def versus(limit_gib: float, seconds: float, n_layers: int = 2, lorax_seq: int = LORAX_SEQ,
           steps: int = 2, step: int = 8192, model: str = MODEL,
           tries: dict[str, Callable[..., dict[str, Any]]] | None = None,
           report: Callable[[dict[str, Any]], None] = lambda found: None,
           try_seconds: float = 150) -> dict[str, Any]:
    """lorax's recipe and Unsloth's QLoRA held to the same card of `limit_gib`, each on
    `n_layers` layers with the card held to `limit_gib` less the other layers' share
    (`addback_gib`, the same for both), the tries that decide `TARGET` first, while
    `seconds` last: lorax at `lorax_seq` (at 5/6 of it if that does not fit), Unsloth at
    lorax's length over `TARGET` (not fitting there, its longest is below it), then
    Unsloth at its published figure. Unsloth's tries take one step (its peak is in it);
    a try gets at most `try_seconds`. `report` gets the findings after every try."""
    tries = tries or {"lorax": lorax_try, "unsloth": unsloth_try}
    t0, rows = time.perf_counter(), []
    cap = limit_gib - addback_gib(n_layers, model)
    found = dict(rows=rows, lorax=None, decisive=None, cap_gib=round(cap, 2),
                 addback_gib=round(limit_gib - cap, 2), limit_gib=limit_gib, layers=n_layers,
                 model=model)

    def attempt(stack: str, seq: int, n_steps: int) -> bool | None:
        left = seconds - (time.perf_counter() - t0)
        if left < 30:
            return None
        rows.append(dict(tries[stack](seq, n_layers, cap, n_steps, min(left, try_seconds), model),
                         stack=stack))
        if stack == "lorax" and rows[-1]["fits"]:
            found["lorax"] = seq
        verdict = {True: "fits", False: "does not fit", None: "unknown"}[rows[-1]["fits"]]
        print(f"{stack} {seq} tokens: {verdict} ({rows[-1].get('error') or 'ok'}), "
              f"{rows[-1]['try_s']} s", flush=True)
        report(found)
        return rows[-1]["fits"]

    for seq in (lorax_seq, lorax_seq * 5 // 6 // step * step):
        if attempt("lorax", seq, steps) is not False:
            break
    if found["lorax"]:
        found["decisive"] = int(found["lorax"] / TARGET) // step * step
        attempt("unsloth", found["decisive"], 1)
    attempt("unsloth", UNSLOTH_CLAIM, 1)
    return found


def versus_verdict(found: dict[str, Any]) -> list[str]:
    """The findings in words: lorax's length, Unsloth's at lorax's over `TARGET`, and at
    its published figure."""
    rows, lorax, decisive = found["rows"], found["lorax"], found["decisive"]
    unsloth = {r["seq"]: r["fits"] for r in rows if r["stack"] == "unsloth"}
    tried = sorted({r["seq"] for r in rows if r["stack"] == "lorax"})
    named = ", ".join(f"{s:,}" for s in tried) or "none tried"
    lines = [f"- **lorax: {lorax:,} tokens fit**." if lorax else
             f"- lorax: no length tried fits ({named})."]
    if decisive and unsloth.get(decisive) is False:
        lines.append(f"- **Unsloth: {decisive:,} tokens do not fit** (out of memory): lorax's "
                     f"longest is at least {lorax / decisive:.2f}x Unsloth's (the target: "
                     f"{TARGET}x).")
    elif decisive and unsloth.get(decisive):
        lines.append(f"- Unsloth: {decisive:,} tokens fit too: these tries do not show "
                     f"lorax's longest at {TARGET}x Unsloth's.")
    elif decisive:
        lines.append(f"- Unsloth at {decisive:,} tokens: not decided (see its row).")
    claim = unsloth.get(UNSLOTH_CLAIM)
    lines.append(f"- Unsloth at its published {UNSLOTH_CLAIM:,} tokens: " + (
        "not tried in the time." if UNSLOTH_CLAIM not in unsloth else
        {True: "fits.", False: "does not fit (out of memory).", None: "not decided."}[claim]))
    return lines


def versus_markdown(found: dict[str, Any]) -> str:
    table = C.column_table(found["rows"], VERSUS_COLUMNS)
    derived_row = next((r["derived_32_layers"] for r in found["rows"] if r["stack"] == "lorax"
                        and r["fits"] and r.get("derived_32_layers")), None)
    notes = [
        f"Both held to {found['limit_gib']:g} GiB: {found['layers']} layers of "
        f"{found['model']}, the card held to {found['cap_gib']:.2f} GiB ({found['limit_gib']:g} "
        f"less {found['addback_gib']:.2f} GiB, the other "
        f"{MODELS[found['model']][0] - found['layers']} layers' NF4 codes, scales, factors and "
        f"Adam state, derived from the shapes). lorax: QLoRA nf4, `{RECIPE}`, JAX's allocator "
        f"held by `XLA_PYTHON_CLIENT_MEM_FRACTION`, attention banded to 4,096 tokens (cuDNN's "
        f"buffers are causal attention's, so the memory is; the time is not). Unsloth: QLoRA "
        f"(bitsandbytes NF4), its host-offloading checkpointing, causal attention, "
        f"`torch.cuda.set_per_process_memory_fraction`. Rank 16 on the seven projections, "
        f"batch 1, one process a try."]
    if derived_row:
        notes.append(f"lorax at 32 layers with causal attention, derived (not run): "
                     f"{derived_row['step_s']} s a step, {derived_row['tokens_per_s']:,} tokens/s, "
                     f"every product, attention's too, at the banded step's TFLOP/s.")
    return "\n".join([table, "", *versus_verdict(found), "", *notes]) + "\n"


# -- the command ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> Any:
    p = C.parser(__doc__, rounds=False, quick=False)
    p.add_argument("--budgets", default=BUDGETS, help="TARGET=GIB,...: the cards and the GiB "
                   "a process can use of each")
    p.add_argument("--margin", type=float, default=0.05, help="of the budget, kept free")
    p.add_argument("--step", type=int, default=2048, help="the lengths tried are multiples of it")
    p.add_argument("--name", default="gpu_compile_context_h200")
    p.add_argument("--confirm", type=int, default=None, metavar="SEQ",
                   help="run the card's confirming step at SEQ tokens (needs a GPU)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--short", type=int, default=131_072, help="the causal run's tokens")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seconds", type=float, default=170)
    p.add_argument("--model", default=MODEL, help="the confirming step's model")
    p.add_argument("--guess", type=int, default=None, help="--unsloth's first length "
                   "(default: Unsloth's published 342,733)")
    p.add_argument("--unsloth", type=float, default=None, metavar="GIB",
                   help="search Unsloth's longest context on a card of GIB (on a GPU, with "
                   "Unsloth installed), within --seconds, on --layers layers")
    p.add_argument("--versus", type=float, default=None, metavar="GIB",
                   help="lorax and Unsloth held to a card of GIB (on a GPU, with Unsloth "
                   "installed): the tries that decide the 1.25x target, within --seconds")
    p.add_argument("--lorax-seq", type=int, default=LORAX_SEQ, help="--versus's lorax length")
    args = p.parse_args(argv)
    if args.versus:
        def write(found: dict[str, Any]) -> None:  # after every try: a cut run keeps its rows
            C.write_table(C.out_dir(args.out), "context_versus",
                          [{k: v for k, v in r.items() if k in dict(VERSUS_COLUMNS)}
                           for r in found["rows"]], versus_markdown(found))
        found = versus(args.versus, args.seconds, args.layers, args.lorax_seq, args.steps,
                       model=args.model, report=write)
        write(found)
        return found
    if args.unsloth:
        found = unsloth_search(args.unsloth, args.seconds, args.layers, args.steps,
                               args.guess or UNSLOTH_CLAIM, args.step, args.model)
        C.write_table(C.out_dir(args.out), "context_unsloth", found["rows"],
                      unsloth_markdown(found))
        return found
    if args.confirm:
        return confirm(args.confirm, args.layers, args.window, args.short, args.steps,
                       args.seconds, args.model)
    clock = C.Clock("context")
    budgets = {k: float(v) for k, v in (b.split("=") for b in args.budgets.split(","))}
    rows, found = run_search(budgets, args.margin, args.step, clock.log)
    C.write_table(C.out_dir(args.out), args.name, rows, markdown(rows, found, args.margin)
                  + f"\nCompiled by jax {jax.__version__}'s CUDA plugin, deviceless; "
                  f"{clock.elapsed:.0f} s.\n")
    return rows, found


if __name__ == "__main__":
    main()
