"""The world of asynchronous training: training ranks and rollout ranks in one torchrun job.

Ranks ``[0, T)`` train (they hold the FSDP2 models), ranks ``[T, N)`` generate: engine ``e``
is rollout ranks ``T + e * tp ... T + e * tp + tp - 1``. Each rank's *default* process group
holds only its side:

* a training rank's holds the training ranks, so FSDP2's mesh, the trainer's all-reduces and
  distributed checkpoints span exactly them;
* a rollout rank's holds the ranks of its own engine: vLLM's ``external_launcher`` builds its
  groups from the default group's world, and an engine never waits in a collective for
  another engine (such a wait, while the trainer waits for that engine to take new weights,
  is how asynchronous trainers deadlock at the weight sync).

torch.distributed has one default group per process, so the group over all N ranks, the
*bridge* (:mod:`fsdp_rlhf.distributed.bridge`), is a gloo backend built from the job's
TCPStore and used directly, not registered with torch.distributed. All of them rendezvous in
that store under their own key prefix.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_rlhf.distributed.env import DistEnv, device_for

_PREFIX = "fsdp_rlhf/split"


@dataclass(frozen=True)
class SplitWorld:
    """Who is who in an asynchronous job of ``world_size`` ranks (pure arithmetic).

    Attributes:
        world_size: every rank of the job (N).
        rollout_ranks: the ranks that only generate (R = engines x tp), the last ones.
        tp_size: ranks per vLLM engine.
    """

    world_size: int
    rollout_ranks: int
    tp_size: int

    def __post_init__(self) -> None:
        if not 0 < self.rollout_ranks < self.world_size or self.rollout_ranks % self.tp_size:
            raise ValueError(
                f"{self.rollout_ranks} rollout ranks in blocks of {self.tp_size} do not split "
                f"a world of {self.world_size}"
            )

    @property
    def training_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def num_engines(self) -> int:
        return self.rollout_ranks // self.tp_size

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.training_ranks

    def rollout_index(self, rank: int) -> int:
        """Place of a rollout rank among the rollout ranks (0 .. R-1)."""
        return rank - self.training_ranks

    def engine(self, rank: int) -> int:
        return self.rollout_index(rank) // self.tp_size

    def engine_ranks(self, engine: int) -> list[int]:
        first = self.training_ranks + engine * self.tp_size
        return list(range(first, first + self.tp_size))

    def rollout_rank(self, index: int) -> int:
        """Global rank of rollout rank ``index``."""
        return self.training_ranks + index

    def group_of(self, rank: int) -> tuple[str, int, int]:
        """``(name, rank in it, size)`` of the default group ``rank`` joins."""
        if not self.is_rollout(rank):
            return "train", rank, self.training_ranks
        index = self.rollout_index(rank)
        return f"engine{index // self.tp_size}", index % self.tp_size, self.tp_size

    def describe(self, rank: int) -> str:
        """``training rank 0`` / ``rollout rank 2 (engine 1)``, for messages."""
        if not self.is_rollout(rank):
            return f"training rank {rank}"
        return f"rollout rank {rank} (engine {self.engine(rank)})"

    def blocks_crossing_nodes(self, local_world_size: int) -> list[int]:
        """Engines whose ranks would sit on two nodes (node = rank // local_world_size)."""
        if local_world_size <= 0:
            return []
        return [
            e
            for e in range(self.num_engines)
            if len({r // local_world_size for r in self.engine_ranks(e)}) > 1
        ]

    def engines_per_node(self, local_world_size: int) -> int:
        """The most engines on one node."""
        nodes: dict[int, int] = {}
        for e in range(self.num_engines):
            node = self.engine_ranks(e)[0] // max(local_world_size, 1)
            nodes[node] = nodes.get(node, 0) + 1
        return max(nodes.values())


def init_split_world(split: SplitWorld, timeout_min: int) -> tuple[DistEnv, dist.Store]:
    """Join this rank's default group (see the module docstring) through the job's store.

    Returns the environment of that group (``rank`` and ``world_size`` are the group's; the
    device is the local rank's, as in :func:`~fsdp_rlhf.distributed.env.init_distributed`)
    and the job's store, from which the bridge is built. Collective over the whole job.
    """
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if world != split.world_size:
        raise RuntimeError(f"world size {world} != the split's {split.world_size}")
    timeout = datetime.timedelta(minutes=timeout_min)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    name, group_rank, group_size = split.group_of(rank)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = device_for(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"{_PREFIX}/{name}", store),
        rank=group_rank,
        world_size=group_size,
        timeout=timeout,
    )
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    env = DistEnv(group_rank, group_size, local_rank, min(local_world, group_size), device, backend)
    return env, store


@contextlib.contextmanager
def group_environment(env: DistEnv) -> Iterator[None]:
    """``RANK`` and ``WORLD_SIZE`` of this rank's default group while the body runs.

    vLLM's external launcher reads the rank from the environment, and its world is the
    default group's; everything else here (the error report, the heartbeat) wants the job's.
    """
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
