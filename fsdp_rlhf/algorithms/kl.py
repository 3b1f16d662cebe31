"""Per-token KL estimators and KL-coefficient controllers.

The estimators follow J. Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html). With tokens sampled from the policy and
``log_ratio = logprobs - ref_logprobs``:

* ``k1 = log_ratio``: unbiased for KL(policy || ref), high variance, can be negative.
* ``k2 = 0.5 * log_ratio ** 2``: biased, low variance, always >= 0. Its gradient with respect
  to ``logprobs`` is ``log_ratio``, which is the gradient of the true KL in expectation.
* ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased, low variance, always >= 0.
* ``k3+``: the value of k3 with the gradient of k2 (straight-through). Used directly as an
  on-policy loss, k3's gradient estimates the gradient of the reverse KL(ref || policy), not
  of KL(policy || ref); the k2 gradient is the right one, so k3+ logs the k3 value but
  optimises with the k2 gradient.

Clamping and gradients
----------------------
``clamp`` bounds the *value* of the estimate (what is logged, added to the reward, or shown as
the KL loss) but not its gradient: the clamp is straight-through, so every token keeps the
gradient of the unclamped estimator. A plain ``clamp(-10, 10)`` would give k2 a zero gradient
once ``|log_ratio| > sqrt(20) ~ 4.47`` and k1 once ``|log_ratio| > 10``: exactly the tokens
that drifted furthest from the reference would stop being pulled back. ``k3+`` therefore has
the gradient ``log_ratio`` (that of k2) everywhere, with the (clamped) k3 value.
``log_ratio_clamp`` (default 20) is the only hard clamp: it guards ``exp`` against overflow and
its gradient is zero beyond it. Note that plain k3's own gradient, ``1 - exp(-log_ratio)``,
grows like ``exp(|log_ratio|)`` for negative log-ratios; prefer ``k3+`` (or k2) as a loss.

Unbiased gradient (``unbiased_gradient=True``, OpenRLHF 0.11.1's ``--algo.kl.unbiased_gradient``)
-------------------------------------------------------------------------------------------
As a loss, after the first optimizer step of a rollout batch the tokens were sampled from
``pi_old``, not from the current policy, so each estimator's own gradient is off-policy (and
k1's is zero in expectation even on-policy). With ``unbiased_gradient`` the value stays the
chosen estimator's (clamped as above) while the gradient becomes
``w * log_ratio * grad(logprobs)`` with ``w = min(pi / pi_old, 10)`` detached: the
importance-weighted score-function gradient of KL(policy || ref), whatever the estimator.
Without ``old_logprobs`` the weight is 1.

Which mean feeds the KL controller
----------------------------------
:func:`kl_mean_parts` gives the numerator and denominator of the two batch means, so they can
be all-reduced (sum both) and divided, exactly, under data parallelism:

* ``"seq-mean-token-mean"``: the mean over sequences of each sequence's token mean. This is
  what OpenRLHF (``masked_mean(kl, mask, dim=-1)`` per sample, averaged) and verl
  (``apply_kl_penalty``) feed their adaptive controllers, so a ``--kl_target`` taken from
  their scripts means the same thing here. **The trainer should use this one for the
  controller.** (Rows without a valid token are left out of the count; verl counts them
  as 0, which only matters for empty responses.)
* ``"token-mean"``: the mean over all valid tokens of the batch. Long responses weigh more.
  Fine as a logged metric (``actor/kl``), but it is not the quantity OpenRLHF/verl targets.

The controllers implement the KL penalty schedule of Ziegler et al., "Fine-Tuning Language
Models from Human Preferences" (2019), section 2.2.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3", "k3+"]
# the largest importance weight pi / pi_old of the unbiased KL gradient (as OpenRLHF)
IS_WEIGHT_CAP = 10.0


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: KLKind = "k1",
    clamp: float | None = 10.0,
    log_ratio_clamp: float = 20.0,
    *,
    unbiased_gradient: bool = False,
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from log-probs of sampled tokens.

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the policy.
        ref_logprobs: (B, T) log-probs of the same tokens under the reference model.
        kind: One of ``"k1"``, ``"k2"``, ``"k3"``, ``"k3+"`` (see the module docstring).
        clamp: Clamp the *value* of the estimate to ``[-clamp, clamp]``; ``None`` disables. A
            few tokens whose probability collapsed under one model otherwise dominate a whole
            batch. The clamp is straight-through: the gradient is that of the unclamped
            estimator (``k3+``: of k2), so far-off tokens are still pulled back.
        log_ratio_clamp: The log ratio is clamped to ``[-c, c]`` before ``exp`` so k3 cannot
            overflow (a hard clamp: no gradient beyond it).
        unbiased_gradient: Keep the value, take the importance-weighted gradient
            ``w * log_ratio`` (see the module docstring).
        old_logprobs: (B, T) log-probs of the policy that sampled the tokens; the weight
            ``w = min(exp(logprobs - old_logprobs), 10)`` of ``unbiased_gradient`` (1 without).

    Returns:
        (B, T) estimates; the caller applies ``response_mask``.
    """
    log_ratio = (logprobs - ref_logprobs).clamp(-log_ratio_clamp, log_ratio_clamp)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "k3+"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2, k3 or k3+")
    if kind == "k3+":
        k2 = 0.5 * log_ratio.square()
        kl = k2 + (kl - k2).detach()
    if clamp is not None:
        kl = kl + (kl.detach().clamp(-clamp, clamp) - kl.detach())
    if unbiased_gradient:
        weight = 1.0
        if old_logprobs is not None:
            weight = (logprobs.detach() - old_logprobs.detach()).exp().clamp(max=IS_WEIGHT_CAP)
        surrogate = weight * 0.5 * log_ratio.square()  # gradient: weight * log_ratio
        kl = kl.detach() + (surrogate - surrogate.detach())
    return kl


def kl_mean_parts(
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    mode: Literal["seq-mean-token-mean", "token-mean"] = "seq-mean-token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numerator and denominator of a batch-mean KL, to be summed over ranks and divided.

    Args:
        kl: (B, T) per-token KL estimates (e.g. from :func:`kl_estimate`).
        response_mask: (B, T) valid response tokens.
        mode: ``"seq-mean-token-mean"``: (sum over sequences of each sequence's token mean,
            number of sequences with at least one valid token); the OpenRLHF/verl quantity
            for the KL controller. ``"token-mean"``: (sum over valid tokens, number of valid
            tokens).

    Returns:
        ``(numerator, denominator)``: 0-d tensors in ``kl``'s dtype, detached. The mean is
        ``numerator / max(denominator, 1)`` locally, or after all-reducing both (SUM) across
        data-parallel ranks for the global value.
    """
    valid = response_mask.bool()
    kl = torch.where(valid, kl.detach(), torch.zeros_like(kl))
    counts = valid.to(kl.dtype).sum(dim=-1)
    if mode == "token-mean":
        return kl.sum(), counts.sum()
    if mode == "seq-mean-token-mean":
        per_seq = kl.sum(dim=-1) / counts.clamp(min=1)
        return per_seq.sum(), (counts > 0).to(kl.dtype).sum()
    raise ValueError(f"unknown KL mean {mode!r}; expected seq-mean-token-mean or token-mean")


class FixedKLController:
    """Constant KL coefficient, with the same interface as :class:`AdaptiveKLController`.

    Args:
        kl_coef: The coefficient ``beta`` of the KL penalty.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so trainers need not special-case the fixed controller."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the observed KL towards a target.

    Each update multiplies the coefficient by ``1 + e * n_steps / horizon`` where
    ``e = clip(current_kl / target - 1, -0.2, 0.2)`` (Ziegler et al. 2019). The clip keeps a
    single outlier batch from moving the coefficient by more than 20% per horizon.

    Args:
        init_kl_coef: Starting coefficient.
        target: Desired KL per sequence (in the same units as ``current_kl``).
        horizon: Number of samples over which a full proportional correction is applied.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be positive, got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust ``value`` after observing ``current_kl`` over ``n_steps`` samples.

        A NaN/Inf observation is ignored: NaN would survive the clip below and poison the
        coefficient (and every later reward) for the rest of the run.
        """
        if not math.isfinite(float(current_kl)):
            return
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))
