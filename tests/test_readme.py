"""The README's code runs as written, and the quickstart example does what it says."""

from __future__ import annotations

import pathlib
import re
import runpy
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_python_blocks_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


def test_quickstart_example_learns(monkeypatch):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        module = runpy.run_path(str(ROOT / "examples" / "quickstart.py"))
    finally:
        sys.path.remove(str(ROOT / "examples"))
    result = module["main"](["--dim", "64", "--layers", "2", "--steps", "30", "--batch", "16"])
    assert result["last_loss"] < 0.5 * result["first_loss"]
    assert result["merge_diff"] < 1e-4
    assert result["frozen_ok"] == 1.0
