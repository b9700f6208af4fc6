"""The main job (examples/shakespeare/train.py) as a user runs it, for the tests."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_main_job(args: list[str], out: pathlib.Path) -> dict:
    """Run the main job with `args` in its own process, at XLA's default optimisation (it
    runs a real model, where the test session's -O0 kernels cost more than the faster
    compiles save); return its results.json."""
    cmd = [sys.executable, str(ROOT / "examples" / "shakespeare" / "train.py"), *args,
           "--out", str(out)]
    run = subprocess.run(cmd, env=xla_flags.env(optimize=True), capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "results.json").read_text())
