"""The machine's matmul limit per dtype, and model FLOP utilisation (MFU) against it.

Every bench rank runs one thread (torchrun sets OMP_NUM_THREADS=1), so the limit of a run is
``nproc`` times the one-thread matmul rate, probed here in the bench process itself on square
matrices as large as the models' biggest projections.
"""

from __future__ import annotations

import time

DTYPES = ("bf16", "fp32")


def matmul_flops(dtype_name: str, n: int = 1024, min_reps: int = 3, budget_s: float = 1.0) -> float:
    """Best FLOP/s of an ``n x n @ n x n`` matmul on one thread (2 n^3 FLOPs each), over at
    least ``min_reps`` repetitions and about ``budget_s`` seconds. The fastest repetition, not the
    median: other jobs on a shared host only ever slow one down (at a load average of 2 the
    median read far below the quiet machine's peak; see benchmarks/)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.matmul(a, b)  # warm-up: oneDNN picks and caches its kernel
        times: list[float] = []
        began = time.perf_counter()
        while len(times) < min_reps or time.perf_counter() - began < budget_s:
            start = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / min(times)


def probe() -> dict[str, float]:
    """One-thread matmul FLOP/s of each dtype the bench runs."""
    return {name: matmul_flops(name) for name in DTYPES}


def best(*probes: dict[str, float]) -> dict[str, float]:
    """Per dtype, the fastest of several probes (taken at different times of a run)."""
    return {name: max(p[name] for p in probes if name in p) for name in probes[0]}


def training_flops(params_m: float, tokens_per_s: float) -> float:
    """Training FLOP/s of forward + backward: 6 x parameters x tokens per second."""
    return 6 * params_m * 1e6 * tokens_per_s


def mfu(params_m: float, tokens_per_s: float, peak_1t: float, nproc: int) -> float:
    """Achieved training FLOP/s over ``nproc`` one-thread matmul peaks."""
    return training_flops(params_m, tokens_per_s) / (peak_1t * nproc)


def grpo_flops_per_token(params_m: float, response_share: float, group_size: int) -> float:
    """Matmul FLOPs a GRPO step must spend per token it counts (every sample's prompt and
    response), a lower bound: each distinct token once through the update (forward + backward,
    6 x params) and the reference forward (2 x params), where a group of ``group_size``
    samples shares one pass of its prompt, and one decode forward (2 x params) per response
    token, ``response_share`` of the counted tokens. Attention and all that is not a matmul
    count as free."""
    distinct = (1 - response_share) / group_size + response_share
    return params_m * 1e6 * (8 * distinct + 2 * response_share)


def grpo_ceiling_tps(
    params_m: float, response_share: float, group_size: int, peak_1t: float
) -> float:
    """Tokens/s/rank a GRPO step could reach with every matmul at the one-thread peak and all
    else free: the machine's arithmetic limit for that step."""
    return peak_1t / grpo_flops_per_token(params_m, response_share, group_size)


# bf16 cells need bf16 matmuls at least this fast relative to fp32 to say anything about bf16:
# CPUs without AVX512-BF16/AMX (e.g. AMD Zen 3) emulate them, many times slower than fp32
# (measured in benchmarks/).
NATIVE_BF16_MIN_RATIO = 0.5


def bf16_blocker(peaks: dict[str, float]) -> str | None:
    """Why bf16 runs say nothing here (no native bf16 matmul), or None."""
    bf16, fp32 = peaks.get("bf16"), peaks.get("fp32")
    if not bf16 or not fp32 or bf16 >= NATIVE_BF16_MIN_RATIO * fp32:
        return None
    return (
        f"no native bf16 matmul on this CPU (one thread: bf16 {bf16 / 1e9:.1f} vs fp32 "
        f"{fp32 / 1e9:.0f} GFLOP/s): bf16 runs are emulated"
    )
