"""Static count of process launches reachable from each test make test selects.

Reads the collected ids (pytest --collect-only -q), parses each test module and the test helper
modules it imports, and walks the call graph by name from the test function (and the fixtures
it names) to the launch sites: local_torchrun (a torchrun of N ranks), run_distributed (N spawned
gloo ranks), run_cli (one CLI process, no torchrun). Call sites are counted once per path, so a
launch inside a loop counts once (a lower bound); session fixtures count once per session."""

import ast
import collections
import re
import sys
from pathlib import Path

ROOT = Path.cwd()
SINKS = {"local_torchrun": "torchrun", "run_distributed": "spawn", "run_cli": "cli"}


class Mod:
    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.funcs: dict[str, ast.AST] = {}
        self.imports: dict[str, tuple[str, str]] = {}
        self.fixture_scope: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.funcs.setdefault(node.name, node)
                for d in node.decorator_list:
                    src = ast.unparse(d)
                    if "fixture" in src:
                        m = re.search(r"scope=['\"](\w+)", src)
                        self.fixture_scope[node.name] = m.group(1) if m else "function"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests"):
                for a in node.names:
                    self.imports[a.asname or a.name] = (node.module, a.name)


MODS: dict[str, Mod] = {}


def mod(name: str) -> Mod | None:
    if name not in MODS:
        p = ROOT / (name.replace(".", "/") + ".py")
        if not p.exists():
            p = ROOT / name.replace(".", "/") / "__init__.py"
        MODS[name] = Mod(p) if p.exists() else None
    return MODS[name]


def calls(node: ast.AST) -> list[str]:
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name):
                out.append(f.id)
            elif isinstance(f, ast.Attribute):
                out.append(f.attr)
        # functions passed as arguments (run_distributed(_check, 2)) are called too
        if isinstance(n, ast.Call):
            out += [a.id for a in n.args if isinstance(a, ast.Name)]
    return out


def reach(modname: str, fname: str, seen: frozenset) -> collections.Counter:
    key = (modname, fname)
    if key in seen:
        return collections.Counter()
    m = mod(modname)
    if m is None:
        return collections.Counter()
    if fname in m.imports:
        return reach(*m.imports[fname], seen | {key})
    node = m.funcs.get(fname)
    if node is None:
        return collections.Counter()
    total = collections.Counter()
    for c in calls(node):
        if c in SINKS:
            total[SINKS[c]] += 1
        elif c in m.funcs or c in m.imports:
            total += reach(modname, c, seen | {key})
    return total


def fixtures_of(modname: str, fname: str) -> list[str]:
    m = mod(modname)
    node = m.funcs.get(fname) if m else None
    return [a.arg for a in node.args.args] if node else []


def find_fixture(modname: str, name: str):
    """(module, scope) defining fixture ``name`` for a test in ``modname``."""
    parts = modname.split(".")
    cands = [modname] + [".".join(parts[:i] + ["conftest"]) for i in range(len(parts) - 1, 0, -1)]
    for c in cands:
        m = mod(c)
        if m and name in m.fixture_scope:
            return c, m.fixture_scope[name]
        if m and c == modname and name in m.imports:
            src = mod(m.imports[name][0])
            if src and name in src.fixture_scope:
                return m.imports[name][0], src.fixture_scope[name]
    return None


def main(ids_file: str) -> None:
    per_test = collections.Counter()
    session = {}
    rows = []
    ids = [line.strip() for line in open(ids_file) if "::" in line]
    for tid in ids:
        path, *names = tid.split("::")
        modname = path.removesuffix(".py").replace("/", ".")
        fname = re.sub(r"\[.*$", "", names[-1])
        c = reach(modname, fname, frozenset())
        todo, seenfx = list(fixtures_of(modname, fname)), set()
        while todo:
            fx = todo.pop()
            if fx in seenfx:
                continue
            seenfx.add(fx)
            found = find_fixture(modname, fx)
            if not found:
                continue
            fmod, scope = found
            fc = reach(fmod, fx, frozenset())
            if scope in ("session", "module", "package"):
                k = (fmod if scope != "session" else "", fx, modname if scope == "module" else "")
                if fc and k not in session:
                    session[k] = fc
            else:
                c += fc
            todo += fixtures_of(fmod, fx)
        if c:
            rows.append((tid, dict(c)))
        per_test += c
    for tid, c in rows:
        print(f"{tid}\t{c}")
    print("# per test:", dict(per_test), "tests with a launch:", len(rows), "of", len(ids))
    shared = collections.Counter()
    for k, v in session.items():
        print("# shared fixture", k, dict(v))
        shared += v
    print("# shared fixtures (once each):", dict(shared))


if __name__ == "__main__":
    main(sys.argv[1])
