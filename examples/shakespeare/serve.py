"""The trained adapter, out of JAX: PEFT for the Hugging Face model, a GGUF LoRA for the
GGUF file it trained on, and llama.cpp itself running that GGUF LoRA.

llama.cpp's next-token distribution with the adapter is compared with lorax's on
held-out text. llama.cpp quantises the activations in its Q4_1 matmuls (to Q8_1), so
the two never agree exactly even on the base model: the base's own gap is measured
first, and the adapter's gap is read against it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import lorax

from . import llama, models

HF_MODEL = models.MODELS["smollm2-135m"].hf_model
# llama.py's stacked (layers, in, out) kernels -> the Hugging Face model's torch modules.
HF_MODULES = models.SMOLLM2_MODULES
# Held-out positions for the llama.cpp comparison: prefixes of this many tokens.
PREFIX_LENGTHS = (16, 48, 80, 112)


def export(lora_params, out_dir: pathlib.Path, peft: bool = True, gguf: bool = True,
           model: models.Model | None = None) -> dict[str, str | None]:
    """Write the adapter as PEFT (for `model.hf_model`) and as a GGUF LoRA (for the GGUF
    file); `model` defaults to SmolLM2.

    The kernels are `x @ w` (`layout="in_out"`). llama.py's q/k rows are in the Hugging
    Face order (gguf_loader reorders the GGUF's rows back), so the GGUF writer reorders
    `lora_b`'s q/k rows as llama.cpp's converter does (`qk_rows="hf"`); Gemma's GGUF keeps
    the Hugging Face order (its RoPE is llama.cpp's NEOX kind), nothing to reorder.
    `gguf=False` (DoRA: llama.cpp has no magnitude vector) skips the GGUF, `peft=False`
    the PEFT adapter (both are for the original base: not for a PiSSA/OLoRA/LoftQ run,
    whose frozen `w` changed)."""
    model = model or models.MODELS[models.DEFAULT]
    peft_dir = out_dir / "peft"
    if peft:
        lorax.save_peft(peft_dir, lora_params, base_model_name_or_path=model.hf_model,
                        module_name=model.hf_modules, layout="in_out", task_type="CAUSAL_LM")
    if not gguf:
        return {"peft": str(peft_dir) if peft else None, "gguf": None}
    gguf_adapter = out_dir / "adapter.gguf"
    lorax.save_gguf_lora(gguf_adapter, lora_params, model.gguf_path(),
                         module_name=model.hf_modules, layout="in_out", qk_rows=model.qk_rows)
    return {"peft": str(peft_dir), "gguf": str(gguf_adapter)}


def held_out_prompts(eval_windows, n_windows: int = 8) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """`(windows, positions)`: held-out token windows and `(window, prefix length)` pairs."""
    windows = np.asarray(eval_windows)[:n_windows]
    lengths = [n for n in PREFIX_LENGTHS if n <= windows.shape[1]] or [windows.shape[1]]
    return windows[:, :max(lengths)], [(i, n) for i in range(len(windows)) for n in lengths]


def lorax_logprobs(cfg, params, windows, positions, logits_fn=llama.logits) -> list[np.ndarray]:
    """lorax's next-token log-probabilities after each prefix: one causal forward over
    the windows gives every prefix's next-token distribution. `logits_fn(cfg, params,
    tokens)`: the model's (`llama.logits`, `gemma3.logits`)."""
    logits = jax.jit(lorax.lora(functools.partial(logits_fn, cfg)))(params, jnp.asarray(windows))
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return [logp[i, n - 1] for i, n in positions]


def agreement(ours: list[np.ndarray], theirs: list[dict[int, float]]) -> dict[str, float]:
    """Top-1 agreement and |Δ log-prob| over llama.cpp's top-5 tokens at each position."""
    top1 = [int(np.argmax(o)) == next(iter(t)) for o, t in zip(ours, theirs)]
    deltas = [abs(float(o[tok]) - lp) for o, t in zip(ours, theirs) for tok, lp in t.items()]
    return {"positions": len(ours), "top1_agreement": float(np.mean(top1)),
            "mean_abs_dlogprob": float(np.mean(deltas)), "max_abs_dlogprob": float(np.max(deltas))}


def shift(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
    """Mean |Δ log-prob| between two llama.cpp runs, over the tokens both list."""
    d = [abs(a_i[t] - b_i[t]) for a_i, b_i in zip(a, b) for t in a_i.keys() & b_i.keys()]
    return float(np.mean(d))


def check_with_llamacpp(cfg, lora_params, eval_windows, gguf_adapter: str, prompt: str,
                        n_sample: int, temperature: float, top_p: float,
                        model: models.Model | None = None) -> dict:
    """Run llama.cpp on the GGUF base with and without the adapter; compare with lorax."""
    from . import llamacpp

    model = model or models.MODELS[models.DEFAULT]
    base_gguf = model.gguf_path()
    logits_fn = model.module.logits
    windows, positions = held_out_prompts(eval_windows)
    prompts = [windows[i, :n].tolist() for i, n in positions]
    base_params = jax.tree.map(lambda x: x.w if isinstance(x, lorax.LoraWeight) else x,
                               lora_params, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))
    ours_base = lorax_logprobs(cfg, base_params, windows, positions, logits_fn)
    ours_tuned = lorax_logprobs(cfg, lora_params, windows, positions, logits_fn)
    cpp_base = llamacpp.next_token_logprobs(base_gguf, prompts)
    cpp_tuned = llamacpp.next_token_logprobs(base_gguf, prompts, lora=[(gguf_adapter, 1.0)])
    # The same adapter on an F32 copy of the GGUF, float32 attention: llama.cpp rounds
    # nothing there, so this is the adapter's own agreement (a temporary file: 540 MB for
    # SmolLM2, 1.1 GB for Gemma 3 270M).
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        llamacpp.write_f32_copy(base_gguf, f32)
        cpp_f32_base = llamacpp.next_token_logprobs(f32, prompts, f32_attention=True)
        cpp_f32_tuned = llamacpp.next_token_logprobs(f32, prompts, lora=[(gguf_adapter, 1.0)],
                                                     f32_attention=True)
    result = {
        "xllamacpp": importlib.metadata.version("xllamacpp"), "quant": model.quant,
        "base": agreement(ours_base, cpp_base),
        "adapter": agreement(ours_tuned, cpp_tuned),
        "f32_base": agreement(ours_base, cpp_f32_base),
        "f32_adapter": agreement(ours_tuned, cpp_f32_tuned),
        # How far the adapter moves llama.cpp's distribution: the scale the gaps above
        # are read against.
        "adapter_shift": shift(cpp_base, cpp_tuned),
        "untuned_lorax_vs_tuned_llamacpp": agreement(ours_base, cpp_tuned),
    }
    result["sample"] = llamacpp.sample(base_gguf, prompt, lora=[(gguf_adapter, 1.0)],
                                       n_predict=n_sample, temperature=temperature, top_p=top_p)
    return result


def report(r: dict) -> str:
    u = r["untuned_lorax_vs_tuned_llamacpp"]
    q = r.get("quant", "Q4_1")

    def line(name, g):
        return (f"  {name:34s} top-1 agreement {g['top1_agreement']:4.0%}, mean |Δ| "
                f"{g['mean_abs_dlogprob']:.4f}, max {g['max_abs_dlogprob']:.4f}\n")

    return (
        f"llama.cpp (xllamacpp {r['xllamacpp']}) vs lorax, next token at "
        f"{r['adapter']['positions']} held-out positions (|Δ log-prob| over llama.cpp's top 5):\n"
        + line(f"{q} GGUF, base model:", r["base"])
        + line(f"{q} GGUF, with the adapter:", r["adapter"])
        + line("F32 copy, base model:", r["f32_base"])
        + line("F32 copy, with the adapter:", r["f32_adapter"])
        + f"  (llama.cpp rounds activations to 8 bits in its {q} matmuls, not on the F32 copy)\n"
        f"  (the adapter moves llama.cpp's log-probs by {r['adapter_shift']:.4f} on average; "
        f"untuned lorax vs tuned llama.cpp: mean |Δ| {u['mean_abs_dlogprob']:.4f})")
