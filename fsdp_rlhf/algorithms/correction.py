"""Correcting the mismatch between the rollout engine's and the trainer's log-probs.

vLLM samples with different kernels and precision than the trainer, so for the same weights
``pi_rollout`` (what actually sampled the tokens) differs from ``pi_old`` (the trainer's
recomputation). The rollout is then slightly off-policy for PPO's old policy. With
``ratio_t = pi_old(y_t) / pi_rollout(y_t)`` per token, each mode returns detached per-token
weights that multiply the policy loss (``policy_loss(..., is_weights=w)``):

* ``"tis"``: truncated importance sampling, ``w_t = clamp(ratio_t, low, high)`` (Yao et al.,
  2025, "Your efficient RL framework secretly brings you off-policy RL training"). With
  ``low = 0`` this is ``min(ratio_t, high)``, verl's token TIS and this trainer's earlier
  ``--use_tis --tis_cap`` (``compat/`` translates them); OpenRLHF's ``tis`` also clamps from
  below (default ``[0.5, 5.0]``).
* ``"icepop"``: token masking, ``w_t = ratio_t`` where ``low <= ratio_t <= high`` and 0
  elsewhere: tokens the two engines disagree on too much do not train at all.
* ``"seq_mask"``: sequence rejection on the geometric-mean ratio ``exp(mean_t log ratio_t)``
  over the valid tokens of the row (length-normalised, so long responses are not rejected just
  for being long); rows outside ``[low, high]`` get weight 0 and kept rows keep the untruncated
  ``ratio_t``. This is OpenRLHF's ``seq-mask-tis`` (0.10-0.11.0) and its ``seq`` level with
  ``mask`` mode (0.11.2).
* ``"seq_mask_tis"``: the same rejection, and kept rows get the ``tis`` weights: verl's
  "geometric rejection + token TIS".

Gating (OpenRLHF 0.11.2's ``is_correction_gating``): the masking modes (``icepop``,
``seq_mask``) may read another statistic than the ratio to decide which tokens or rows to drop,
a divergence between the two policies at the sampled token, bounded from above only (a trust
region ``[0, delta]``); survivors still get ``ratio_t``:

* ``"ratio"``: the ratio itself (the default; the row statistic is its geometric mean);
* ``"binary_kl"``: with ``p = pi_rollout(y_t)`` and ``q = pi_old(y_t)`` (both clamped into
  ``[1e-6, 1 - 1e-6]``), the KL between the two Bernoulli distributions "this token or not",
  ``p log(p / q) + (1 - p) log((1 - p) / (1 - q))`` (FlashREINFORCE's trust region);
* ``"tv"``: ``|p - q|``, their total variation.

The row statistic of a divergence is its mean over the row's valid tokens.

Rejected tokens keep their place in the loss normaliser (``num_tokens``), as in OpenRLHF; verl
instead drops them from the response mask before counting. The lead chooses by what mask it
counts tokens with.

"Bypass" mode (``--use_rollout_logprobs_as_old``) needs no function here: passing the engine's
log-probs as ``old_logprobs`` makes the PPO ratio itself correct for the mismatch.

Off-policy batches (asynchronous training: tokens sampled by weights one or more versions
behind ``pi_old``) are the same problem with a larger gap; ``--off_policy_correction`` chooses
how the behaviour policy enters the objective (docs/async.md). :func:`behaviour_ratio_stats`
and :func:`logprob_gap_by_staleness` make the gap visible whatever the choice.

Shapes: (B, T) for every per-token tensor; masks are 1/True on valid response tokens.
"""

from __future__ import annotations

import torch

from .kl import kl_estimate
from .masked import masked_mean, masked_sum
from .names import (
    IS_GATINGS,
    SEQUENCE_CORRECTIONS,
    ISCorrection,
    ISGating,
    correction_problem,
)

_LOG_RATIO_GUARD = 20.0
_PROB_GUARD = 1e-6


@torch.no_grad()
def rollout_mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs are from the rollout engine's, on valid tokens.

    Args:
        old_logprobs: (B, T) log-probs of the sampled tokens under the trainer.
        rollout_logprobs: (B, T) log-probs reported by the rollout engine.
        response_mask: (B, T) valid response tokens.

    Returns:
        Detached local 0-d tensors: ``mismatch_kl`` (k3 estimate of KL(rollout || trainer),
        the direction the tokens were sampled from; token mean), ``mismatch_k1`` (token mean
        of ``rollout - old``, OpenRLHF's ``vllm_kl``), ``mismatch_abs_diff`` (token mean of
        ``|old - rollout|``) and ``mismatch_abs_diff_max`` (its max; reduce it across ranks
        with MAX, the others with a token-weighted mean).
    """
    diff = old_logprobs - rollout_logprobs
    abs_diff = torch.where(response_mask.bool(), diff.abs(), torch.zeros_like(diff))
    return {
        "mismatch_kl": masked_mean(
            kl_estimate(rollout_logprobs, old_logprobs, "k3", clamp=None), response_mask
        ),
        "mismatch_k1": masked_mean(-diff, response_mask),
        "mismatch_abs_diff": masked_mean(abs_diff, response_mask),
        "mismatch_abs_diff_max": abs_diff.amax() if abs_diff.numel() else abs_diff.sum(),
    }


def _token_probs(logprobs: torch.Tensor) -> torch.Tensor:
    """Probabilities in float64, clamped away from 0 and 1 (finite logs)."""
    return logprobs.detach().double().exp().clamp(_PROB_GUARD, 1.0 - _PROB_GUARD)


@torch.no_grad()
def binary_kl(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(Bernoulli(p) || Bernoulli(q)) with ``p = pi_rollout(y_t)``, ``q =
    pi_old(y_t)`` (each clamped into ``[1e-6, 1 - 1e-6]``); (B, T) in the inputs' dtype, >= 0,
    0 where they agree.

    Computed in float64 and clamped at 0: for two policies that nearly agree the two terms
    cancel to ~1e-9, below float32's rounding of each, and in float32 about a third of such
    tokens come out slightly negative, outside a trust region ``[0, delta]``; a row of one such
    token would be rejected although the policies agree.
    """
    p, q = _token_probs(rollout_logprobs), _token_probs(old_logprobs)
    kl = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
    return kl.clamp(min=0).to(old_logprobs.dtype)


@torch.no_grad()
def total_variation(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``|pi_rollout(y_t) - pi_old(y_t)|`` (probabilities clamped as in
    :func:`binary_kl`, in float64); (B, T) in the inputs' dtype."""
    tv = (_token_probs(rollout_logprobs) - _token_probs(old_logprobs)).abs()
    return tv.to(old_logprobs.dtype)


@torch.no_grad()
def sequence_geometric_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``exp(mean_t log_ratio_t)`` over the valid tokens of each row; (B,), 1 for empty rows."""
    valid = response_mask.bool()
    total = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1)
    mean = total / valid.to(log_ratio.dtype).sum(dim=-1).clamp(min=1)
    return torch.exp(mean.clamp(-_LOG_RATIO_GUARD, _LOG_RATIO_GUARD))


def _row_mean(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    valid = response_mask.bool()
    total = torch.where(valid, values, torch.zeros_like(values)).sum(dim=-1)
    return total / valid.to(values.dtype).sum(dim=-1).clamp(min=1)


@torch.no_grad()
def gating_statistic(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    gating: ISGating = "ratio",
    per_sequence: bool = False,
) -> torch.Tensor:
    """What a masking correction compares with ``[low, high]``: per token (B, T), or with
    ``per_sequence`` per row (B,): the geometric-mean ratio, or a divergence's row mean (0 and
    ratio 1 for rows without valid tokens, so those are never rejected)."""
    if gating == "ratio":
        log_ratio = (old_logprobs - rollout_logprobs).clamp(-_LOG_RATIO_GUARD, _LOG_RATIO_GUARD)
        if per_sequence:
            return sequence_geometric_ratio(log_ratio, response_mask)
        return log_ratio.exp()
    if gating == "binary_kl":
        stat = binary_kl(old_logprobs, rollout_logprobs)
    elif gating == "tv":
        stat = total_variation(old_logprobs, rollout_logprobs)
    else:
        raise ValueError(f"unknown IS gating {gating!r}; expected one of {IS_GATINGS}")
    return _row_mean(stat, response_mask) if per_sequence else stat


@torch.no_grad()
def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: ISCorrection = "tis",
    low: float = 0.5,
    high: float = 5.0,
    gating: ISGating = "ratio",
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token weights correcting the rollout/trainer mismatch (see the module docstring).

    Args:
        old_logprobs: (B, T) log-probs of the sampled tokens under the trainer (``pi_old``).
        rollout_logprobs: (B, T) log-probs reported by the rollout engine.
        response_mask: (B, T) valid response tokens.
        mode: ``"none"``, ``"tis"``, ``"icepop"``, ``"seq_mask"`` or ``"seq_mask_tis"``.
        low: Lower threshold (``>= 0``; 0 disables the lower side).
        high: Upper threshold (``> low``).
        gating: The statistic ``icepop`` and ``seq_mask`` compare with ``[low, high]``:
            ``"ratio"``, ``"binary_kl"`` or ``"tv"`` (the divergences need ``low = 0``).

    Returns:
        ``(weights, stats)``: detached (B, T) weights, 0 at masked and rejected positions
        (``None`` for ``mode="none"``), and detached local stats: the
        :func:`rollout_mismatch_metrics` plus, unless ``mode="none"``, ``is_weight_mean``
        (mean weight over valid tokens), ``is_clipfrac`` (valid tokens whose weight was
        truncated), ``is_masked_frac`` (valid tokens given weight 0 by a mask) and, for the
        sequence modes, ``is_seq_masked_frac`` (non-empty rows rejected).
    """
    stats = rollout_mismatch_metrics(old_logprobs, rollout_logprobs, response_mask)
    if mode == "none":
        return None, stats
    problem = correction_problem(mode, low, high, gating)
    if problem is not None:
        raise ValueError(problem)
    valid = response_mask.bool()
    log_ratio = (old_logprobs - rollout_logprobs).clamp(-_LOG_RATIO_GUARD, _LOG_RATIO_GUARD)
    ratio = torch.exp(log_ratio)
    inside = (ratio >= low) & (ratio <= high)
    keep = valid
    truncated = torch.zeros_like(valid)
    if mode == "tis" or mode == "seq_mask_tis":
        weights = ratio.clamp(min=low, max=high)
        truncated = ~inside
    else:
        weights = ratio
    if mode == "icepop":
        stat = gating_statistic(old_logprobs, rollout_logprobs, response_mask, gating)
        keep = valid & (stat >= low) & (stat <= high)
    elif mode in SEQUENCE_CORRECTIONS:
        seq_stat = gating_statistic(
            old_logprobs, rollout_logprobs, response_mask, gating, per_sequence=True
        )
        seq_keep = (seq_stat >= low) & (seq_stat <= high)
        keep = valid & seq_keep.unsqueeze(-1)
        nonempty = valid.any(dim=-1)
        rejected = (nonempty & ~seq_keep).to(ratio.dtype)
        n_rows = nonempty.to(ratio.dtype).sum().clamp(min=1)
        stats["is_seq_masked_frac"] = rejected.sum() / n_rows
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    stats["is_weight_mean"] = masked_mean(weights, response_mask)
    stats["is_clipfrac"] = masked_mean((truncated & keep).to(ratio.dtype), response_mask)
    stats["is_masked_frac"] = masked_sum((valid & ~keep).to(ratio.dtype), response_mask) / (
        valid.to(ratio.dtype).sum().clamp(min=1)
    )
    return weights, stats


def staleness_clip(
    clip_eps_low: float, clip_eps_high: float | None, lag: torch.Tensor | None
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """PPO's clip range around the behaviour policy for tokens ``lag`` versions stale: the
    ratio bounds ``[(1 - eps_low)^(1 + lag), (1 + eps_high)^(1 + lag)]``, returned as the
    ``(clip_eps_low, clip_eps_high)`` :func:`~fsdp_rlhf.algorithms.losses.policy_loss` takes
    (per token when ``lag`` is a (B, T) tensor; the plain range for ``lag`` None or 0).

    Each PPO update may move the policy one trust region (``1 +- eps``) from where it starts;
    the policy this update produces is ``1 + lag`` updates from a token sampled ``lag``
    versions before the update's start, so the region around the behaviour policy compounds.
    One region (the plain clip) silences tokens that only moved as on-policy updates would
    have; none lets a stale batch push its tokens further in the direction the updates since
    it was sampled already took them.
    """
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if lag is None:
        return clip_eps_low, clip_eps_high
    power = 1.0 + lag.clamp(min=0).to(torch.float32)
    low = 1.0 - (1.0 - clip_eps_low) ** power
    high = (1.0 + clip_eps_high) ** power - 1.0
    return low, high


@torch.no_grad()
def behaviour_ratio_stats(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps_low: float | torch.Tensor = 0.2,
    clip_eps_high: float | torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The policy being trained against the behaviour policy (the weights that sampled each
    token), on valid tokens: ``r_t = exp(logprobs - behaviour_logprobs)``.

    Args:
        logprobs: (B, T) log-probs under the policy being updated.
        behaviour_logprobs: (B, T) the engine's log-probs of the sampled tokens.
        advantages: (B, T) advantages.
        response_mask: (B, T) valid response tokens.
        clip_eps_low, clip_eps_high: PPO's clip range around the behaviour policy
            (``None``: ``clip_eps_low``), floats or per token (:func:`staleness_clip`).

    Returns:
        Detached local 0-d tensors: ``behaviour_ratio`` (token mean of ``r_t``),
        ``behaviour_ratio_max`` (its max; reduce with MAX) and ``behaviour_clipfrac`` (valid
        tokens a PPO clip around the behaviour policy silences: ``r_t > 1 + eps_high`` with a
        positive advantage, ``r_t < 1 - eps_low`` with a negative one).
    """
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    valid = response_mask.bool()
    log_ratio = (logprobs.detach() - behaviour_logprobs).clamp(-_LOG_RATIO_GUARD, _LOG_RATIO_GUARD)
    ratio = torch.where(valid, log_ratio.exp(), torch.ones_like(log_ratio))
    silenced = ((advantages > 0) & (ratio > 1.0 + clip_eps_high)) | (
        (advantages < 0) & (ratio < 1.0 - clip_eps_low)
    )
    return {
        "behaviour_ratio": masked_mean(ratio, response_mask),
        "behaviour_ratio_max": ratio.where(valid, torch.zeros_like(ratio)).amax()
        if ratio.numel()
        else ratio.sum(),
        "behaviour_clipfrac": masked_mean((silenced & valid).to(ratio.dtype), response_mask),
    }


@torch.no_grad()
def logprob_gap_by_staleness(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    lag: torch.Tensor,
    response_mask: torch.Tensor,
    max_lag: int,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``|log pi_old - log pi_behaviour|`` per staleness: for each lag ``0 .. max_lag`` (the
    versions between the weights that sampled a token and ``pi_old``) the sum over the valid
    tokens of that lag and their count (local 0-d tensors; divide the global sums).

    Args:
        old_logprobs: (B, T) the trainer's log-probs before this step's update.
        behaviour_logprobs: (B, T) the engine's log-probs (each token its own version's).
        lag: (B, T) integer staleness of each token.
        response_mask: (B, T) valid response tokens.
        max_lag: the largest lag reported (the queue's bound).
    """
    valid = response_mask.bool()
    gap = (old_logprobs - behaviour_logprobs).abs()
    out = {}
    for k in range(max_lag + 1):
        tokens = valid & (lag == k)
        out[k] = (gap.where(tokens, torch.zeros_like(gap)).sum(), tokens.sum())
    return out
