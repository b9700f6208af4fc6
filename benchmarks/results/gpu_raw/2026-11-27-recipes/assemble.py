"""benchmarks/results/accelerator_recipes.{csv,md,png} from this folder's card outputs.

    python benchmarks/results/gpu_raw/2026-11-27-recipes/assemble.py

One H200, one lease, four commands in a row on the warm machine (10 minutes in all), each
cell in a process of its own with `XLA_PYTHON_CLIENT_PREALLOCATE=false`:

1. `bash scripts/card OUT 540` (`call1*`): `--cells pending` reached its first four cells
   (PyTorch + PEFT compiled without checkpointing at 1 and 4 x 2048, lorax LoRA remat
   `dots` scanned and unrolled at 1 x 2048) before its deadline, then the host-offload value
   check (`call1-check.txt`);
2. `python -m benchmarks.accelerator --no-probe --cells
   llama-3-8b:lora:4:none:auto:unrolled,llama-3-8b:lora:4:none:auto` (`call2*`);
3. the same with `llama-3-8b:lora:1:layer:auto@cublas,llama-3-8b:lora:1:layer:auto,
   llama-3-8b:lora:1:dots:auto@cublas` (`call3*`);
4. the same with `llama-3-8b:qlora-nf4:1:dots:auto:unrolled,llama-3-8b:qlora-nf4:1:dots:auto`
   (`call4*`; the second cell was past its deadline, not run).

The ratios are recomputed over all rows: those within one command are the 1 x 2048 lorax
rows against PEFT (command 1) and the `cublas` rows against remat `layer` (command 3); the
rest pair rows of two commands minutes apart on the same card.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
from benchmarks import _common as C  # noqa: E402
from benchmarks import accelerator as A  # noqa: E402

RUN = ("one H200, one lease, four commands in a row (gpu_raw/2026-11-27-recipes), "
       "each cell in a process of its own")


def main(out: Path = HERE.parents[1], name: str = "accelerator_recipes") -> None:
    rows = [r for i in (1, 2, 3, 4) for r in C.read_csv(HERE / f"call{i}.csv")
            if "step_s" in r and r["step_s"] != ""]
    rows = A.with_ratios([{k: v for k, v in r.items() if not k.startswith("vs_")} for r in rows])
    C.write_csv(out / f"{name}.csv", rows)
    A.write_tables(out, RUN, name)


if __name__ == "__main__":
    main()
