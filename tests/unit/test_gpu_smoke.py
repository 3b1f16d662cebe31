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


def _smoke():
    sys.path.insert(0, str(ROOT / "cmd"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    gpu_smoke.RESULTS.clear()
    return gpu_smoke


def test_gpu_smoke_counts_a_failed_check(capsys):
    gpu_smoke = _smoke()

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
    import importlib.util

    src = (Path(__file__).resolve().parents[2] / "cmd" / "gpu_smoke.py").read_text()
    has_vllm = importlib.util.find_spec("vllm") is not None
    missing = [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_rlhf")
        # the vLLM adapter imports vLLM: checked where it is installed
        if has_vllm or not node.module.startswith("fsdp_rlhf.rollout.vllm")
        for alias in node.names
        if not hasattr(importlib.import_module(node.module), alias.name)
    ]
    assert not missing, missing


def test_a_check_whose_needs_are_missing_is_a_skip_not_a_failure(capsys, monkeypatch):
    gpu_smoke = _smoke()
    monkeypatch.setitem(gpu_smoke.HAVE, "vllm", False)
    monkeypatch.setitem(gpu_smoke.HAVE, "cuda", True)

    def never():
        raise AssertionError("a skipped check must not run")

    assert gpu_smoke.check("engine", never, needs=("vllm", "cuda")) is None
    line = capsys.readouterr().out.strip()
    assert line.startswith("SKIP engine: needs vLLM") and gpu_smoke.RESULTS == []


def test_estimate_beside_measured_peaks():
    """doctor's phases against one step's metrics: the scoring phase is the largest of the
    no-grad passes; the CUDA context is left out of the tensors the allocator sees."""
    from fsdp_rlhf.distributed.memory import GIB, Phase

    gpu_smoke = _smoke()
    phases = [
        Phase("rollout", {"cuda context + nccl": GIB, "hf engine copy": 3 * GIB}),
        Phase("scoring (no-grad)", {"cuda context + nccl": GIB, "logits": 4 * GIB}),
        Phase("actor update", {"cuda context + nccl": GIB, "activations": 10 * GIB}),
        Phase("vllm start-up/wake", {"vllm pool": 50 * GIB}),  # not measured with the HF engine
    ]
    metrics = {
        "memory/rollout_gib": 3.0,
        "memory/old_log_p_gib": 3.5,
        "memory/reference_model_gib": 5.0,
        "memory_reserved/reference_model_gib": 5.5,
        "memory/update_gib": 8.0,
        "memory_device_used/update_gib": 9.9,
    }
    rows = {r["phase"]: r for r in gpu_smoke.compare_phases(phases, metrics)}
    assert set(rows) == {"rollout", "scoring (no-grad)", "actor update"}
    assert rows["rollout"]["error"] == 0.0
    assert rows["scoring (no-grad)"]["allocated_gib"] == 5.0
    assert rows["scoring (no-grad)"]["error"] == pytest.approx(-0.2)
    assert rows["scoring (no-grad)"]["reserved_gib"] == 5.5
    assert rows["actor update"]["error"] == pytest.approx(0.25)
    assert rows["actor update"]["device_used_gib"] == 9.9
    text = gpu_smoke.format_rows(list(rows.values()))
    assert text[3].startswith("actor update | 11.00 (10.00) | 8.00 | - | 9.90 | +25%")
