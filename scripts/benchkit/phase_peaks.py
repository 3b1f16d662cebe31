"""Run ``fsdp_rlhf.cli`` with each phase's own peak memory recorded (CPU, Linux).

The trainer's ``memory/<phase>`` metrics on CPU are the process's peak RSS so far
(``ru_maxrss``): a later phase cannot show less than an earlier one, so they do not say which
phase holds a peak. Launched in place of ``-m fsdp_rlhf.cli`` (same arguments), this wraps
:class:`fsdp_rlhf.metrics.PhaseTimer` and records, per phase:

- ``anon``: the peak of the process's anonymous resident memory (tensors, heaps: RSS less
  file-backed and shared pages), sampled every ~0.2 ms by a thread (torch releases the GIL in
  its kernels; the switch interval is lowered so the sampler also runs between Python ops).
  Anonymous memory does not move with the page cache, so it compares runs on a busy machine,
  where the kernel evicts shared-library pages (part of RSS) as other jobs need memory.
- ``hwm``: Linux's high-water mark of the whole RSS (VmHWM, exact, file pages included), read
  and reset through ``/proc/self/clear_refs`` at every phase boundary.

A reading counts for every phase open at the time (``all`` holds the step's peak). What comes
before the first phase (imports, vLLM start-up and profiling, model loading) is ``startup``.
At exit each rank writes ``$PHASE_PEAKS_DIR/rank<R>.json``: ``{"anon": {phase: GiB},
"hwm": {phase: GiB}}`` with ``startup`` and ``overall`` among the phases.

    torchrun ... scripts/benchkit/phase_peaks.py ppo --pretrain ... (the ppo flags)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

GiB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
POLL_S = 0.0002


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not in /proc/self/status")


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _anon_bytes(statm) -> int:
    statm.seek(0)
    fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE  # resident - shared (file-backed, shmem)


class PhasePeaks:
    """Per-phase maxima of anonymous memory (sampled) and of VmHWM (reset at boundaries)."""

    def __init__(self) -> None:
        self.open: list[str] = ["startup"]
        self.anon: dict[str, int] = {}
        self.hwm: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def start(self) -> None:
        sys.setswitchinterval(POLL_S)
        self._thread.start()

    def _sample(self) -> None:
        with open("/proc/self/statm") as statm:
            while not self._stop.is_set():
                value = _anon_bytes(statm)
                with self._lock:
                    for name in (*self.open, "overall"):
                        if value > self.anon.get(name, 0):
                            self.anon[name] = value
                time.sleep(POLL_S)

    def _boundary(self) -> None:
        """Credit the high-water mark since the last boundary to every open phase."""
        hwm = _hwm_bytes()
        with self._lock:
            for name in (*self.open, "overall"):
                self.hwm[name] = max(self.hwm.get(name, 0), hwm)
        _reset_hwm()

    @contextlib.contextmanager
    def phase(self, name: str):
        self._boundary()
        with self._lock:
            if "startup" in self.open:
                self.open.remove("startup")
            self.open.append(name)
        try:
            yield
        finally:
            self._boundary()
            with self._lock:
                self.open.remove(name)

    def write(self, out_dir: Path, rank: int) -> None:
        self._boundary()
        self._stop.set()
        out_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            row = {
                "anon": {k: round(v / GiB, 4) for k, v in sorted(self.anon.items())},
                "hwm": {k: round(v / GiB, 4) for k, v in sorted(self.hwm.items())},
            }
        tmp = out_dir / f".rank{rank}.json.tmp"
        tmp.write_text(json.dumps(row, indent=1) + "\n")
        tmp.rename(out_dir / f"rank{rank}.json")


def install(out_dir: Path, rank: int) -> PhasePeaks:
    """Wrap the trainer's phase timer and the CLI's exit (it ends ranks with ``os._exit``)."""
    from fsdp_rlhf import cli, metrics

    peaks = PhasePeaks()
    timer = metrics.PhaseTimer.__call__

    @contextlib.contextmanager
    def timed(self, name: str):
        with peaks.phase(name), timer(self, name):
            yield

    metrics.PhaseTimer.__call__ = timed
    end = cli.end_without_teardown

    def write_then_end(code: int) -> None:
        peaks.write(out_dir, rank)
        end(code)

    cli.end_without_teardown = write_then_end
    peaks.start()
    return peaks


def main() -> None:
    install(Path(os.environ["PHASE_PEAKS_DIR"]), int(os.environ.get("RANK", "0")))
    from fsdp_rlhf import cli

    cli.main()


if __name__ == "__main__":
    main()
