"""Which items each rank uses at each step: deterministic, world-size aware, resumable exactly.

Each epoch draws one permutation of all items from ``(seed, epoch)``. Step ``s`` of an epoch
takes the global batch ``perm[s * G:(s + 1) * G]`` and rank ``r`` its contiguous slice. The
order depends only on the seed, the data and the global batch size, so a resumed run (from
``DataPosition``) sees exactly the batches the uninterrupted run would have seen, and a resume
on a different number of ranks still consumes the same global batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DataPosition:
    """The next step to run: ``step`` counts optimizer steps within ``epoch``."""

    epoch: int = 0
    step: int = 0

    @classmethod
    def from_global_step(cls, global_step: int, steps_per_epoch: int) -> DataPosition:
        """A checkpoint taken at the end of an epoch resumes at the start of the next one."""
        epoch, step = divmod(global_step, steps_per_epoch)
        return cls(epoch, step)


class StepSchedule:
    """Per-step, per-rank item indices over a fixed number of epochs.

    Args:
        num_items: dataset size N.
        global_batch: items per optimizer step summed over ranks (G); the last N % G items of
            each epoch's permutation are skipped (they differ every epoch).
        world_size, rank: this rank's slice is ``G / world_size`` items.
        seed: permutation seed (with the epoch).
    """

    def __init__(
        self, num_items: int, global_batch: int, world_size: int, rank: int, seed: int
    ) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} not divisible by world {world_size}")
        self.num_items = num_items
        self.global_batch = global_batch
        self.per_rank = global_batch // world_size
        self.rank = rank
        self.seed = seed
        self.steps_per_epoch = num_items // global_batch
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """(N,) item order of ``epoch``; cached for the current epoch."""
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            self._perm_epoch = epoch
        return self._perm

    def rank_indices(self, epoch: int, step: int) -> list[int]:
        """This rank's ``G / world_size`` item indices for ``(epoch, step)``."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside epoch of {self.steps_per_epoch} steps")
        start = step * self.global_batch + self.rank * self.per_rank
        return self.permutation(epoch)[start : start + self.per_rank].tolist()

    def positions(self, start: DataPosition, max_epochs: int) -> Iterator[DataPosition]:
        """Every position from ``start`` to the end of ``max_epochs`` epochs."""
        for epoch in range(start.epoch, max_epochs):
            first = start.step if epoch == start.epoch else 0
            for step in range(first, self.steps_per_epoch):
                yield DataPosition(epoch, step)


def eval_shard(
    num_items: int, world_size: int, rank: int, micro_batch: int
) -> list[tuple[list[int], int]]:
    """This rank's eval micro-batches, the same number on every rank.

    Sharded forwards are collectives, so a rank with fewer items still runs as many forwards:
    its shard is padded with item 0, and each micro-batch says how many leading items are real.

    Returns:
        ``[(indices, num_valid), ...]``, ``len(indices) == micro_batch``.
    """
    mine = list(range(rank, num_items, world_size))
    per_rank = -(-num_items // world_size)
    n_micro = -(-per_rank // micro_batch)
    padded = mine + [0] * (n_micro * micro_batch - len(mine))
    out = []
    for i in range(n_micro):
        start = i * micro_batch
        valid = max(0, min(micro_batch, len(mine) - start))
        out.append((padded[start : start + micro_batch], valid))
    return out
