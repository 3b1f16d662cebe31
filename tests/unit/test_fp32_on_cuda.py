"""A CUDA run without --bf16 trains (and generates) in fp32: rank 0 says so in one start-up line
(fsdp_rlhf.trainers.common.log_startup); CPU runs and --bf16 runs say nothing about it."""

from __future__ import annotations

import logging

import torch

from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.trainers import common


def _env(device: str, rank: int = 0) -> DistEnv:
    return DistEnv(rank, 2, rank, 2, torch.device(device), "nccl" if device == "cuda" else "gloo")


def _startup_lines(caplog, env: DistEnv, bf16: bool) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fsdp_rlhf"):
        common.log_startup(env, zero_stage=3, bf16=bf16)
    return [r.getMessage() for r in caplog.records if "no --bf16" in r.getMessage()]


def test_cuda_without_bf16_is_one_warning_on_rank0(caplog):
    (line,) = _startup_lines(caplog, _env("cuda"), bf16=False)
    assert "trains in fp32 on the GPU" in line and "pass --bf16" in line
    assert [r.levelno for r in caplog.records if "no --bf16" in r.getMessage()] == [logging.WARNING]
    assert _startup_lines(caplog, _env("cuda", rank=1), bf16=False) == []


def test_no_warning_with_bf16_or_on_cpu(caplog, monkeypatch):
    monkeypatch.setattr(common, "bf16_warning", lambda *a: None)  # the CPU probe: not this test's
    assert _startup_lines(caplog, _env("cuda"), bf16=True) == []
    assert _startup_lines(caplog, _env("cpu"), bf16=False) == []
    assert common.fp32_on_cuda_warning("cpu", bf16=False) is None
