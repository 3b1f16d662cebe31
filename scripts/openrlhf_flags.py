"""Extract the flags an OpenRLHF argument parser defines, as data (names, types, defaults).

    python -m scripts.openrlhf_flags --git-dir OPENRLHF.git --tag v0.11.0 \
        --out fsdp_rlhf/compat/data
    pip download openrlhf==0.11.2 --no-deps -d /tmp/orl
    python -m scripts.openrlhf_flags --wheel /tmp/orl/openrlhf-0.11.2-*.whl \
        --out fsdp_rlhf/compat/data

    python -m scripts.openrlhf_flags --git-dir OPENRLHF.git --tag v0.9.5 --parsers kd \
        --out fsdp_rlhf/compat/data

reads ``openrlhf/cli/train_{ppo_ray,rm,sft,dpo}.py`` at that tag (``--parsers kd``: the
offline knowledge distillation's ``train_kd.py``, in releases 0.2.5 to 0.9.5 and on a branch;
or in that PyPI wheel: releases after 0.11.0 have no tag in the mirrors we read) without
running them (their imports need Ray and DeepSpeed): the ``parser.add_argument(...)`` calls of
the ``__main__`` block are read from the syntax tree, ``for prefix in (...)`` loops unrolled.
What is written is
facts about their interface (names, types, defaults, choices), one JSON file per parser, so that
``tests/unit/test_compat.py`` can walk every flag. Their code is not copied.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import zipfile
from pathlib import Path

PARSERS = {
    "ppo": "openrlhf/cli/train_ppo_ray.py",
    "rm": "openrlhf/cli/train_rm.py",
    "sft": "openrlhf/cli/train_sft.py",
    "dpo": "openrlhf/cli/train_dpo.py",
}
# parsers OpenRLHF has removed (train_kd.py after 0.9.5): extracted when asked for by name
REMOVED_PARSERS = {"kd": "openrlhf/cli/train_kd.py"}


def _value(node: ast.AST, env: dict[str, object]) -> object:
    """A literal, a loop variable, an f-string over loop variables, or the source text."""
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                parts.append(str(_value(v.value, env)))
        return "".join(parts)
    if isinstance(node, ast.IfExp):
        test = _value(node.test, env)
        if isinstance(test, bool):
            return _value(node.body if test else node.orelse, env)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
        left, right = _value(node.left, env), _value(node.comparators[0], env)
        if not isinstance(left, _Source) and not isinstance(right, _Source):
            return left == right
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _Source(ast.unparse(node))


class _Source(str):
    """An expression kept as source text (``float("inf")``, a timestamp)."""


def _flag(call: ast.Call, env: dict[str, object]) -> dict[str, object]:
    names = [_value(a, env) for a in call.args]
    kw = {k.arg: _value(k.value, env) for k in call.keywords if k.arg}
    out: dict[str, object] = {"names": names}
    action = kw.get("action")
    tp = call_type = next((k.value for k in call.keywords if k.arg == "type"), None)
    if action in ("store_true", "store_false"):
        out["type"] = "bool"
    elif tp is not None:
        out["type"] = ast.unparse(call_type)
    else:
        out["type"] = "str"
    for key in ("action", "nargs", "choices", "dest"):
        if key in kw:
            out[key] = kw[key]
    if "default" in kw:
        d = kw["default"]
        out["default"] = {"expr": str(d)} if isinstance(d, _Source) else d
    elif action == "store_true":
        out["default"] = False
    else:
        out["default"] = None
    if isinstance(kw.get("help"), str):
        out["help"] = kw["help"]
    return out


def _walk(body: list[ast.stmt], env: dict[str, object], out: list[dict]) -> None:
    for stmt in body:
        if isinstance(stmt, ast.For) and isinstance(stmt.target, ast.Name):
            for item in ast.literal_eval(stmt.iter):
                _walk(stmt.body, {**env, stmt.target.id: item}, out)
            continue
        if isinstance(stmt, ast.If):
            _walk(stmt.body, env, out)
            continue
        for node in ast.walk(stmt):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                out.append(_flag(node, env))


def extract(source: str) -> list[dict]:
    tree = ast.parse(source)
    main = next(s for s in tree.body if isinstance(s, ast.If) and "__main__" in ast.unparse(s.test))
    flags: list[dict] = []
    # stop at parse_args(): validation code after it is not the interface
    body = []
    for stmt in main.body:
        if "parse_args" in ast.unparse(stmt):
            break
        body.append(stmt)
    _walk(body, {}, flags)
    return flags


def _from_git(git_dir: str, tag: str, parsers: dict[str, str]) -> tuple[str, dict[str, str]]:
    sources = {}
    for command, path in parsers.items():
        sources[command] = subprocess.run(
            ["git", "--git-dir", git_dir, "show", f"{tag}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return tag, sources


def _from_wheel(wheel: str) -> tuple[str, dict[str, str]]:
    """A wheel keeps the package under ``openrlhf-X.data/purelib/`` or at its root."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        version = next(
            line.split(":", 1)[1].strip()
            for line in zf.read(meta).decode().splitlines()
            if line.startswith("Version:")
        )
        sources = {}
        for command, path in PARSERS.items():
            member = next(n for n in names if n == path or n.endswith("/" + path))
            sources[command] = zf.read(member).decode()
    return version, sources


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--git-dir")
    ap.add_argument("--tag")
    ap.add_argument("--wheel", help="an openrlhf wheel from PyPI instead of a git tag")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parsers", nargs="*", help="with --git-dir: these parsers only (kd, ...)")
    args = ap.parse_args()
    parsers = PARSERS
    if args.parsers:
        known = {**PARSERS, **REMOVED_PARSERS}
        parsers = {name: known[name] for name in args.parsers}
    if args.wheel:
        release, sources = _from_wheel(args.wheel)
    elif args.git_dir and args.tag:
        release, sources = _from_git(args.git_dir, args.tag, parsers)
    else:
        ap.error("give --wheel, or --git-dir and --tag")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for command, path in parsers.items():
        flags = extract(sources[command])
        doc = {"openrlhf": release, "parser": path, "flags": flags}
        if args.wheel:
            doc["source"] = f"PyPI wheel {Path(args.wheel).name}"
        target = out / f"openrlhf-{release.lstrip('v')}-{command}.json"
        target.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{target}: {len(flags)} flags")


if __name__ == "__main__":
    main()
