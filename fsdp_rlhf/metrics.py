"""Metrics: rank-0 console (rich), TensorBoard, Weights & Biases (``metrics_wandb``) and
``<save_path>/metrics.jsonl``; phase timers.

Metric names are ``group/name`` (verl / MindSpeed RL names for PPO), the same in every sink.
``metrics.jsonl`` holds one JSON object per logged optimizer step with ``"step"`` and every metric.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fsdp_rlhf.errors import writing

log = logging.getLogger("fsdp_rlhf")


def setup_logging(rank: int, debug: bool = False) -> None:
    """Rank 0 logs INFO to the console through rich; other ranks only warnings, rank-prefixed."""
    from rich.logging import RichHandler

    level = logging.DEBUG if debug else logging.INFO
    root = logging.getLogger("fsdp_rlhf")
    root.handlers.clear()
    root.propagate = False
    if rank == 0:
        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=debug, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
        root.setLevel(level)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(message)s"))
        root.setLevel(logging.WARNING)
    root.addHandler(handler)


def peak_memory_gib(device: torch.device) -> float:
    """Peak device memory (CUDA) or peak RSS of this process (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class PhaseTimer:
    """Named wall-clock timers, e.g. ``with timer("rollout"): ...`` -> ``timing/rollout``."""

    def __init__(self, device: torch.device, census=None) -> None:
        """``census``: a ``distributed.memory_census.PhaseCensus`` taken at the end of the phases
        it wants (``memory_owner/<phase>/<owner>_gib``); None: none."""
        self.device = device
        self.census = census
        self.times: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        # CUDA only: the caching allocator's peak reserve, and the device's used memory at the
        # phase's end (mem_get_info: vLLM's pool and the CUDA context included)
        self.reserved: dict[str, float] = {}
        self.device_used: dict[str, float] = {}
        self.owners: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            self.memory[name] = peak_memory_gib(self.device)
            if self.device.type == "cuda":
                self.reserved[name] = torch.cuda.max_memory_reserved(self.device) / 2**30
                free, total = torch.cuda.mem_get_info(self.device)
                self.device_used[name] = (total - free) / 2**30
            if self.census is not None and self.census.wants(name):
                self._take_census(name)

    def _take_census(self, name: str) -> None:
        try:  # a diagnostic: it must not end the job
            taken = self.census()
        except Exception as e:  # noqa: BLE001
            log.warning("memory census at the end of %s failed: %s", name, e)
            return
        self.owners[name] = taken.gib()
        log.info("memory census at the end of %s (GiB): %s", name, taken.line())

    def pop(self) -> dict[str, float]:
        """All timings (``timing/<phase>``), peak memory (``memory/<phase>_gib``) and the
        census's bytes by owner (``memory_owner/<phase>/<owner>_gib``), then reset."""
        out = {f"timing/{k}": v for k, v in self.times.items()}
        out.update({f"memory/{k}_gib": v for k, v in self.memory.items()})
        out.update({f"memory_reserved/{k}_gib": v for k, v in self.reserved.items()})
        out.update({f"memory_device_used/{k}_gib": v for k, v in self.device_used.items()})
        if self.owners:
            for phase, owners in self.owners.items():
                out.update({metric_name(phase, o): v for o, v in owners.items()})
        self.times, self.memory, self.reserved, self.device_used = {}, {}, {}, {}
        self.owners = {}
        return out


def metric_name(phase: str, owner: str) -> str:
    """``memory_owner/<phase>/<owner>_gib`` (spaces in the owner as ``_``)."""
    return f"memory_owner/{phase}/{owner.replace(' ', '_')}_gib"


def _fmt(v: float) -> str:
    if v == 0 or (1e-3 <= abs(v) < 1e5):
        return f"{v:.4g}"
    return f"{v:.3e}"


class MetricLogger:
    """Writes metrics on rank 0 only; other ranks get a logger that does nothing."""

    def __init__(
        self,
        rank: int,
        save_path: str | None,
        tensorboard: str | None,
        *,
        append: bool = True,
        wandb=None,
    ) -> None:
        """``append=False`` starts a fresh ``metrics.jsonl`` (a new run); resumed runs append.
        ``wandb``: an open :class:`~fsdp_rlhf.metrics_wandb.WandbRun` (rank 0), or None."""
        self.enabled = rank == 0
        self._jsonl = None
        self._tb = None
        self._wandb = wandb if self.enabled else None
        if not self.enabled:
            return
        if save_path:
            self._path = Path(save_path) / "metrics.jsonl"
            with writing(self._path):
                Path(save_path).mkdir(parents=True, exist_ok=True)
                self._jsonl = open(self._path, "a" if append else "w")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            with writing(tensorboard):
                self._tb = SummaryWriter(tensorboard)

    def log(
        self,
        step: int,
        metrics: dict[str, float],
        console_keys: list[str] | None = None,
        note: str = "",
        console: bool = True,
    ):
        """Write one row to metrics.jsonl and TensorBoard; print it when ``console``.

        ``note`` (e.g. progress and ETA) is appended to the console line only.
        """
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if self._jsonl:
            row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in clean.items()}}
            with writing(self._path):
                self._jsonl.write(json.dumps(row) + "\n")
                self._jsonl.flush()
        if self._tb:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb:
            self._wandb.log(clean, step)
        if not console:
            return
        keys = console_keys or sorted(clean)
        line = " ".join(f"{k}={_fmt(clean[k])}" for k in keys if k in clean)
        log.info("step %d | %s%s", step, line, f" | {note}" if note else "")

    def text(self, tag: str, body: str, step: int) -> None:
        if self.enabled and self._tb:
            self._tb.add_text(tag, body, step)

    def table(self, tag: str, rows: list[dict], step: int) -> None:
        """Rows of one table (e.g. prompt/response/score samples): a W&B table."""
        if self._wandb:
            self._wandb.table(tag, rows, step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            # called from a `finally` while an exception propagates: mark the run failed
            self._wandb.close(exit_code=1 if sys.exc_info()[0] is not None else 0)
            self._wandb = None


class Progress:
    """A rich progress bar with ETA on rank 0; silent elsewhere and when not on a terminal."""

    def __init__(self, rank: int, total: int, description: str, start: int = 0) -> None:
        self._bar = None
        if rank == 0 and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task(description, total=total, completed=start)
            self._bar.start()

    def advance(self, n: int = 1) -> None:
        if self._bar:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar:
            self._bar.stop()


def _row_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop rows with ``step > after_step`` from a metrics.jsonl (write temp, then rename).

    A run killed mid-write leaves a torn last line; such unparseable rows are dropped (with a
    warning) instead of making every resume fail.
    """
    if not path.is_file():
        return
    keep, torn = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        step = _row_step(line)
        if step is None:
            torn += 1
        elif step <= after_step:
            keep.append(line)
    if torn:
        log.warning("%s: dropped %d unreadable row(s) (a write cut short)", path, torn)
    tmp = path.with_suffix(".jsonl.tmp")
    with writing(tmp):
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
