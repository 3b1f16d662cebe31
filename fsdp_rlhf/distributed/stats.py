"""Masked statistics all-reduced over a process group.

With data parallelism every rank holds a slice of the rollout batch, and with gradient
accumulation every optimizer step is split further into micro-batches. Statistics such as the
advantage mean/std and the token count used to normalise the loss must describe the whole
global batch, otherwise the result depends on how it was sharded. These helpers all-reduce
sums and counts (never means, which cannot be combined without their weights).

All functions fall back to single-process behaviour when ``torch.distributed`` is unavailable
or not initialised, so the same trainer code runs in unit tests and on one GPU.

``group=None`` means the whole default group. With sequence parallelism the ranks of a group
all hold the same rows, so statistics over the global batch pass the layout's data group
(``ParallelLayout.data_group``: one rank of each group), else each token counts N times.

The all-reduces are not differentiable: statistics are computed under ``no_grad`` and treated
as constants, which is what advantage whitening and loss normalisation need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fsdp_rlhf.distributed.collectives import all_reduce


def _all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    # on the group's device (an NCCL group cannot reduce host tensors), back on tensor's
    return all_reduce(tensor, dist.ReduceOp.SUM, group)


def global_token_count(
    mask: torch.Tensor | Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> int:
    """Number of valid tokens summed over micro-batches and over all ranks of ``group``.

    Pass the masks of every micro-batch of one optimizer step to get the denominator for
    ``aggregate_loss(..., mode="token-mean", num_tokens=...)``.

    Args:
        mask: A response mask (B, T), or a sequence of them (one per micro-batch).
        group: Process group; ``None``: the default group (see the module doc).

    Returns:
        The global count as a Python int (identical on every rank).
    """
    masks = [mask] if isinstance(mask, torch.Tensor) else list(mask)
    if not masks:
        raise ValueError("global_token_count needs at least one mask")
    # summed where the masks are, one read by the host at the end (each read is a device
    # sync); int64 keeps the count exact; host masks (SFT's) are reduced on the group's device.
    device = masks[0].device
    local = torch.stack([m.bool().sum().to(device, torch.int64) for m in masks]).sum()
    return int(_all_reduce_sum(local.view(1), group).item())


@torch.no_grad()
def global_masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Mean of ``values`` over the valid entries of all ranks.

    Args:
        values: Tensor of any shape, e.g. (B, T); B may differ between ranks.
        mask: Same shape as ``values``.
        group: Process group; ``None``: the default group.

    Returns:
        Scalar tensor in ``values.dtype`` (0 when no rank has a valid entry).
    """
    valid = mask.bool()
    # One float64 all-reduce carries both the sum and the count.
    stats = torch.stack([values.double().where(valid, 0.0).sum(), valid.sum().double()])
    total, count = _all_reduce_sum(stats, group).unbind()
    return (total / count.clamp(min=1)).to(values.dtype)


@torch.no_grad()
def global_masked_var(
    values: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Variance of ``values`` over the valid entries of all ranks.

    Uses two passes (global mean, then global sum of squared deviations) rather than
    ``E[x^2] - E[x]^2``, which cancels catastrophically for large-mean inputs.

    Args:
        values: Tensor of any shape, e.g. (B, T).
        mask: Same shape as ``values``.
        unbiased: Apply Bessel's correction with the global count.
        group: Process group; ``None``: the default group.

    Returns:
        Scalar tensor in ``values.dtype``.
    """
    valid = mask.bool()
    mean = global_masked_mean(values.double(), mask, group)
    sq_dev = ((values.double() - mean) ** 2).where(valid, 0.0).sum()
    stats = torch.stack([sq_dev, valid.sum().double()])
    total, count = _all_reduce_sum(stats, group).unbind()
    denom = count - 1 if unbiased else count
    return (total / denom.clamp(min=1)).to(values.dtype)


@torch.no_grad()
def global_masked_center(
    values: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``values`` minus their global masked mean (``--no_advantage_std_norm``: whitening
    without the division by the std). 0 where ``mask`` is 0."""
    centered = values - global_masked_mean(values, mask, group)
    return torch.where(mask.bool(), centered, torch.zeros_like(centered))


@torch.no_grad()
def global_masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Whiten ``values`` with mean and (unbiased) std taken over the valid entries of all ranks.

    Matches :func:`fsdp_rlhf.algorithms.masked.masked_whiten` applied to the concatenation of
    every rank's batch.

    Args:
        values: Tensor of any shape, e.g. advantages (B, T).
        mask: Same shape as ``values``.
        shift_mean: Subtract the global mean; ``False`` only rescales.
        eps: Added to the variance before the square root.
        group: Process group; ``None``: the default group.

    Returns:
        Tensor shaped like ``values``, 0 where ``mask`` is 0. Carries no gradient.
    """
    mean = global_masked_mean(values, mask, group)
    var = global_masked_var(values, mask, unbiased=True, group=group)
    centered = values - mean if shift_mean else values
    whitened = centered * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def to_host(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Python floats of a dict of numbers and 0-dim tensors, with one device-to-host copy for all
    the tensors (each ``float(tensor)`` on a GPU is a synchronisation of its own)."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in values.items():  # a step's statistics live on the GPU and on the host
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        stacked = torch.stack([values[k].detach().double().reshape(()) for k in keys])
        out.update(zip(keys, stacked.cpu().tolist(), strict=True))
    return {k: out[k] for k in values}
