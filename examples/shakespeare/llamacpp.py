"""Run the real llama.cpp in-process (PyPI `xllamacpp`) as an independent reference.

    from examples.shakespeare import llamacpp
    top = llamacpp.next_token_logprobs(path, [[504, 3181, 28], ...], lora=[("a.gguf", 1.0)])
    top[0]  # {token_id: logprob, ...}: llama.cpp's 5 most probable next tokens

`xllamacpp` wraps llama.cpp's own server (`llama-server`'s request handling, no HTTP
round trip), so the numbers are what llama.cpp computes for the GGUF: its Q4_1 / Q8_0
matmul kernels (which quantise the activations to Q8_1 / Q8_0), an f16 KV cache and
flash attention by default (`f32_attention=True` switches both off), and LoRA adapters
in llama.cpp's GGUF format applied unmerged, `W x + s B (A x)` with
`s = scale * adapter.lora.alpha / r`.

Notes, checked with xllamacpp 2026.10.11549 and SmolLM2-135M-Instruct.Q4_1.gguf:

- Token-id prompts go in unchanged: the server adds a BOS token only when the GGUF says
  `tokenizer.ggml.add_bos_token`, which SmolLM2's says it doesn't (prompt_tokens in the
  reply equals len(prompt)). Text prompts (`sample`) are tokenised by llama.cpp, likewise
  without a BOS.
- The returned log-probabilities are the model's raw next-token distribution (a softmax
  over all logits, before any sampler) because the request sets
  `"post_sampling_probs": False` (also the server's default); with `True` and
  temperature 0 the greedy sampler would report probability 1 for its pick.
- The server leaves out the probabilities of a token that ends in an incomplete UTF-8
  character (`"logprobs": null`); a logit bias makes the one sampled token a plain "a"
  (the bias doesn't touch the reported raw log-probabilities). See `logprobs_request`.
- Prompt caching is switched off per request, so every prompt is evaluated from scratch
  and the results don't depend on the order of the prompts.
- Install: `pip install xllamacpp==2026.10.11549` (a prebuilt CPU wheel).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

__all__ = ["logprobs_request", "next_token_logprobs", "sample", "server", "write_f32_copy"]


def _xllamacpp():
    try:
        import xllamacpp
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "llama.cpp reference needs the `xllamacpp` package: "
            "`pip install xllamacpp==2026.10.11549`") from err
    return xllamacpp


@contextlib.contextmanager
def server(gguf_path: str | os.PathLike, *, lora: Sequence[tuple[str, float]] = (),
           n_ctx: int = 512, n_threads: int | None = None, f32_attention: bool = False,
           verbosity: int = 0):
    """A loaded `xllamacpp.Server` for `gguf_path`, with LoRA adapters `lora`
    (`(path, scale)` pairs, in llama.cpp's LoRA GGUF format) applied; one slot of `n_ctx`
    tokens. `f32_attention` keeps attention in float32: a float32 KV cache and no flash
    attention (llama.cpp's CPU flash attention works in f16 whatever the cache type; its
    defaults are an f16 cache and flash attention on).
    `verbosity` 0 silences llama.cpp's log (3 is the server's usual info level).
    `n_threads` defaults to `$LLAMACPP_THREADS`, else llama.cpp's choice (all cores). On a
    machine whose cores are busy with other work (the test suite's second worker), 1 is
    much faster: llama.cpp's threads spin-wait at each of the graph's barriers."""
    xlc = _xllamacpp()
    n_threads = n_threads or int(os.environ.get("LLAMACPP_THREADS") or 0)
    for path in [gguf_path, *(p for p, _ in lora)]:
        if not os.path.isfile(path):  # the server only says "Failed to init server"
            raise FileNotFoundError(path)
    params = xlc.CommonParams()
    params.model.path = os.fspath(gguf_path)
    params.verbosity = verbosity
    params.n_ctx = n_ctx
    params.n_parallel = 1
    params.n_batch = params.n_ubatch = max(n_ctx, 512)  # a whole prompt in one batch
    params.warmup = False
    if f32_attention:
        params.cache_type_k = params.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
        params.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if n_threads:
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = n_threads
    params.lora_adapters = [xlc.CommonAdapterLoraInfo(os.fspath(p), float(s)) for p, s in lora]
    srv = xlc.Server(params)
    try:
        yield srv
    finally:
        del srv  # ~Server stops llama.cpp's main loop and frees the model


def _complete(srv, request: dict) -> dict:
    reply = srv.handle_completions(request)
    if not isinstance(reply, dict) or "error" in reply or not reply.get("choices"):
        raise RuntimeError(f"llama.cpp completion failed: {reply!r}"[:2000])
    return reply["choices"][0]


def logprobs_request(prompt: Sequence[int], top: int) -> dict:
    """The completion request for `prompt`'s raw top-`top` next-token log-probabilities."""
    return {
        "prompt": [int(t) for t in prompt],  # a token-id list: used as is, no BOS added
        "n_predict": 1,
        "n_probs": top,
        "post_sampling_probs": False,  # the model's softmax, not the sampler's
        "temperature": 0.0,
        "cache_prompt": False,
        # The server drops a generated token's probabilities when the token ends in an
        # incomplete UTF-8 character (a byte-fallback piece; it waits for the rest) and
        # then replies `"logprobs": null`. Make the greedy pick a plain ASCII token: the
        # bias acts in the sampler only, the reported (pre-sampling) log-probabilities
        # come from the raw logits and are unchanged by it.
        "logit_bias": [["a", 1000.0]],
    }


def next_token_logprobs(gguf_path: str | os.PathLike, prompts: Sequence[Sequence[int]], *,
                        lora: Sequence[tuple[str, float]] = (), top: int = 5,
                        n_threads: int | None = None, f32_attention: bool = False,
                        ) -> list[dict[int, float]]:
    """For each prompt (a list of token ids, no BOS added), llama.cpp's `top` most
    probable next tokens as `{token_id: natural-log probability}`, most probable first.

    The model (and the adapters in `lora`, `(path, scale)` pairs) is loaded once per
    call; the prompts then run one after another, each from an empty KV cache.
    `f32_attention`: see `server` (float32 attention; off = llama.cpp's defaults).

    Agreement with `llama.py` on held-out Shakespeare prefixes (16-128 tokens): with the
    shipped Q4_1 GGUF, |logprob difference| over the top 5 is about 0.08 on average and
    up to ~0.7 (llama.cpp quantises the activations of every Q4_1/Q8_0 matmul to 8 bits),
    top-1 agreement ~94%. With an F32 GGUF (the same weights dequantised) it is 0.0014
    mean / 0.008 max, and 0.0002 / 0.0003 with `f32_attention=True`.

    `n_threads`: see `server`."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    n_ctx = max(512, -(-(max(map(len, prompts)) + 8) // 256) * 256)
    out = []
    with server(gguf_path, lora=lora, n_ctx=n_ctx, n_threads=n_threads,
                f32_attention=f32_attention) as srv:
        for prompt in prompts:
            choice = _complete(srv, logprobs_request(prompt, top))
            if not (choice.get("logprobs") or {}).get("content"):
                raise RuntimeError(f"llama.cpp returned no log-probabilities: {choice!r}")
            first = choice["logprobs"]["content"][0]
            out.append({int(t["id"]): float(t["logprob"]) for t in first["top_logprobs"]})
    return out


def sample(gguf_path: str | os.PathLike, prompt_text: str, *,
           lora: Sequence[tuple[str, float]] = (), n_predict: int = 40, seed: int = 0,
           temperature: float = 1.0, top_p: float = 0.9, n_threads: int | None = None,
           ignore_eos: bool = False) -> str:
    """llama.cpp's continuation of `prompt_text` (tokenised by llama.cpp, no BOS), up to
    `n_predict` tokens, stopping at end-of-text unless `ignore_eos`.

    Sampling as `llama.sample_token` does it: temperature, then nucleus (top-p) on the
    tempered distribution, nothing else (llama.cpp's default top-k 40, min-p 0.05 and its
    top-p-before-temperature order are switched off); temperature 0 is greedy. The
    random numbers are llama.cpp's own, so only greedy text can match lorax's sample."""
    with server(gguf_path, lora=lora, n_threads=n_threads,
                n_ctx=max(512, n_predict + 4 * len(prompt_text) + 8)) as srv:
        choice = _complete(srv, {
            "prompt": prompt_text,
            "n_predict": n_predict,
            "seed": seed,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": 0,
            "min_p": 0.0,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "samplers": ["temperature", "top_p"],
            "ignore_eos": ignore_eos,
            "cache_prompt": False,
        })
    return choice["text"]


# GGUF's metadata value types: their sizes, for the scalars (gguf-py's GGUFValueType).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _skip_value(buf: bytes, pos: int, vtype: int) -> int:
    """The position after the value of type `vtype` at `pos`."""
    if vtype in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[vtype]
    if vtype == _STRING:
        return pos + 8 + int.from_bytes(buf[pos:pos + 8], "little")
    if vtype != _ARRAY:
        raise ValueError(f"GGUF: unknown metadata value type {vtype} at byte {pos}")
    sub, n = int.from_bytes(buf[pos:pos + 4], "little"), int.from_bytes(buf[pos + 4:pos + 12], "little")
    pos += 12
    if sub in _SCALAR_BYTES:
        return pos + n * _SCALAR_BYTES[sub]
    for _ in range(n):
        pos = _skip_value(buf, pos, sub)
    return pos


def write_f32_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """An F32 copy of a GGUF model (every tensor dequantised, the same metadata and
    names), so llama.cpp's matmuls run without quantising activations: with
    `f32_attention`, llama.cpp then matches a float32 JAX model to ~1e-4.

    The metadata is copied byte for byte (only `general.file_type` becomes 0, all F32):
    gguf-py's reader would parse every one of the vocabulary's strings into fields,
    seconds for a 49k-token vocabulary."""
    import struct

    import gguf
    import numpy as np

    buf = np.memmap(os.fspath(src), np.uint8, mode="r")
    head = memoryview(buf)
    magic, _, n_tensors, n_kv = struct.unpack_from("<4sIQQ", head)
    if magic != b"GGUF":
        raise ValueError(f"{os.fspath(src)!r} is not a GGUF file")
    pos, file_type_at, alignment = 24, None, 32
    for _ in range(n_kv):
        klen = int.from_bytes(head[pos:pos + 8], "little")
        key = bytes(head[pos + 8:pos + 8 + klen]).decode()
        vtype = int.from_bytes(head[pos + 8 + klen:pos + 12 + klen], "little")
        pos += 12 + klen
        if key == "general.file_type" and vtype == 4:
            file_type_at = pos
        elif key == "general.alignment":
            alignment = int.from_bytes(head[pos:pos + 4], "little")
        pos = _skip_value(head, pos, vtype)
    kv = bytearray(head[:pos])  # the header and the metadata
    if file_type_at is not None:
        kv[file_type_at:file_type_at + 4] = (0).to_bytes(4, "little")  # ALL_F32
    tensors = []  # (name with its length, dims, type, offset in the data section)
    for _ in range(n_tensors):
        nlen = int.from_bytes(head[pos:pos + 8], "little")
        name = bytes(head[pos:pos + 8 + nlen])
        n_dims = int.from_bytes(head[pos + 8 + nlen:pos + 12 + nlen], "little")
        dims = struct.unpack_from(f"<{n_dims}Q", head, pos + 12 + nlen)
        qtype, offset = struct.unpack_from("<IQ", head, pos + 12 + nlen + 8 * n_dims)
        pos += 12 + nlen + 8 * n_dims + 12
        tensors.append((name, dims, gguf.GGMLQuantizationType(qtype), offset))
    data_at = -(-pos // alignment) * alignment
    pad = lambda n: b"\0" * (-n % alignment)  # noqa: E731
    infos, at = bytearray(), 0  # the same infos, each tensor F32 at its new aligned offset
    for name, dims, _, _ in tensors:
        infos += name + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, 0, at)
        at += 4 * int(np.prod(dims))
        at += -at % alignment
    with open(dst, "wb") as f:
        f.write(kv)
        f.write(infos)
        f.write(pad(len(kv) + len(infos)))
        for _, dims, qtype, offset in tensors:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows = int(np.prod(dims[1:]))
            start = data_at + offset
            raw = buf[start:start + rows * dims[0] // block * size].reshape(rows, -1)
            x = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)
            f.write(x.tobytes())
            f.write(pad(x.nbytes))
