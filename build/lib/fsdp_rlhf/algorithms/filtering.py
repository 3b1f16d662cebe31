"""DAPO's dynamic sampling: drop prompt groups that carry no learning signal.

With group baselines (GRPO, RLOO, REINFORCE++-baseline, Dr. GRPO) a prompt whose ``n``
responses all got the same score has zero advantage on every token, so it only dilutes the
batch. DAPO (Yu et al., 2025, arXiv:2503.14476, section 3.2) keeps sampling until the batch
is full of groups with mixed scores. The trainer owns the loop (generate, score, filter,
repeat up to ``--max_num_gen_batches``); the tests it needs are here.

Rows of a group are contiguous: row ``i`` belongs to group ``i // n_samples_per_prompt``.
"""

from __future__ import annotations

import torch

from fsdp_rlhf.algorithms.advantages import group_scores


@torch.no_grad()
def dynamic_filter_groups(
    scores: torch.Tensor,
    n_samples_per_prompt: int,
    reward_range: tuple[float, float] | None = None,
    atol: float = 0.0,
) -> torch.Tensor:
    """Which prompt groups to keep.

    Args:
        scores: (B,) sequence scores, ``B = G * n_samples_per_prompt``.
        n_samples_per_prompt: Group size ``n`` (> 1).
        reward_range: ``None``: DAPO/verl's rule, keep groups whose scores are not all equal
            (``max - min > atol``), whatever the reward scale. ``(low, high)``: OpenRLHF's
            ``--dynamic_filtering_reward_range`` rule, keep groups whose mean score lies
            strictly inside ``(low, high)``; with 0/1 rewards and ``(0, 1)`` both rules agree.
        atol: Score spread at or below which a group counts as uniform (``reward_range=None``).

    Returns:
        (G,) bool keep mask, one entry per group.
    """
    grouped = group_scores(scores, n_samples_per_prompt, purpose="dynamic filtering")
    if reward_range is None:
        spread = grouped.amax(dim=1) - grouped.amin(dim=1)
        return spread > atol
    low, high = reward_range
    if not low < high:
        raise ValueError(f"reward_range needs low < high, got {reward_range}")
    mean = grouped.mean(dim=1)
    return (mean > low) & (mean < high)


def expand_group_mask(group_keep: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """(G,) per-group mask -> (G * n,) per-row mask (rows of a group are contiguous)."""
    return group_keep.repeat_interleave(n_samples_per_prompt)
