"""Masked reductions over the valid tokens of a padded batch.

Responses in a batch have different lengths, so every statistic must ignore the padding.
``response_mask`` is 1 (or True) on valid tokens and 0 on padding; it is cast to the value
dtype, so boolean and integer masks both work.

These are the single-process versions; :mod:`fsdp_rlhf.distributed.stats` has the
all-reduced ones for statistics that must be global across data-parallel ranks.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set.

    Args:
        values: Tensor of any shape, e.g. (B, T).
        mask: Same shape as ``values``; nonzero marks valid entries.
        dim: Reduce over this dimension only; ``None`` reduces over everything.

    Returns:
        Scalar tensor, or ``values`` with ``dim`` reduced.
    """
    # where() rather than multiply so that inf/nan at padded positions cannot leak in.
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over entries where ``mask`` is set.

    Args:
        values: Tensor of any shape, e.g. (B, T).
        mask: Same shape as ``values``.
        dim: Reduce over this dimension only; ``None`` reduces over everything.

    Returns:
        Scalar tensor, or ``values`` with ``dim`` reduced. A slice without any valid entry
        yields 0 rather than nan, so empty responses do not poison a batch statistic.
    """
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all entries where ``mask`` is set.

    Args:
        values: Tensor of any shape, e.g. (B, T).
        mask: Same shape as ``values``.
        unbiased: Apply Bessel's correction (divide by ``n - 1``).

    Returns:
        Scalar tensor. With fewer than two valid entries the unbiased estimate is undefined;
        the denominator is clamped to 1 so the result stays finite.
    """
    mean = masked_mean(values, mask)
    count = mask.to(values.dtype).sum()
    sum_sq = masked_sum((values - mean) ** 2, mask)
    denom = count - 1 if unbiased else count
    return sum_sq / denom.clamp(min=1)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Normalise ``values`` to unit variance (and zero mean) over the valid entries.

    Args:
        values: Tensor of any shape, e.g. advantages (B, T).
        mask: Same shape as ``values``.
        shift_mean: Subtract the mean. With ``False`` the values are only divided by their
            standard deviation, which keeps the sign of each value.
        eps: Added to the variance before the square root.

    Returns:
        Tensor shaped like ``values``. Entries where ``mask`` is 0 are set to 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    centered = values - mean if shift_mean else values
    whitened = centered * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
