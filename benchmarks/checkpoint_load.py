"""Quantizing a dense checkpoint as it is read: peak host memory of
`lorax.load_safetensors(dir, quantize="nf4")` on a synthetic sharded bf16 checkpoint.

    python -m benchmarks.checkpoint_load [--quick] [--out DIR] [--gib G]

The checkpoint is Llama-shaped (TinyLlama's hidden 2048, MLP 5632, vocabulary 32000, as many
layers as make `--gib` GiB; 2.2 GiB by default), random bf16 values, written as shards of at most
512 MiB with `model.safetensors.index.json`, as `save_pretrained` writes them. Each load
runs in a fresh Python process (its peak resident set, `ru_maxrss`, is the measurement):

- `quantize="nf4"` (and with double quantization): the seven projections of every
  layer quantized tensor by tensor, rows at a time, as they are read;
- read dense, then `lorax.quantize`: what loading whole first costs.

The bound the issue sets is the result's bytes (codes, scales and the tensors left dense)
plus two of the largest tensors plus the interpreter (the process's peak after importing
JAX and lorax and quantizing one small array, before the load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


import ml_dtypes
import numpy as np

from . import _common as C

# (hidden, MLP, vocabulary): TinyLlama-1.1B's; --quick's a small model of the same shape.
DIMS, QUICK_DIMS = (2048, 5632, 32000), (256, 704, 4000)
SHARD_BYTES = 512 << 20
MIB = 1 << 20


def layer_tensors(i: int, dims: tuple[int, int, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, m, _ = dims
    p = f"model.layers.{i}."
    return [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (h // 4, h)),
            (p + "self_attn.v_proj.weight", (h // 4, h)), (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (m, h)), (p + "mlp.up_proj.weight", (m, h)),
            (p + "mlp.down_proj.weight", (h, m)), (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,))]


def checkpoint_tensors(gib: float, dims: tuple[int, int, int]) -> list[tuple[str, tuple[int, ...]]]:
    h, _, vocab = dims
    ends = [("model.embed_tokens.weight", (vocab, h)), ("model.norm.weight", (h,)),
            ("lm_head.weight", (vocab, h))]
    per_layer = sum(2 * int(np.prod(s)) for _, s in layer_tensors(0, dims))
    fixed = sum(2 * int(np.prod(s)) for _, s in ends)
    n_layers = max(1, round((gib * (1 << 30) - fixed) / per_layer))
    return [ends[0], *(t for i in range(n_layers) for t in layer_tensors(i, dims)), *ends[1:]]


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng: Any) -> None:
    """A safetensors file written tensor by tensor (never the whole shard in memory)."""
    header, offset = {}, 0
    for name, shape in tensors:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape in tensors:
            x = rng.standard_normal(shape, np.float32) * 0.02
            f.write(x.astype(ml_dtypes.bfloat16).tobytes())


def write_checkpoint(directory: Path, gib: float, dims: tuple[int, int, int] = DIMS) -> dict[str, Any]:
    tensors = checkpoint_tensors(gib, dims)
    shards, current, size = [], [], 0
    for t in tensors:
        n = 2 * int(np.prod(t[1]))
        if current and size + n > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += n
    shards.append(current)
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(directory / file, shard, rng)
        weight_map.update({name: file for name, _ in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    sizes = [2 * int(np.prod(s)) for _, s in tensors]
    return {"bytes": sum(sizes), "largest": max(sizes), "tensors": len(tensors), "shards": len(shards)}


# Runs in a fresh process: prints the peak RSS after start-up, then after the load.
PROBE = r"""
import json, resource, sys, jax, jax.numpy as jnp, lorax
lorax.QuantizedArray.from_dense(jnp.ones((64, 64), jnp.bfloat16), "nf4")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
how, path = sys.argv[1], sys.argv[2]
if how == "dense-then-quantize":
    tensors, _ = lorax.load_safetensors(path)
    spec = {k: (lorax.LORA_FREEZE if v.ndim == 2 and "embed" not in k and "lm_head" not in k
                else lorax.LORA_FULL) for k, v in tensors.items()}
    tensors = lorax.quantize(tensors, spec, "nf4", min_size=0)
else:
    opts = {"double_quant": True} if how == "nf4-dq" else None
    tensors, _ = lorax.load_safetensors(path, quantize="nf4", quantize_options=opts)
jax.block_until_ready(tensors)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kept = sum(v.nbytes for v in tensors.values())
print(json.dumps({"base": base, "peak": peak, "kept": kept}))
"""

CASES = {"nf4": "`quantize=\"nf4\"` on load", "nf4-dq": "`quantize=\"nf4\"`, double_quant",
         "dense-then-quantize": "read dense, then `lorax.quantize`"}


def measure(how: str, path: Path) -> dict[str, int]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROBE, how, str(path)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def rows_for(info: dict[str, Any], results: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    rows = []
    for how, r in results.items():
        bound = r["kept"] + 2 * info["largest"] + r["base"]
        rows.append({"case": how, "checkpoint_mib": round(info["bytes"] / MIB, 1),
                     "largest_tensor_mib": round(info["largest"] / MIB, 1),
                     "result_mib": round(r["kept"] / MIB, 1),
                     "interpreter_mib": round(r["base"] / MIB, 1),
                     "peak_rss_mib": round(r["peak"] / MIB, 1),
                     "bound_mib": round(bound / MIB, 1),
                     "peak_over_bound": round(r["peak"] / bound, 3)})
    return rows


def markdown(rows: list[dict[str, Any]], info: dict[str, Any]) -> list[str]:
    return [f"A {info['bytes'] / (1 << 30):.2f} GiB bf16 checkpoint in {info['shards']} shards "
          f"({info['tensors']} tensors, the largest {info['largest'] / MIB:.0f} MiB). Peak "
          "resident memory of a fresh process; the bound is the result's bytes plus two of "
          "the largest tensors plus the interpreter.", "",
          C.md_table(["load", "result MiB", "interpreter MiB", "peak RSS MiB", "bound MiB",
                      "peak / bound"],
                     [[CASES[r["case"]], f"{r['result_mib']:,.0f}", f"{r['interpreter_mib']:,.0f}",
                       f"{r['peak_rss_mib']:,.0f}", f"{r['bound_mib']:,.0f}",
                       f"{r['peak_over_bound']:.2f}"] for r in rows])]


def main(argv: list[str] | None = None) -> None:
    parser = C.parser(__doc__, rounds=False)
    parser.add_argument("--gib", type=float, default=2.2, help="checkpoint size (GiB)")
    args = C.parse(parser, argv)
    gib, dims = (0.02, QUICK_DIMS) if args.quick else (args.gib, DIMS)
    with tempfile.TemporaryDirectory() as tmp:
        info = write_checkpoint(Path(tmp), gib, dims)
        # (--quick: one streamed load and the whole one, each a process of its own.)
        cases = ("nf4", "dense-then-quantize") if args.quick else CASES
        results = {how: measure(how, Path(tmp)) for how in cases}
    rows = rows_for(info, results)
    name = "checkpoint_load_quick" if args.quick else "checkpoint_load"
    C.write_results(args.out, name, rows, markdown(rows, info),
                    facts={"command": "python -m benchmarks.checkpoint_load"
                           + (" --quick" if args.quick else "")})


if __name__ == "__main__":
    main()
