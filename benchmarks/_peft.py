"""The same Llama-3 LoRA step in PyTorch + PEFT, what a user would pick instead of lorax:
one cell of `benchmarks.accelerator` (`peft:MODEL:BATCH:eager|compiled:on|off`).

    python -m benchmarks._peft MODEL [--batch B] [--steps N] [--compile] [--no-checkpointing]

`transformers.LlamaForCausalLM` at `benchmarks.scale`'s shapes (tied 128,256-token
embedding), bf16 weights made on the device, PEFT's LoRA r16 on q/k/v/o/gate/up/down
(PEFT's default float32 adapters), SDPA attention (the library's default), AdamW on the
adapters, B windows of 2048 tokens. `--compile`: `torch.compile` of the whole model (its
first step compiles). Gradient checkpointing is on unless `--no-checkpointing`. Prints
one line, `RESULT {json}` (the device's peak is `torch.cuda.max_memory_allocated`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import peft
import torch
import transformers

# name: (layers, dim, hidden, heads, kv heads, seq), as benchmarks.scale.MODELS (kept apart:
# this process imports no JAX, so the two frameworks never share the device).
MODELS = {
    "tiny": (2, 256, 512, 4, 2, 64),
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 2048),
    "llama-3-8b": (32, 4096, 14336, 32, 8, 2048),
    "llama-3-70b": (80, 8192, 28672, 64, 8, 2048),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(model: str, device: str, checkpointing: bool) -> tuple[Any, int, int]:
    n, d, f, h, kv, seq = MODELS[model]
    vocab = 4096 if model == "tiny" else 128_256
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=n,
        num_attention_heads=h, num_key_value_heads=kv, max_position_embeddings=seq,
        rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # the weights made in bf16, no f32 copy first
    try:
        with torch.device(device):
            base = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)  # PEFT's adapters: float32
    if checkpointing:
        base.gradient_checkpointing_enable()
    base.config.use_cache = False
    config = peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    return peft.get_peft_model(base, config), vocab, seq


def run(model: str, batch: int, steps: int, compile_: bool, checkpointing: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    net, vocab, seq = build(model, device, checkpointing)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:].contiguous()
    forward = torch.compile(net) if compile_ else net
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    setup_s = time.perf_counter() - t0
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = forward(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    timed = times[min(2, steps - 1):]
    method = "peft" + ("-compiled" if compile_ else "-eager") + ("" if checkpointing else "-nockpt")
    return dict(
        cell=f"peft:{model}:{batch}:{'compiled' if compile_ else 'eager'}:{'on' if checkpointing else 'off'}",
        model=model, method=method, batch=batch, remat="layer" if checkpointing else "none",
        attention=getattr(net.config, "_attn_implementation", None), seq=seq,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        platform=device, torch=torch.__version__, peft=peft.__version__,
        transformers=transformers.__version__, setup_s=setup_s,
        compile_s=times[0] - statistics.median(timed) if compile_ else 0.0,
        step_s=statistics.median(timed), step_s_all=[round(t, 4) for t in times],
        tokens_per_s=batch * seq / statistics.median(timed),
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
        trainable_gib=sum(p.numel() * p.element_size() for p in params) / 2**30,
        losses=[round(v, 4) for v in losses], finite=all(v == v for v in losses))


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
