"""The PyTorch stacks users pick for speed, beside lorax in `benchmarks.accelerator`: one cell
each, in a process of its own (both libraries patch transformers' Llama classes).

    python -m benchmarks._torch_anchors liger MODEL [--batch B] [--steps N] [--compile]
                                        [--no-checkpointing]
    python -m benchmarks._torch_anchors unsloth MODEL [--batch B] [--steps N] [--quant 16bit|nf4]
                                        [--checkpointing unsloth|on|off] [--model-dir DIR]
                                        [--seq TOKENS --layers N --memory-gib GIB]
    python -m benchmarks._torch_anchors save MODEL [--model-dir DIR]   # the folder Unsloth loads

- `liger`: PEFT + Liger-Kernel. `apply_liger_kernel_to_llama` (RoPE, RMSNorm, SwiGLU and the
  fused linear cross-entropy, which never forms the logits) before the model is built, then
  `benchmarks._peft`'s model (transformers' Llama at the benchmark's shapes, bf16, PEFT's
  LoRA r16 on the seven projections); the loss through `labels=`. `--compile`:
  `torch.compile` of the whole model. Checkpointing (transformers') on unless
  `--no-checkpointing`.
- `unsloth`: Unsloth's `FastLanguageModel` on a random-weight Llama at the same shapes,
  saved once in `--model-dir` (default: `/dev/shm` where it has room, else the temporary
  folder; reused by the next cell) with an offline word-level tokenizer made in code;
  `--quant nf4` loads it with `load_in_4bit=True` (bitsandbytes NF4, QLoRA), `16bit` with
  `load_in_16bit=True`; LoRA r16 on the same seven projections; `--checkpointing unsloth`
  (its default: checkpoints offloaded to host memory), `on` (transformers') or `off`.
  `--seq`, `--layers`, `--memory-gib`: one try of `benchmarks.context --unsloth`'s search
  for Unsloth's longest context (a window of `--seq` tokens on a model of `--layers`
  layers, the card held to `--memory-gib`; out of memory is a row with an `error`).

The batch, the timing and the row are `benchmarks._peft`'s: the same tokens as every stack
(`benchmarks._batch`), AdamW at 1e-4 on the adapters, two warm-up steps, the device's peak
`torch.cuda.max_memory_allocated` after the setup. The library shifts `labels` itself, so
a 2,048-token window gives 2,047 targets (lorax's and PEFT's cells: 2,048). `compile_s` is
the first step's time over the median (Triton's kernels compiled there). Prints one line,
`RESULT {json}`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ._batch import LORA_ALPHA, MODELS, RANK, layer_weights, vocab

# Nothing from torch, transformers or peft at import: Unsloth must be imported before them
# (every import of them below waits for that reason).
QUANTS = ("16bit", "nf4")
CHECKPOINTING = {"unsloth": "unsloth", "on": True, "off": False}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "UNSLOTH_DISABLE_STATISTICS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3 (`benchmarks._batch.LOW`: never drawn)


def versions(*names: str) -> dict[str, str]:
    """Installed versions of `names` (distribution names), `missing` where absent."""
    out = {}
    for name in names:
        try:
            out[name.replace("-", "_")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name.replace("-", "_")] = "missing"
    return out


def device_of() -> str:
    import torch  # lazy: after unsloth
    return "cuda" if torch.cuda.is_available() else "cpu"


# -- PEFT + Liger-Kernel ------------------------------------------------------------------------


def liger(model: str, batch: int, steps: int, compile_: bool, checkpointing: bool) -> dict:
    """One PEFT + Liger-Kernel cell (the module docstring)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama  # lazy: optional
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True)  # before the model is built
    import torch  # lazy: after liger_kernel's patches

    from . import _peft as P  # lazy: imports torch
    device, t0 = device_of(), time.perf_counter()
    net, vocab, seq = P.build(model, device, checkpointing)
    params = [p for p in net.parameters() if p.requires_grad]
    x = P.windows(batch, seq, vocab, device)[:, :-1].contiguous()
    forward = torch.compile(net) if compile_ else net
    net.train()  # the fused linear cross-entropy (no logits formed) is its training path
    step = P.adamw_step(params, lambda: forward(input_ids=x, labels=x).loss)

    setup_s = P.start(device) - t0
    times, losses = P.train(step, steps, device)
    mode, ckpt = ("compiled" if compile_ else "eager"), ("on" if checkpointing else "off")
    return P.result(f"liger:{model}:{batch}:{mode}:{ckpt}", model,
                    f"liger-{mode}" + ("" if checkpointing else "-nockpt"), batch, seq, ckpt,
                    times, losses, setup_s, True, params,
                    getattr(net.config, "_attn_implementation", None), device,
                    **versions("liger-kernel", "triton"))


# -- Unsloth ------------------------------------------------------------------------------------


def default_model_dir(need_bytes: int = 0) -> Path:
    """`/dev/shm` where it has room for `need_bytes` (and a margin), else the temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.2 * need_bytes:
        return shm / "lorax-anchors"
    return Path(tempfile.gettempdir()) / "lorax-anchors"


def model_bytes(model: str, layers: int | None = None) -> int:
    """bf16 bytes of `model`'s weights (the tied embedding once, the norms aside), with
    `layers` layers if given."""
    n, d = MODELS[model][:2]
    return 2 * ((layers or n) * layer_weights(model) + vocab(model) * d)


def positions_for(seq: int | None) -> int | None:
    """The saved model's `max_position_embeddings` for a `seq`-token cell: the next power
    of two (folders shared by nearby lengths), None at the model's own window."""
    return None if seq is None else 1 << max(11, (seq - 1).bit_length())


MODEL_NAMES = tuple(MODELS)


def tokenizer(vocab: int, seq: int) -> Any:
    """A word-level tokenizer of `vocab` ids made in code (nothing downloaded): the special
    tokens, then `t4`, `t5`, ... one per id."""
    import transformers  # lazy: after unsloth
    from tokenizers import Tokenizer, models, pre_tokenizers  # lazy: after unsloth
    words = {w: i for i, w in enumerate(SPECIAL)}
    words.update({f"t{i}": i for i in range(len(SPECIAL), vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", model_max_length=seq)


def saved_model(model: str, model_dir: Path, device: str, layers: int | None = None,
                seq: int | None = None) -> tuple[Path, float]:
    """A folder holding a random-weight Llama at `model`'s shapes (bf16 safetensors, made on
    `device`, norm weights ones) and its tokenizer, made once (a `DONE` file marks it whole):
    (the folder, seconds spent making it now). `layers`, `seq`: a long-context cell's model
    (fewer layers; positions for `seq` tokens)."""
    positions = positions_for(seq)
    tag = "".join(f"-{v}{k}" for k, v in (("l", layers), ("p", positions)) if v)
    path = Path(model_dir) / f"{model}{tag}-random-bf16"
    if (path / "DONE").exists():
        return path, 0.0
    import torch  # lazy: after unsloth

    from . import _peft as P  # lazy: imports torch
    t0 = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    cfg, vocab, seq = P.llama_config(model, layers, positions, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2)
    base = P.base_model(cfg, device)
    base.save_pretrained(path, safe_serialization=True)
    tokenizer(vocab, seq).save_pretrained(path)
    del base
    if device == "cuda":
        torch.cuda.empty_cache()
    (path / "DONE").write_text(model + "\n")
    return path, time.perf_counter() - t0


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a step's error is the card running out of memory: torch's
    `OutOfMemoryError`, or a Triton or cuBLAS kernel's CUDA error that says so."""
    return (type(error).__name__ == "OutOfMemoryError"
            or "out of memory" in str(error).lower())


def unsloth(model: str, batch: int, steps: int, quant: str, checkpointing: str,
            model_dir: Path | None, seq: int | None = None, layers: int | None = None,
            memory_gib: float | None = None) -> dict:
    """One Unsloth cell (the module docstring). `seq`, `layers`: a long-context cell (that
    many tokens a window, a model of that many layers); `memory_gib`: the card held to
    that many GiB (`torch.cuda.set_per_process_memory_fraction`). Running out of memory
    is a result: the row's `error` is `out of memory`, with the peak reached."""
    t0 = time.perf_counter()
    import unsloth as U  # lazy: first, before transformers, peft and trl
    from unsloth import FastLanguageModel  # lazy: (the same)
    import_s = time.perf_counter() - t0
    import torch  # lazy: after unsloth

    from . import _peft as P  # lazy: imports torch
    device, t0 = device_of(), time.perf_counter()
    if memory_gib and device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_gib * 2**30 / total))
    folder, save_s = saved_model(model, model_dir or default_model_dir(model_bytes(model, layers)),
                                 device, layers, seq)
    _, vocab, seq = P.llama_config(model, layers, seq)
    gc = CHECKPOINTING[checkpointing]
    net, _ = FastLanguageModel.from_pretrained(
        str(folder), max_seq_length=seq, dtype=torch.bfloat16, load_in_4bit=quant == "nf4",
        load_in_16bit=quant == "16bit", local_files_only=True, use_exact_model_name=True,
        fix_tokenizer=False, use_gradient_checkpointing=gc)
    net = FastLanguageModel.get_peft_model(
        net, r=RANK, lora_alpha=LORA_ALPHA, lora_dropout=0, bias="none", target_modules=P.TARGETS,
        use_gradient_checkpointing=gc, random_state=0, max_seq_length=seq)
    FastLanguageModel.for_training(net)
    params = [p for p in net.parameters() if p.requires_grad]
    x = P.windows(batch, seq, vocab, device)[:, :-1].contiguous()
    step = P.adamw_step(params, lambda: net(input_ids=x, labels=x).loss)

    setup_s = P.start(device) - t0
    try:
        times, losses, error = *P.train(step, steps, device), None
    except RuntimeError as e:  # (torch's OutOfMemoryError, or a kernel's CUDA error saying so)
        if not is_out_of_memory(e):
            raise
        times, losses, error = [float("nan")], [float("nan")], "out of memory"
    suffix = {"unsloth": "", "on": "-hfckpt", "off": "-nockpt"}[checkpointing]
    cell = f"unsloth:{model}:{batch}:{quant}:{checkpointing}" + (f":{seq}:{layers}" if layers else "")
    return P.result(cell, model, f"unsloth-{quant}{suffix}", batch, seq, checkpointing, times,
                    losses, setup_s, True, params, getattr(net.config, "_attn_implementation", None),
                    device, import_s=import_s, save_s=save_s, unsloth=U.__version__,
                    layers=layers or MODELS[model][0], memory_gib=memory_gib,
                    **({"error": error} if error else {}),
                    **versions("unsloth-zoo", "bitsandbytes", "triton", "trl"))


# -- the command --------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="stack", required=True)
    for name in ("liger", "unsloth", "save"):
        s = sub.add_parser(name)
        s.add_argument("model", choices=MODEL_NAMES)
        if name == "save":
            s.add_argument("--model-dir", type=Path, default=None)
            continue
        s.add_argument("--batch", type=int, default=1)
        s.add_argument("--steps", type=int, default=8)
        if name == "liger":
            s.add_argument("--compile", action="store_true")
            s.add_argument("--no-checkpointing", action="store_true")
        else:
            s.add_argument("--quant", choices=QUANTS, default="16bit")
            s.add_argument("--checkpointing", choices=list(CHECKPOINTING), default="unsloth")
            s.add_argument("--model-dir", type=Path, default=None)
            s.add_argument("--seq", type=int, default=None, help="tokens a window (long context)")
            s.add_argument("--layers", type=int, default=None, help="the model's layers")
            s.add_argument("--memory-gib", type=float, default=None,
                           help="hold the card to this many GiB")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    for k, v in OFFLINE.items():
        os.environ.setdefault(k, v)
    # Unsloth compiles its patched modules into a folder (default: the working directory's).
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION",
                          str(Path(tempfile.gettempdir()) / "unsloth_compiled_cache"))
    if a.stack == "save":
        folder, seconds = saved_model(a.model, a.model_dir or default_model_dir(
            model_bytes(a.model)), device_of())
        print(f"SAVED {folder} ({seconds:.1f} s)", flush=True)
        return
    row = (liger(a.model, a.batch, a.steps, a.compile, not a.no_checkpointing)
           if a.stack == "liger" else
           unsloth(a.model, a.batch, a.steps, a.quant, a.checkpointing, a.model_dir, a.seq,
                   a.layers, a.memory_gib))
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
