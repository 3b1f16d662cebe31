"""Advantage estimators: GAE for PPO with a critic, and critic-free alternatives.

All estimators return constants (no autograd graph) with zeros at masked positions. Masked
positions are skipped rather than treated as time steps: the "next" step of a valid token is
the next *valid* token of its row, so padding anywhere (left, right, or holes such as tool
outputs inside a response) neither breaks the recursion nor leaks its values or rewards in.

Group estimators assume the ``n_samples_per_prompt`` responses of one prompt are contiguous
rows: row ``i`` belongs to group ``i // n_samples_per_prompt``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .masked import masked_whiten
from .names import ADVANTAGE_ESTIMATORS, BASELINE_ESTIMATORS, GROUP_ESTIMATORS
from .rewards import last_valid_index, shape_rewards

WhitenFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MeanFn = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al., 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_{t'} - V_t`` with ``t'`` the next valid token (``V = 0``
    after the last one, i.e. the episode terminates), and
    ``A_t = delta_t + gamma * lam * A_{t'}``.

    Args:
        rewards: (B, T) per-token rewards.
        values: (B, T) critic values of the states before each response token.
        response_mask: (B, T) valid response tokens.
        gamma: Discount factor.
        lam: GAE lambda; 1 gives Monte-Carlo returns minus values, 0 gives one-step TD.

    Returns:
        ``(advantages, returns)``, both (B, T), where ``returns = advantages + values`` on
        valid tokens; both are 0 at masked positions.
    """
    valid = response_mask.bool()
    zeros = torch.zeros_like(rewards[:, 0])
    next_value, next_adv = zeros, zeros
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # Masked steps carry the running state through unchanged.
        next_adv = torch.where(valid[:, t], adv, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(valid[:, t], adv, zeros)
    returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return advantages, returns


@torch.no_grad()
def discounted_returns(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t'}`` over valid tokens; (B, T), 0 where masked."""
    valid = response_mask.bool()
    zeros = torch.zeros_like(rewards[:, 0])
    running = zeros
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, zeros)
    return returns


@torch.no_grad()
def reinforce_plus_plus(
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    whiten_fn: WhitenFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages (Hu, 2025, arXiv:2501.03262): whitened discounted returns.

    Args:
        rewards: (B, T) per-token rewards (score on the last token, optional KL penalty).
        response_mask: (B, T) valid response tokens.
        gamma: Discount factor.
        whiten_fn: ``fn(values, mask) -> whitened``; defaults to the local
            :func:`~fsdp_rlhf.algorithms.masked.masked_whiten`. Pass
            ``functools.partial(global_masked_whiten, group=...)`` to normalise over the
            global batch.

    Returns:
        ``(advantages, returns)``, both (B, T) and 0 at masked positions.
    """
    returns = discounted_returns(rewards, response_mask, gamma)
    advantages = (whiten_fn or masked_whiten)(returns, response_mask)
    return advantages * response_mask.to(advantages.dtype), returns


def group_scores(
    scores: torch.Tensor, n_samples_per_prompt: int, purpose: str = "group baselines"
) -> torch.Tensor:
    """(B,) scores as (B / n, n) prompt groups; rows of a group are contiguous.

    ``purpose`` names the caller in the error raised for groups of one or a ragged batch.
    """
    if n_samples_per_prompt <= 1:
        raise ValueError(f"{purpose}: n_samples_per_prompt must be > 1, got {n_samples_per_prompt}")
    if scores.dim() != 1 or scores.shape[0] % n_samples_per_prompt != 0:
        raise ValueError(
            f"scores must be (B,) with B divisible by n_samples_per_prompt="
            f"{n_samples_per_prompt}, got shape {tuple(scores.shape)}"
        )
    return scores.reshape(-1, n_samples_per_prompt)


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    mask = response_mask.to(per_seq.dtype)
    return per_seq.reshape(-1, 1) * mask


@torch.no_grad()
def rloo(
    scores: torch.Tensor, response_mask: torch.Tensor, n_samples_per_prompt: int
) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al., 2019; Ahmadian et al., 2024, arXiv:2402.14740).

    The baseline of each sample is the mean score of the other samples of its prompt, so it
    is independent of the sample itself and the estimator stays unbiased.

    Args:
        scores: (B,) sequence scores.
        response_mask: (B, T) valid response tokens.
        n_samples_per_prompt: Samples per prompt ``n`` (> 1, divides B).

    Returns:
        (B, T) advantages, the sequence advantage on every valid token.
    """
    grouped = group_scores(scores, n_samples_per_prompt)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (n_samples_per_prompt - 1)
    return _broadcast(grouped - baseline, response_mask)


@torch.no_grad()
def grpo(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    n_samples_per_prompt: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages (Shao et al., 2024, arXiv:2402.03300): group-normalised scores.

    ``A_i = (s_i - mean(group)) / (std(group) + eps)`` with the unbiased group std. Groups
    whose samples all scored the same get 0.

    Args:
        scores: (B,) sequence scores.
        response_mask: (B, T) valid response tokens.
        n_samples_per_prompt: Samples per prompt ``n`` (> 1, divides B).
        eps: Added to the std so uniform groups do not divide by zero.

    Returns:
        (B, T) advantages.
    """
    grouped = group_scores(scores, n_samples_per_prompt)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    return _broadcast((grouped - mean) / (std + eps), response_mask)


@torch.no_grad()
def dr_grpo(
    scores: torch.Tensor, response_mask: torch.Tensor, n_samples_per_prompt: int
) -> torch.Tensor:
    """Dr. GRPO advantages (Liu et al., 2025, arXiv:2503.20783): group mean baseline only.

    Dropping the std division removes GRPO's bias towards prompts that are too easy or too
    hard; pair it with ``aggregate_loss(mode="seq-mean-token-sum")`` or a token-mean with a
    constant normaliser to also drop the length bias.

    Args:
        scores: (B,) sequence scores.
        response_mask: (B, T) valid response tokens.
        n_samples_per_prompt: Samples per prompt ``n`` (> 1, divides B).

    Returns:
        (B, T) advantages.
    """
    grouped = group_scores(scores, n_samples_per_prompt)
    return _broadcast(grouped - grouped.mean(dim=1, keepdim=True), response_mask)


@torch.no_grad()
def reinforce_plus_plus_baseline(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    n_samples_per_prompt: int,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    whiten_fn: WhitenFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu et al., 2025, arXiv:2501.03262): group mean baseline, then
    REINFORCE++'s batch whitening.

    As OpenRLHF's ``reinforce_baseline`` (verl: ``reinforce_plus_plus_baseline``): each score
    minus the mean score of its prompt's group is placed on the last valid token, the
    per-token ``token_rewards`` (e.g. the KL penalty ``-kl_coef * kl``) are added, the
    discounted reward-to-go is taken and whitened over all valid tokens of the batch. Without
    ``token_rewards`` and with ``gamma = 1`` every token of a row carries the centred score
    before whitening, which is verl's definition.

    Args:
        scores: (B,) sequence scores (clipped/shaped as desired).
        response_mask: (B, T) valid response tokens.
        n_samples_per_prompt: Samples per prompt ``n`` (> 1, divides B; rows of a group
            are contiguous).
        token_rewards: Optional (B, T) per-token rewards excluding the score.
        gamma: Discount factor (OpenRLHF forces 1 for this estimator).
        whiten_fn: ``fn(values, mask) -> whitened``; defaults to the local
            :func:`~fsdp_rlhf.algorithms.masked.masked_whiten`; pass the global one under
            data parallelism.

    Returns:
        ``(advantages, returns)``, both (B, T) and 0 at masked positions; ``returns`` are the
        un-whitened reward-to-go of the centred rewards.
    """
    grouped = group_scores(scores, n_samples_per_prompt)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    valid = response_mask.bool()
    rewards = torch.zeros(response_mask.shape, dtype=centred.dtype, device=centred.device)
    if token_rewards is not None:
        rewards = torch.where(valid, token_rewards.to(centred.dtype), rewards)
    last, has_valid = last_valid_index(response_mask)
    bonus = torch.where(has_valid, centred, torch.zeros_like(centred))
    rewards = rewards.scatter_add(1, last.unsqueeze(1), bonus.unsqueeze(1))
    return reinforce_plus_plus(rewards, response_mask, gamma, whiten_fn)


@torch.no_grad()
def flash_reinforce(
    scores: torch.Tensor, response_mask: torch.Tensor, mean_fn: MeanFn | None = None
) -> torch.Tensor:
    """FlashREINFORCE advantages (OpenRLHF's ``flash_reinforce``): each score minus the mean
    score of the rollout batch, on every valid token; no prompt groups, no whitening.

    Made for one response per prompt (``n_samples_per_prompt 1``), where group baselines are
    zero; with several, the batch mean still applies (OpenRLHF does the same).

    Args:
        scores: (B,) sequence scores.
        response_mask: (B, T) valid response tokens.
        mean_fn: ``fn(scores) -> 0-d mean``; the local ``scores.mean()`` by default. Pass the
            data-parallel mean so every rank subtracts the mean of the whole rollout batch.

    Returns:
        (B, T) advantages.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be (B,), got shape {tuple(scores.shape)}")
    baseline = (mean_fn or torch.mean)(scores)
    return _broadcast(scores - baseline, response_mask)


class Advantages(NamedTuple):
    """What every estimator produces; each (B, T), 0 at masked positions."""

    rewards: torch.Tensor  # shaped per-token rewards: score on the last token, KL penalty
    advantages: torch.Tensor
    returns: torch.Tensor


_GROUP_FNS = dict(zip(GROUP_ESTIMATORS, (rloo, grpo, dr_grpo), strict=True))


@torch.no_grad()
def estimate_advantages(
    estimator: str,
    scores: torch.Tensor,
    kl: torch.Tensor,
    kl_coef: float,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    n_samples_per_prompt: int = 1,
    whiten_fn: WhitenFn | None = None,
    mean_fn: MeanFn | None = None,
) -> Advantages:
    """Shape rewards and run one estimator (``names.ADVANTAGE_ESTIMATORS``).

    Args:
        scores: (B,) sequence scores.
        kl: (B, T) per-token KL estimate; its penalty ``-kl_coef * kl`` is part of the reward
            (pass zeros or ``kl_coef=0`` when the KL term lives in the loss instead).
        values: (B, T) critic values; GAE only.
        whiten_fn: ``fn(values, mask)``, the local masked whitening by default; pass a
            global one so GAE and REINFORCE++ normalise over the whole data-parallel batch.
        mean_fn: ``fn(scores)``, the batch-mean baseline of ``flash_reinforce`` (local mean by
            default; pass the data-parallel one).

    Group estimators need the ``n_samples_per_prompt`` samples of a prompt in contiguous rows;
    the KL penalty keeps its per-token place there, its reward-to-go added to the group
    advantage.
    """
    whiten = whiten_fn or masked_whiten
    rewards = shape_rewards(scores, kl, kl_coef, response_mask)
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs critic values")
        adv, returns = gae(rewards, values, response_mask, gamma, lam)
        return Advantages(rewards, whiten(adv, response_mask), returns)
    if estimator == "reinforce++":
        adv, returns = reinforce_plus_plus(rewards, response_mask, gamma, whiten_fn=whiten)
        return Advantages(rewards, adv, returns)
    if estimator in BASELINE_ESTIMATORS:
        penalty = -kl_coef * kl * response_mask
        adv, returns = reinforce_plus_plus_baseline(
            scores, response_mask, n_samples_per_prompt, penalty, gamma, whiten_fn=whiten
        )
        return Advantages(rewards, adv, returns)
    if estimator == "flash_reinforce":
        group = flash_reinforce(scores, response_mask, mean_fn)
    elif estimator in _GROUP_FNS:
        group = _GROUP_FNS[estimator](scores, response_mask, n_samples_per_prompt)
    else:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; one of {ADVANTAGE_ESTIMATORS}"
        )
    kl_to_go = discounted_returns(-kl_coef * kl * response_mask, response_mask, gamma)
    advantages = (group + kl_to_go) * response_mask
    return Advantages(rewards, advantages, discounted_returns(rewards, response_mask, gamma))
