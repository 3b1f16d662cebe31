"""The package's import graph: lower layers never import upward.

algorithms/ is pure tensor math (torch and itself); distributed/, rollout/, data/, models/
never import trainers/ or the entry points; inside trainers/ nothing imports the command
modules (ppo.py, rm.py, sft.py, dpo.py); the library never imports its test fixtures.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "fsdp_rlhf"
LOWER = ("algorithms", "distributed", "rollout", "data", "models")
ENTRY_POINTS = ("fsdp_rlhf.cli", "fsdp_rlhf.doctor", "fsdp_rlhf.trainers")
TRAINER_ENTRIES = tuple(f"fsdp_rlhf.trainers.{m}" for m in ("ppo", "rm", "sft", "dpo"))
_ENTRY_PREFIXES = tuple(f"{m}." for m in TRAINER_ENTRIES)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every fsdp_rlhf module a file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("fsdp_rlhf")}


def _files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_never_import_trainers_or_entry_points(layer):
    for f in _files(layer):
        bad = [m for m in _imports(f) if m.startswith(ENTRY_POINTS)]
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_algorithms_import_only_themselves():
    for f in _files("algorithms"):
        bad = [m for m in _imports(f) if not m.startswith("fsdp_rlhf.algorithms")]
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_no_trainer_module_imports_an_entry_module():
    for f in _files("trainers"):
        if _module_name(f) in TRAINER_ENTRIES:
            continue
        bad = [m for m in _imports(f) if m in TRAINER_ENTRIES or m.startswith(_ENTRY_PREFIXES)]
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_the_library_never_imports_test_fixtures():
    for f in sorted(PKG.rglob("*.py")):
        if "testing" in f.relative_to(PKG).parts:
            continue
        bad = [m for m in _imports(f) if m.startswith("fsdp_rlhf.testing")]
        assert not bad, f"{f.relative_to(PKG)} imports {bad}"


def test_the_import_scanner_sees_relative_and_absolute_imports(tmp_path):
    assert "fsdp_rlhf.algorithms.masked" in _imports(PKG / "algorithms" / "advantages.py")
    assert "fsdp_rlhf.trainers.common" in _imports(PKG / "trainers" / "rm.py")
