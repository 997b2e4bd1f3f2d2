"""No function of the tuner is longer than 80 lines (issue 14: one house a newcomer can read).

A longer one is split where a name can say what the part does. The length is the function's
lines from ``def`` (or its first decorator) to its last line, docstring and nested functions
included.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 80


def _lengths() -> list[tuple[int, str]]:
    out = []
    for path in sorted((REPO / "optimizer").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                end = node.end_lineno or node.lineno
                where = f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
                out.append((end - first + 1, where))
    return out


def test_functions_fit_in_80_lines() -> None:
    too_long = sorted(((n, w) for n, w in _lengths() if n > MAX_LINES), reverse=True)
    assert not too_long, "split these where a name can say what the part does: " + "; ".join(
        f"{where} ({n} lines)" for n, where in too_long
    )


def test_the_check_sees_functions() -> None:
    assert len(_lengths()) > 100
