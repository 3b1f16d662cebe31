"""cmd/gpu_smoke.py without CUDA: one SKIP line, exit 0, nothing built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_smoke_skips_without_cuda():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "cmd" / "gpu_smoke.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == ["SKIP: no CUDA device"]


def test_gpu_smoke_counts_a_failed_check(capsys):
    sys.path.insert(0, str(ROOT / "cmd"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    gpu_smoke.RESULTS.clear()

    def boom():
        raise AssertionError("kept 3 GiB")

    assert gpu_smoke.check("broken", boom) is None
    assert gpu_smoke.check("fine", lambda: ("ok", 7)) == 7
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL broken") and "kept 3 GiB" in lines[0]
    assert lines[1].startswith("PASS fine")
    assert gpu_smoke.RESULTS == [False, True]


def test_every_library_name_the_smoke_imports_exists():
    """The smoke only runs on a GPU: a rename in the library would otherwise first show there."""
    import ast
    import importlib

    src = (Path(__file__).resolve().parents[2] / "cmd" / "gpu_smoke.py").read_text()
    missing = [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_rlhf")
        for alias in node.names
        if not hasattr(importlib.import_module(node.module), alias.name)
    ]
    assert not missing, missing
