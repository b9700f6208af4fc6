"""Tiny random Hugging Face checkpoints of the architectures `examples/shakespeare/llama.py`
runs, and transformers' own logits on them (tests/data/models/<arch>/).

    .tools/ckpt-ref/bin/python scripts/make_model_fixtures.py [OUT_DIR]

Each case is `save_pretrained` of a seeded random transformers model in float32 (norm and
every other weight drawn, not left at their initial ones, so each part shows in the
logits) plus `reference.npz`: `input_ids` (2, 12) and transformers' `logits` for them
(eager attention, float32). The `llama3_bnb4` case is the `llama3` checkpoint loaded with
bitsandbytes' NF4 (double quantization, float32 compute) on CPU and saved: what Unsloth's
`*-bnb-4bit` repos are; its logits are transformers' with each 4-bit layer's product on
bitsandbytes' own float32 dequantization of the codes (bitsandbytes' CPU product itself
rounds to bfloat16 on the way: its logits are kept too, as `bnb_logits`).
Checked against the committed files by tests/examples/test_hf_models_real.py
(scripts/test-checkpoints); read without torch by tests/examples/test_hf_models.py.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import numpy as np
import torch
import transformers as T

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "models"
BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
            attn_implementation="eager")
# arch -> (config class, model class, its own fields): each the family's distinguishing part.
ARCHS = {
    # Llama 3.1's RoPE rule with an original context of 32 (wavelengths on both sides of the
    # band and inside it, at head_dim 16), an untied lm_head, two layers.
    "llama3": (T.LlamaConfig, T.LlamaForCausalLM, dict(
        num_hidden_layers=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=5,
                                                             tie_word_embeddings=False)),
    # Gemma 3: sliding-window and global layers (their own RoPE bases), per-head q/k norms,
    # norms around attention and MLP (stored without Gemma's `1 +`), embedding scaling.
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
}


def random_model(arch: str) -> torch.nn.Module:
    config_cls, model_cls, own = ARCHS[arch]
    torch.manual_seed(list(ARCHS).index(arch))
    model = model_cls(config_cls(**{**BASE, **own})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma's norms are stored as w in (1 + w): centred on 0, as the others' are on 1.
            centre = 1.0 if "norm" in name and arch != "gemma3" else 0.0
            p.copy_(centre + 0.15 * torch.randn_like(p))
    return model


def input_ids() -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7))


def write_case(out: Path, model: torch.nn.Module) -> None:
    ids = input_ids()
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    np.savez(out / "reference.npz", input_ids=ids.numpy(), logits=logits)


def make(out_dir: Path) -> None:
    for arch in ARCHS:
        model = random_model(arch)
        model.save_pretrained(out_dir / arch)
        write_case(out_dir / arch, model)
        print(arch, sum(f.stat().st_size for f in (out_dir / arch).iterdir()) // 1024, "KiB")
    bnb = T.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    model = T.AutoModelForCausalLM.from_pretrained(out_dir / "llama3", quantization_config=bnb,
                                                   device_map="cpu", dtype=torch.float32)
    model.save_pretrained(out_dir / "llama3_bnb4")
    # bitsandbytes' CPU product rounds to bfloat16 on the way (its layers are within ~1e-2
    # of x @ W.T in float32, whatever the compute and quant_state dtypes): the reference is
    # transformers with each Linear4bit's product on bitsandbytes' own float32
    # dequantization (`dequantize_4bit`), and `bnb_logits` what bitsandbytes computes.
    # (The exact product first: bitsandbytes' first CPU product in eval mode repacks the
    # weights for its own kernel, after which `dequantize_4bit` no longer reads them.)
    ids = input_ids()
    with torch.no_grad():
        with exact_linear4bit():
            logits = model(ids).logits.float().numpy()
        bnb_logits = model(ids).logits.float().numpy()
    np.savez(out_dir / "llama3_bnb4" / "reference.npz", input_ids=ids.numpy(), logits=logits,
             bnb_logits=bnb_logits)


@contextlib.contextmanager
def exact_linear4bit():
    """bitsandbytes' Linear4bit as `x @ dequantize_4bit(W).T` in float32."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as BF

    def forward(self, x):
        state = copy.copy(self.weight.quant_state)
        state.dtype = torch.float32
        w = BF.dequantize_4bit(self.weight.data, state)
        return torch.nn.functional.linear(x.float(), w, None if self.bias is None else self.bias.float())

    original = bnb.nn.Linear4bit.forward
    bnb.nn.Linear4bit.forward = forward
    try:
        yield
    finally:
        bnb.nn.Linear4bit.forward = original


if __name__ == "__main__":
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
