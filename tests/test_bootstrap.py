"""scripts/bootstrap.sh refuses two accelerator extras at once, before it installs anything.

JAX's cuda12 and cuda13 plugins side by side (what `poetry install --all-extras` gives)
make `jax.devices()` segfault, even without a GPU, and poetry cannot declare extras
exclusive. The script's own argument check (`check_extras`) runs here alone, cut out of
the script, so no case can reach an install.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bootstrap.sh"


def _check_extras(*args: str) -> subprocess.CompletedProcess:
    """`check_extras args...` with the script's definitions, in a fresh bash."""
    text = SCRIPT.read_text()
    names = re.search(r"^ACCELERATOR_EXTRAS=.*$", text, re.M)
    function = re.search(r"^check_extras\(\) \{.*?^\}$", text, re.M | re.S)
    assert names and function, "check_extras or ACCELERATOR_EXTRAS not found in bootstrap.sh"
    program = f'set -euo pipefail\n{names.group()}\n{function.group()}\ncheck_extras "$@"\n'
    return subprocess.run(["bash", "-c", program, "bootstrap", *args],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("args", [
    ["-E", "cuda12", "-E", "cuda13"],
    ["--all-extras"],
    ["--with", "dev", "-E", "cuda12 cuda13"],
    ["--extras=tpu", "-Ecuda13"],
    ["--extras", "gguf", "--extras", "cuda13 tpu"],
])
def test_two_accelerator_extras_are_refused(args):
    res = _check_extras(*args)
    assert res.returncode != 0
    assert "refusing the accelerator extras" in res.stderr and "segfault" in res.stderr
    if "--all-extras" in args:
        assert "--all-extras" in res.stderr


@pytest.mark.parametrize("args", [
    [],
    ["--with", "dev,docs,examples"],
    ["-E", "cuda13"],
    ["-E", "cuda12", "-E", "gguf", "--extras=cuda12"],
    ["--extras", "gguf tpu", "--dry-run"],
])
def test_one_accelerator_extra_passes(args):
    res = _check_extras(*args)
    assert res.returncode == 0 and res.stderr == ""


def test_the_check_runs_before_any_install():
    """The script checks its arguments before installing poetry, and `poetry_install`
    (also called by those who source the script) checks its own."""
    text = SCRIPT.read_text()
    top = text.index('check_extras "$@" || exit')
    assert top < text.index("python3 -m venv") and top < text.index("poetry_install() {")
    body = text[text.index("poetry_install() {"):]
    assert body.index('check_extras "$@"') < body.index('"$POETRY" install')
