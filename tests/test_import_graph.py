"""A package's modules import each other without a circle, and import at the top.

Python tolerates a circle of module-level imports only in some orders, and a circle
closed by an import inside a function hides it until that function runs: either way
the function in the circle lives in the wrong module (the house rule is "no
function-level import to dodge a cycle"). So the graph here counts every `import` and
`from ... import` in a module's code, at module level and inside functions alike.
Examples in docstrings (`>>> import lorax`, fenced code) are strings, not imports.

An edge `a -> b` means module `a` imports module `b`: `from .c import name` names `c`,
`from . import c` names the submodule `c` (or the package's `__init__` when `c` is a
name defined there), and `import p.c` names `p.c`. Importing a submodule also runs its
package's `__init__`, but that edge is implied by any sibling import and is left out;
an explicit import of the package (`import lorax`, `from .. import name`) is an edge to
its `__init__`, which imports its submodules: a submodule doing so closes a circle.

An import inside a function is allowed only with a `# lazy: <reason>` comment on its
line (an optional or heavy dependency needed on one path only).

Run as a script to print a package's edges: `python tests/test_import_graph.py [lorax]`.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ["lorax", "benchmarks"]
LAZY = "# lazy:"


def module_names(package_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file for every module of the package at `package_dir`
    (a package is named by its `__init__.py`)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _importing_package(module: str, path: pathlib.Path) -> str:
    """The package a relative import in `module` is relative to."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: pathlib.Path,
             modules: dict[str, pathlib.Path]) -> list[str]:
    """The modules of the package that one import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    if node.level:
        base = _importing_package(module, path)
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    if source not in modules:
        return []
    subs = [f"{source}.{alias.name}" for alias in node.names]
    found = [sub for sub in subs if sub in modules]
    # Any name that is not a submodule comes from the package's (or module's) own code.
    return found + ([source] if len(found) < len(subs) else [])


def imports(package_dir: pathlib.Path) -> list[tuple[str, str, int, bool, bool]]:
    """`(importer, imported, line, inside a function, has a # lazy: reason)` for every
    import in the package at `package_dir` of one of its own modules, or of anything
    else when made inside a function (there, `imported` is the name as written)."""
    modules = module_names(package_dir)
    out = []
    for module, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        for node, in_function in _import_nodes(ast.parse(text)):
            lazy = LAZY in lines[node.lineno - 1]
            targets = _targets(node, module, path, modules)
            if in_function and not targets:
                targets = [_written(node)]
            out.extend((module, t, node.lineno, in_function, lazy) for t in targets)
    return out


def _written(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.Import):
        return ", ".join(alias.name for alias in node.names)
    return "." * node.level + (node.module or "")


def _import_nodes(tree: ast.AST, in_function: bool = False):
    """Every import statement under `tree`, and whether it sits inside a function."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                  ast.Lambda))
        yield from _import_nodes(child, inner)


def graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its code."""
    out: dict[str, set[str]] = {m: set() for m in module_names(package_dir)}
    for importer, imported, _, _, _ in imports(package_dir):
        if imported in out:
            out[importer].add(imported)
    return out


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of `edges` as `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_form_no_circle(package):
    cycle = find_cycle(graph(ROOT / package))
    assert cycle is None, (
        f"{package} imports in a circle: {' -> '.join(cycle)}. Move the function that "
        "closes it to the module of the value it works on (or a module both can import).")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_inside_a_function_without_a_reason(package):
    bad = [f"{importer} line {line}: {imported}"
           for importer, imported, line, in_function, lazy in imports(ROOT / package)
           if in_function and not lazy]
    assert not bad, (f"imports inside functions (move them to the top of the module, or "
                     f"say why they must wait with a '{LAZY} <reason>' comment): {bad}")


def test_the_graph_sees_function_level_and_package_imports(tmp_path):
    """Negative control: a circle closed inside a function, and one through the package's
    `__init__`, are both found; a docstring example is not an import."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\nVERSION = 1\n")
    (pkg / "a.py").write_text(
        '"""\n>>> import pkg.b\n"""\nfrom . import b\n\ndef f():\n    from .sub import c\n')
    (pkg / "b.py").write_text("import os\n\ndef g():\n    import json  # lazy: a reason\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("def h():\n    from .. import VERSION\n")
    assert graph(pkg) == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.sub.c"},
                          "pkg.b": set(), "pkg.sub": set(), "pkg.sub.c": {"pkg"}}
    assert find_cycle(graph(pkg)) == ["pkg", "pkg.a", "pkg.sub.c", "pkg"]
    inner = {(m, t, lazy) for m, t, _, in_fn, lazy in imports(pkg) if in_fn}
    assert inner == {("pkg.a", "pkg.sub.c", False), ("pkg.b", "json", True),
                     ("pkg.sub.c", "pkg", False)}
    (pkg / "sub" / "c.py").write_text("from pkg.b import g\n")
    assert find_cycle(graph(pkg)) is None


if __name__ == "__main__":
    for name in sys.argv[1:] or PACKAGES:
        for importer, targets in graph(ROOT / name).items():
            print(f"{importer} -> {', '.join(sorted(targets))}")
        print("cycle:", find_cycle(graph(ROOT / name)))
