"""One `train-rm` optimizer step and one evaluation pass."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from fsdp_rlhf.algorithms import pairwise_loss
from fsdp_rlhf.config import RMConfig, RMLossConfig
from fsdp_rlhf.data.preference import PairBatch
from fsdp_rlhf.distributed.env import all_reduce_scalars
from fsdp_rlhf.distributed.fsdp import accumulate
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.stats import to_host
from fsdp_rlhf.models.forward import sequence_scores
from fsdp_rlhf.models.inputs import InputSpec
from fsdp_rlhf.trainers.guards import BadStepGuard, guarded_step


def score_pairs(
    model: nn.Module, batch: PairBatch, device: torch.device, spec: InputSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over the 2B sequences, built by ``spec`` (its rows part:
    :func:`~fsdp_rlhf.trainers.offline.models.pair_layout`). Returns (B,) chosen and (B,)
    rejected scores (fp32)."""
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    # a VLM's pairs carry their images (padded rows)
    scores = sequence_scores(model, spec.build(ids, mask, images=batch.images))
    return scores[: batch.num_pairs], scores[batch.num_pairs :]


def objective(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None,
    cfg: RMLossConfig,
) -> torch.Tensor:
    """Mean Bradley-Terry loss over B pairs, plus the optional centering penalty.

    The penalty ``coef * mean((c + r)^2)`` (TRL's ``center_rewards_coefficient``) pins the
    reward scale's offset near 0, which the pairwise loss alone leaves free.
    """
    loss = pairwise_loss(chosen, rejected, margin, kind=cfg.loss)
    if cfg.center_rewards_coefficient:
        loss = loss + cfg.center_rewards_coefficient * (chosen + rejected).pow(2).mean()
    return loss


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: list[PairBatch],
    cfg: RMConfig,
    device: torch.device,
    guard: BadStepGuard,
    step: int,
    spec: InputSpec,
    gathered: bool = False,
) -> dict[str, float]:
    """Forward/backward over this rank's micro-batches (built by ``spec``: see
    :func:`score_pairs`; ``gathered``: ``--accumulate_gathered`` resolved), clip, optimizer
    and scheduler step
    (skipped by ``guard`` when the gradient norm is NaN/Inf; ``step`` names it).

    Gradients are synchronised (reduce-scattered) only after the last micro-batch; each
    micro-batch loss is divided by their count so the update uses the mean over the step.

    Returns:
        This rank's means of ``loss acc chosen_reward reject_reward margin``, plus the
        global ``grad_norm`` and the ``lr`` this step used.
    """
    sums: dict[str, float | torch.Tensor] = dict.fromkeys(
        ("loss", "acc", "chosen_reward", "reject_reward", "margin"), 0.0
    )
    for i, batch in enumerate(batches):
        accumulate(model, i == len(batches) - 1, cfg.fsdp.zero_stage, gathered)
        chosen, rejected = score_pairs(model, batch, device, spec)
        margin = batch.margin.to(device) if batch.margin is not None else None
        loss = objective(chosen, rejected, margin, cfg.loss)
        (loss / len(batches)).backward()
        chosen, rejected = chosen.detach(), rejected.detach()
        # on the device: one host copy per step below, not a synchronisation per micro-batch
        sums["loss"] += loss.detach()
        sums["acc"] += (chosen > rejected).float().mean()
        sums["chosen_reward"] += chosen.mean()
        sums["reject_reward"] += rejected.mean()
        sums["margin"] += (chosen - rejected).mean()
    sums = to_host(sums)
    lr = scheduler.get_last_lr()[0]
    grad_norm = guarded_step(
        model.parameters(), optimizer, scheduler, cfg.optim.max_norm, guard, step
    )
    stats = {k: v / len(batches) for k, v in sums.items()}
    return {**stats, "grad_norm": grad_norm, "lr": lr}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[PairBatch],
    cfg: RMConfig,
    device: torch.device,
    spec: InputSpec,
    parallel: ParallelLayout | None = None,
) -> dict[str, float]:
    """Loss, accuracy and reward mean/std (over chosen and rejected) on the eval set
    (forwards built by ``spec``; sums reduced over ``parallel``'s data group, None: every
    rank).

    Every rank runs the same number of forwards (shards are padded); sums are reduced once.
    The std is the unbiased one over all 2 x N eval rewards.
    """
    model.eval()
    sums = dict.fromkeys(("loss", "correct", "pairs", "reward_sum", "reward_sq"), 0.0)
    for batch in batches:
        chosen, rejected = score_pairs(model, batch, device, spec)
        n = batch.num_valid
        if n == 0:
            continue  # padding only: the forward above kept the collectives in step
        chosen, rejected = chosen[:n], rejected[:n]
        margin = batch.margin[:n].to(device) if batch.margin is not None else None
        sums["loss"] += objective(chosen, rejected, margin, cfg.loss).item() * n
        sums["correct"] += (chosen > rejected).sum().item()
        sums["pairs"] += n
        rewards = torch.cat([chosen, rejected]).double()
        sums["reward_sum"] += rewards.sum().item()
        sums["reward_sq"] += rewards.pow(2).sum().item()
    model.train()
    group = parallel.data_group if parallel is not None else None
    tot = all_reduce_scalars(sums, op="sum", group=group)
    n_rewards = 2 * tot["pairs"]
    mean = tot["reward_sum"] / n_rewards
    var = (tot["reward_sq"] - n_rewards * mean**2) / (n_rewards - 1)
    return {
        "eval/loss": tot["loss"] / tot["pairs"],
        "eval/acc": tot["correct"] / tot["pairs"],
        "eval/reward_mean": mean,
        "eval/reward_std": math.sqrt(max(var, 0.0)),
    }
