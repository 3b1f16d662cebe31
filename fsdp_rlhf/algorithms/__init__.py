"""RLHF math as pure torch functions: masked statistics, log-probs, KL, rewards, advantages,
losses, direct preference (DPO/IPO) losses, distillation signals, rollout/trainer mismatch
correction, dynamic-sampling filters and pass@k. Nothing
here imports model, inference or config code, so it can be unit-tested in isolation and
reused by any trainer.

The names of the estimators and loss aggregations (:mod:`.names`) come without torch; the
functions load with their module on first use, so the config tree can import the names
cheaply (``fsdp-rlhf ppo --help``).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .names import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGG_MODES,
    AdvantageEstimator,
    LossAgg,
)

_MODULE_OF = {
    "AdaptiveKLController": "kl",
    "Advantages": "advantages",
    "FixedKLController": "kl",
    "PreferenceOutput": "preference",
    "aggregate_loss": "losses",
    "behaviour_ratio_stats": "correction",
    "binary_kl": "correction",
    "clip_scores": "rewards",
    "distill_advantages": "distill",
    "distill_kl": "distill",
    "dpo_loss": "preference",
    "dr_grpo": "advantages",
    "dynamic_filter_groups": "filtering",
    "entropy_bonus": "losses",
    "entropy_from_logits": "logprobs",
    "estimate_advantages": "advantages",
    "eval_pass_metrics": "passk",
    "expand_group_mask": "filtering",
    "flash_reinforce": "advantages",
    "forward_kl_from_logits": "distill",
    "gae": "advantages",
    "gathered_logprobs": "logprobs",
    "gating_statistic": "correction",
    "grpo": "advantages",
    "gspo_loss": "losses",
    "head_logprobs": "logprobs",
    "ipo_loss": "preference",
    "kd_forward_kl": "distill",
    "kd_loss": "distill",
    "kl_estimate": "kl",
    "kl_mean_parts": "kl",
    "logprob_gap_by_staleness": "correction",
    "logprobs_from_logits": "logprobs",
    "masked_mean": "masked",
    "masked_sum": "masked",
    "masked_var": "masked",
    "masked_whiten": "masked",
    "nll_loss": "preference",
    "overlong_penalty": "rewards",
    "pairwise_loss": "losses",
    "pass_at_k": "passk",
    "pass_at_k_per_prompt": "passk",
    "picked_logprobs": "distill",
    "policy_loss": "losses",
    "preference_logits": "preference",
    "preference_loss": "preference",
    "reinforce_plus_plus": "advantages",
    "reinforce_plus_plus_baseline": "advantages",
    "rloo": "advantages",
    "rollout_correction": "correction",
    "rollout_mismatch_metrics": "correction",
    "shape_rewards": "rewards",
    "staleness_clip": "correction",
    "stop_properly_penalty": "rewards",
    "topk_kl": "distill",
    "topk_logprobs": "distill",
    "topk_mass": "distill",
    "total_variation": "correction",
    "value_loss": "losses",
}

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "AdvantageEstimator",
    "LossAgg",
    *_MODULE_OF,
]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
