"""Two real processes on one machine: examples/fsdp.py on a global 8-device mesh (4 CPU
devices each, collectives through gloo, coordinator on 127.0.0.1), each feeding its own
slice of the batch, then `save_adapter` and `save_peft` from both.

The per-step losses equal the single-process 8-device run's, and the files process 0
writes are byte-identical to the single-process run's. Every child is started in its
own process group, bounded in time, and killed with its group whatever happens.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp.py"
ARGS = ["--layers", "1", "--dim", "64", "--rank", "4", "--batch", "8", "--seq", "8",
        "--steps", "3"]
TIMEOUT = 300


def _env() -> dict:
    # The example sets its own device count.
    return xla_flags.env(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cmds: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run the commands at once; wait for all (bounded); reap every group, always."""
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for c in cmds]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step +\d+ loss (\S+)$", out, flags=re.M)]


def _files(d: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (d / "adapter.safetensors",
                                             d / "peft" / "adapter_model.safetensors")}


# The QLoRA case is the default path's representative (~20 s per run); the dense one is slow.
@pytest.mark.parametrize("qtype", [pytest.param(None, marks=pytest.mark.slow), "nf4"])
def test_two_processes_train_and_save_like_one(tmp_path, qtype):
    """A dense base, and a quantized one (FSDP-QLoRA: codes sharded like W)."""
    base = [sys.executable, str(EXAMPLE), *ARGS, *(["--qtype", qtype] if qtype else [])]

    def distributed(out, n):
        port = _free_port()
        return _launch([[*base, "--out", str(tmp_path / out), "--processes", str(n),
                         "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}"]
                        for i in range(n)])

    plain = _launch([[*base, "--out", str(tmp_path / "plain")]])[0]
    # The same single process through gloo: the collectives' summation order is then
    # the two processes' too, which bit-identical files need (the plain run's in-process
    # all-reduce sums in another order: the same losses to ~1e-7, other last bits).
    one = distributed("one", 1)[0]
    two = distributed("two", 2)
    for run in (plain, one, *two):
        assert run.returncode == 0, run.stderr[-3000:]
        assert "mesh: 8 devices" in run.stdout
    assert len(_losses(plain.stdout)) == 3
    for run in (one, *two):
        np.testing.assert_allclose(_losses(run.stdout), _losses(plain.stdout), rtol=1e-5)
    assert "by process 0" in two[0].stdout and "by process 1" in two[1].stdout
    assert _files(tmp_path / "two") == _files(tmp_path / "one")


from kill_during_save import KILLER  # noqa: E402


# ~35 s: slow; a kill during a save is in the default path with one process
# (tests/examples/test_checkpointing.py).
@pytest.mark.slow
def test_two_processes_killed_during_a_save_resume_to_the_same_adapter(tmp_path):
    """Both processes die while checkpoint 4 is being written (after its files, before
    orbax commits it); run again, they resume from checkpoint 2 and write the adapter an
    uninterrupted two-process run writes, byte for byte."""
    args = [*ARGS[:-2], "--steps", "6", "--checkpoint-every", "2"]

    def run(out, kill=None):
        port = _free_port()
        cmds = []
        for i in range(2):
            cmd = [str(EXAMPLE), *args, "--out", str(tmp_path / out), "--processes", "2",
                   "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}",
                   "--checkpoint-dir", str(tmp_path / out / "ckpt")]
            cmds.append([sys.executable, *(["-c", KILLER, *kill] if kill else []), *cmd])
        return _launch(cmds)

    straight = run("straight")
    assert all(r.returncode == 0 for r in straight), straight[0].stderr[-3000:]
    killed = run("killed", kill=("during", "4"))
    assert [r.returncode for r in killed] == [-signal.SIGKILL] * 2, killed[0].stderr[-3000:]
    resumed = run("killed")
    assert all(r.returncode == 0 for r in resumed), resumed[0].stderr[-3000:]
    assert all("resumed from step 2" in r.stdout for r in resumed), resumed[0].stdout
    assert _files(tmp_path / "killed") == _files(tmp_path / "straight")
