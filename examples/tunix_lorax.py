"""google-tunix's Qwen3 and Llama3 (Flax NNX, unedited) on a Hugging Face checkpoint read by
`lorax.load_safetensors`, quantized codes kept; `lorax.lora` over the model; tunix's own
`PeftTrainer` training lorax's factors. docs/tunix.md walks through it; the tests are
tests/frameworks/test_tunix.py (`bash scripts/test-tunix`, its own env with tunix).

The checkpoint goes into tunix's model state through tunix's own per-family name maps
(`tunix.models.<family>.params._get_key_and_transform_mapping`): each torch name maps to
an NNX path and a `(permute, reshape)` into tunix's einsum layouts, e.g. `q_proj`'s
`(heads * head_dim, embed)` to `(embed, heads, head_dim)` and `o_proj`'s
`(embed, heads * head_dim)` to `(heads, head_dim, embed)`. A dense tensor takes the two
as numpy would; a `lorax.QuantizedArray` takes them on its codes (`relayout`), never
dequantized:

- transposing moves the codes' leading axes (the block axis, its blocks untouched, is
  only renamed);
- splitting an axis other than the block axis reshapes the codes' leading axes;
- splitting the block axis (`o_proj`'s `heads * head_dim` input) keeps its last part as
  the block axis and the others as leading axes. Blocks that straddle two heads (a block
  longer than `head_dim`: bitsandbytes' 64 beside a 16- or 32-wide head, or per-channel
  FP8's one block per row) are first cut into blocks of `gcd(block, head_dim)` values,
  each with its block's scale (and zero point): the same codes, bit for bit the same
  values. GGUF's fixed blocks (and K-quant super-blocks) cannot be cut and raise.
- bitsandbytes' double quantization (8-bit codes of the scales, in groups of 256 along
  the flattened rows) follows a split of the rows where the groups fall on whole heads
  (Llama / Qwen's head_dim 128 with 64 blocks per row); elsewhere (`o_proj`, tiny models)
  the scales are expanded to their exact float32 values first: 4 bytes per block beside
  the block's codes (32 bytes for bitsandbytes' 64-value NF4 blocks), no code touched.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import lorax

# The one lorax internal used: double quantization's second level (bitsandbytes' dynamic
# map), to expand double-quantized scales to the exact float32 values lorax reads.

# Hugging Face `model_type` -> tunix's family package and model class.
FAMILIES = {"qwen3": ("tunix.models.qwen3", "Qwen3"), "llama": ("tunix.models.llama3", "Llama3")}
PROJECTIONS = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
_DQ_GROUP = 256  # bitsandbytes' double quantization: 256 scales per group


# -- a QuantizedArray's codes in another layout --------------------------------------------


def _reblock(qa: lorax.QuantizedArray, size: int) -> lorax.QuantizedArray:
    """The same values in blocks of `size` (dividing the block size), each with its
    block's scale and min: codes regrouped, never decoded."""
    fmt, bs = qa.format, qa.block_size
    pairs = not fmt.element_codes  # two 4-bit codes per byte, in value order ("pairs")
    if size == bs:
        return qa
    if fmt.fixed_block or fmt.packing not in (None, "pairs", "int4") or (pairs and size % 2):
        raise ValueError(
            f"relayout: a {qa.qtype} weight's blocks of {bs} values cannot be cut into "
            f"blocks of {size} (GGUF's blocks are fixed; 4-bit codes pair up in bytes), so "
            f"its block axis cannot be split there; dequantize it, or quantize it anew.")
    qa, r = qa.single_level_scales(), bs // size
    codes = qa.codes.reshape(*qa.codes.shape[:-2], qa.codes.shape[-2] * r, -1)
    scales, mins = (None if x is None else jnp.repeat(x, r, axis=-1) for x in (qa.scales, qa.mins))
    return qa.with_leaves((codes, scales, mins, None, None), block_size=size)


def _move_leading(x: jax.Array | None, order: Sequence[int]) -> jax.Array | None:
    """`x` with its first `len(order)` axes put in `order`."""
    if x is None or list(order) == sorted(order):
        return x
    return jnp.transpose(x, (*order, *range(len(order), x.ndim)))


def transpose(qa: lorax.QuantizedArray, perm: Sequence[int]) -> lorax.QuantizedArray:
    """`qa` with its logical axes permuted as `jnp.transpose(dense, perm)` would.

    !!! Example

        ```python
        import jax, jax.numpy as jnp, lorax
        w = jax.random.normal(jax.random.PRNGKey(0), (128, 64))
        q = lorax.QuantizedArray.from_dense(w, "nf4", axis=-1)
        assert (transpose(q, (1, 0)).dequantize() == q.dequantize().T).all()
        ```
    """
    n, block = qa.ndim, qa.ndim + qa.axis
    others = [d for d in range(n) if d != block]
    order = [others.index(p) for p in perm if p != block]
    if order and order[-1] != len(order) - 1:  # the scales' double-quantization rows move
        qa = qa.single_level_scales()
    leaves = [_move_leading(x, order) for x in qa.leaves()[:3]]
    leaves += [_move_leading(x, order[:-1]) for x in qa.leaves()[3:]]
    return qa.with_leaves(tuple(leaves), axis=list(perm).index(block) - n)


def _split_leading(qa: lorax.QuantizedArray, s: int, sizes: tuple[int, ...]
                   ) -> lorax.QuantizedArray:
    """Split the codes' leading axis `s` (not the block axis) into `sizes`."""
    n_other = qa.codes.ndim - 2
    # The double quantization's groups run along (rows x blocks): they follow a split of
    # the rows only where each group falls within one of the new last rows.
    if (qa.scale_scales is not None and s == n_other - 1
            and (sizes[-1] * qa.codes.shape[-2]) % _DQ_GROUP):
        qa = qa.single_level_scales()

    def split(x: jax.Array | None, at: int) -> jax.Array | None:
        return None if x is None else x.reshape(*x.shape[:at], *sizes, *x.shape[at + 1:])

    codes, scales, mins = (split(x, s) for x in qa.leaves()[:3])
    ss, so = qa.scale_scales, qa.scale_offset
    if ss is not None and s < n_other - 1:
        ss, so = split(ss, s), split(so, s)
    elif ss is not None:  # the new leading rows share the offset; the groups divide evenly
        lead = sizes[:-1]
        ss = ss.reshape(*ss.shape[:-1], *lead, ss.shape[-1] // math.prod(lead))
        so = jnp.broadcast_to(so.reshape(*so.shape[:-1], *(1,) * len(lead), 1),
                              (*so.shape[:-1], *lead, 1))
    return qa.with_leaves((codes, scales, mins, ss, so))


def split_axis(qa: lorax.QuantizedArray, d: int, sizes: Sequence[int]) -> lorax.QuantizedArray:
    """`qa` with its logical axis `d` split into `sizes`, as `dense.reshape` would.

    !!! Example

        ```python
        import jax, lorax
        w = jax.random.normal(jax.random.PRNGKey(0), (64, 64))  # (embed, heads * head_dim)
        q = lorax.QuantizedArray.from_dense(w, "nf4", axis=-1)  # blocks of 64 across heads
        o = split_axis(q, 1, (4, 16))  # (embed, heads, head_dim): blocks of 16
        assert o.shape == (64, 4, 16) and o.block_size == 16
        assert (o.dequantize() == q.dequantize().reshape(64, 4, 16)).all()
        ```
    """
    sizes, n, block = tuple(sizes), qa.ndim, qa.ndim + qa.axis
    others = [x for x in range(n) if x != block]
    if d != block:
        out = _split_leading(qa, others.index(d), sizes)
        return out.with_leaves(out.leaves(), axis=qa.axis - (len(sizes) - 1) * (d > block))
    # Double quantization's groups run along the rows' blocks, which now regroup.
    qa = _reblock(qa.single_level_scales(), math.gcd(qa.block_size, sizes[-1]))
    per_row, new = sizes[-1] // qa.block_size, len(sizes) - 1
    lead = (*qa.codes.shape[:len(others)], *sizes[:-1], per_row)
    codes = qa.codes.reshape(*lead, qa.codes.shape[-1])
    scales, mins = (None if x is None else x.reshape(lead) for x in (qa.scales, qa.mins))
    # Leading axes in logical order: those before the block axis, the new ones, the rest.
    before = sum(x < d for x in others)
    order = [*range(before), *range(len(others), len(others) + new), *range(before, len(others))]
    leaves = (_move_leading(codes, order), _move_leading(scales, order), _move_leading(mins, order))
    return qa.with_leaves((*leaves, None, None), axis=qa.axis)


def _split_plan(shape: tuple[int, ...], new: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """`(axis, sizes)` for each axis of `shape` that `reshape(new)` splits; a reshape
    that merges axes raises."""
    plan, j = [], 0
    for d, n in enumerate(shape):
        k = j
        while k < len(new) and math.prod(new[j:k + 1]) < n:
            k += 1
        if k >= len(new) or math.prod(new[j:k + 1]) != n:
            raise ValueError(f"relayout: reshape {shape} -> {new} merges axes; only splits "
                             "keep a QuantizedArray's blocks")
        if k > j:
            plan.append((d, new[j:k + 1]))
        j = k + 1
    return plan


def relayout(w: Any, permute: Sequence[int] | None, reshape: Sequence[int] | None) -> Any:
    """`w.transpose(permute).reshape(reshape)` (tunix's name-map transforms) for a dense
    array or a `lorax.QuantizedArray` (on its codes: see the module docstring).

    !!! Example

        ```python
        import jax, lorax
        w = jax.random.normal(jax.random.PRNGKey(0), (64, 128))  # torch's o_proj (embed, h*d)
        q = lorax.QuantizedArray.from_dense(w, "nf4", axis=-1)
        o = relayout(q, (1, 0), (8, 16, 64))  # tunix's (heads, head_dim, embed)
        assert (o.dequantize() == q.dequantize().T.reshape(8, 16, 64)).all()
        ```
    """
    if not isinstance(w, lorax.QuantizedArray) and hasattr(w, "dequantize"):
        raise ValueError(f"relayout: a {type(w).__name__} (GPTQ act-order's rows in their "
                         "stored order) cannot take another layout as its codes")
    if not isinstance(w, lorax.QuantizedArray):
        w = w if permute is None else jnp.transpose(w, permute)
        return w if reshape is None else w.reshape(reshape)
    if permute is not None:
        w = transpose(w, permute)
    # Splits from the last axis back, so the earlier axes keep their numbers.
    for d, sizes in reversed(_split_plan(w.shape, tuple(reshape or w.shape))):
        w = split_axis(w, d, sizes)
    return w


# -- tunix's model from a checkpoint -----------------------------------------------------


def family(hf_config: dict) -> Any:
    """tunix's package for the checkpoint's `model_type` (`tunix.models.qwen3`, ...)."""
    kind = hf_config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"tunix_lorax: model_type {kind!r} is not one of {sorted(FAMILIES)}")
    return importlib.import_module(FAMILIES[kind][0])


def tunix_config(hf_config: dict, dtype: Any = jnp.float32) -> Any:
    """tunix's `ModelConfig` for a Hugging Face `config.json` (as a dict).

    tunix 0.1.7 rotates with RoPE base 1e6 whatever `rope_theta` says, and its Llama3 has
    no `llama3` frequency rule: a checkpoint whose RoPE differs gets a warning (its
    logits are not transformers'). `dtype`: Qwen3's compute and parameter dtype (Llama3's
    parameters are float32)."""
    fam, c = family(hf_config), hf_config
    rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta"),
                                        **(c.get("rope_scaling") or {})}
    if rope.get("rope_theta") != 1e6 or rope.get("rope_type", "default") != "default":
        warnings.warn(f"tunix 0.1.7's {FAMILIES[c['model_type']][1]} uses RoPE base 1e6 and no "
                      f"scaling; this checkpoint's is {rope}: its logits will differ", stacklevel=2)
    kw = {"num_layers": c["num_hidden_layers"], "vocab_size": c["vocab_size"],
          "embed_dim": c["hidden_size"], "hidden_dim": c["intermediate_size"],
          "num_heads": c["num_attention_heads"], "num_kv_heads": c["num_key_value_heads"],
          "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
          "rope_theta": int(rope.get("rope_theta") or 1e6), "norm_eps": c["rms_norm_eps"]}
    tied = bool(c.get("tie_word_embeddings", False))
    if c["model_type"] == "qwen3":
        return fam.model.ModelConfig(**kw, use_tied_embedding=tied, dtype=dtype, param_dtype=dtype)
    return fam.model.ModelConfig(**kw, weight_tying=tied)


def _as_dtype(w: Any, dtype: Any) -> Any:
    if isinstance(w, lorax.QuantizedArray):  # the same codes, read as `dtype`
        return w.with_leaves(w.leaves(), dense_dtype=jnp.dtype(dtype))
    return w if hasattr(w, "dequantize") else jnp.asarray(w, dtype)  # (relayout refuses it)


def tunix_state(tensors: dict[str, Any], hf_config: dict, *, dtype: Any = jnp.float32
                ) -> tuple[nnx.GraphDef, dict, Any]:
    """Put `lorax.load_safetensors`' tensors into tunix's model: `(graphdef, state, config)`,
    `state` a pure dict (tunix's NNX paths) holding dense arrays and `QuantizedArray`s in
    tunix's layouts; `nnx.merge(graphdef, state)` is the model inside `lorax.lora`.

    **Raises:** `ValueError` naming the tunix path of a weight the checkpoint lacks or whose
    shape disagrees, or a quantized weight whose blocks cannot take tunix's layout.

    !!! Example

        ```python
        tensors, hf = lorax.load_safetensors("tests/data/models/llama3_bnb4")
        graphdef, state, cfg = tunix_state(tensors, hf)
        q = state["layers"][0]["attn"]["q_proj"]["w"]  # (embed, heads, head_dim) NF4 codes
        assert q.qtype == "bnb_nf4" and q.shape == (64, 4, 16)
        ```
    """
    from tunix.models import safetensors_loader
    from tunix.utils import torch_utils

    fam = family(hf_config)
    cfg = tunix_config(hf_config, dtype)
    cls = getattr(fam.model, FAMILIES[hf_config["model_type"]][1])
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=0))))
    key_map = fam.params._get_key_and_transform_mapping(cfg)
    placed = {}
    for name, w in tensors.items():
        try:
            key, transform = torch_utils.torch_key_to_jax_key(key_map, name)
        except ValueError:  # not a weight of tunix's model (tunix's loader skips them too)
            continue
        try:
            placed[key] = relayout(_as_dtype(w, dtype), *(transform or (None, None)))
        except ValueError as err:
            raise ValueError(f"{name} -> {key}: {err}") from None

    def fill(path: Any, want: Any) -> Any:
        key = safetensors_loader.path_to_key(path)
        got = placed.get(key)
        if got is None or tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"tunix_state: {key} {want.shape} is "
                             f"{'missing' if got is None else tuple(got.shape)} in the checkpoint")
        return got

    return graphdef, jax.tree_util.tree_map_with_path(fill, abstract.to_pure_dict()), cfg


def load(path: str | Path, *, dtype: Any = jnp.float32, **load_options: Any
         ) -> tuple[nnx.GraphDef, dict, Any]:
    """`tunix_state(*lorax.load_safetensors(path, **load_options))`: a checkpoint
    directory (bf16, bitsandbytes NF4, FP8, ...; `quantize="nf4"` to quantize a dense one
    as it is read) as tunix's model.

    !!! Example

        ```python
        graphdef, state, cfg = load("tests/data/models/qwen3")
        logits = jax.jit(lorax.lora(logits_fn(graphdef)))(state, jnp.zeros((1, 8), jnp.int32))
        ```
    """
    tensors, hf = lorax.load_safetensors(path, **load_options)
    return tunix_state(tensors, hf, dtype=dtype)


# -- running and training it -----------------------------------------------------------


def forward(graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
    """`(state, tokens, positions, attention_mask) -> logits`: tunix's model call, as a
    function of its state (for `lorax.lora`)."""

    def apply(state: Any, tokens: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(graphdef, state)(tokens, positions, None, mask)
        return logits

    return apply


def model_inputs(tokens: jax.Array, input_mask: jax.Array | None = None) -> dict[str, jax.Array]:
    """tunix's model inputs for `tokens` (B, L): `positions` and the causal
    `attention_mask` by tunix's own helpers (padding where `input_mask` is False)."""
    from tunix.sft import utils

    mask = jnp.ones(tokens.shape, bool) if input_mask is None else input_mask
    return {"input_tokens": tokens, "input_mask": mask,
            "positions": utils.build_positions_from_mask(mask),
            "attention_mask": utils.make_causal_attn_mask(mask)}


def logits_fn(graphdef: nnx.GraphDef) -> Callable[[Any, jax.Array], jax.Array]:
    """`(state, tokens) -> logits` over the whole sequence (causal, no padding)."""
    apply = forward(graphdef)

    def logits(state: Any, tokens: jax.Array) -> jax.Array:
        x = model_inputs(tokens)
        return apply(state, tokens, x["positions"], x["attention_mask"])

    return logits


class Frozen(nnx.Variable):
    """The frozen base (codes, scales, dense norms): neither `nnx.Param` nor `LoRAParam`,
    so tunix's optimizer and gradients leave it alone."""


class LoraModel(nnx.Module):
    """tunix-callable model for `PeftTrainer`: lorax's factors as `nnx.LoRAParam`, the
    frozen base as `Frozen`, the call `lorax.lora(tunix's model)`.

    !!! Example

        ```python
        trainer = peft_trainer.PeftTrainer(LoraModel(graphdef, lora_state, spec),
                                           optax.adam(1e-2), training_config)
        trainer.with_gen_model_input_fn(lambda x: model_inputs(x.input_tokens, x.input_mask))
        ```
    """

    def __init__(self, graphdef: nnx.GraphDef, lora_state: Any, spec: Any,
                 on_materialize: str = "error"):
        trainable, frozen = lorax.partition(lora_state, spec)
        leaves, self.trainable_def = jax.tree.flatten(trainable)
        base, self.frozen_def = jax.tree.flatten(frozen)
        self.factors = nnx.List([nnx.LoRAParam(x) for x in leaves])
        self.base = nnx.List([Frozen(x) for x in base])
        self.apply = lorax.lora(forward(graphdef), on_materialize=on_materialize)

    def lora_state(self) -> Any:
        """The `LoraWeight` tree (`lorax.combine` of factors and base)."""
        trainable = self.trainable_def.unflatten([p[...] for p in self.factors])
        return lorax.combine(trainable, self.frozen_def.unflatten([v[...] for v in self.base]))

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: Any,
                 attention_mask: jax.Array) -> tuple[jax.Array, None]:
        return self.apply(self.lora_state(), tokens, positions, attention_mask), None


# -- the whole path, as a script -------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Load a checkpoint into tunix's model, put rank-`--rank` factors on the seven
    projections and train them with tunix's `PeftTrainer` on random tokens; returns the
    per-step losses. `.tools/tunix/bin/python examples/tunix_lorax.py [CHECKPOINT_DIR]`."""
    import argparse

    import optax
    from tunix.sft import metrics_logger, peft_trainer

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("checkpoint", nargs="?", default=str(Path(__file__).resolve().parents[1]
                                                          / "tests/data/models/llama3_bnb4"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--log-dir", default="/tmp/tunix_lorax_logs")
    args = ap.parse_args(argv)
    graphdef, state, cfg = load(args.checkpoint)
    qtypes = sorted({w.qtype for w in jax.tree.leaves(state, is_leaf=_is_q) if _is_q(w)})
    kind = type(cfg).__module__.split(".")[2]
    print(f"tunix {kind}: {cfg.num_layers} layers, quantized: {qtypes or 'none'}")
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 16), 0, cfg.vocab_size)
    spec = lorax.simple_spec(state, targets=PROJECTIONS, rank=args.rank)
    spec = lorax.infer_layout(logits_fn(graphdef), state, spec, tokens)
    model = LoraModel(graphdef, lorax.init_lora(state, spec, jax.random.PRNGKey(1)), spec)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=1000, max_steps=args.steps,
        metrics_logging_options=metrics_logger.MetricsLoggerOptions(log_dir=args.log_dir))
    trainer = peft_trainer.PeftTrainer(model, optax.adam(1e-2), config)
    trainer = trainer.with_gen_model_input_fn(lambda x: model_inputs(x.input_tokens, x.input_mask))
    batch = peft_trainer.TrainingInput(input_tokens=tokens, input_mask=jnp.ones(tokens.shape, bool))
    trainer.train([batch] * args.steps)
    losses = [float(x) for x in trainer.metrics_logger.get_metric_history("", "loss", "train")]
    print("PeftTrainer losses:", " ".join(f"{x:.4f}" for x in losses))
    return losses


def _is_q(x: Any) -> bool:
    return isinstance(x, lorax.QuantizedArray)


if __name__ == "__main__":
    main()
