"""Process-group setup from the torchrun environment, and rank helpers.

Started without torchrun (no ``WORLD_SIZE`` in the environment) the CLI runs as one process; a
world-size-1 gloo group is still created so the same code paths (DTensor, DCP) run everywhere.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from fsdp_rlhf.distributed.collectives import all_reduce

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (how its work is split: the run's
    :class:`~fsdp_rlhf.distributed.layout.ParallelLayout`, passed beside it)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free on this machine right now (for a single-node rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_min: int = 60) -> DistEnv:
    """Initialise (or reuse) the default process group: nccl on CUDA, gloo on CPU.

    ``timeout_min`` (``--dist_timeout_min``) bounds how long a collective waits for a rank that
    never arrives (a crashed or hung peer) before the job fails instead of hanging.

    NOTE: this must run before any vLLM engine is built. vLLM with ``external_launcher`` reuses an
    existing group; built first with tp=1 on 2 ranks it creates a world-size-1 group with rank 1
    and gloo aborts (``rank < size. 1 vs 1``).
    """
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device = device_for(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_min),
        )
    return DistEnv(rank, world_size, local_rank, local_world_size, device, backend)


def job_position() -> tuple[int, int, int]:
    """``(rank, world size, ranks per node)`` of this process in the whole job, from the
    launcher's environment (set by :func:`init_distributed` for a lone process). With
    ``--async_train`` a rank's default group is only its side of the job; these are not."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (
        int(os.environ.get("RANK", "0")),
        world,
        int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    )


def job_hosts() -> int:
    """Hosts the whole job spans: its world size over the ranks per node (the launcher's
    environment; 1 for a lone process)."""
    _, world, per_node = job_position()
    return max(1, -(-world // max(1, per_node)))


def launched_world_size() -> int:
    """The world size torchrun (or srun) announced, readable before the process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_size() -> int:
    """Ranks in the default group (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_scalars(values: dict[str, float], op: str = "mean", group=None) -> dict[str, float]:
    """Reduce a dict of Python floats across ranks in one collective (sum, mean, max or min)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    reduce_op = {
        "sum": dist.ReduceOp.SUM,
        "mean": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[op]
    t = all_reduce(t, reduce_op, group)  # on the group's device (CUDA for NCCL)
    if op == "mean":
        t /= dist.get_world_size(group)
    return dict(zip(keys, t.tolist(), strict=True))


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from ``src`` to every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class PeerFailure(RuntimeError):
    """Raised on the ranks whose own part worked when another rank's part failed."""


def run_and_agree(fn: Callable[[], T], what: str, *, only_rank0: bool = False) -> T | None:
    """Collective: run ``fn`` (on rank 0 only, or on every rank), then agree on the outcome.

    One all-reduce tells every rank whether it failed anywhere. The rank that failed re-raises
    its own exception; the others raise :class:`PeerFailure` at once instead of waiting at
    the next barrier until the process-group timeout (60 minutes by default) ends the job.
    Returns ``fn``'s result (None on ranks that did not run it).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    error: BaseException | None = None
    result = None
    if not only_rank0 or rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            error = e
    failed = all_reduce_scalars({"failed": float(error is not None)}, op="max")["failed"] > 0
    if error is not None:
        raise error
    if failed:
        where = "rank 0" if only_rank0 else "another rank"
        raise PeerFailure(f"{what} failed on {where}; its log has the error")
    return result
