"""A character-level `tokenizer.json` for the tiny Hugging Face model fixtures (their
vocabularies are 128 tokens): the corpus's characters plus the special tokens, with the
post-processor a Llama 3 or Gemma 3 tokenizer has (a BOS before each text) or none."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, processors

from examples.shakespeare import data

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


def write(directory: Path, vocab_size: int, bos: bool) -> Tokenizer:
    """Write `tokenizer.json` and `tokenizer_config.json` (eos `<eos>`) into `directory`."""
    train, held = data.load_plays()
    chars = sorted(set("".join(train.values()) + "".join(held.values())))
    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    assert len(vocab) <= vocab_size, (len(vocab), vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tok
