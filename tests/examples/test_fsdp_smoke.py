"""Smoke test of examples/fsdp.py: run as a script (it sets XLA_FLAGS itself), tiny settings."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fsdp_example_runs_and_shards_the_weights():
    # The script must set up its own simulated devices, not rely on the test session's.
    env = xla_flags.env(PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "fsdp.py"), "--layers", "1", "--dim", "64",
         "--rank", "4", "--batch", "8", "--seq", "8", "--steps", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout

    assert "mesh: 8 devices" in out
    w_dev, w_all = map(int, re.search(r"per-device W bytes: (\d+) of (\d+)", out).groups())
    assert w_dev * 8 == w_all
    f_dev, f_all = map(int, re.search(r"per-device factor bytes: (\d+) of (\d+)", out).groups())
    assert 0 < f_dev < f_all and f_all < w_all
    assert re.search(r"compiled memory per device: arguments \d+, outputs \d+, "
                     r"temporaries \d+, aliased \d+", out)

    losses = [float(v) for v in re.findall(r"^step +\d+ loss (\S+)$", out, flags=re.M)]
    assert len(losses) == 4
    assert losses[-1] < losses[0]
    assert "LoraMaterializationWarning" not in result.stderr
