"""Run a test function on N gloo ranks in their own processes (CPU), and collect per-rank results.

The ranks are forked from the warm launcher's server (fsdp_rlhf/testing/warm_launch.py: torch
and the rest imported once per session) or, with ``FSDP_RLHF_TEST_LAUNCHER=torchrun`` or when
the server cannot serve the case, spawned as fresh processes.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_rlhf.distributed.env import DistEnv, device_for, free_port
from fsdp_rlhf.testing import warm_launch

REPO = Path(__file__).resolve().parents[1]
JOB_VAR = "FSDP_RLHF_TEST_JOB"  # the warm ranks' job file (the function, its arguments)


def current_env() -> DistEnv:
    """The environment of the process group ``run_distributed`` made (inside a test function)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return DistEnv(rank, world, local_rank, local_world, device_for(local_rank), dist.get_backend())


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, backend: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        # Plain pickle copies tensors by value; torch's queue pickler would share them through
        # file descriptors that vanish when this process exits before the parent reads.
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - shipped to the parent, which re-raises
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable, world_size: int = 2, *args: Any, timeout: float = 600, backend: str = "gloo"
) -> list[Any]:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)`` under gloo
    (``backend``: e.g. ``"cuda:gloo"``, a group that, like NCCL, has no host backend).

    ``fn`` must be a module-level function (picklable). Returns the per-rank return values
    (they must be picklable); a failure on any rank raises with that rank's traceback.
    """
    if warm_launch.mode() == "warm":
        try:
            return _run_warm(fn, world_size, args, timeout, backend)
        except warm_launch.Fallback as why:
            print(warm_launch.note_fallback(fn.__qualname__, why), file=sys.stderr)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, queue, backend), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                errors.append(f"a rank died with exit code {dead[0].exitcode}")
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout}s")
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _run_warm(fn: Callable, world_size: int, args: tuple, timeout: float, backend: str) -> list:
    with tempfile.TemporaryDirectory(prefix="dist_job_") as folder:
        job = Path(folder) / "job.pkl"
        job.write_bytes(pickle.dumps((fn, args, world_size, free_port(), backend)))
        env = {**os.environ, JOB_VAR: str(job)}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        )
        stdout, stderr = sys.stdout.fileno(), sys.stderr.fileno()
        sys.stdout.flush()
        sys.stderr.flush()
        code = warm_launch.launch(
            # sys.argv as a spawned rank has it (["-c", "--multiprocessing-fork"])
            "call", ["-c", "--multiprocessing-fork"], env, str(REPO), world_size, timeout,
            stdout, stderr,
            call="tests.dist_utils:_warm_rank",
        )  # fmt: skip
        results, errors = {}, []
        for rank in range(world_size):
            path = Path(folder) / f"{rank}.pkl"
            if not path.exists():
                continue
            status, payload = pickle.loads(path.read_bytes())
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
        if not errors and (code != 0 or len(results) < world_size):
            errors.append(f"a rank died (exit code {code})")
        if errors:
            raise RuntimeError("\n".join(errors))
        return [results[r] for r in range(world_size)]


class _FileQueue:
    """``_worker``'s queue for a warm rank: its one result, written next to the job file."""

    def __init__(self, folder: Path):
        self.folder = folder

    def put(self, item) -> None:
        rank, status, payload = item
        tmp = self.folder / f"{rank}.pkl.tmp"
        tmp.write_bytes(pickle.dumps((status, payload)))
        tmp.rename(self.folder / f"{rank}.pkl")


def _warm_rank(rank: int) -> None:
    """A warm rank's entry (the launcher's ``call``): the spawned rank's ``_worker``."""
    job = Path(os.environ[JOB_VAR])
    fn, args, world_size, port, backend = pickle.loads(job.read_bytes())
    _worker(rank, world_size, port, fn, args, _FileQueue(job.parent), backend)
