"""No function of the package is longer than 80 lines (issue #47): a longer one is doing more
than one job, and the next feature would add a branch to it."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdp_rlhf

LIMIT = 80


def long_functions(root: Path, limit: int = LIMIT) -> list[tuple[int, str]]:
    """``(lines, "path:name")`` of every function in ``root``'s modules over ``limit`` lines
    (decorators excluded, docstring and body included)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((lines, f"{path.relative_to(root.parent)}:{node.name}"))
    return found


def test_no_function_is_over_80_lines():
    assert long_functions(Path(fsdp_rlhf.__file__).parent) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == [(LIMIT + 1, "pkg/m.py:f")]
