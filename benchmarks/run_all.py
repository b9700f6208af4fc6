"""Run the benchmarks (memory, trace time, dispatch, speed, blocks, qlora, variants, moe, adapters, scale, offload, layers, quant_error, checkpoint_load); results under `benchmarks/results/`.

    python -m benchmarks                      # everything, default sizes (~20 min on 2 cores + blocks)
    python -m benchmarks --quick              # smoke run of every benchmark
    python -m benchmarks --out DIR --only memory,trace_time,dispatch

`--quick` and `--out` are passed to every benchmark. The speed benchmarks (speed, then
the transformer blocks) are run last: memory and trace time do not depend on machine load
(trace time a little), speed does, so check `cat /proc/loadavg` before a run you mean to
report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import scale  # (first: it asks for 8 simulated devices before JAX is imported)
from . import _common as C
from . import (adapters, blocks, checkpoint_load, dispatch, layers, memory, moe,
               offload, qlora, quant_error, speed, trace_time, variants)

BENCHMARKS = {"memory": memory, "trace_time": trace_time, "dispatch": dispatch, "speed": speed,
              "blocks": blocks, "qlora": qlora, "variants": variants, "moe": moe,
              "adapters": adapters, "scale": scale, "offload": offload, "layers": layers,
              "quant_error": quant_error, "checkpoint_load": checkpoint_load}


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run of every benchmark")
    p.add_argument("--out", default=None, help="output directory (default benchmarks/results)")
    p.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset")
    a = p.parse_args(argv)
    out = C.out_dir(a.out)
    common = (["--quick"] if a.quick else []) + ["--out", str(out)]
    for name in (n for n in BENCHMARKS if n in a.only.split(",")):
        print(f"== {name}", flush=True)
        BENCHMARKS[name].main(common)
    return out


if __name__ == "__main__":
    main()
