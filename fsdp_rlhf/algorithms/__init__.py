"""RLHF math as pure torch functions: masked statistics, log-probs, KL, rewards, advantages
and losses. Nothing here imports model, inference or config code, so it can be unit-tested
in isolation and reused by any trainer.
"""

from .advantages import (
    Advantages,
    dr_grpo,
    estimate_advantages,
    gae,
    grpo,
    reinforce_plus_plus,
    rloo,
)
from .kl import AdaptiveKLController, FixedKLController, kl_estimate
from .logprobs import entropy_from_logits, logprobs_from_logits
from .losses import (
    aggregate_loss,
    entropy_bonus,
    pairwise_loss,
    policy_loss,
    truncated_is_weights,
    value_loss,
)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .rewards import RunningMeanStd, clip_scores, shape_rewards

__all__ = [
    "Advantages",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMeanStd",
    "aggregate_loss",
    "clip_scores",
    "dr_grpo",
    "entropy_bonus",
    "entropy_from_logits",
    "estimate_advantages",
    "gae",
    "grpo",
    "kl_estimate",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_loss",
    "policy_loss",
    "reinforce_plus_plus",
    "rloo",
    "shape_rewards",
    "truncated_is_weights",
    "value_loss",
]
