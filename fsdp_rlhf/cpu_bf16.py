"""Whether this CPU multiplies bf16 matrices natively, for a warning before a slow ``--bf16`` run.

CPUs with AVX512-BF16 or AMX run bf16 matmuls 2-4x faster than fp32; without them (AVX2-only
x86, e.g. AMD Zen 3) PyTorch emulates bf16 and ``nn.functional.linear`` runs several times
slower in bf16 than in fp32 (measured in
benchmarks/grpo_rm_vs_trl_amd-epyc-zen3-avx2-2core_2026-11-24.md), so ``--bf16`` makes a CPU
run slower there, not faster. A timing probe rather than a CPU-flag table: it also covers ARM
and whatever oneDNN does on the next CPU.
"""

from __future__ import annotations

import time

import torch

# warn when bf16 is this much slower than fp32 (the machines seen: 0.12x or >= 2x)
SLOW_RATIO = 0.5


def linear_flops(dtype: torch.dtype, rows: int = 256, width: int = 512, reps: int = 3) -> float:
    """Best-of-``reps`` FLOP/s of one ``(rows, width) x (width, width)`` linear in ``dtype``."""
    x = torch.randn(rows, width, dtype=dtype)
    w = torch.randn(width, width, dtype=dtype)
    torch.nn.functional.linear(x, w)  # warm-up: oneDNN picks its kernel
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * width * width / best


def bf16_warning(device_type: str, bf16: bool) -> str | None:
    """A warning line when ``--bf16`` runs on a CPU that emulates bf16 matmuls, else None."""
    if device_type != "cpu" or not bf16:
        return None
    bf16_rate, fp32_rate = linear_flops(torch.bfloat16), linear_flops(torch.float32)
    if bf16_rate >= SLOW_RATIO * fp32_rate:
        return None
    return (
        f"--bf16 on a CPU without native bf16 matmuls (no AVX512-BF16/AMX): bf16 linear layers "
        f"run at {bf16_rate / 1e9:.1f} GFLOP/s here against {fp32_rate / 1e9:.1f} in fp32, so "
        "this run is several times slower than without --bf16"
    )
