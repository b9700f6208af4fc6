"""The same Llama-3 LoRA step in PyTorch + PEFT, what a user would pick instead of lorax:
one cell of `benchmarks.accelerator` (`peft:MODEL:BATCH:eager|compiled:on|off`).

    python -m benchmarks._peft MODEL [--batch B] [--steps N] [--compile] [--no-checkpointing]

`transformers.LlamaForCausalLM` at `benchmarks._batch.MODELS`' shapes (tied 128,256-token
embedding), bf16 weights made on the device, PEFT's LoRA r16 on q/k/v/o/gate/up/down
(PEFT's default float32 adapters), SDPA attention (the library's default), AdamW on the
adapters, B windows of 2048 tokens (`benchmarks._batch`: the tokens every stack trains
on). `--compile`: `torch.compile` of the whole model (its first step compiles). Gradient
checkpointing is on unless `--no-checkpointing`. Prints one line, `RESULT {json}` (the
device's peak is `torch.cuda.max_memory_allocated`).

The model, the batch, the timing and the row are shared with the other PyTorch cells
(`benchmarks._torch_anchors`: PEFT + Liger-Kernel, Unsloth).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any, Callable

import peft
import torch
import transformers

from ._batch import LORA_ALPHA, MODELS, RANK, learning_windows, vocab  # (NumPy only: no JAX in this process)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config(model: str, layers: int | None = None, seq: int | None = None,
                 **extra: Any) -> tuple[Any, int, int]:
    """`transformers.LlamaConfig` at `MODELS[model]`'s shapes (tied embedding), its vocabulary
    size and window length; `layers`, `seq`: other than the model's (a long-context cell);
    `extra`: more config fields (token ids for a saved model)."""
    n, d, f, h, kv, window = MODELS[model]
    n, seq = layers or n, seq or window
    cfg = transformers.LlamaConfig(
        vocab_size=vocab(model), hidden_size=d, intermediate_size=f, num_hidden_layers=n,
        num_attention_heads=h, num_key_value_heads=kv, max_position_embeddings=seq,
        rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=True, **extra)
    return cfg, vocab(model), seq


def base_model(cfg: Any, device: str) -> Any:
    """`LlamaForCausalLM(cfg)` made on `device` in bf16 (no float32 copy first): random
    weights by transformers' own initialisation, norm weights ones."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)  # PEFT's adapters: float32


def build(model: str, device: str, checkpointing: bool) -> tuple[Any, int, int]:
    """The PEFT model (LoRA r16 on `TARGETS`, float32 adapters), its vocabulary and window."""
    cfg, vocab, seq = llama_config(model)
    base = base_model(cfg, device)
    if checkpointing:
        base.gradient_checkpointing_enable()
    base.config.use_cache = False
    config = peft.LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    return peft.get_peft_model(base, config), vocab, seq


def windows(batch: int, seq: int, vocab: int, device: str) -> Any:
    """`benchmarks._batch.learning_windows` on `device`: the tokens every stack trains on."""
    return torch.from_numpy(learning_windows(batch, seq, vocab)).long().to(device)


def train(step: Callable[[], Any], steps: int, device: str) -> tuple[list[float], list[float]]:
    """`steps` calls of `step` (one training step, returning its loss tensor), each timed to
    the device's end: (seconds, losses)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
    return times, losses


def adamw_step(params: list, loss: Callable[[], Any]) -> Callable[[], Any]:
    """One training step of `loss()` (a PyTorch scalar) with AdamW at 1e-4 on `params`, the
    optimizer every PyTorch cell uses."""
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> Any:
        value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    return step


def start(device: str) -> float:
    """The setup's end: the device synchronised, its peak counter reset (so a cell's peak is
    its weights and state plus the steps' own); the time."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return time.perf_counter()


def result(cell: str, model: str, method: str, batch: int, seq: int, checkpointing: str,
           times: list[float], losses: list[float], setup_s: float, compiled: bool,
           params: list[Any], attention: Any, device: str, **extra: Any) -> dict[str, Any]:
    """A torch cell's `RESULT` row, the fields the JAX cells' rows have where they apply
    (median over the steps after two warm-ups; the peak is `torch.cuda.max_memory_allocated`)."""
    timed = times[min(2, len(times) - 1):]
    step_s = statistics.median(timed)
    return dict(
        cell=cell, model=model, method=method, batch=batch,
        remat={"off": "none", "on": "layer"}.get(checkpointing, checkpointing),
        attention=attention, seq=seq,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        platform=device, torch=torch.__version__, peft=peft.__version__,
        transformers=transformers.__version__, setup_s=setup_s,
        compile_s=max(0.0, times[0] - step_s) if compiled else 0.0,
        step_s=step_s, step_s_all=[round(t, 4) for t in times],
        tokens_per_s=batch * seq / step_s,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
        trainable_gib=sum(p.numel() * p.element_size() for p in params) / 2**30,
        losses=[round(v, 4) for v in losses], first_loss=losses[0], last_loss=losses[-1],
        finite=all(math.isfinite(v) for v in losses), **extra)


def run(model: str, batch: int, steps: int, compile_: bool, checkpointing: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    net, vocab, seq = build(model, device, checkpointing)
    params = [p for p in net.parameters() if p.requires_grad]
    ids = windows(batch, seq, vocab, device)
    x, y = ids[:, :-1], ids[:, 1:].contiguous()
    forward = torch.compile(net) if compile_ else net
    net.train()
    step = adamw_step(params, lambda: torch.nn.functional.cross_entropy(
        forward(input_ids=x).logits.float().view(-1, vocab), y.view(-1)))

    setup_s = start(device) - t0
    times, losses = train(step, steps, device)
    mode, ckpt = ("compiled" if compile_ else "eager"), ("on" if checkpointing else "off")
    method = "peft" + ("-compiled" if compile_ else "-eager") + ("" if checkpointing else "-nockpt")
    return result(f"peft:{model}:{batch}:{mode}:{ckpt}", model, method, batch, seq, ckpt, times,
                  losses, setup_s, compile_, params,
                  getattr(net.config, "_attn_implementation", None), device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", choices=list(MODELS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--no-checkpointing", action="store_true")
    a = p.parse_args(argv)
    row = run(a.model, a.batch, a.steps, a.compile, not a.no_checkpointing)
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
