"""Run one torchrun job and observe it from outside: when each step finished and peak RSS.

Both trainers are timed the same way: each writes one JSON line per optimizer step (ours:
``metrics.jsonl`` with ``--logging_steps 1``; TRL: a callback in the worker) and this process
stamps every line with its arrival time. Steady-state rates then come from the time between
step lines, which leaves out start-up (imports, model load, vLLM init, tokenisation) and the
final save on both sides alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
POLL_S = 0.02


@dataclass
class Job:
    """What one run left behind: step rows with arrival times, wall time, peak RSS."""

    name: str
    wall_s: float
    rows: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    peak_rss_gib: float = 0.0  # max over the job's processes of VmHWM


def cli(subcommand: str, **flags) -> list[str]:
    """``-m fsdp_rlhf.cli SUBCOMMAND --flag value ...``; True adds a bare flag, False omits it."""
    args = ["-m", "fsdp_rlhf.cli", subcommand]
    for name, value in flags.items():
        if value is True:
            args.append(f"--{name}")
        elif value is not False:
            args += [f"--{name}", str(value)]
    return args


def use_tcmalloc(want: bool) -> str:
    """Preload tcmalloc into every run of this bench (both sides alike) when ``want`` and one is
    installed; returns what the runs use, for the report."""
    from fsdp_rlhf.allocator import SWITCH, find_tcmalloc, preloaded_allocator, tcmalloc_preload

    current = os.environ.get("LD_PRELOAD", "")
    if preloaded_allocator(current):
        return f"preloaded by the caller: {current}"
    found = find_tcmalloc() if want else None
    if found is None:
        # our CLI would otherwise preload tcmalloc by itself, TRL's side not
        os.environ[SWITCH] = "0"
        return "glibc malloc" + (" (no tcmalloc installed)" if want else "")
    os.environ["LD_PRELOAD"] = tcmalloc_preload(current, found)
    return f"tcmalloc ({found}) preloaded into both sides"


def glibc_env() -> dict[str, str]:
    """Environment override that takes tcmalloc/jemalloc out of ``LD_PRELOAD`` and stops our
    CLI from preloading tcmalloc by itself."""
    from fsdp_rlhf.allocator import SWITCH, without_fast_allocators

    return {"LD_PRELOAD": without_fast_allocators(os.environ.get("LD_PRELOAD", "")), SWITCH: "0"}


def bench_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(REPO),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        HF_DATASETS_CACHE=str(work / "hf_datasets"),
        VLLM_LOGGING_LEVEL="WARNING",
        TRANSFORMERS_VERBOSITY="error",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
    )
    return env


def _children(pid: int) -> list[int]:
    """All descendants of ``pid`` (Linux /proc scan)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _hwm_gib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


class _Tail:
    """New complete JSON lines of a file that another process appends to."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows, self.arrivals = path, 0, [], []

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            # not written yet, or for a moment during the final export, which moves the run's
            # logs into the new model folder before renaming it into place
            return
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        now = time.time()
        for line in complete.splitlines():
            if line.strip():
                self.rows.append(json.loads(line))
                self.arrivals.append(now)


def run_job(
    name: str, cmd: list[str], log: Path, steps_file: Path, env: dict, timeout_s: float = 900
) -> Job:
    """Run ``cmd`` to completion while tailing ``steps_file`` and sampling RSS."""
    tail, peak, last_rss = _Tail(steps_file), 0.0, 0.0
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        while proc.poll() is None:
            time.sleep(POLL_S)
            tail.poll()
            if time.time() - last_rss > 0.5:  # /proc scans are not free on 2 cores
                last_rss = time.time()
                peak = max([peak] + [_hwm_gib(p) for p in _children(proc.pid)])
            if time.time() - start > timeout_s:
                proc.kill()
                raise RuntimeError(f"{name}: timed out after {timeout_s:.0f} s (log: {log})")
    tail.poll()
    if proc.returncode != 0:
        lines = log.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{name}: exit {proc.returncode} (log: {log})\n" + "\n".join(lines))
    return Job(name, time.time() - start, tail.rows, tail.arrivals, peak)
