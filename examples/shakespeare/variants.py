"""The main job once per LoRA variant, and a table of what each did.

    python examples/shakespeare/variants.py [--steps 50] [--out DIR] [--only NAME,...]

Each variant is `train.py` with its flags (`--dora`, `--init pissa`, `--dropout 0.1`,
`--loraplus 16`, ...) on the job's default QLoRA base (the GGUF's Q4_1 kernels), same
data order, seed and step count, in its own process, without the dense-base rerun and
llama.cpp. Writes `variants.csv` and `variants_shakespeare.md` (held-out perplexity
before and after, training loss along the way, step time, XLA's estimate of one step)
to `benchmarks/results/`, where docs/variants.md includes them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = {
    "plain LoRA": [],
    "DoRA": ["--dora"],
    "init pissa": ["--init", "pissa"],
    "init olora": ["--init", "olora"],
    # LoftQ quantizes the dequantized Q4_1 kernels itself, in NF4 (in Q4_1 again they would
    # be exact: no error to correct); plain LoRA on the same NF4 base is its comparison.
    "init loftq (NF4 base)": ["--init", "loftq", "--base-qtype", "nf4"],
    "plain LoRA (NF4 base)": ["--base-qtype", "nf4"],
    "dropout 0.1": ["--dropout", "0.1"],
    "LoRA+ 16": ["--loraplus", "16"],
    "init gaussian": ["--init", "gaussian"],
    # PiSSA's factors hold the weight's top singular directions: Adam's steps of --lr
    # move them as fast as any factor, and the paper trains at a full fine-tuning rate.
    "init pissa at lr 5e-4": ["--init", "pissa", "--lr", "5e-4"],
    # The same lower rate for plain LoRA (PiSSA's fair comparison) and for LoRA+, whose
    # output side then runs at 8e-3.
    "plain LoRA at lr 5e-4": ["--lr", "5e-4"],
    "LoRA+ 16 at lr 5e-4": ["--loraplus", "16", "--lr", "5e-4"],
}


def main(argv: list[str] | None = None) -> pathlib.Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--work", default="shakespeare-variants", help="where each run writes")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of the names to run; the table keeps the "
                        "other variants' earlier runs found in --work")
    p.add_argument("--quick", action="store_true", help="train.py --quick for every variant")
    a = p.parse_args(argv)
    names = list(VARIANTS) if a.only is None else [n.strip() for n in a.only.split(",")]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"--only: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    out, work = pathlib.Path(a.out), pathlib.Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in VARIANTS:
        run_dir = work / name.replace(",", "").replace(" ", "-").replace("+", "plus")
        t0 = time.perf_counter()
        if name in names:
            cmd = [sys.executable, str(ROOT / "examples" / "shakespeare" / "train.py"),
                   *VARIANTS[name], "--steps", str(a.steps), "--no-compare-dense",
                   "--no-llamacpp", "--sample-tokens", "0", "--out", str(run_dir),
                   *(["--quick"] if a.quick else [])]
            print(f"\n=== {name}: {' '.join(cmd[2:])}", flush=True)
            subprocess.run(cmd, check=True)
        elif (run_dir / "results.json").exists():  # --only: the others' earlier runs in --work
            print(f"\n=== {name}: earlier run in {run_dir}", flush=True)
        else:
            continue
        r = json.loads((run_dir / "results.json").read_text())
        losses = r["losses"]
        at = lambda i: sum(losses[max(0, i - 5):i]) / len(losses[max(0, i - 5):i])  # noqa: E731
        rows.append(dict(
            variant=name, flags=" ".join(VARIANTS[name]), steps=len(losses),
            ppl_before=r["ppl_before"], ppl_after=r["ppl_after"],
            loss_steps_1_5=at(min(5, len(losses))), loss_last_5=at(len(losses)),
            trainable=r["trainable_params"], step_s=r["step_time_s"],
            xla_mib=r["xla_bytes_lora"] / 2**20, base=r["base"],
            wall_s=time.perf_counter() - t0 if name in names else float("nan")))
    csv = out / "variants_shakespeare.csv"
    keys = list(rows[0])
    csv.write_text(",".join(keys) + "\n" + "\n".join(
        ",".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys)
        for row in rows) + "\n")
    base = next((r for r in rows if r["variant"] == "plain LoRA"), rows[0])
    md = ["| variant | flags | held-out ppl before | after | vs plain | train loss, steps 1-5 "
          "| last 5 | trainable | step s | step / plain | XLA MiB |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(
            f"| {r['variant']} | `{r['flags'] or '(none)'}` | {r['ppl_before']:.2f} | "
            f"{r['ppl_after']:.2f} | {r['ppl_after'] - base['ppl_after']:+.2f} | "
            f"{r['loss_steps_1_5']:.3f} | {r['loss_last_5']:.3f} | {r['trainable']:,} | "
            f"{r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f} | {r['xla_mib']:.0f} |")
    note = (f"SmolLM2-135M-Instruct on its Q4_1 GGUF base, rank 8, alpha 16, every projection, "
            f"{rows[0]['steps']} AdamW steps of 4 x 128 tokens, lr 4e-3 (warm-up + cosine); "
            "held-out perplexity on 32 windows of Hamlet and The Tempest. "
            "`python examples/shakespeare/variants.py` (one process per variant).")
    (out / "variants_shakespeare.md").write_text(note + "\n\n" + "\n".join(md) + "\n")
    print("\n".join(md))
    return out


if __name__ == "__main__":
    main()
