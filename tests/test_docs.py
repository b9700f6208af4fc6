"""The docs site builds with --strict, documents every public name, and its examples run."""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import lorax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_public_name_is_in_the_api_reference():
    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: lorax\.(\w+)", api, flags=re.M))
    assert documented == set(lorax.__all__)


@pytest.mark.parametrize("name", sorted(lorax.__all__))
def test_public_docstring_examples_run(name):
    obj = getattr(lorax, name)
    if not callable(obj):
        return
    doc = inspect.getdoc(obj) or ""
    assert "Arguments" in doc or inspect.isclass(obj), f"{name} has no Arguments section"
    for block in re.findall(r"```python\n(.*?)```", doc, flags=re.S):
        exec(compile(inspect.cleandoc(block), f"<{name} docstring>", "exec"), {})


@pytest.mark.docs
def test_docs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "index.html").exists()
