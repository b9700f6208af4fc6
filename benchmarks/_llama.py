"""The Llama every Llama benchmark trains: the main job's plain-JAX model
(`examples/shakespeare/llama.py`: per-layer remat under `lax.scan`, the chunked
cross-entropy over a tied embedding) at the shapes of `_batch.MODELS`, LoRA rank 16 on
q, k, v, o, gate, up, down, and its Adam step.

- compile-only runs: `build` (a method's parameters, abstract), `abstract_step` (the step
  and its abstract arguments, frozen weights and Adam's state in host memory if asked),
  `lowered_step` (lowered for `cuda`);
- card runs: `materialise` (random values made on the device, nothing dense first for a
  quantized weight) and `setup` (a cell's trainable and frozen halves and its loss;
  `hand`: LoRA written into the model by hand).

Methods: `full` (every weight trained), `lora` (dense frozen base), `qlora-<qtype>` (every
frozen matrix quantized: NF4 with double quantization as QLoRA's recipe, `bnb_nf4`
bitsandbytes' layout, `int8`, GGUF's K-quants), `qlora-<qtype>-bf16` (scales in the
model's dtype, compiled on a GPU with `DEQUANT_OPTIONS`: the products read the codes).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lorax
from lorax import _placement
from lorax._quant._formats import get_format

from ._batch import LORA_ALPHA, MODELS, RANK, vocab

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ALPHA = float(LORA_ALPHA)  # alpha / RANK = 1, as the PyTorch cells' PEFT adapters
DTYPE = jnp.bfloat16
LAYER_LOOPS = ("scan", "unrolled")  # stacked under `lax.scan`, or a list of layers unrolled
KQUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


def _load_llama() -> Any:
    # Loaded from its file as a module of the benchmarks' own: they swap its `block`
    # (hand-written LoRA, activations pinned to a mesh), which must not reach the
    # examples' `llama` module in the same process.
    spec = importlib.util.spec_from_file_location(
        "lorax_bench_llama", ROOT / "examples" / "shakespeare" / "llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LLAMA = _load_llama()


def config(name: str, attention: str = "auto", remat: str = "layer") -> Any:
    """The Llama config of `name`; `attention` and `remat` as `llama.Config` takes them
    (the default: cuDNN's fused attention on a GPU, query chunks elsewhere; per-layer
    remat)."""
    n, d, f, h, kv, _ = MODELS[name]
    return LLAMA.Config(n, d, f, h, kv, 5e5, 1e-5, vocab(name), attention=attention, remat=remat)


def abstract_params(cfg: Any, dtype: Any, layers: str = "scan") -> dict:
    if layers not in LAYER_LOOPS:
        raise ValueError(f"layers {layers!r}: expected one of {LAYER_LOOPS}")
    hd = cfg.dim // cfg.n_heads
    n, d = cfg.n_layers, cfg.dim
    shapes = dict(q=(d, cfg.n_heads * hd), k=(d, cfg.n_kv_heads * hd),
                  v=(d, cfg.n_kv_heads * hd), o=(cfg.n_heads * hd, d), gate=(d, cfg.hidden),
                  up=(d, cfg.hidden), down=(cfg.hidden, d), attn_norm=(d,), mlp_norm=(d,))
    sds = lambda *s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    stack = ([{k: sds(*s) for k, s in shapes.items()} for _ in range(n)] if layers == "unrolled"
             else {k: sds(n, *s) for k, s in shapes.items()})
    return {"embed": sds(cfg.vocab, d), "final_norm": sds(d), "layers": stack}


def map_layers(fn: Callable, layers: Any) -> Any:
    """`fn(layer_dict)` of a stacked layers dict, or of each of a list of them."""
    return [fn(layer) for layer in layers] if isinstance(layers, list) else fn(layers)


def spec_for(params: dict, method: str) -> dict:
    if method == "full":
        return jax.tree.map(lambda _: lorax.LORA_FULL, params)
    batch_ndim = 0 if isinstance(params["layers"], list) else 1
    layer = lambda names: {  # noqa: E731
        k: lorax.LoraSpec(RANK, alpha=ALPHA, batch_ndim=batch_ndim) if k in TARGETS
        else lorax.LORA_FREEZE for k in names}
    return {"embed": lorax.LORA_FREEZE, "final_norm": lorax.LORA_FREEZE,
            "layers": map_layers(layer, params["layers"])}


def build(cfg: Any, method: str, dtype: Any, layers: str = "scan") -> tuple[Any, dict]:
    """Abstract parameters for a method (`LoraWeight`s, `QuantizedArray`s), and its spec:
    `qlora-<qtype>` quantizes every frozen matrix by `lorax.quantize`'s rule (K-quants,
    which only GGUF files carry, as `QuantizedArray.from_gguf` holds them)."""
    params = abstract_params(cfg, dtype, layers)
    spec = spec_for(params, method)
    if method.startswith("qlora"):
        qtype = method.split("-")[1]
        # QLoRA's recipe: NF4 (lorax's or bitsandbytes' layout) with its absmax values
        # quantized too (double quantization), as Unsloth's `*-bnb-4bit` checkpoints are.
        quantize = _kquantize if qtype in KQUANTS else functools.partial(
            lorax.quantize, double_quant=get_format(qtype).double_quantizable,
            scale_dtype=dtype if method.endswith("-bf16") else None)
        params = jax.eval_shape(lambda p: quantize(p, spec, qtype, dtype=dtype), params)
    if method != "full":
        params = jax.eval_shape(
            lambda p: lorax.init_lora(p, spec, jax.random.PRNGKey(0), dtype=jnp.float32), params)
    return params, spec


def _kquantize(params: dict, spec: dict, qtype: str, dtype: Any) -> dict:
    """GGUF K-quant blocks of every frozen matrix, as a GGUF file stores them: a kernel's
    blocks along its input axis (`(layers, in, out)`), the embedding's along `dim`."""
    def one(w: Any, axis: int) -> Any:
        rows = w.shape[:-2] + (w.shape[-1],) if axis == -2 else w.shape[:-1]
        blocks = w.shape[axis] // 256
        half = jnp.zeros((*rows, blocks), jnp.float16)
        fmt = get_format(qtype)
        codes = jnp.zeros((*rows, blocks, fmt.code_bytes(256)), jnp.uint8)
        mins = half if fmt.has_mins else None
        return lorax.QuantizedArray(codes, half, mins, qtype=qtype, block_size=256, axis=axis,
                                    dense_dtype=dtype)
    layers = map_layers(lambda layer: {k: one(v, -2) if k in TARGETS else v
                                       for k, v in layer.items()}, params["layers"])
    return dict(params, embed=one(params["embed"], -1), layers=layers)


# XLA's fusion of a dequantization into the product reading it (`qlora-*-bf16` on a GPU):
# int8 or int4 codes times scales in the weight's dtype, the dot merger off so that a
# layer's k and v products are not joined over written weights (docs/qlora.md). int4 codes
# (`s4`) stay packed along the axis they are stored in: XLA would otherwise lay every
# stacked weight out again for the backward product, once per step, whole.
DEQUANT_OPTIONS = {"xla_gpu_experimental_enable_subchannel_dequantisation_fusion": True,
                   "xla_gpu_dot_merger_threshold_mb": 0,
                   "xla_gpu_experimental_pack_dot_operands_along_k_dimension": False}


def compiler_options(method: str) -> dict[str, Any] | None:
    """The compile options a method is measured with: `qlora-int8-bf16` and
    `qlora-s4-bf16` on a GPU, XLA's dequantization fusion; every other method, none."""
    fused = method.removesuffix("+host") in ("qlora-int8-bf16", "qlora-s4-bf16")
    return dict(DEQUANT_OPTIONS) if fused and jax.default_backend() == "gpu" else None


# -- the step ----------------------------------------------------------------------------------


def lora_loss(cfg: Any) -> Callable:
    """`loss(trainable, frozen, windows)` of the model under `lorax.lora`."""
    apply = lorax.lora(lambda p, w: LLAMA.loss(cfg, p, w), on_materialize="allow")
    return lambda t, f, w: apply(lorax.combine(t, f), w)


def adam_step(loss: Callable, optimizer: Any) -> Callable:
    """`step(trainable, frozen, opt_state, windows) -> (trainable, opt_state, loss)`: the
    gradient of `loss(trainable, frozen, windows)` and one optimizer update."""
    def step(trainable: Any, frozen: Any, opt_state: Any, windows: Any) -> tuple:
        value, grads = jax.value_and_grad(lambda t: loss(t, frozen, windows))(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value
    return step


def abstract_step(model: str, method: str = "qlora-nf4", offload: bool = True,
                  remat: str = "layer", layers: str = "scan", attention: str = "xla",
                  state_on_host: bool = False, batch: int = 1, seq: int | None = None,
                  **cfg_fields: Any) -> tuple[Callable, tuple]:
    """The bf16 Adam step of `model` and its abstract arguments (nothing allocated), its
    frozen half in host memory if `offload`, Adam's state too if `state_on_host`
    (`lorax.offload_state`), `batch` windows of `seq` tokens (the model's own length by
    default). `cfg_fields`: other `llama.Config` fields (`n_layers`, `mlp_chunk`, ...).
    (cuDNN's attention needs cuDNN, so JAX's CUDA plugin, to lower: `xla` by default.)"""
    cfg = config(model, attention, remat)._replace(**cfg_fields)
    trainable, frozen = lorax.partition(*build(cfg, method, DTYPE, layers))
    if offload:
        frozen = lorax.offload_frozen(frozen)
    optimizer = optax.adam(1e-4)
    state = jax.eval_shape(optimizer.init, trainable)
    if state_on_host:  # (`eval_shape` keeps no memory kind: the state's placed here)
        optimizer = lorax.offload_state(optimizer)
        state = jax.tree.map(lambda x: _placement._to_host(x, "pinned_host"), state)
    windows = jax.ShapeDtypeStruct((batch, (seq or MODELS[model][-1]) + 1), jnp.int32)
    return adam_step(lora_loss(cfg), optimizer), (trainable, frozen, state, windows)


def in_host(x: Any) -> bool:
    return getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host"


def sharding(x: Any) -> Any:
    return x.sharding if in_host(x) else jax.sharding.SingleDeviceSharding(jax.devices()[0])


def typed(x: Any) -> Any:
    """A host-placed abstract argument as the type a host array traces with (a
    `ShapeDtypeStruct` traces as device memory whatever its sharding says)."""
    if not in_host(x):
        return x
    return jax.core.ShapedArray(x.shape, x.dtype, memory_space=jax.memory.Space.Host)


def lowered_step(model: str, method: str, remat: str = "layer", layers: str = "scan",
                 attention: str = "cudnn", batch: int = 1, seq: int | None = None,
                 **cfg_fields: Any) -> str:
    """`abstract_step` for `model` and `method` (`+host`: the frozen half in host memory;
    `+state`: Adam's state too) lowered for `cuda`, the trainable parameters and optimizer
    state donated (as a card's cell donates them)."""
    base, *where = method.split("+")
    step, args = abstract_step(model, base, "host" in where, remat, layers, attention,
                               state_on_host="state" in where, batch=batch, seq=seq,
                               **cfg_fields)
    jitted = jax.jit(step, in_shardings=jax.tree.map(sharding, args), donate_argnums=(0, 2))
    return jitted.trace(*jax.tree.map(typed, args)).lower(
        lowering_platforms=("cuda",)).as_text()


# -- parameters on the device (a card's run) -----------------------------------------------------

HOST_BLOCK = 1 << 26  # bytes of fresh random codes per host leaf (`_host_fill`)
WEIGHT_STD = 0.02  # a dense weight's values (transformers' `initializer_range` for Llama)
SCALE = 1e-3  # a quantized weight's float scales before `quant_scale_for` sizes them


def _fill(sds: Any, key: Any, scale: float) -> Any:
    """Random values of `sds`'s kind: codes as random bits; `scale` (non-zero: a quantized
    weight's float leaves) `scale * (1 + U)`; else normal with `WEIGHT_STD`."""
    dt = jnp.dtype(sds.dtype)
    if dt == jnp.dtype(jnp.int4):  # 4-bit codes, one per element
        return jax.random.randint(key, sds.shape, -8, 8, jnp.int8).astype(dt)
    if jnp.issubdtype(dt, jnp.integer):  # codes: random bits
        bits = jax.random.bits(key, sds.shape, jnp.dtype(f"uint{dt.itemsize * 8}"))
        return jax.lax.bitcast_convert_type(bits, dt)
    if scale:  # a quantized weight's scales: small and positive
        return (scale * (1 + jax.random.uniform(key, sds.shape))).astype(dt)
    return (WEIGHT_STD * jax.random.normal(key, sds.shape)).astype(dt)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_fill(key: Any, shape: tuple, dtype: Any, scale: float) -> Any:
    # One program per leaf signature, not one for the whole tree: unrolled layers' hundreds
    # of leaves in one program took XLA:GPU over 5 minutes to compile (an H200, jax 0.11.2);
    # each layer's leaves share their signatures, so a model compiles a handful.
    return _fill(jax.ShapeDtypeStruct(shape, dtype), key, scale)


def _host_fill(sds: Any, seed: Any, scale: float) -> Any:
    """`_fill`'s kind of values made by NumPy, put in the device's host memory: a frozen
    stack is never whole on the device, not even while it is made."""
    rng, dt = np.random.default_rng(seed), jnp.dtype(sds.dtype)
    if dt == jnp.dtype(jnp.int4):  # (NumPy's int4 takes a byte each: one code per byte)
        n = int(np.prod(sds.shape))
        block = rng.integers(-8, 8, min(n, HOST_BLOCK), np.int8)
        x = _repeated(block, n).astype(dt).reshape(sds.shape)
    elif jnp.issubdtype(dt, jnp.integer):
        # One random block repeated: NumPy's generator made ~0.3 GB/s on the card's host, so
        # 70B's 33 GiB of codes drawn whole took 100 s of device time, and a code's value
        # does not change the step's speed.
        n = int(np.prod(sds.shape)) * dt.itemsize
        x = _repeated(np.frombuffer(rng.bytes(min(n, HOST_BLOCK)), np.uint8), n)
        x = x.view(dt).reshape(sds.shape)
    elif scale:
        x = (scale * (1 + rng.random(sds.shape, np.float32))).astype(dt)
    else:
        x = (WEIGHT_STD * rng.standard_normal(sds.shape, np.float32)).astype(dt)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    return jax.device_put(x, host)


def _repeated(block: np.ndarray, n: int) -> np.ndarray:
    """`np.resize(block, n)` at copy speed (a broadcast store, not concatenated copies)."""
    x, whole = np.empty(n, block.dtype), n - n % block.size
    x[:whole].reshape(-1, block.size)[:] = block
    x[whole:] = block[:n - whole]
    return x


def is_quantized(x: Any) -> bool:
    return isinstance(x, lorax.QuantizedArray)


def is_norm(path: Any) -> bool:
    """A norm's weight: the last dict key on its path ends with `norm` (`attn_norm`,
    `mlp_norm`, `final_norm`)."""
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return bool(names) and str(names[-1]).endswith("norm")


def materialise(abstract: Any, seed: int = 0, frozen_on_host: bool = False,
                quant_scale: float = SCALE) -> Any:
    """Random arrays of an abstract tree, each leaf made on the device by a jitted fill
    (`QuantizedArray` leaves as codes and scales, its float leaves `quant_scale * (1 + U)`);
    norm weights ones, as a model starts training. `frozen_on_host`: each `LoraWeight`'s
    `w` and each bare `QuantizedArray` made in host memory instead (where
    `lorax.offload_frozen` would have put it)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_quantized)
    key = jax.random.PRNGKey(seed)

    def values(i: int, path: Any, node: Any) -> Any:
        if is_norm(path):
            return jnp.ones(node.shape, node.dtype)
        host = frozen_on_host and (is_quantized(node)
                                   or any(getattr(k, "name", None) == "w" for k in path))
        scale = quant_scale if is_quantized(node) else 0.0
        leaves, tree = jax.tree.flatten(node)  # a QuantizedArray's codes and scales
        return jax.tree.unflatten(tree, [
            _host_fill(s, (seed, i, j), scale) if host else _device_fill(
                jax.random.fold_in(jax.random.fold_in(key, i), j), tuple(s.shape),
                jnp.dtype(s.dtype), scale)
            for j, s in enumerate(leaves)])

    out = [values(i, path, node) for i, (path, node) in enumerate(paths)]
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.cache
def quant_scale_for(method: str) -> float:
    """The float-scale size at which `method`'s random codes decode to weights of standard
    deviation `WEIGHT_STD` (as the dense methods' weights): measured on the tiny model's
    weights of the same format filled at `SCALE` (a format's decoding is linear in its
    float leaves, and the codes are random bits whatever the shape)."""
    params = materialise(build(config("tiny"), method.removesuffix("+host"), DTYPE)[0])
    stds = [float(jnp.std(q.dequantize().astype(jnp.float32)))
            for q in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(q)]
    return SCALE * WEIGHT_STD / float(np.mean(stds)) if stds else SCALE


def hand_block(cfg: Any, x: Any, layer: dict) -> Any:
    """`llama.block` with LoRA written into it by hand (factors cast to the activations'
    dtype, as lorax's rule casts them to the weight's)."""
    L = LLAMA
    b, t, _ = x.shape
    hd = cfg.dim // cfg.n_heads

    def lin(h: Any, name: str) -> Any:
        a, bb = layer[name + "_a"].astype(h.dtype), layer[name + "_b"].astype(h.dtype)
        return h @ layer[name] + (h @ a) @ bb

    h = L.rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    q = L.rope(lin(h, "q").reshape(b, t, cfg.n_heads, hd), cfg.rope_theta)
    k = L.rope(lin(h, "k").reshape(b, t, cfg.n_kv_heads, hd), cfg.rope_theta)
    v = lin(h, "v").reshape(b, t, cfg.n_kv_heads, hd)
    x = x + lin(L.attention(q, k, v, implementation=cfg.attention), "o")
    h = L.rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
    return x + lin(jax.nn.silu(lin(h, "gate")) * lin(h, "up"), "down")


def hand_factors(layer: dict, key: Any) -> dict:
    """LoRA factors for one layers dict (stacked or one layer's): `a` random, `b` zero."""
    factors = {}
    for i, name in enumerate(TARGETS):
        *lead, d_in, d_out = layer[name].shape
        factors[name + "_a"] = 0.01 * jax.random.normal(
            jax.random.fold_in(key, i), (*lead, d_in, RANK))
        factors[name + "_b"] = jnp.zeros((*lead, RANK, d_out), jnp.float32)
    return factors


def setup(cfg: Any, method: str, layers: str = "scan") -> tuple[Any, Any, Callable]:
    """(trainable, frozen, loss(trainable, frozen, windows)) of a card's cell, the arrays
    on the device (`+host`: the frozen weights in host memory)."""
    if method == "hand":
        dense = materialise(abstract_params(cfg, DTYPE, layers))
        keys = iter(jax.random.split(jax.random.PRNGKey(1), cfg.n_layers))
        factors = map_layers(lambda layer: hand_factors(layer, next(keys)), dense["layers"])
        LLAMA.block = hand_block  # (a cell's process runs that one cell)

        def hand_loss(t: Any, f: Any, w: Any) -> Any:
            fl, tl = f["layers"], t["layers"]
            merged = ([dict(a, **b) for a, b in zip(fl, tl)] if isinstance(fl, list)
                      else dict(fl, **tl))
            return LLAMA.loss(cfg, dict(f, layers=merged), w)
        return {"layers": factors}, dense, hand_loss
    abstract, spec = build(cfg, method.removesuffix("+host"), DTYPE, layers)
    params = materialise(abstract, frozen_on_host=method.endswith("+host"),
                         quant_scale=quant_scale_for(method) if "qlora" in method else SCALE)
    trainable, frozen = lorax.partition(params, spec)
    return trainable, frozen, lora_loss(cfg)
