"""`fsdp-rlhf doctor` on 2 CPU ranks under torchrun, and its memory arithmetic."""

from __future__ import annotations

import pytest

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.config_base import build_config
from fsdp_rlhf.doctor import estimate_memory
from tests.e2e.helpers import torchrun


@pytest.mark.slow
def test_doctor_reports_every_check_on_two_ranks(tiny_qwen2, trained_rm):
    flags = [
        "--pretrain",
        tiny_qwen2,
        "--reward_pretrain",
        trained_rm,
        "--prompt_max_len",
        "32",
        "--generate_max_len",
        "16",
    ]
    proc = torchrun(["doctor", *flags])
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-3000:]
    for check in (
        "all-reduce",
        "--pretrain loads",
        "--reward_pretrain loads",
        "rollout engine starts",
        "memory estimate fits",
    ):
        for rank in (0, 1):
            assert f"[rank {rank}] PASS {check}" in out, (check, out[-3000:])
    assert "bus bandwidth" in out and "torch" in out and "VERDICT: READY" in out
    assert "allocator" in out  # the devices table says which malloc each rank runs on
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_doctor_fails_loudly_on_a_model_without_value_head(tiny_qwen2):
    # A causal LM is not a reward model: the check must fail and the verdict must say so.
    proc = torchrun(
        [
            "doctor",
            "--pretrain",
            tiny_qwen2,
            "--reward_pretrain",
            tiny_qwen2,
            "--rollout_engine",
            "hf",
            "--prompt_max_len",
            "32",
        ]
    )
    assert proc.returncode == 1
    assert "FAIL --reward_pretrain loads" in proc.stdout and "VERDICT: NOT READY" in proc.stdout


def test_memory_estimate_counts_sharded_states_and_offload():
    cfg, _ = build_config(PPOConfig, ["--reward_pretrain", "rm"])
    n, world = 7_000_000_000, 8
    est = estimate_memory(cfg, n, n, world, device_gib=80.0, vllm_gib=74.0)
    # actor + critic: fp32 param + grad + 2 Adam moments = 16 B each, sharded over 8 ranks;
    # frozen reference + reward: 4 B each, sharded
    expected = (2 * n * 16 + 2 * n * 4) / world / 2**30
    assert est.train_gib == pytest.approx(expected)
    assert est.rollout_gib == pytest.approx(74.0 + n * 4 / world / 2**30)
    assert not est.fits  # 74 GiB of vLLM plus a 3.3 GiB shard is over 95% of 80 GiB
    offloaded, _ = build_config(
        PPOConfig, ["--reward_pretrain", "rm", "--adam_offload", "--ref_reward_offload"]
    )
    lighter = estimate_memory(offloaded, n, n, world, device_gib=80.0, vllm_gib=50.0)
    assert lighter.train_gib == pytest.approx(2 * n * 8 / world / 2**30)
    assert lighter.fits
