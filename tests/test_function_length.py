"""The house keeps its functions short: none in `lorax/` over ~60 lines of code.

A function's length is its lines of code, its docstring, blank lines and comment-only
lines aside (a nested function counts in its parent too). A function that reads worse
split says why in a `# long: <reason>` comment on the line above it or in its header.

Run as a script to list the longest: `python tests/test_function_length.py [N]`.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 60


def _docstring_lines(node: ast.AST) -> range:
    body = getattr(node, "body", [])
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return range(body[0].lineno, body[0].end_lineno + 1)
    return range(0)


def code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of code of `node` (1-based `lines` of its file), docstring and comments aside."""
    doc = _docstring_lines(node)
    code = [lines[i - 1].strip() for i in range(node.lineno, node.end_lineno + 1) if i not in doc]
    return sum(1 for line in code if line and not line.startswith("#"))


def has_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A `# long:` comment on the line above the function (or its decorators) or in its
    header (the lines up to the first statement of its body)."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    header = range(first - 1, node.body[0].lineno)
    return any("# long:" in lines[i - 1] for i in header if i >= 1)


def functions(root: pathlib.Path = ROOT / "lorax") -> list[tuple[int, str, bool]]:
    """`(code lines, 'file:line name', has a # long: reason)` of every function under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"
                out.append((code_lines(lines, node), where, has_reason(lines, node)))
    return sorted(out, reverse=True)


def test_no_long_function_without_a_reason():
    long = [f"{where} ({n} lines)" for n, where, reason in functions() if n > LIMIT and not reason]
    assert not long, (f"functions over {LIMIT} lines of code (split them into named steps, or "
                      f"say why not with a '# long: <reason>' comment): {long}")


def test_the_count_sees_long_functions_and_reasons(tmp_path):
    """Negative control: a long function is counted as such (docstring, blanks and comments
    aside), and a reason comment is found."""
    body = "\n".join(f"    x{i} = {i}  # code" for i in range(LIMIT + 1))
    src = f'def f():\n    """Doc.\n\n    More doc.\n    """\n    # a comment\n\n{body}\n'
    (tmp_path / "m.py").write_text(src + "\n\n# long: a table\ndef g():\n" + body + "\n")
    found = {where.split()[-1]: (n, reason) for n, where, reason in functions(tmp_path)}
    assert found == {"f": (LIMIT + 2, False), "g": (LIMIT + 2, True)}


if __name__ == "__main__":
    for n, where, reason in functions()[: int(sys.argv[1]) if len(sys.argv) > 1 else 20]:
        print(f"{n:4d}  {where}{'  (# long: reason given)' if reason else ''}")
