"""The run's parallel layout: which ranks hold what, built once at launch and passed on.

One object names every dimension a rank's work is split along (torchtitan's ``ParallelDims``
is the model), and it travels as an argument: nothing reads a module global or an attribute
stuck onto a model to learn how the run is laid out.

- ``world``: the ranks of this rank's default group: every rank of the job, or under
  ``--async_train`` the training ranks (a rollout rank's default group is its engine's ranks,
  ``distributed.split_world``). FSDP2 shards every model over it.
- ``sp``: sequence parallelism (Ulysses, ``--sequence_parallel_size``): groups of N
  consecutive ranks run the same rows, each its 1/N slice of every sequence
  (``distributed.sequence_parallel``).
- ``dp``: data parallelism, ``world / sp`` ranks holding different rows; statistics over the
  global batch reduce on ``data_group`` (one rank per sequence-parallel group).
- ``ep``: expert parallelism (``--expert_parallel_size E``): the E ranks of an expert group
  split each MoE layer's experts (tokens go to their experts by all-to-all), and the W / E
  ranks holding the same experts shard the expert weights
  (``distributed.expert_parallel``).
- ``split``: under ``--async_train``, the job's training and rollout ranks.

Shapes: W ranks in the default group, N = sp size, W / N data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

from fsdp_rlhf.distributed.expert_parallel import ExpertParallel, new_expert_parallel_groups
from fsdp_rlhf.distributed.sequence_parallel import SequenceParallel, new_sequence_parallel_groups
from fsdp_rlhf.distributed.split_world import SplitWorld


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits along every parallel dimension (see the module docstring).

    Attributes:
        world_size, rank: this rank's default group (the training ranks under --async_train).
        sp: its sequence-parallel group.
        ep: its expert-parallel groups.
        data_group: the ranks that reduce statistics over the global batch, one per
            sequence-parallel group (None: the whole default group).
        split: the job's training and rollout ranks under --async_train (None: colocated).
    """

    world_size: int = 1
    rank: int = 0
    sp: SequenceParallel = field(default_factory=SequenceParallel)
    ep: ExpertParallel = field(default_factory=ExpertParallel)
    data_group: ProcessGroup | None = None
    split: SplitWorld | None = None

    def __post_init__(self) -> None:
        if self.world_size % self.sp.size:
            raise ValueError(
                f"sequence_parallel_size {self.sp.size} does not divide the world size "
                f"{self.world_size}"
            )

    @property
    def dp_size(self) -> int:
        """Ranks holding different rows: ``world / sp``."""
        return self.world_size // self.sp.size

    @property
    def dp_rank(self) -> int:
        """This rank's data shard (the ranks of a sequence-parallel group share one)."""
        return self.rank // self.sp.size

    def describe(self) -> str:
        """One line for the start-up log."""
        parts = [f"world {self.world_size}", f"data-parallel {self.dp_size}"]
        if self.sp.enabled:
            parts.append(f"sequence-parallel {self.sp.size} (Ulysses)")
        if self.ep.enabled:
            parts.append(f"expert-parallel {self.ep.size}")
        if self.split is not None:
            parts.append(
                f"{self.split.training_ranks} training + {self.split.rollout_ranks} rollout ranks"
            )
        return ", ".join(parts)


def build_layout(
    sequence_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    split: SplitWorld | None = None,
    device_type: str = "cpu",
) -> ParallelLayout:
    """The layout of the default group's world (collective: every rank, once, after the
    default process group exists; without one, the one-rank layout). ``device_type``: the
    expert groups' device mesh's."""
    if not dist.is_initialized():
        if sequence_parallel_size != 1:
            raise RuntimeError("sequence parallelism needs an initialised process group")
        if expert_parallel_size != 1:
            raise RuntimeError("expert parallelism needs an initialised process group")
        return ParallelLayout(split=split)
    sp, data = new_sequence_parallel_groups(sequence_parallel_size)
    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        sp=sp,
        ep=new_expert_parallel_groups(expert_parallel_size, device_type),
        data_group=data,
        split=split,
    )
