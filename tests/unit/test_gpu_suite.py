"""The GPU suite's own logic without a GPU (tests/gpu runs under `make test-gpu`): its skip
reasons, the estimate-vs-measured table, and that every library name it imports exists (the
suite only runs in full on a GPU: a rename would first show there)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests.gpu import suite

GPU_TESTS = Path(__file__).parents[1] / "gpu"


def test_a_check_whose_needs_are_missing_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setitem(suite.HAVE, "vllm", False)
    monkeypatch.setitem(suite.HAVE, "cuda", True)
    with pytest.raises(pytest.skip.Exception, match="needs vLLM"):
        suite.require("cuda", "vllm")
    suite.require("cuda")  # present: no skip


def test_estimate_beside_measured_peaks():
    """doctor's phases against one step's metrics: the rollout is the larger of the weight
    sync and generation, the scoring phase the largest of the no-grad passes; the CUDA context
    and the allocator's slack (reserved, not allocated) are left out of the tensors the
    allocator counts."""
    from fsdp_rlhf.distributed.memory import GIB, Phase

    phases = [
        Phase(
            "rollout",
            {"cuda context + nccl": GIB, "hf engine copy": 3 * GIB, "allocator slack": GIB},
        ),
        Phase("scoring (no-grad)", {"cuda context + nccl": GIB, "logits": 4 * GIB}),
        Phase("actor update", {"cuda context + nccl": GIB, "activations": 10 * GIB}),
        Phase("vllm start-up/wake", {"vllm pool": 50 * GIB}),  # not measured with the HF engine
    ]
    metrics = {
        "memory/resharding_to_infer_gib": 3.75,  # the weight sync
        "memory/rollout_gib": 3.0,
        "memory/old_log_p_gib": 3.5,
        "memory/reference_model_gib": 5.0,
        "memory_reserved/reference_model_gib": 5.5,
        "memory/update_gib": 8.0,
        "memory_device_used/update_gib": 9.9,
    }
    rows = {r["phase"]: r for r in suite.compare_phases(phases, metrics)}
    assert set(rows) == {"rollout", "scoring (no-grad)", "actor update"}
    assert rows["rollout"]["allocated_gib"] == 3.75
    assert rows["rollout"]["estimate_tensors_gib"] == 3.0
    assert rows["rollout"]["error"] == pytest.approx(-0.2)
    assert rows["scoring (no-grad)"]["allocated_gib"] == 5.0
    assert rows["scoring (no-grad)"]["error"] == pytest.approx(-0.2)
    assert rows["scoring (no-grad)"]["reserved_gib"] == 5.5
    assert rows["actor update"]["error"] == pytest.approx(0.25)
    assert rows["actor update"]["device_used_gib"] == 9.9
    text = suite.format_rows(list(rows.values()))
    assert text[3].startswith("actor update | 11.00 (10.00) | 8.00 | - | 9.90 | +25%")


def test_every_library_name_the_suite_imports_exists():
    has_vllm = suite.available("vllm")
    missing = []
    for path in sorted(GPU_TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                "fsdp_rlhf"
            ):
                continue
            if node.module.startswith("fsdp_rlhf.rollout.vllm") and not has_vllm:
                continue  # the vLLM adapter imports vLLM: checked where it is installed
            module = importlib.import_module(node.module)
            missing += [
                (path.name, node.module, a.name) for a in node.names if not hasattr(module, a.name)
            ]
    assert not missing, missing


def test_the_suite_model_has_first_dimensions_that_do_not_divide_two_ranks():
    for sizes in (suite.SIZES,):
        assert sizes["inter"] % 2 and sizes["vocab"] % 2, sizes
        assert sizes["hidden"] == 64 * sizes["heads"], sizes  # vLLM's CPU attention: heads of 64
