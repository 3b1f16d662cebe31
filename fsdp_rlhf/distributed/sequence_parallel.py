"""Sequence parallelism (Ulysses): the ranks that share one micro-batch, and their collectives.

With ``--sequence_parallel_size N`` the world of W ranks is split into W / N sequence-parallel
groups of N consecutive ranks. The ranks of one group hold the same rows (the same micro-batch)
and each runs its 1/N slice of every sequence through the model; around each attention call an
all-to-all turns sequence shards into head shards and back (``models.ulysses``). So:

- the data-parallel degree is ``dp = W / N``: batch sizes, data shards, token counts and loss
  normalisation count one rank per group (``data_group``: the ranks with the same position in
  their group, one per group), never the N copies;
- FSDP2 still shards every model over all W ranks; the gradients each rank computes from its
  slice are summed over the world, so one group's sum is the gradient of its micro-batch;
- outputs (log-probs, values) are gathered along the sequence once per forward
  (:func:`gather_sequence`), and every rank of a group computes the same loss from them.

The groups are built once at launch (:func:`new_sequence_parallel_groups`, inside
``distributed.layout.build_layout``) and travel in the run's
:class:`~fsdp_rlhf.distributed.layout.ParallelLayout`, passed to what needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

T = TypeVar("T")


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group (the SP slot of the run's ``ParallelLayout``).

    Attributes:
        size: N, ranks per sequence-parallel group (1: off).
        rank: this rank's position in its group (which 1/N slice of each sequence it holds).
        group: the N ranks of this rank's group (None when N == 1): the all-to-alls and the
            output gathers run on it.
        cpu_group: a gloo group over ``group`` for small host-side exchanges (rollouts);
            ``group`` itself on CPU.
    """

    size: int = 1
    rank: int = 0
    group: ProcessGroup | None = None
    cpu_group: ProcessGroup | None = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous part of ``items`` (sizes differ by at most one): what it
        generates of its group's prompts. With N = 1, all of them."""
        if not self.enabled:
            return list(items)
        start, stop = share_range(len(items), self.size, self.rank)
        return list(items[start:stop])


def share_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``n`` items are cut into ``parts`` contiguous
    parts, the first ``n % parts`` one item larger.

    >>> [share_range(5, 2, i) for i in range(2)]
    [(0, 3), (3, 5)]
    """
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def new_sequence_parallel_groups(size: int) -> tuple[SequenceParallel, ProcessGroup | None]:
    """The groups of ``--sequence_parallel_size size`` over the default group's world
    (collective: every rank, once, after the default process group exists): this rank's
    :class:`SequenceParallel` and its data group, the ranks holding the same slice position in
    every group (one rank per data shard; None when ``size`` is 1: the whole world).

    Groups are blocks of ``size`` consecutive ranks, like vLLM's tensor-parallel blocks: with
    ``--vllm_tensor_parallel_size`` equal to N an engine serves exactly one group.
    """
    if size == 1:
        return SequenceParallel(), None
    if not dist.is_initialized():
        raise RuntimeError("sequence parallelism needs an initialised process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"sequence_parallel_size {size} does not divide the world size {world}")
    on_cpu = dist.get_backend() == "gloo"
    group = data = cpu = None
    # new_group is collective over the world: every rank creates every group in one order
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        g = dist.new_group(ranks)
        c = g if on_cpu else dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            group, cpu = g, c
    for offset in range(size):
        g = dist.new_group(list(range(offset, world, size)))
        if rank % size == offset:
            data = g
    return SequenceParallel(size=size, rank=rank % size, group=group, cpu_group=cpu), data


# ---------------------------------------------------------------- autograd collectives


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits along dim 0 (gloo implements only this form).
    With equal splits the exchange is its own adjoint: the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


@torch.compiler.disable
def all_to_all(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Chunk i of ``x``'s dim 0 (N equal chunks) goes to rank i of ``group``; the result's
    chunk j came from rank j. Differentiable. Kept out of compiled graphs: collectives inside
    dynamo-traced FSDP code deadlocked elsewhere (prime-rl #3195)."""
    return _AllToAll.apply(x, group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; the backward keeps this rank's slice of the gradient.

    Every rank of the group computes the same loss from the gathered tensor, so each rank's
    gradient with respect to the whole is the same, and its own slice of it is exactly the
    gradient of its local part: no reduction (a sum over the N ranks would scale the
    gradients by N)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.rank, ctx.local = dim, rank, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(ctx.dim, ctx.rank * ctx.local, ctx.local).contiguous(), None, None


@torch.compiler.disable
def gather_sequence(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """The N equal slices of ``group``'s ranks concatenated along ``dim`` (rank order).
    Differentiable, for a loss that every rank of the group computes alike."""
    return _GatherSequence.apply(x, dim, group)


def gather_objects(obj: T, sp: SequenceParallel) -> list[T]:
    """Every rank's ``obj`` in the group, in rank order (host-side, picklable objects)."""
    if not sp.enabled:
        return [obj]
    out: list = [None] * sp.size
    dist.all_gather_object(out, obj, group=sp.cpu_group)
    return out


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 1 (the sequence) whose backward sums the gradient over the group
    and keeps this rank's slice (a reduce-scatter): for a layer every rank of the group runs
    on the whole row, each contributing part of the result (a head slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_dim1(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_dim1(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """Sum over the group of each rank's whole-row partial result, this rank's slice of the
    sequence kept (dim 1); the backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_dim1(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_dim1(grad, ctx.group), None


def _gather_dim1(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(B, Lr, ...) slices -> (B, N * Lr, ...), rank order."""
    n = dist.get_world_size(group)
    moved = x.transpose(0, 1).contiguous()  # (Lr, B, ...): the collective's chunks are dim 0
    out = moved.new_empty((n * moved.shape[0], *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_dim1(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(B, N * Lr, ...) partial sums -> this rank's (B, Lr, ...) slice of their sum."""
    n = dist.get_world_size(group)
    moved = x.transpose(0, 1).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.transpose(0, 1)


@torch.compiler.disable
def gather_rows(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's (B, Lr, ...) slice -> the whole (B, N * Lr, ...) rows; the backward sums the
    group's gradients (see :class:`_GatherRows`). Differentiable."""
    return _GatherRows.apply(x, group)


@torch.compiler.disable
def reduce_scatter_rows(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Each rank's (B, N * Lr, ...) partial result -> this rank's (B, Lr, ...) slice of the
    group's sum. Differentiable."""
    return _ReduceScatterRows.apply(x, group)
