"""The doctor's per-phase estimate (``distributed.memory``) beside the peaks two PPO steps
measure on a 1.5 B model (Qwen2.5-1.5B's shape, random weights built on the GPU): FAIL where
the estimate's tensors differ from ``max_memory_allocated`` by more than 10%. A failure here
calibrates the model (its ASSUMED constants first) or says why the difference is expected.
Under the table, what the device held at each phase's end by owner (the memory census:
models' params and grads, optimizer states, the engine's copy, other tensors, and what no
Python object holds): where a gap is, and whose."""

from __future__ import annotations

import pytest

from tests.gpu.suite import (
    HAVE,
    MEMORY_TOLERANCE,
    census_env,
    census_rows,
    cli,
    compare_phases,
    device_bytes,
    format_census,
    format_rows,
    metrics,
    ppo_flags,
)

pytestmark = pytest.mark.gpu


def test_estimate_beside_measured_peaks_1_5b(big_model, tmp_path, detail):
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.memory_plan import plan_job

    model = big_model
    sizes = dict(micro=4, prompt=128, response=256)
    extra = ["--bf16", "--zero_stage", "3", "--gradient_checkpointing"]
    flags = [*ppo_flags(model, tmp_path / "run", sizes), *extra]
    if HAVE["vllm"]:
        flags += ["--vllm_gpu_memory_utilization", "0.3"]
    phases = plan_job(build_config(PPOConfig, flags)[0], 1, device_bytes(), cuda=True)
    cli(["ppo", *flags], nproc=1, timeout=360, env=census_env())
    row = metrics(tmp_path / "run" / "out")[-1]
    table = compare_phases(phases, row)
    detail("\n".join(format_rows(table)))
    detail("on the device at each phase's end, by owner (memory census):")
    detail("\n".join(format_census(census_rows(row))))
    off = [r["phase"] for r in table if abs(r["error"]) > MEMORY_TOLERANCE]
    assert table and not off, f"estimate off by more than 10% in {off or 'every phase'}"
