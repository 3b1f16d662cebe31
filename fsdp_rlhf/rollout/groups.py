"""Tensor-parallel rollout groups: which ranks form one engine, and how prompts move inside it;
and how the ranks of a sequence-parallel group share their generation.

With vLLM's ``external_launcher`` backend every rank runs its own copy of the engine loop and
the ranks of one tensor-parallel engine must call ``generate`` with identical requests (they
all-reduce activations every step). vLLM forms its TP groups as contiguous rank blocks
(``arange(world).view(-1, tp)`` in ``vllm.distributed.parallel_state``), so ranks
``[k * tp, (k + 1) * tp)`` are engine ``k``. Each rank all-gathers the prompts of its block,
the block generates for all of them, and each rank keeps the rows of its own prompts.

With sequence parallelism the N ranks of a group train on the same rows, so they need the same
rollouts: each rank generates its share of the group's prompts (as many as it would generate
without sequence parallelism, on its own engine slice) and the group all-gathers the outputs
(:func:`gather_rollouts`), in prompt order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fsdp_rlhf.distributed.sequence_parallel import SequenceParallel, gather_objects
from fsdp_rlhf.rollout.engine import RolloutOutput, SamplingConfig

T = TypeVar("T")
K = TypeVar("K")


def tp_blocks(world_size: int, tp_size: int) -> list[list[int]]:
    """Ranks of each engine: contiguous blocks of ``tp_size`` (vLLM's layout)."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(
            f"vllm_tensor_parallel_size {tp_size} must divide the number of ranks {world_size}"
        )
    return [list(range(s, s + tp_size)) for s in range(0, world_size, tp_size)]


@dataclass(frozen=True)
class RolloutGroups:
    """This rank's place among the rollout engines.

    Attributes:
        tp_size: ranks per engine.
        world_size: all ranks.
        rank: global rank.
        group: a gloo group over this rank's engine block (prompt exchange is small CPU data);
            None when ``tp_size == 1``.
    """

    tp_size: int
    world_size: int
    rank: int
    group: ProcessGroup | None

    @property
    def engine_index(self) -> int:
        return self.rank // self.tp_size

    @property
    def num_engines(self) -> int:
        return self.world_size // self.tp_size

    @property
    def rank_in_engine(self) -> int:
        return self.rank % self.tp_size

    @property
    def engine_ranks(self) -> list[int]:
        return tp_blocks(self.world_size, self.tp_size)[self.engine_index]


def build_rollout_groups(tp_size: int) -> RolloutGroups:
    """Create the engine groups. Collective: every rank calls it, at the same point.

    ``new_group`` must be entered by all ranks for every group in the same order, so each rank
    creates every block's group and keeps its own.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    blocks = tp_blocks(world, tp_size)
    group = None
    if tp_size > 1:
        for block in blocks:
            g = dist.new_group(block, backend="gloo")
            if rank in block:
                group = g
    return RolloutGroups(tp_size=tp_size, world_size=world, rank=rank, group=group)


def gather_prompts(
    groups: RolloutGroups, prompts: list[T], sampling: SamplingConfig
) -> tuple[list[T], list[int]]:
    """All prompts of this rank's engine, in rank order, and how many each rank sent (a
    prompt is its token ids, or what else the engine needs with them: its images).

    The ranks of one engine must also sample alike: different settings (a stop token, n)
    would give them different schedules and the TP all-reduces would mix unrelated batches
    into garbage, so a mismatch raises here instead.
    """
    if groups.group is None:
        return prompts, [len(prompts)]
    parts: list[tuple[list[T], SamplingConfig] | None] = [None] * groups.tp_size
    dist.all_gather_object(parts, (prompts, sampling), group=groups.group)
    settings = {part[1] for part in parts}
    if len(settings) > 1:
        raise ValueError(
            f"ranks {groups.engine_ranks} of one vLLM engine called generate with "
            f"different sampling settings: {settings}"
        )
    flat = [p for part in parts for p in part[0]]
    return flat, [len(part[0]) for part in parts]


def serve_from_first(
    groups: RolloutGroups, keys: list[K], lookup: Callable[[list[K]], list[T]] | None
) -> list[T]:
    """The items of ``keys`` for this rank, from the engine's first rank, which alone holds
    them: it calls ``lookup`` with each rank's keys in turn (the other ranks pass None). One
    gather of the keys and one scatter of the items over the engine's gloo group; a lookup
    that fails on the first rank raises on every rank, with its message."""
    if groups.group is None:
        if lookup is None:
            raise ValueError("serve_from_first: a one-rank engine must look its keys up")
        return lookup(keys)
    first = groups.engine_ranks[0]
    wanted: list[list[K] | None] = [None] * groups.tp_size
    dist.all_gather_object(wanted, keys, group=groups.group)
    parts: list | None = None
    if groups.rank == first:
        if lookup is None:
            raise ValueError("serve_from_first: the engine's first rank must look keys up")
        try:
            parts = [lookup(k) for k in wanted]
        except Exception as e:  # noqa: BLE001 - every rank raises it, not the first alone
            parts = [e] * groups.tp_size
    out: list = [None]
    dist.scatter_object_list(out, parts, src=first, group=groups.group)
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def own_prompt_range(counts: list[int], rank_in_engine: int) -> tuple[int, int]:
    """[start, stop) of this rank's prompts within the gathered list."""
    start = sum(counts[:rank_in_engine])
    return start, start + counts[rank_in_engine]


def gather_rollouts(
    out: RolloutOutput, sp: SequenceParallel, pad_id: int, scores: torch.Tensor | None = None
) -> tuple[RolloutOutput, torch.Tensor | None]:
    """Every rank of the sequence-parallel group gets the group's rollouts, rank by rank (the
    order of :meth:`SequenceParallel.share`), and the per-row ``scores`` that came with them
    (a multi-turn environment's). Identity without sequence parallelism."""
    if not sp.enabled:
        return out, scores
    parts = gather_objects((out, None if scores is None else scores.cpu()), sp)
    merged = RolloutOutput.concat([p[0] for p in parts], pad_id)
    if scores is None:
        return merged, None
    return merged, torch.cat([p[1] for p in parts]).to(scores.device)
