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
reduce with a sum) to keep the contract. The ``seq-mean-*`` modes (``seq-mean-token-mean``,
``seq-mean-token-sum`` and Dr. GRPO's ``seq-mean-token-sum-norm``, whose per-sequence sums
are also divided by the constant ``norm_len = generate_max_len``) follow the same contract
with ``num_seqs`` (global number of sequences). Without ``num_tokens``/``num_seqs`` the local
micro-batch count is used, which is only correct for a single unsplit batch.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .masked import masked_mean, masked_sum
from .names import LOSS_AGG_MODES, LossAgg

Count = int | float | torch.Tensor | None


def aggregate_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: LossAgg = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_len: int | float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar (see the module docstring for the contract).

    Args:
        per_token_loss: (B, T) loss per token.
        response_mask: (B, T) valid response tokens.
        mode: ``"token-mean"``: sum over valid tokens / ``num_tokens``.
            ``"seq-mean-token-mean"``: each sequence's token mean, summed / ``num_seqs``.
            ``"seq-mean-token-sum"``: each sequence's token sum, summed / ``num_seqs``.
            ``"seq-mean-token-sum-norm"``: each sequence's token sum divided by the constant
            ``norm_len``, summed / ``num_seqs`` (Dr. GRPO, Liu et al., 2025,
            arXiv:2503.20783: no per-response length normaliser, a constant instead, the
            generation budget ``generate_max_len``). verl's mode of that name divides the
            micro-batch's sum by ``norm_len`` only, without ``num_seqs``, so its scale grows
            with the batch size; here it is a mean over sequences like the other modes.
        num_tokens: Global valid-token count for ``token-mean``; ``None`` uses the local one.
        num_seqs: Global sequence count for the ``seq-mean-*`` modes; ``None`` uses B.
        norm_len: The constant of ``seq-mean-token-sum-norm`` (required there, > 0),
            normally ``generate_max_len``; ignored by the other modes.

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
    elif mode == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs norm_len > 0, got {norm_len}")
        per_seq = masked_sum(per_token_loss, response_mask, dim=-1) / norm_len
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGG_MODES}")
    return per_seq.sum() / (per_seq.shape[0] if num_seqs is None else num_seqs)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps_low: float | torch.Tensor = 0.2,
    clip_eps_high: float | torch.Tensor | None = None,
    dual_clip: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    is_weights: torch.Tensor | None = None,
    norm_len: int | float | None = None,
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
        clip_eps_low: Lower clip range, ratio >= 1 - clip_eps_low; a float, or (B, T) per
            token (a range widened by staleness, ``correction.staleness_clip``).
        clip_eps_high: Upper clip range; ``None`` uses ``clip_eps_low``.
        dual_clip: Dual-clip constant ``c > 1``; ``None`` disables.
        loss_agg: Aggregation mode, see :func:`aggregate_loss`.
        num_tokens: Global token count, see :func:`aggregate_loss`.
        num_seqs: Global sequence count, see :func:`aggregate_loss`.
        is_weights: Optional (B, T) detached importance weights multiplying the per-token
            loss, e.g. from :func:`~fsdp_rlhf.algorithms.correction.rollout_correction`.
        norm_len: Constant of ``seq-mean-token-sum-norm``, see :func:`aggregate_loss`.

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
    return aggregate_loss(loss, response_mask, loss_agg, num_tokens, num_seqs, norm_len), stats


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    loss_agg: LossAgg = "seq-mean-token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    is_weights: torch.Tensor | None = None,
    norm_len: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization loss (Zheng et al., 2025, arXiv:2507.18071).

    The importance ratio is per sequence, the geometric mean of the token ratios:
    ``s_i = exp(mean_t (logprobs - old_logprobs))`` over the valid tokens of row ``i``. Every
    token of the row uses it through the paper's GSPO-token form
    ``log s_i,t = sg[log s_i] + logprobs_t - sg[logprobs_t]``, whose value is ``s_i`` and whose
    gradient with respect to ``logprobs_t`` is ``s_i``; with sequence-level advantages and
    ``seq-mean-token-mean`` aggregation this is exactly GSPO's sequence objective
    ``-mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``. Per-token advantages
    give GSPO-token. Ratios of whole sequences stay close to 1, so the clip range is about
    three orders of magnitude smaller than PPO's (the paper uses 3e-4 / 4e-4).

    Args:
        logprobs: (B, T) log-probs under the current policy (with grad).
        old_logprobs: (B, T) log-probs under the policy that generated the rollout (or the
            rollout engine's, with ``--use_rollout_logprobs_as_old``).
        advantages: (B, T) advantages, normally constant along each row.
        response_mask: (B, T) valid response tokens.
        clip_eps_low: Lower clip range of ``s_i``.
        clip_eps_high: Upper clip range; ``None`` uses ``clip_eps_low``.
        loss_agg: Aggregation; GSPO is defined with ``seq-mean-token-mean`` (the default, and
            what OpenRLHF and verl force); other modes are allowed for experiments.
        num_tokens: Global token count, see :func:`aggregate_loss`.
        num_seqs: Global sequence count, see :func:`aggregate_loss`.
        is_weights: Optional (B, T) detached weights multiplying the per-token loss.
        norm_len: Constant of ``seq-mean-token-sum-norm``, see :func:`aggregate_loss`.

    Returns:
        ``(loss, stats)``; stats holds detached local values: ``pg_clipfrac`` (fraction of
        valid tokens whose sequence took the clipped term), ``seq_clipfrac`` (fraction of
        non-empty sequences clipped), ``ppo_kl`` (k1 estimate of KL(old || current), token
        mean) and ``seq_ratio_mean`` (mean of ``s_i`` over non-empty sequences).
    """
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    valid = response_mask.bool()
    dtype = logprobs.dtype
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    lengths = valid.to(dtype).sum(dim=-1)
    seq_log_ratio = (log_ratio.sum(dim=-1) / lengths.clamp(min=1)).detach().clamp(-20.0, 20.0)
    # Value s_i on every token; gradient s_i * d logprobs_t.
    token_log_ratio = seq_log_ratio.unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss = loss * is_weights
    took_clip = (clipped > unclipped).to(dtype)
    nonempty = (lengths > 0).to(dtype)
    seq_clipped = (took_clip * valid.to(dtype)).amax(dim=-1)
    stats = {
        "pg_clipfrac": masked_mean(took_clip, response_mask).detach(),
        "seq_clipfrac": (masked_sum(seq_clipped, nonempty) / nonempty.sum().clamp(min=1)).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "seq_ratio_mean": masked_mean(seq_log_ratio.exp(), nonempty).detach(),
    }
    return aggregate_loss(loss, response_mask, loss_agg, num_tokens, num_seqs, norm_len), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    value_clip: float | None = None,
    loss_agg: LossAgg = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_len: int | float | None = None,
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
        norm_len: Constant of ``seq-mean-token-sum-norm``, see :func:`aggregate_loss`.

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
    loss = aggregate_loss(per_token, response_mask, loss_agg, num_tokens, num_seqs, norm_len)
    return loss, {"vf_clipfrac": clipfrac.detach()}


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    loss_agg: LossAgg = "token-mean",
    num_tokens: Count = None,
    num_seqs: Count = None,
    norm_len: int | float | None = None,
) -> torch.Tensor:
    """Loss term rewarding policy entropy: ``-coef * aggregate(entropy)``; add it to the loss.

    Args:
        entropy: (B, T) per-token entropy (see ``entropy_from_logits``), with grad.
        response_mask: (B, T) valid response tokens.
        coef: Entropy coefficient (>= 0 encourages exploration).
        loss_agg: Aggregation mode, see :func:`aggregate_loss`.
        num_tokens: Global token count, see :func:`aggregate_loss`.
        num_seqs: Global sequence count, see :func:`aggregate_loss`.
        norm_len: Constant of ``seq-mean-token-sum-norm``, see :func:`aggregate_loss`.

    Returns:
        Scalar loss term.
    """
    agg = aggregate_loss(entropy, response_mask, loss_agg, num_tokens, num_seqs, norm_len)
    return -coef * agg


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
