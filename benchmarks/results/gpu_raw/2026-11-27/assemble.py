"""benchmarks/results/accelerator_host.{csv,md,png} and accelerator_qlora.* from this
folder's card outputs.

    python benchmarks/results/gpu_raw/2026-11-27/assemble.py

Rows: the 70B and 8B `+host` steps under the offload flags and the 70B on-device step
(lease B: `overlap.py`, `dev70.jsonl`), beside the `+host` steps with the flags of
`scripts/card` as it was (lease A: `host-pipelined.csv`, `host-plain.csv`) and lease A's 8B
on-device step. One H200 kind; two leases, an hour apart at most. `accelerator_qlora`: lease
A's second run of `scripts/card` as it printed it (QLoRA against LoRA, same remat).
"""
import csv
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
from benchmarks import _common as C  # noqa: E402
from benchmarks import accelerator as A  # noqa: E402


def _number(v):
    try:
        return float(v) if any(c in v for c in ".e") else int(v)
    except (TypeError, ValueError):
        return v


def row(r, cell, **extra):
    r = {k: _number(v) if isinstance(v, str) else v for k, v in r.items()
         if k not in ("flags", "cap", "t", "trace", "vs_device", "mfu")}
    return A.with_rates({**r, "cell": cell, "xla_flags": r.get("xla_flags") or "", **extra}, {})


def main(out=HERE.parents[1]):
    a1 = {r["cell"]: r for r in csv.DictReader(open(HERE / "host-pipelined.csv"))}
    a2 = {r["cell"]: r for r in csv.DictReader(open(HERE / "host-plain.csv"))}
    b = [json.loads(line) for line in open(HERE / "overlap.jsonl")]
    b70 = [json.loads(line.removeprefix("RESULT ")) for line in open(HERE / "dev70.jsonl")]
    h70, d70 = "llama-3-70b:qlora-nf4+host:1:layer:auto", "llama-3-70b:qlora-nf4:1:layer:auto"
    h8, d8 = "llama-3-8b:qlora-nf4+host:1:layer:auto", "llama-3-8b:qlora-nf4:1:layer:auto"
    rows = A.with_ratios([
        row(b[2], h70, mem_cap_gib=22.0), row(b70[0], d70), row(a1[h70], h70), row(a2[h70], h70),
        row(b[1], h8, mem_cap_gib=4.0), row(b[0], h8, mem_cap_gib=4.0), row(a1[d8], d8)])
    (out / "accelerator_host_traces.json").write_text(json.dumps({h8: b[0]["trace"]}, indent=1))
    C.write_csv(out / "accelerator_host.csv", rows)
    A.write_tables(out, "one H200 kind, two leases (gpu_raw/2026-11-27), each cell in a "
                   "process of its own", "accelerator_host")
    plain = [row(r, r["cell"], **({"mem_cap_gib": 22.0} if "+host" in r["cell"] else {}))
             for r in csv.DictReader(open(HERE / "host-plain.csv"))]
    C.write_csv(out / "accelerator_qlora.csv", A.with_ratios(plain))
    A.write_tables(out, "one H200, `bash scripts/card` (2026-11-27, its second run), cells in "
                   "processes of their own", "accelerator_qlora")


if __name__ == "__main__":
    main()
