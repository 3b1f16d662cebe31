"""How a rank's rows are cut into micro-batches: a fixed number of rows, or a token budget.

Responses of varied length make fixed-size micro-batches wasteful: a padded micro-batch costs
its longest row times its row count, and one long response sets the padding of all its
neighbours. With ``--use_dynamic_batch`` (OpenRLHF's flag) the rows are sorted by length and
bin-packed, first fit decreasing, into micro-batches that each fit a token budget
(``--train_max_tokens_per_gpu`` for the updates, ``--rollout_max_tokens_per_gpu`` for the no-grad
forwards), and each micro-batch is cut to its own longest prompt and response
(:meth:`Experience.trimmed`). Short rows then go many to a forward, long ones few.

Nothing else changes: the losses are normalised by the optimizer step's global token (or
sequence) count, not per micro-batch, so the split does not change the step. FSDP's collectives
need every rank to run the same number of forwards (and the gradient reduce-scatter on the same
last micro-batch), so the ranks agree on the largest count (one all-reduce) and a rank with
fewer runs empty micro-batches: a one-row forward whose result is dropped (weight 0).
Rows that share one pass of their prompt (``--share_prompt_prefix``) stay together: they are
packed as one unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_rlhf.distributed.env import all_reduce_scalars


@dataclass(frozen=True)
class MicroBatching:
    """``size`` rows per micro-batch, or with ``max_tokens`` as many rows as fit that many
    tokens (``packed``: the sum of their lengths; padded: rows x the longest). ``group``
    consecutive rows are never split."""

    size: int
    max_tokens: int | None = None
    packed: bool = False
    group: int = 1

    @property
    def dynamic(self) -> bool:
        return self.max_tokens is not None

    def split(self, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Index tensors into ``lengths`` (one per micro-batch; an empty one is padding that
        keeps this rank's count equal to every other rank's). Collective when dynamic."""
        n = lengths.shape[0]
        if not self.dynamic:
            return [torch.arange(i, min(i + self.size, n)) for i in range(0, n, self.size)]
        bins = token_bins(lengths.tolist(), self.max_tokens, self.packed, self.group)
        # every rank runs the largest count of all ranks (one all-reduce)
        count = int(all_reduce_scalars({"n": len(bins)}, op="max")["n"])
        empty = torch.zeros(0, dtype=torch.long)
        return [torch.tensor(b, dtype=torch.long) for b in bins] + [empty] * (count - len(bins))


def token_bins(
    lengths: list[int], max_tokens: int, packed: bool, group: int = 1
) -> list[list[int]]:
    """First fit decreasing: the rows (in units of ``group`` consecutive rows) sorted longest
    first, each into the first micro-batch it fits, the cost of a micro-batch being the sum of
    its lengths (``packed``) or its rows times its longest (padded). A unit larger than the
    budget gets a micro-batch of its own. Each micro-batch lists its rows in ascending order.

    >>> token_bins([5, 1, 4, 2, 3], max_tokens=6, packed=True)
    [[0, 1], [2, 3], [4]]
    >>> token_bins([5, 1, 4, 2, 3], max_tokens=9, packed=False)
    [[0], [2, 4], [1, 3]]
    """
    if len(lengths) % group:
        raise ValueError(f"{len(lengths)} rows do not split into groups of {group}")
    units = [list(range(i, i + group)) for i in range(0, len(lengths), group)]
    longest = [max(lengths[r] for r in u) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-longest[u], u))
    bins: list[list[int]] = []
    costs: list[tuple[int, int]] = []  # (rows, longest) padded; (tokens, 0) packed
    for u in order:
        rows, size = units[u], longest[u]
        tokens = sum(lengths[r] for r in rows)
        for b, (a, m) in enumerate(costs):
            new = (a + tokens, 0) if packed else (a + len(rows), max(m, size))
            if (new[0] if packed else new[0] * new[1]) <= max_tokens:
                bins[b] += rows
                costs[b] = new
                break
        else:
            bins.append(list(rows))
            costs.append((tokens, 0) if packed else (len(rows), size))
    return [sorted(b) for b in bins]  # units stay contiguous: their rows are consecutive


def padded_tokens(lengths: torch.Tensor, micros: list[torch.Tensor], width: int | None) -> int:
    """Tokens a padded forward computes over ``micros``: rows x the longest row of each (cut to
    its own longest, dynamic) or rows x ``width`` (fixed, the whole batch's padded width)."""
    total = 0
    for idx in micros:
        if len(idx):
            total += len(idx) * (width if width is not None else int(lengths[idx].max()))
    return total
