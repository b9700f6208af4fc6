"""The tokens every stack of `benchmarks.accelerator` trains on, the same for all of them
(lorax, PyTorch + PEFT, PEFT + Liger-Kernel, Unsloth): NumPy only, so a PyTorch cell's
process imports no JAX and a JAX cell's no torch.

Each window is a random sequence of `period(seq)` tokens repeated, from a fixed seed: a
batch with structure, so a step that learns shows it within a few steps (the loss falls
from about ln(V) as the adapters pick up the few hundred tokens in use, then their
repetition), where uniformly random tokens leave nothing to learn but the unigram
distribution's flatness.
"""

from __future__ import annotations

import numpy as np

SEED = 52  # the issue that asked for it
LOW = 4  # the first ids are special tokens in the Unsloth cells' tokenizer: never drawn


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
