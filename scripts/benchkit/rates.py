"""Steady-state rates from per-step arrival times, and the statistics the report uses."""

from __future__ import annotations

import statistics

from scripts.benchkit.launch import Job


def steady_window(job: Job, warmup: int, key: str | None = None) -> tuple[list[dict], float]:
    """Rows after the first ``warmup`` steps, and the wall seconds they took.

    The window starts when step ``warmup`` was logged, so it holds every later step in full
    (compute, logging, data loading), and nothing from start-up or the final save.
    """
    pairs = [(r, t) for r, t in zip(job.rows, job.arrivals, strict=True) if key is None or key in r]
    if warmup < 1 or len(pairs) <= warmup:
        raise RuntimeError(f"{job.name}: {len(pairs)} step rows; need more than warmup={warmup}")
    rows = [r for r, _ in pairs[warmup:]]
    return rows, pairs[-1][1] - pairs[warmup - 1][1]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """``median [min-max]`` for the table."""
    if not values:
        return "-"
    lo, mid, hi = (fmt.format(v) for v in (min(values), median(values), max(values)))
    return f"{mid} [{lo}-{hi}]"


def interleaved(calls: dict, reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each call over ``reps`` interleaved rounds (A B A B ...) after ``warmup``
    calls of each, on one thread (the bench's in-process comparisons)."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for call in calls.values():
            for _ in range(warmup):
                call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(reps):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return times
