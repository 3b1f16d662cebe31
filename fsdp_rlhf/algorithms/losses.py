"""Policy, value, entropy and reward-model losses, and how per-token losses are aggregated.

Loss normalisation contract (``aggregate_loss``)
------------------------------------------------
An optimizer step consumes a global batch split over data-parallel ranks and, on each rank,
over gradient-accumulation micro-batches. With ``mode="token-mean"`` and ``num_tokens`` set
to the number of valid tokens in the whole global batch (see
:func:`~fsdp_rlhf.distributed.stats.global_token_count`), each call returns
``masked_sum(loss) / num_tokens``. Summing these over micro-batches (accumulate, do not
average) and over ranks gives exactly the token mean over the global batch, however it was
sharded. Data-parallel wrappers that *average* gradients over ranks (DDP, FSDP's default)
divide by the world size, so the trainer must multiply the loss by the world size (or
reduce with a sum) to keep the contract. The ``seq-mean-*`` modes follow the same contract
with ``num_seqs`` (global number of sequences). Without ``num_tokens``/``num_seqs`` the local
micro-batch count is used, which is only correct for a single unsplit batch.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .kl import kl_estimate
from .masked import masked_mean, masked_sum

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def aggregate_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: LossAgg = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar (see the module docstring for the contract).

    Args:
        per_token_loss: (B, T) loss per token.
        response_mask: (B, T) valid response tokens.
        mode: ``"token-mean"``: sum over valid tokens / ``num_tokens``.
            ``"seq-mean-token-mean"``: each sequence's token mean, summed / ``num_seqs``.
            ``"seq-mean-token-sum"``: each sequence's token sum, summed / ``num_seqs``.
        num_tokens: Global valid-token count for ``token-mean``; ``None`` uses the local one.
        num_seqs: Global sequence count for the ``seq-mean-*`` modes; ``None`` uses B.

    Returns:
        Scalar loss.
    """
    if mode == "token-mean":
        if num_tokens is None:
            num_tokens = response_mask.to(per_token_loss.dtype).sum().clamp(min=1)
        return masked_sum(per_token_loss, response_mask) / num_tokens
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(per_token_loss, response_mask, dim=-1)
    elif mode == "seq-mean-token-sum":
        per_seq = masked_sum(per_token_loss, response_mask, dim=-1)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}")
    return per_seq.sum() / (per_seq.shape[0] if num_seqs is None else num_seqs)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective of PPO (Schulman et al., 2017, arXiv:1707.06347).

    Per token: ``max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))`` with
    ``r = exp(logprobs - old_logprobs)``. Separate bounds allow DAPO's "clip-higher" (Yu et
    al., 2025, arXiv:2503.14476). With ``dual_clip = c > 1`` the loss of negative-advantage
    tokens is further capped at ``-c * A`` (Ye et al., 2020, arXiv:1912.09729), so a huge
    ratio on a bad action cannot produce an unbounded update.

    Args:
        logprobs: (B, T) log-probs under the current policy (with grad).
        old_logprobs: (B, T) log-probs under the policy that generated the rollout.
        advantages: (B, T) advantages.
        response_mask: (B, T) valid response tokens.
        clip_eps_low: Lower clip range, ratio >= 1 - clip_eps_low.
        clip_eps_high: Upper clip range; ``None`` uses ``clip_eps_low``.
        dual_clip: Dual-clip constant ``c > 1``; ``None`` disables.
        loss_agg: Aggregation mode, see :func:`aggregate_loss`.
        num_tokens: Global token count, see :func:`aggregate_loss`.
        num_seqs: Global sequence count, see :func:`aggregate_loss`.
        is_weights: Optional (B, T) detached importance weights multiplying the per-token
            loss, e.g. from :func:`truncated_is_weights`.

    Returns:
        ``(loss, stats)``; stats holds detached local means over valid tokens:
        ``pg_clipfrac`` (tokens whose clipped term was selected), ``pg_clipfrac_lower``
        (tokens capped by the dual clip) and ``ppo_kl`` (k1 estimate of KL(old || current)).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    # Clamp before exp: a stale token with a large log-ratio would otherwise overflow to inf.
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    dual_capped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_capped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_capped, cap, loss)
    if is_weights is not None:
        loss = loss * is_weights
    stats = {
        "pg_clipfrac": masked_mean((clipped > unclipped).to(loss.dtype), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(dual_capped.to(loss.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return aggregate_loss(loss, response_mask, loss_agg, num_tokens, num_seqs), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    value_clip: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Squared-error critic loss, optionally clipped around the rollout-time values.

    With ``value_clip = c`` the loss is ``0.5 * max((V - R)^2, (V_clip - R)^2)`` where
    ``V_clip = old_values + clip(V - old_values, -c, c)``, the PPO2 baselines convention.

    Args:
        values: (B, T) current critic predictions (with grad).
        old_values: (B, T) critic predictions at rollout time.
        returns: (B, T) regression targets.
        response_mask: (B, T) valid response tokens.
        value_clip: Clip range ``c``; ``None`` disables clipping.
        loss_agg: Aggregation mode, see :func:`aggregate_loss`.
        num_tokens: Global token count, see :func:`aggregate_loss`.
        num_seqs: Global sequence count, see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``; stats has ``vf_clipfrac``, the detached local fraction of valid
        tokens where the clipped error was selected (0 without clipping).
    """
    unclipped = (values - returns).square()
    if value_clip is None:
        per_token = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (clipped_values - returns).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).to(values.dtype), response_mask)
    loss = aggregate_loss(per_token, response_mask, loss_agg, num_tokens, num_seqs)
    return loss, {"vf_clipfrac": clipfrac.detach()}


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    loss_agg: LossAgg = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Loss term rewarding policy entropy: ``-coef * aggregate(entropy)``; add it to the loss.

    Args:
        entropy: (B, T) per-token entropy (see ``entropy_from_logits``), with grad.
        response_mask: (B, T) valid response tokens.
        coef: Entropy coefficient (>= 0 encourages exploration).
        loss_agg: Aggregation mode, see :func:`aggregate_loss`.
        num_tokens: Global token count, see :func:`aggregate_loss`.
        num_seqs: Global sequence count, see :func:`aggregate_loss`.

    Returns:
        Scalar loss term.
    """
    return -coef * aggregate_loss(entropy, response_mask, loss_agg, num_tokens, num_seqs)


def pairwise_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    kind: Literal["sigmoid", "logexp"] = "sigmoid",
) -> torch.Tensor:
    """Bradley-Terry loss for reward-model training (Ouyang et al., 2022, eq. 1).

    Args:
        chosen_scores: (B,) scores of the preferred responses.
        rejected_scores: (B,) scores of the rejected responses.
        margin: Optional (B,) or scalar margin the chosen score must exceed the rejected
            one by (Llama 2, Touvron et al., 2023).
        kind: ``"sigmoid"``: ``-log sigmoid(c - r - m)``; ``"logexp"``:
            ``log(1 + exp(r - c + m))``. Mathematically equal; both are computed in
            overflow-safe forms.

    Returns:
        Scalar mean loss.
    """
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin
    if kind == "sigmoid":
        return -F.logsigmoid(diff).mean()
    if kind == "logexp":
        return F.softplus(-diff).mean()
    raise ValueError(f"unknown pairwise loss {kind!r}; expected 'sigmoid' or 'logexp'")


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights correcting the rollout-engine / trainer mismatch.

    The inference engine samples with slightly different numerics than the trainer, so the
    rollout is off-policy for the trainer's "old" policy. Weighting each token's loss by
    ``min(pi_old / pi_rollout, cap)`` corrects for it with bounded variance (truncated IS;
    Ionides, 2008; applied to RL fine-tuning by Yao et al., 2025, "Your efficient RL
    framework secretly brings you off-policy RL training").

    Args:
        old_logprobs: (B, T) log-probs of the sampled tokens under the trainer.
        rollout_logprobs: (B, T) log-probs reported by the rollout engine.
        response_mask: (B, T) valid response tokens.
        cap: Upper bound of the weights (> 0).

    Returns:
        ``(weights, stats)``: detached (B, T) weights, 0 where masked; stats with local
        means over valid tokens: ``tis_mean_weight``, ``tis_clipfrac``,
        ``mismatch_abs_diff`` (mean |old - rollout|) and ``mismatch_kl`` (k3 estimate of
        KL(rollout || trainer), the direction sampled from).
    """
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")
    log_ratio = (old_logprobs - rollout_logprobs).clamp(-20.0, 20.0)
    raw = torch.exp(log_ratio)
    weights = raw.clamp(max=cap) * response_mask.to(raw.dtype)
    stats = {
        "tis_mean_weight": masked_mean(weights, response_mask),
        "tis_clipfrac": masked_mean((raw > cap).to(raw.dtype), response_mask),
        "mismatch_abs_diff": masked_mean((old_logprobs - rollout_logprobs).abs(), response_mask),
        "mismatch_kl": masked_mean(
            kl_estimate(rollout_logprobs, old_logprobs, "k3", clamp=None), response_mask
        ),
    }
    return weights, stats
