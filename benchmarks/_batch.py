"""What every stack of `benchmarks.accelerator` shares (lorax, PyTorch + PEFT, PEFT +
Liger-Kernel, Unsloth): the model shapes and the tokens. NumPy only, so a PyTorch cell's
process imports no JAX and a JAX cell's no torch.

Each window is a random sequence of `period(seq)` tokens repeated, from a fixed seed: a
batch with structure, so a step that learns shows it within a few steps (the loss falls
from about ln(V) as the adapters pick up the few hundred tokens in use), where uniformly
random tokens leave nothing to learn but the unigram distribution's flatness.
"""

from __future__ import annotations

import numpy as np

# name: (layers, dim, hidden, heads, kv heads, seq): Llama 3.2-1B, 3-8B, 3-70B, and a
# tiny one for smoke runs; a tied vocabulary of `vocab(name)` tokens.
MODELS = {
    "tiny": (2, 256, 512, 4, 2, 64),
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 2048),
    "llama-3-8b": (32, 4096, 14336, 32, 8, 2048),
    "llama-3-70b": (80, 8192, 28672, 64, 8, 2048),
}
VOCAB = 128_256
SEED = 52  # the issue that asked for it
LOW = 4  # the first ids are special tokens in the Unsloth cells' tokenizer: never drawn
# Every stack's adapters: rank 16 on the seven projections, scaled by alpha / rank = 1
# (PEFT's `lora_alpha`; lorax's `alpha`, whose default of 1, lorax 0.3's, would scale
# them by 1/16 and make the same steps learn 16 times slower).
RANK = 16
LORA_ALPHA = 16


def layer_weights(model: str) -> int:
    """Weights in one layer's seven projections (q, k, v, o, gate, up, down)."""
    _, d, f, h, kv, _ = MODELS[model]
    return 2 * d * d + 2 * d * kv * (d // h) + 3 * d * f


def vocab(model: str) -> int:
    return 4096 if model == "tiny" else VOCAB


def period(seq: int) -> int:
    """Tokens in one repeated sequence: 256 at 2,048 tokens a window, fewer for a short one."""
    return max(2, min(256, seq // 8))


def learning_windows(batch: int, seq: int, vocab: int, seed: int = SEED) -> np.ndarray:
    """`(batch, seq + 1)` int32 token ids (inputs `[:, :-1]`, targets `[:, 1:]`): row `i`
    is its own random sequence of `period(seq)` ids in `[LOW, vocab)`, repeated. Row `i`
    does not depend on `batch` (a batch of 4 starts with the batch of 1's window)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(LOW, vocab, (batch, period(seq)), dtype=np.int64)
    return np.stack([np.resize(r, seq + 1) for r in rows]).astype(np.int32)
