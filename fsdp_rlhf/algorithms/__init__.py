"""RLHF math as pure torch functions: masked statistics, log-probs, KL, rewards, advantages,
losses, rollout/trainer mismatch correction, dynamic-sampling filters and pass@k. Nothing
here imports model, inference or config code, so it can be unit-tested in isolation and
reused by any trainer.
"""

from .advantages import (
    Advantages,
    dr_grpo,
    estimate_advantages,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from .correction import rollout_correction, rollout_mismatch_metrics
from .filtering import dynamic_filter_groups, expand_group_mask
from .kl import AdaptiveKLController, FixedKLController, kl_estimate, kl_mean, kl_mean_parts
from .logprobs import entropy_from_logits, gathered_logprobs, logprobs_from_logits
from .losses import (
    aggregate_loss,
    entropy_bonus,
    gspo_loss,
    pairwise_loss,
    policy_loss,
    truncated_is_weights,
    value_loss,
)
from .masked import masked_mean, masked_sum, masked_var, masked_whiten
from .passk import eval_pass_metrics, pass_at_k, pass_at_k_per_prompt
from .rewards import RunningMeanStd, clip_scores, overlong_penalty, shape_rewards

__all__ = [
    "Advantages",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMeanStd",
    "aggregate_loss",
    "clip_scores",
    "dr_grpo",
    "dynamic_filter_groups",
    "entropy_bonus",
    "entropy_from_logits",
    "gathered_logprobs",
    "estimate_advantages",
    "eval_pass_metrics",
    "expand_group_mask",
    "gae",
    "grpo",
    "gspo_loss",
    "kl_estimate",
    "kl_mean",
    "kl_mean_parts",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "pairwise_loss",
    "pass_at_k",
    "pass_at_k_per_prompt",
    "policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "rollout_correction",
    "rollout_mismatch_metrics",
    "shape_rewards",
    "truncated_is_weights",
    "value_loss",
]
