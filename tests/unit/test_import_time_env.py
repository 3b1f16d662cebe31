"""No module of the package reads the environment while it is imported.

A process forked after the imports (the tests' warm launcher, fsdp_rlhf/testing/warm_launch.py)
gets its own environment afterwards; a value read at import would be the server's. It happened
once: FSDP_RLHF_KILL_AT was read at import, and the resume tests' kills never fired.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "fsdp_rlhf"


def _reads_env(node: ast.AST) -> bool:
    """Whether ``node`` reads the environment (setting a variable, ``os.environ[k] = v``, is
    not reading: a forked process keeps what the import set, as a fresh one would set it)."""
    stores = {
        id(sub.value)
        for sub in ast.walk(node)
        if isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store)
    }
    for sub in ast.walk(node):
        if id(sub) in stores:
            continue
        if isinstance(sub, ast.Attribute) and sub.attr in ("environ", "getenv", "environb"):
            if isinstance(sub.value, ast.Name) and sub.value.id == "os":
                return True
        if isinstance(sub, ast.Name) and sub.id in ("environ", "getenv"):
            return True
    return False


def _import_time_nodes(body: list[ast.stmt]):
    """Statements run while the module is imported: the module's and its classes' bodies,
    decorators and default values, not function bodies."""
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from stmt.decorator_list
            yield from stmt.args.defaults
            yield from (d for d in stmt.args.kw_defaults if d is not None)
        elif isinstance(stmt, ast.ClassDef):
            yield from stmt.decorator_list
            yield from stmt.bases
            yield from _import_time_nodes(stmt.body)
        elif isinstance(stmt, ast.If) and _is_main_guard(stmt):
            continue
        else:
            yield stmt


def _is_main_guard(stmt: ast.If) -> bool:
    test = stmt.test
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def offenders(source: str) -> list[str]:
    tree = ast.parse(source)
    readers = {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and _reads_env(f)
    }
    out = []
    for node in _import_time_nodes(tree.body):
        if _reads_env(node):
            out.append(f"line {node.lineno}: reads the environment")
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            name = call.func.id if isinstance(call.func, ast.Name) else None
            if name in readers:
                out.append(f"line {node.lineno}: calls {name}(), which reads the environment")
    return out


def test_the_checker_sees_both_ways_of_reading_at_import():
    assert offenders("import os\nX = os.environ.get('A')\n")
    assert offenders("import os\ndef f():\n    return os.getenv('A')\nX = f()\n")
    assert offenders("import os\nclass C:\n    X = os.environ['A']\n")
    assert not offenders("import os\ndef f():\n    return os.environ.get('A')\n")
    assert not offenders("import os\nif __name__ == '__main__':\n    os.environ['A']\n")
    assert not offenders("import os\nos.environ['A'] = '0'\n")


def test_no_module_reads_the_environment_at_import():
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        bad = offenders(path.read_text())
        if bad:
            found[str(path.relative_to(PKG.parent))] = bad
    assert not found, found
