"""Direct preference losses on sequence log-probabilities: DPO, IPO, cDPO, and the NLL term.

Every function takes per-pair sums of response-token log-probabilities (the policy's and the
frozen reference's) and returns per-pair values; the trainer averages them. Notation:
``h = (logp_c - logp_r) - (ref_c - ref_r)``, the policy's log-ratio margin over the reference.

- DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7): ``-log sigmoid(beta * h)``.
- cDPO (Mitchell 2023, "A note on DPO with noisy preferences", eq. 3): labels flipped with
  probability ``eps``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.
- IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17): ``(h - 1 / (2 beta))^2``.
- NLL term (Llama 3.1 report, section 4.1.4; OpenRLHF's ``--nll_loss_coef``): the chosen
  response's mean per-token negative log-likelihood.

The implicit rewards TRL and OpenRLHF log are ``beta * (logp - ref)`` per side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def preference_logits(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
) -> torch.Tensor:
    """``h``: (B,) policy log-ratio minus reference log-ratio; all inputs (B,)."""
    return (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)


def dpo_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """(B,) DPO loss, or cDPO's with ``label_smoothing`` = flip probability in [0, 0.5)."""
    loss = -F.logsigmoid(beta * logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-beta * logits)
    return loss


def ipo_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """(B,) IPO loss: squared distance of ``h`` from ``1 / (2 beta)``."""
    return (logits - 1.0 / (2.0 * beta)) ** 2


def nll_loss(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """(B,) mean negative log-likelihood per chosen response token; ``chosen_tokens`` (B,)
    counts the response tokens (>= 1)."""
    return -chosen_logps / chosen_tokens.clamp(min=1).to(chosen_logps.dtype)


@dataclass(frozen=True)
class PreferenceOutput:
    """Per-pair (B,) values: ``loss`` (the preference loss plus the weighted NLL term), the
    implicit rewards, and the NLL term alone."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    nll: torch.Tensor


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    *,
    beta: float,
    ipo: bool = False,
    label_smoothing: float = 0.0,
    nll_loss_coef: float = 0.0,
) -> PreferenceOutput:
    """DPO, cDPO or IPO per pair, plus ``nll_loss_coef`` x the chosen side's NLL.

    Args:
        chosen_logps, rejected_logps: (B,) summed response log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: (B,) the same under the reference (no grad).
        chosen_tokens: (B,) response tokens of each chosen sequence.
    """
    logits = preference_logits(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    loss = ipo_loss(logits, beta) if ipo else dpo_loss(logits, beta, label_smoothing)
    nll = nll_loss(chosen_logps, chosen_tokens)
    if nll_loss_coef:
        loss = loss + nll_loss_coef * nll
    return PreferenceOutput(
        loss=loss,
        chosen_rewards=beta * (chosen_logps - ref_chosen_logps).detach(),
        rejected_rewards=beta * (rejected_logps - ref_rejected_logps).detach(),
        nll=nll.detach(),
    )
