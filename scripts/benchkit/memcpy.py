"""The weight-sync reference: a plain ``copy_`` of the same bytes on this machine."""

from __future__ import annotations

import statistics
import time

import torch


def memcpy_gbps(nbytes: int, threads: int, reps: int = 7) -> float:
    """Median GB/s of ``dst.copy_(src)`` over ``nbytes`` of bf16 (one full model's worth)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randn(nbytes // 2).to(torch.bfloat16)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in once: the sync copies into live engine memory too
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(old)


def memcpy_reference(nbytes: int) -> dict[str, float]:
    """One thread (what each rank has under torchrun with 2 ranks on 2 cores) and all cores."""
    import os

    return {
        "bytes": nbytes,
        "gbps_1_thread": memcpy_gbps(nbytes, 1),
        "gbps_all_threads": memcpy_gbps(nbytes, os.cpu_count() or 1),
    }
