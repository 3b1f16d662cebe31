"""From sequence-level ``scores`` to per-token ``rewards``, and running reward normalisation.

A reward model (or verifier) gives one raw score per response, shape (B,). PPO with a
per-token KL penalty (Ziegler et al. 2019; Ouyang et al. 2022) turns it into per-token
rewards: every token pays ``kl_coef * kl`` and the last token also receives the score.
"""

from __future__ import annotations

import torch


def clip_scores(scores: torch.Tensor, max_abs: float | None) -> torch.Tensor:
    """Clamp raw scores to ``[-max_abs, max_abs]``; ``None`` returns them unchanged.

    Args:
        scores: (B,) raw sequence scores.
        max_abs: Bound on the absolute score.

    Returns:
        (B,) clipped scores.
    """
    if max_abs is None:
        return scores
    if max_abs <= 0:
        raise ValueError(f"max_abs must be positive, got {max_abs}")
    return scores.clamp(-max_abs, max_abs)


def last_valid_index(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last valid token of each row.

    Args:
        response_mask: (B, T) mask; rows may have different lengths, left or right padding.

    Returns:
        ``(index, has_valid)``: (B,) int64 positions (0 for empty rows) and (B,) bool.
    """
    valid = response_mask.bool()
    positions = torch.arange(1, valid.shape[-1] + 1, device=valid.device)
    # 1-based positions where valid and 0 elsewhere, so an all-padding row maxes out at 0.
    last = (positions * valid).amax(dim=-1)
    return (last - 1).clamp(min=0), last > 0


def shape_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    kl_coef: float | torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Per-token rewards: KL penalty on every token plus the score on the last one.

    Args:
        scores: (B,) sequence scores (already clipped/normalised as desired).
        kl: (B, T) per-token KL estimate (see :func:`~fsdp_rlhf.algorithms.kl.kl_estimate`).
        kl_coef: Penalty coefficient ``beta``; a float or 0-d tensor.
        response_mask: (B, T) valid response tokens.

    Returns:
        (B, T) rewards, 0 at masked positions. Rows with no valid token get nothing, not even
        their score, because there is no action to credit it to.
    """
    valid = response_mask.bool()
    rewards = torch.where(valid, -kl_coef * kl, torch.zeros_like(kl))
    last, has_valid = last_valid_index(response_mask)
    bonus = torch.where(has_valid, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_len: int,
    buffer_len: int | float,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, arXiv:2503.14476, eq. 13).

    Responses up to ``max_len - buffer_len`` tokens are not penalised; inside the last
    ``buffer_len`` tokens before ``max_len`` the penalty grows linearly to ``-penalty_factor``
    and stays there for longer (truncated) responses:
    ``-penalty_factor * clip((L - (max_len - buffer_len)) / buffer_len, 0, 1)``. Add it to the
    scores before advantages (OpenRLHF's ``--overlong_buffer_len``/``--overlong_penalty_factor``).

    Args:
        response_lengths: (B,) valid response tokens per row (e.g. ``response_mask.sum(-1)``).
        max_len: The generation budget (``generate_max_len``).
        buffer_len: Length of the penalty ramp (``0 < buffer_len <= max_len``).
        penalty_factor: Penalty at (and beyond) ``max_len`` (>= 0).

    Returns:
        (B,) penalties (<= 0) in the default float dtype, or ``response_lengths``'s if float.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got {buffer_len} and {max_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    lengths = response_lengths
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.get_default_dtype())
    exceed = (lengths - (max_len - buffer_len)) / buffer_len
    return -penalty_factor * exceed.clamp(0.0, 1.0)


def stop_properly_penalty(
    scores: torch.Tensor, truncated: torch.Tensor, coef: float
) -> torch.Tensor:
    """ProRL's stop-properly penalty (OpenRLHF's ``--stop_properly_penalty_coef``).

    A truncated response (cut by the generation budget, finish reason ``length``: it never
    wrote EOS) keeps ``coef`` times its score when ``0 <= coef <= 1`` (0 zeroes it), or gets
    the fixed score ``coef`` when ``coef < 0`` (e.g. -0.5, whatever it scored). Responses that
    stopped on their own are unchanged.

    Args:
        scores: (B,) sequence scores.
        truncated: (B,) bool or 0/1, True where the response was truncated.
        coef: The coefficient; values above 1 are rejected (they would reward truncation).

    Returns:
        (B,) scores in ``scores``'s dtype.
    """
    if coef > 1:
        raise ValueError(f"coef must be <= 1, got {coef}")
    cut = truncated.to(device=scores.device).bool()
    penalised = torch.full_like(scores, coef) if coef < 0 else scores * coef
    return torch.where(cut, penalised, scores)
