"""The start-up warning for --bf16 on a CPU that emulates bf16 matmuls (fsdp_rlhf.cpu_bf16)."""

from __future__ import annotations

import torch

from fsdp_rlhf import cpu_bf16


def _rates(monkeypatch, bf16: float, fp32: float) -> None:
    rates = {torch.bfloat16: bf16, torch.float32: fp32}
    monkeypatch.setattr(cpu_bf16, "linear_flops", lambda dtype: rates[dtype])


def test_warns_only_for_bf16_on_a_cpu_that_emulates_it(monkeypatch):
    _rates(monkeypatch, bf16=9.5e9, fp32=77e9)  # AMD Zen 3, AVX2 only
    line = cpu_bf16.bf16_warning("cpu", bf16=True)
    assert line.startswith("--bf16 on a CPU without native bf16 matmuls")
    assert "9.5 GFLOP/s here against 77.0 in fp32" in line
    assert cpu_bf16.bf16_warning("cpu", bf16=False) is None
    assert cpu_bf16.bf16_warning("cuda", bf16=True) is None
    _rates(monkeypatch, bf16=437e9, fp32=96e9)  # AVX512-BF16: bf16 is the fast path
    assert cpu_bf16.bf16_warning("cpu", bf16=True) is None


def test_probe_measures_both_dtypes():
    for dtype in (torch.float32, torch.bfloat16):
        assert cpu_bf16.linear_flops(dtype, rows=16, width=64, reps=1) > 0
