"""A Hugging Face Gemma 3 (text) checkpoint for `gemma3.py`: its own configuration and name
map where it differs from the Llama family's (`hf_loader` dispatches here on `model_type`).

What differs from the GGUF `gemma3_loader` reads: Hugging Face stores Gemma's RMSNorm
weights without the `1 +` that llama.cpp's converter adds, so it is added here (in float32,
as transformers computes `1 + w`); sliding-window and global layers come from the config's
`layer_types`, their RoPE bases from its `rope_parameters`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from . import gemma3, hf_names

MODEL_TYPES = ("gemma3_text", "gemma3")

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
    "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}
TOP_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm"}
NORMS = {"attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm",
         "final_norm"}


def _theta(hf: dict, kind: str, old: str, default: float, where: str) -> float:
    rp = (hf.get("rope_parameters") or {}).get(kind) or {}
    if rp.get("rope_type", "default") != "default":
        raise ValueError(f"{where}: rope type {rp['rope_type']!r} of the {kind} layers is not "
                         "implemented (gemma3.py has the default rule).")
    return float(rp.get("rope_theta", hf.get(old) or default))


def config(hf: dict, where: str) -> gemma3.Config:
    """`gemma3.Config` of a Hugging Face Gemma 3 text config."""
    n = int(hf["num_hidden_layers"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    if int(hf.get("query_pre_attn_scalar") or head_dim) != head_dim:
        raise ValueError(f"{where}: query_pre_attn_scalar {hf['query_pre_attn_scalar']} is not "
                         f"head_dim {head_dim}: gemma3.py scales queries by head_dim ** -0.5.")
    if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
        raise ValueError(f"{where}: logit soft-capping is not implemented in gemma3.py.")
    types = hf.get("layer_types") or ["full_attention"] * n
    if len(types) != n:
        raise ValueError(f"{where}: layer_types names {len(types)} layers, num_hidden_layers "
                         f"is {n}.")
    return gemma3.Config(
        n_layers=n, dim=int(hf["hidden_size"]), hidden=int(hf["intermediate_size"]),
        n_heads=int(hf["num_attention_heads"]), n_kv_heads=int(hf["num_key_value_heads"]),
        head_dim=head_dim,
        rope_theta=_theta(hf, "full_attention", "rope_theta", 1e6, where),
        rope_theta_local=_theta(hf, "sliding_attention", "rope_local_base_freq", 1e4, where),
        window=int(hf.get("sliding_window") or 0),
        sliding=tuple(t == "sliding_attention" for t in types),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), vocab=int(hf["vocab_size"]))


def _norm(x: Any) -> Any:
    return (jnp.asarray(x, jnp.float32) + 1.0).astype(x.dtype)


def params(tensors: dict[str, Any], cfg: gemma3.Config, where: str) -> dict:
    """gemma3.py's parameters from `lorax.load_safetensors(..., transpose=True)`'s tensors."""
    def convert(name: str, ours: str, x: Any) -> Any:
        x = x.T if ours == "embed" else x  # loaded transposed: the table is (vocab, dim)
        hf_names.checked(name, ours, x, shapes, where)
        return _norm(x) if ours in NORMS else x

    shapes = hf_names.expected(cfg.dim, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                               cfg.vocab)

    layers, out = hf_names.mapped(tensors, LAYER_NAMES, TOP_NAMES, cfg.n_layers, where, convert)
    for i, layer in enumerate(layers):
        missing = sorted(set(LAYER_NAMES.values()) - set(layer))
        if missing:
            raise ValueError(f"{where}: layer {i} has no {', '.join(missing)} (config.json says "
                             f"num_hidden_layers = {cfg.n_layers}).")
    if set(out) != {"embed", "final_norm"}:
        raise ValueError(f"{where}: the checkpoint has no model.embed_tokens.weight or "
                         "model.norm.weight.")
    return {**out, "layers": layers}


def hf_tensors(p: dict) -> dict[str, Any]:
    """gemma3.py's parameters under their Hugging Face names, kernels `(in, out)`, norms
    back to the `w` of `1 + w` (see `hf_loader.hf_tensors`)."""
    names = {v: k for k, v in LAYER_NAMES.items()}
    unnorm = lambda x: (jnp.asarray(x, jnp.float32) - 1.0).astype(x.dtype)  # noqa: E731
    out = {"model.embed_tokens.weight": p["embed"].T,
           "model.norm.weight": unnorm(p["final_norm"])}
    for i, layer in enumerate(p["layers"]):
        out.update({f"model.layers.{i}.{names[k]}": unnorm(v) if k in NORMS else v
                    for k, v in layer.items()})
    return out
