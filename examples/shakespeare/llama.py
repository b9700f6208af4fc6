"""A small Llama forward pass in plain JAX (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings).

The Llama family is configuration of this one model: Llama 3.x (`rope_scaling`, its
`llama3` frequency rule; an untied `lm_head`), Qwen 3 (RMSNorm on each head's queries
and keys: `q_norm` / `k_norm` in a layer's parameters; `head_dim` of its own), Qwen 2.5
(biases on q, k and v: `q_bias` / `k_bias` / `v_bias`) and Mistral (`window`: sliding-window
attention). A layer's optional parameters switch their part on where they are present.
`hf_loader.py` builds the `Config` and the parameters from a Hugging Face checkpoint.

Written with no LoRA in mind: parameters are a dict of arrays, dense kernels are
`(in, out)` and the per-layer ones are stacked along a leading layer axis and run
under `lax.scan`, so one layer is traced and compiled once; or, as a list of per-layer
dicts (`unstack_layers`), run one after another, the loop unrolled (see
`hidden_states` for what that trades). Two memory savers any JAX
training script uses: each layer is rematerialised in the backward pass (only its
input is kept), and the loss goes over the vocabulary in chunks, so the full
`(batch, seq, vocab)` logits never exist at once.

Two fields of `Config` choose how the step runs on a given device, never its values:
`attention` (cuDNN's fused attention on a GPU, query chunks elsewhere) and `remat` (what
the backward pass keeps: with memory to spare, `"none"` or `"dots"` is faster on a GPU).
`gemma3.py` uses the same two. A third, `mlp_chunk`, is for long sequences (`mlp`). A
fourth, `layout`, says where values live on a mesh of Explicit axes (`Layout`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P


class Layout(NamedTuple):
    """Where the step's values live on a mesh of Explicit axes (`jax.make_mesh`'s default:
    sharding in types), where the model states what Auto axes leave to XLA's propagation.

    `batch`: the mesh axis the windows are split along (None: whole on every device).
    `tp`: the axis of Megatron's tensor parallelism (None: none): q, k, v, gate and up are
    used split along their outputs, o and down along their inputs, and those two products'
    partial sums land on the batch layout (`out_sharding`: an all-reduce). Every other
    parameter is used whole. However a weight is stored (FSDP: split along any axis), each
    layer regathers it to that layout where the layer starts (`reshard`: FSDP's
    all-gather, a reduce-scatter of its gradient), so the gather is per layer under
    `lax.scan` too. Under Auto axes leave `Config.layout` at None.
    """
    batch: str | None = None
    tp: str | None = None

    @property
    def tokens(self) -> P:
        """`(B, T, dim)` activations: split along the batch, whole along `tp`."""
        return P(self.batch, None, None)

    def used(self, name: str, x):
        """Parameter `name` of a layer (or the model) resharded to where it is used."""
        if name in COLUMN:
            spec = P(None, self.tp)
        elif name in ROW:
            spec = P(self.tp, None)
        elif name.endswith("_bias") and name[: -len("_bias")] in COLUMN:
            spec = P(self.tp)
        else:
            spec = P()
        return jax.sharding.reshard(x, spec)


COLUMN, ROW = ("q", "k", "v", "gate", "up"), ("o", "down")  # split along out, along in


class Config(NamedTuple):
    n_layers: int
    dim: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    rope_theta: float
    norm_eps: float
    vocab: int
    # How the step runs, not what it computes (see `attention` and `hidden_states`).
    attention: str = "auto"
    remat: str = "layer"
    # The family's variations (defaults: SmolLM2's Llama): a head size other than
    # dim / n_heads (Qwen 3); Llama 3.1's RoPE frequency rule, `(factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings)`; Mistral's sliding window.
    head_dim: int | None = None
    rope_scaling: tuple[float, float, float, int] | None = None
    window: int | None = None
    # How the step runs (see `mlp`): the MLP's `(tokens, hidden)` intermediates made this
    # many tokens at a time, for long sequences (None: all at once).
    mlp_chunk: int | None = None
    # Where values live on a mesh of Explicit axes (see `Layout`; None: Auto axes, or none).
    layout: Layout | None = None

    @property
    def hd(self) -> int:
        """Each head's size."""
        return self.head_dim or self.dim // self.n_heads


def rms_norm(x, w, eps):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, theta, scaling=None):
    """Rotary embedding, HF's half-split ("rotate_half") layout. x: (B, T, heads, head_dim).
    `scaling`: Llama 3.1's frequency rule (`Config.rope_scaling`), or None."""
    t, d = x.shape[1], x.shape[-1]
    freqs = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    if scaling is not None:
        freqs = llama3_frequencies(freqs, *scaling)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs  # (T, d/2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def llama3_frequencies(freqs, factor, low_freq_factor, high_freq_factor, original_context):
    """Llama 3.1's RoPE rule: long wavelengths slowed by `factor`, short ones kept, the
    band between them interpolated (transformers' `_compute_llama3_parameters`)."""
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    wavelen = 2 * jnp.pi / freqs
    scaled = jnp.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


# Queries per attention chunk. Longer sequences attend in chunks of this many queries,
# each chunk's scores recomputed in the backward pass, so no (T, T) score matrix per head
# is ever whole: at 2048 tokens the largest attention buffer is a quarter of one.
QUERY_CHUNK = 512
ATTENTION = ("auto", "cudnn", "xla", "chunked")


def attention(q, k, v, *, window: int | None = None, scale: float | None = None,
              implementation: str = "auto"):
    """Causal grouped-query attention. q: (B, T, H, d); k, v: (B, T, KV, d); `(B, T, H * d)`
    out. `window`: a query at `i` sees keys `j` with `i - window < j <= i` (None: all of
    `j <= i`); `scale`: the scores' factor (None: `d ** -0.5`).

    `implementation` picks how, never what: `"cudnn"` is cuDNN's fused flash attention
    through `jax.nn.dot_product_attention` (GPU, bf16/f16, head dim a multiple of 8 up to
    128), `"xla"` the same function's XLA path (the whole `(T, T)` scores per head),
    `"chunked"` this module's query chunks (below), `"auto"` cuDNN where it applies and
    the chunks elsewhere.
    """
    b, t, h, d = q.shape
    implementation = _attention_implementation(implementation, q)
    if implementation in ("cudnn", "xla"):
        out = jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation=implementation,
            local_window_size=None if window is None else (window - 1, 0))
        return out.reshape(b, t, h * d)
    return chunked_attention(q, k, v, window=window, scale=scale)


def _attention_implementation(name: str, q) -> str:
    if name not in ATTENTION:
        raise ValueError(f"attention implementation {name!r}: expected one of {ATTENTION}")
    if name != "auto":
        return name
    d = q.shape[-1]
    fused = (jax.default_backend() == "gpu" and d % 8 == 0 and d <= 128
             and q.dtype in (jnp.bfloat16, jnp.float16))
    return "cudnn" if fused else "chunked"


def chunked_attention(q, k, v, *, window: int | None = None, scale: float | None = None):
    """`attention` in query chunks of `QUERY_CHUNK`, for any backend and dtype.

    Each query row's softmax runs over all its keys whether or not the queries are
    chunked, so chunking changes which buffers exist, not the result. A chunk takes
    every `n`-th query (strided, not contiguous): each chunk then holds the same share
    of every stretch of the sequence, so a sequence split across devices stays split
    in every chunk, and the causal work is the same in each.
    """
    b, t, h, d = q.shape
    attend = functools.partial(_attend, k=k, v=v, window=window, scale=scale)
    if t <= QUERY_CHUNK or t % QUERY_CHUNK:
        return attend(q, jnp.arange(t)).reshape(b, t, h * d)
    n, size = t // QUERY_CHUNK, QUERY_CHUNK
    chunks = jnp.moveaxis(q.reshape(b, size, n, h, d), 2, 0)  # chunk i: queries i, i + n, ...
    one = jax.checkpoint(lambda c: attend(c[0], jnp.arange(size) * n + c[1]), prevent_cse=False)
    out = jnp.moveaxis(lax.map(one, (chunks, jnp.arange(n))), 0, 2)  # (B, size, n, KV, G, d)
    return out.reshape(b, t, h * d, out_sharding=_typed_like(out, (0, None, 3)))


def _typed_like(x, axes):
    """On a mesh of Explicit axes, where a reshape JAX cannot type itself puts `x`'s
    values: output axis `i` split as `x`'s axis `axes[i]` (None: whole). Else None."""
    sharding = jax.typeof(x).sharding
    kinds = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if not any(kind == jax.sharding.AxisType.Explicit for kind in kinds):
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return P(*[None if a is None else spec[a] for a in axes])


def _attend(q, positions, *, k, v, window, scale):
    """Queries at `positions` against every key, causally; `(B, Tq, KV, G, d)` out."""
    b, tq, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, tq, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k)
    scores = (scores / jnp.sqrt(d).astype(q.dtype) if scale is None
              else scores * jnp.asarray(scale, scores.dtype))
    keys = jnp.arange(k.shape[1])[None, :]
    mask = positions[:, None] >= keys
    if window is not None:
        mask = mask & (positions[:, None] - keys < window)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v)


def _heads(cfg: Config, h, layer, name: str, n: int):
    """One projection's heads `(B, T, n, head_dim)`: its bias (Qwen 2.5) and its per-head
    RMSNorm (Qwen 3's q / k) where the layer has them."""
    b, t, _ = h.shape
    y = h @ layer[name]
    if f"{name}_bias" in layer:
        y = y + layer[f"{name}_bias"]
    y = y.reshape(b, t, n, cfg.hd)
    return rms_norm(y, layer[f"{name}_norm"], cfg.norm_eps) if f"{name}_norm" in layer else y


def _use(cfg: Config, name: str, x):
    """Parameter `name` as the step uses it: under `cfg.layout`, regathered (`Layout.used`)."""
    return x if cfg.layout is None else cfg.layout.used(name, x)


def _row_product(cfg: Config, x, w):
    """`x @ w` for o and down: under tensor parallelism a contraction split along `tp`,
    whose sum Explicit axes need told where to land."""
    if cfg.layout is None or cfg.layout.tp is None:
        return x @ w
    return jnp.matmul(x, w, out_sharding=cfg.layout.tokens)


def _lookup(cfg: Config, table, ids):
    """Rows `ids` of `table`: an indexed gather, typed as the ids are split under a layout."""
    if cfg.layout is None:
        return table[ids]
    return table.at[ids].get(out_sharding=P(*cfg.layout.tokens[:ids.ndim], None))


def block(cfg: Config, x, layer):
    layer = {name: _use(cfg, name, x) for name, x in layer.items()}
    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    q = rope(_heads(cfg, h, layer, "q", cfg.n_heads), cfg.rope_theta, cfg.rope_scaling)
    k = rope(_heads(cfg, h, layer, "k", cfg.n_kv_heads), cfg.rope_theta, cfg.rope_scaling)
    v = _heads(cfg, h, layer, "v", cfg.n_kv_heads)
    a = attention(q, k, v, window=cfg.window, implementation=cfg.attention)
    x = x + _row_product(cfg, a, layer["o"])
    h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
    return x + mlp(h, layer, cfg.mlp_chunk, functools.partial(_row_product, cfg))


def mlp(h, layer, chunk: int | None = None, down=jnp.matmul):
    """SwiGLU, `(B, T, dim)` in and out. `chunk`: `chunk` tokens at a time (a `lax.map`
    over the tokens, each chunk recomputed in the backward pass; a last, shorter chunk
    where `chunk` does not divide T), so the `(B, T, hidden)` gate and up outputs and
    their gradients, 3.5 times the width of everything else a layer makes, are never
    whole: what a long sequence needs. The same values either way. `down(x, w)`: the
    last product (`block` passes the row-parallel one)."""
    def one(h):
        return down(jax.nn.silu(h @ layer["gate"]) * (h @ layer["up"]), layer["down"])

    b, t, d = h.shape
    if not chunk or t <= chunk:
        return one(h)
    n = t // chunk
    chunks = jnp.moveaxis(h[:, : n * chunk].reshape(b, n, chunk, d), 1, 0)
    out = lax.map(jax.checkpoint(one, prevent_cse=False), chunks)  # (a scan body)
    out = jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, -1)
    return out if n * chunk == t else jnp.concatenate([out, one(h[:, n * chunk:])], axis=1)


REMAT = ("layer", "dots", "none", "offload")


def remat(cfg, layer_fn, *, in_loop: bool = False):
    """`layer_fn` under `cfg.remat`, the memory/compute trade of the backward pass:
    `"layer"` keeps each layer's input and recomputes the rest (the least device memory),
    `"dots"` also keeps the matrix products' outputs (recomputes only the cheap
    elementwise work), `"none"` keeps everything (no recomputation, the most memory),
    `"offload"` is `"layer"` with each kept input in host memory (moved out in the
    forward pass, back in the backward pass: for long sequences, where the kept inputs
    fill the device).

    `in_loop`: `layer_fn` is a `lax.scan` body. Its recomputation then needs no barrier
    against XLA merging it with the forward pass (`prevent_cse=False`, as
    `jax.checkpoint` advises for scan bodies), and the barrier would keep XLA from
    moving the next layer's host-resident weights in while this layer computes (its
    pipelined host offloading; docs/qlora.md). Unrolled layers keep the barrier."""
    if cfg.remat not in REMAT:
        raise ValueError(f"remat {cfg.remat!r}: expected one of {REMAT}")
    if cfg.remat == "none":
        return layer_fn
    if cfg.remat == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
            offload_src="device", offload_dst="pinned_host")
        named = lambda x, *rest: layer_fn(checkpoint_name(x, "layer_input"), *rest)  # noqa: E731
        return jax.checkpoint(named, policy=policy, prevent_cse=not in_loop)
    policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable if cfg.remat == "dots"
              else None)
    return jax.checkpoint(layer_fn, policy=policy, prevent_cse=not in_loop)


def hidden_states(cfg: Config, params, tokens):
    """Final-norm hidden states, (B, T, dim).

    `params["layers"]` stacked (one dict of `(layers, ...)` arrays) runs under `lax.scan`:
    one layer traced and compiled, whatever the depth. A list of per-layer dicts
    (`unstack_layers`) runs unrolled: longer to compile, but each layer's matrix products
    read its weights where they lie. Under `lax.scan` XLA copies every layer's slice out of
    the stack before a product reads it, and each saved activation into a stack (on an
    H200, 20 ms of a 160 ms Llama-3-8B step). What unrolling gains on a card is not
    measured yet, and XLA:CPU loses remat's savings without the loop (docs/gpu.md,
    "Unrolled layers"). The same values either way.
    """
    x = _lookup(cfg, _use(cfg, "embed", params["embed"]), tokens)
    step = lambda x, layer: (block(cfg, x, layer), None)  # noqa: E731
    if isinstance(params["layers"], (list, tuple)):
        unrolled = remat(cfg, step)  # one wrapper: its traced layer is reused by every call
        for layer in params["layers"]:
            x, _ = unrolled(x, layer)
    else:
        x, _ = lax.scan(remat(cfg, step, in_loop=True), x, params["layers"])
    return rms_norm(x, _use(cfg, "final_norm", params["final_norm"]), cfg.norm_eps)


def unstack_layers(params):
    """`params` with its stacked `"layers"` as a list of per-layer dicts, for `hidden_states`'
    unrolled loop (new arrays: call it once, outside the training step, before
    `lorax.init_lora` or quantization). Layers already in a list are returned as they are."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return dict(params, layers=list(layers))
    paths = jax.tree_util.tree_flatten_with_path(layers)[0]
    counts = {jax.tree_util.keystr(path): (x.shape[:1] or (None,))[0] for path, x in paths}
    if len(set(counts.values())) != 1:
        axes = ", ".join(f"layers{k}: {n}" for k, n in counts.items())
        raise ValueError(f"unstack_layers: params['layers'] must stack every leaf along one "
                         f"leading layer axis; their leading axes are {axes}")
    n = next(iter(counts.values()))
    return dict(params, layers=[jax.tree.map(lambda x: x[i], layers) for i in range(n)])


def logits(cfg: Config, params, tokens):
    """`(B, T, vocab)` logits: the tied embedding, or an untied `(dim, vocab)` `lm_head`
    if `params` has one (the training loss and `generate` use the tied one)."""
    h = hidden_states(cfg, params, tokens)
    return h @ params["lm_head"] if "lm_head" in params else h @ params["embed"].T


VOCAB_CHUNKS = 16


def loss(cfg: Config, params, windows):
    """Mean next-token cross-entropy over `(B, T + 1)` token windows.

    `logsumexp` over the tied output layer one vocabulary chunk at a time (a running
    max and sum, the chunk's logits recomputed in the backward pass): the same value as
    `optax.softmax_cross_entropy_with_integer_labels` on the full logits. It runs in the
    hidden states' dtype: bf16 activations give a bf16 loss (cast `h` to float32 first
    for a float32 one).
    """
    h = hidden_states(cfg, params, windows[:, :-1])
    # An untied output layer (Llama 3 8B) is `(dim, vocab)`: its transpose, as the tied
    # embedding is laid out (inside `lorax.lora` a quantized one stays quantized).
    out = (_use(cfg, "lm_head", params["lm_head"]).T if "lm_head" in params
           else _use(cfg, "embed", params["embed"]))
    lookup = functools.partial(_lookup, cfg)
    return tied_loss(h, out, windows[:, 1:], cfg.vocab, lookup)


def tied_loss(h, embed, targets, vocab: int, lookup=lambda table, ids: table[ids]):
    """Mean cross-entropy of hidden states `h` (B, T, dim) against `targets` (B, T) through
    the tied `(vocab, dim)` output layer `embed`, `VOCAB_CHUNKS` slices of it at a time.
    `lookup(table, ids)`: how rows are read (`loss` passes its layout's)."""
    target_logit = jnp.einsum("btd,btd->bt", h, lookup(embed, targets))
    n = VOCAB_CHUNKS if vocab % VOCAB_CHUNKS == 0 else 1
    size = vocab // n

    @functools.partial(jax.checkpoint, prevent_cse=False)  # (a scan body)
    def chunk(carry, i):
        m, s = carry
        z = h @ lax.dynamic_slice_in_dim(embed, i * size, size, axis=0).T  # (B, T, size)
        m_new = jnp.maximum(m, z.max(axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[..., None]).sum(axis=-1)
        return (m_new, s), None

    # Typed as the per-token values are (on a mesh of Explicit axes, split as the batch).
    init = (jnp.full_like(target_logit, -jnp.inf), jnp.zeros_like(target_logit))
    (m, s), _ = lax.scan(chunk, init, jnp.arange(n))
    return (m + jnp.log(s) - target_logit).mean()


def sample_token(logits, key, temperature: float, top_p: float):
    """One token from `logits` (vocab,): nucleus (top-p) sampling at `temperature`.

    Keeps the most probable tokens up to the first whose cumulative probability reaches
    `top_p` (so the top token always survives) and samples from them renormalised.
    `temperature` and `top_p` are Python numbers, fixed at trace time; temperature 0 is
    greedy decoding.
    """
    if temperature == 0:
        return jnp.argmax(logits)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    scaled = logits.astype(jnp.float32) / temperature
    if top_p == 1:  # nothing to cut: skip the sort over the vocabulary
        return jax.random.categorical(key, scaled)
    order = jnp.argsort(scaled, descending=True)
    probs = jax.nn.softmax(scaled[order])
    # The mass strictly before a token decides: a token is kept while the tokens above
    # it have not yet reached top_p, which also keeps the top one (mass 0 before it).
    keep = jnp.zeros(scaled.shape, bool).at[order].set(jnp.cumsum(probs) - probs < top_p)
    # Drawn in vocabulary order, so a key's random numbers belong to the same tokens
    # for any two models (and with or without the cut); categorical renormalises.
    return jax.random.categorical(key, jnp.where(keep, scaled, -jnp.inf))


def generate(cfg: Config, params, prompt, n_new: int, key, temperature=1.0, top_p=0.9):
    """Sample `n_new` tokens after `prompt` (1-d int array), without a KV cache.

    Every step runs the whole fixed-length buffer; the causal mask keeps the unfilled
    tail from affecting earlier positions, so one compiled shape serves every step.
    The same `key` gives the same random numbers at every step, so two parameter sets
    sampled with it differ only because their weights do.
    """
    return sample_loop(functools.partial(hidden_states, cfg), params, prompt, n_new, key,
                       temperature, top_p)


def sample_loop(hidden, params, prompt, n_new: int, key, temperature, top_p):
    """`generate` for any model whose `hidden(params, tokens)` gives final hidden states
    and whose output layer is the tied `params["embed"]`."""
    n_prompt = prompt.shape[0]
    buf = jnp.zeros(n_prompt + n_new, jnp.int32).at[:n_prompt].set(prompt)

    def step(i, carry):
        buf, key = carry
        h = hidden(params, buf[None])[0, i - 1]
        key, sub = jax.random.split(key)
        token = sample_token(h @ params["embed"].T, sub, temperature, top_p)
        return buf.at[i].set(token.astype(jnp.int32)), key

    buf, _ = lax.fori_loop(n_prompt, n_prompt + n_new, step, (buf, key))
    return buf[n_prompt:]
