"""A PEFT adapter for a torch Gemma, on Gemma's own JAX parameter layout, against real PEFT.

Runs in the optional env `.tools/peft` (`bash scripts/test-peft`); skips elsewhere.

The JAX side keeps the parameters as the gemma library (and KerasHub) do: `q_einsum`
`(heads, embed, head_dim)`, `kv_einsum` `(2, kv_heads, embed, head_dim)`,
`attn_vec_einsum` `(heads, head_dim, embed)`, `gating_einsum` `(2, embed, hidden)` (gate
and up, picked as `w[0]`, `w[1]`) and `linear` `(hidden, embed)`. PEFT's `q_proj` LoRA
on torch's `(heads * head_dim, embed)` weight is `b: (embed, k)`, `a: (k, heads, head_dim)`
on the JAX kernel: `M` (embed) sits between the two `N` axes, which `lorax.infer_layout`
finds by itself (`m_axes=(1,)`); k/v and gate/up get per-slice factors, as PEFT's
separate modules have.

- import: PEFT's adapter (random A and B on all seven projections) -> `lorax.load_peft`
  onto the JAX parameters: lorax's logits equal `PeftModel`'s;
- export: a lorax adapter with non-zero factors -> `lorax.save_peft` ->
  `PeftModel.from_pretrained` gives lorax's logits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers import GemmaConfig, GemmaForCausalLM  # noqa: E402

import lorax  # noqa: E402

TOL = 1e-4  # max |logit difference| between torch and JAX for the same f32 model
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
              attn_implementation="eager")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_NAME = "lorax-tests/tiny-gemma"


def torch_gemma() -> GemmaForCausalLM:
    torch.manual_seed(0)
    model = GemmaForCausalLM(GemmaConfig(**CONFIG)).eval()
    with torch.no_grad():  # norms start at 0 (scale 1 + w): move them so they matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    return model


def gemma_params(model: GemmaForCausalLM) -> dict:
    """torch's weights in the gemma library's layouts."""
    n, kv, h = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    d = CONFIG["hidden_size"]
    t = {k: v.detach().numpy() for k, v in model.state_dict().items()}

    def heads(w: np.ndarray, count: int) -> np.ndarray:  # (count*h, d) -> (count, d, h)
        return w.reshape(count, h, d).transpose(0, 2, 1)

    layers = []
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers.append({
            "pre_attention_norm": t[p + "input_layernorm.weight"],
            "q_einsum": heads(t[p + "self_attn.q_proj.weight"], n),
            "kv_einsum": np.stack([heads(t[p + "self_attn.k_proj.weight"], kv),
                                   heads(t[p + "self_attn.v_proj.weight"], kv)]),
            "attn_vec_einsum": t[p + "self_attn.o_proj.weight"].reshape(d, n, h).transpose(1, 2, 0),
            "pre_ffw_norm": t[p + "post_attention_layernorm.weight"],
            "gating_einsum": np.stack([t[p + "mlp.gate_proj.weight"].T, t[p + "mlp.up_proj.weight"].T]),
            "linear": t[p + "mlp.down_proj.weight"].T,
        })
    params = {"embedder": t["model.embed_tokens.weight"], "layers": layers,
              "final_norm": t["model.norm.weight"]}
    return jax.tree.map(jnp.asarray, params)


def _rms(x, w):
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + CONFIG["rms_norm_eps"]) * (1.0 + w)


def _rope(x, positions):
    h = x.shape[-1]
    inv = 1.0 / (CONFIG["rope_theta"] ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    freqs = positions[:, None].astype(jnp.float32) * inv[None]
    cos, sin = (jnp.concatenate([f(freqs)] * 2, -1)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin


def gemma_forward(params, ids):
    """Gemma 1 in plain JAX on the gemma library's parameter layouts (no model code
    of lorax's: the kernels are used as the library uses them)."""
    n, kv, h = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    x = params["embedder"][ids] * jnp.asarray(math.sqrt(CONFIG["hidden_size"]), jnp.float32)
    positions = jnp.arange(ids.shape[1])
    causal = jnp.tril(jnp.ones((ids.shape[1], ids.shape[1]), bool))
    for p in params["layers"]:
        y = _rms(x, p["pre_attention_norm"])
        q = _rope(jnp.einsum("btd,ndh->btnh", y, p["q_einsum"]), positions) * h ** -0.5
        k = _rope(jnp.einsum("btd,kdh->btkh", y, p["kv_einsum"][0]), positions)
        v = jnp.einsum("btd,kdh->btkh", y, p["kv_einsum"][1])
        k, v = (jnp.repeat(z, n // kv, axis=2) for z in (k, v))
        scores = jnp.where(causal[None, None], jnp.einsum("btnh,bsnh->bnts", q, k), -jnp.inf)
        o = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("btnh,nhd->btd", o, p["attn_vec_einsum"])
        y = _rms(x, p["pre_ffw_norm"])
        gate = jax.nn.gelu(jnp.dot(y, p["gating_einsum"][0]), approximate=True)
        x = x + jnp.dot(gate * jnp.dot(y, p["gating_einsum"][1]), p["linear"])
    return _rms(x, params["final_norm"]) @ params["embedder"].T


def module_name(path: str, layer):
    """lorax key paths -> torch module names; k/v and gate/up are slices of one array."""
    parts = path.split("/")
    if len(parts) != 3:  # embedder, norms: not adapted
        return path.replace("/", ".")
    _, i, leaf = parts
    base = f"model.layers.{i}."
    names = {"q_einsum": "self_attn.q_proj", "attn_vec_einsum": "self_attn.o_proj",
             "linear": "mlp.down_proj"}
    if leaf in names:
        return base + names[leaf]
    pair = {"kv_einsum": ("self_attn.k_proj", "self_attn.v_proj"),
            "gating_einsum": ("mlp.gate_proj", "mlp.up_proj")}[leaf]
    return base + (pair[layer] if layer is not None else f"{leaf}.stacked")


def _lora_tree(params, ids, rank=4):
    targets = r"q_einsum|kv_einsum|attn_vec_einsum|gating_einsum|linear"
    spec = lorax.simple_spec(params, targets=targets, rank=rank)
    spec = lorax.infer_layout(gemma_forward, params, spec, ids)
    return lorax.init_lora(params, spec, jax.random.PRNGKey(0)), spec


def _torch_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.array(ids))).logits.numpy()


@pytest.fixture(scope="module")
def setup():
    model = torch_gemma()
    params = gemma_params(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 12)))
    base = _torch_logits(model, ids)
    got = np.asarray(jax.jit(gemma_forward)(params, ids))
    assert np.abs(got - base).max() <= TOL, "the JAX Gemma must match torch's before any LoRA"
    return model, params, ids, base


def test_infer_layout_gives_pefts_factorisation(setup):
    _, params, ids, _ = setup
    lp, spec = _lora_tree(params, ids)
    q = lp["layers"][0]["q_einsum"]
    assert q.b.shape == (CONFIG["hidden_size"], 4)
    assert q.a.shape == (4, CONFIG["num_attention_heads"], CONFIG["head_dim"])
    assert spec["layers"][0]["kv_einsum"].batch_ndim == 1
    assert spec["layers"][0]["gating_einsum"].batch_ndim == 1


def test_peft_made_adapter_loads_onto_gemma_layouts(setup, tmp_path):
    model, params, ids, base = setup
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    pm = peft.get_peft_model(torch_gemma(), config)
    pm.save_pretrained(tmp_path)
    want = _torch_logits(pm.eval(), ids)
    assert np.abs(want - base).max() > 1000 * TOL  # the adapter moves the logits

    lp, _ = _lora_tree(params, ids)
    loaded, loaded_spec = lorax.load_peft(tmp_path, lp, module_name=module_name, layout="in_out")
    assert loaded_spec["layers"][0]["q_einsum"].m_axes == (1,)
    got = np.asarray(jax.jit(lorax.lora(gemma_forward, on_materialize="error"))(loaded, ids))
    diff = float(np.abs(got - want).max())
    print(f"\nPEFT-made Gemma adapter -> lorax.load_peft on gemma layouts: max |logit diff| {diff:.2e}")
    assert diff <= TOL


def test_lorax_adapter_loads_into_peft(setup, tmp_path):
    model, params, ids, base = setup
    lp, _ = _lora_tree(params, ids)
    rng = np.random.default_rng(2)
    lp = jax.tree.map(
        lambda l: lorax.LoraWeight(l.w, l.a * 20.0, jnp.asarray(
            0.05 * rng.standard_normal(l.b.shape), jnp.float32), alpha=l.alpha, m_axes=l.m_axes)
        if isinstance(l, lorax.LoraWeight) else l, lp, is_leaf=lambda l: isinstance(l, lorax.LoraWeight))
    want = np.asarray(jax.jit(lorax.lora(gemma_forward, on_materialize="error"))(lp, ids))
    assert np.abs(want - base).max() > 1000 * TOL
    lorax.save_peft(tmp_path, lp, base_model_name_or_path=BASE_NAME, module_name=module_name,
                    layout="in_out")
    pm = peft.PeftModel.from_pretrained(torch_gemma(), tmp_path).eval()
    got = _torch_logits(pm, ids)
    diff = float(np.abs(got - want).max())
    print(f"\nlorax Gemma adapter -> PeftModel: max |logit diff| {diff:.2e}")
    assert diff <= TOL
