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


def _runnable_pages() -> list[str]:
    """Pages whose first ```python block starts with an import: complete examples, run
    block after block in one namespace. Other pages show fragments (`params = ...`
    of the reader's own model) and are not run."""
    pages = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        if blocks and re.match(r"(import|from) ", blocks[0]):
            pages.append(page.name)
    return pages


def test_the_runnable_pages_are_the_expected_ones():
    assert {"index.md", "distributed.md", "qlora.md"} <= set(_runnable_pages())


@pytest.mark.parametrize("page", _runnable_pages())
def test_docs_page_python_blocks_run(page):
    text = (ROOT / "docs" / page).read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        exec(compile(block, f"docs/{page}", "exec"), namespace)
