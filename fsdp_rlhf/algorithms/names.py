"""The names of the advantage estimators, loss aggregations and rollout corrections, defined
once: the config tree
takes its flag choices from here, the estimators and losses dispatch on them. No torch here, so
the config (and ``--help``) imports it cheaply."""

from __future__ import annotations

from typing import Literal, get_args

AdvantageEstimator = Literal[
    "gae",
    "reinforce++",
    "rloo",
    "grpo",
    "dr_grpo",
    "reinforce_plus_plus_baseline",
    "reinforce_baseline",
    "flash_reinforce",
]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
CRITIC_ESTIMATORS = ("gae",)  # the others are critic-free
# Group-mean baselines over the n_samples_per_prompt samples of a prompt.
GROUP_ESTIMATORS = ("rloo", "grpo", "dr_grpo")
# One estimator under verl's name and OpenRLHF's: a group-mean baseline, then REINFORCE++.
BASELINE_ESTIMATORS = ("reinforce_plus_plus_baseline", "reinforce_baseline")
ESTIMATORS_NEEDING_GROUPS = (*GROUP_ESTIMATORS, *BASELINE_ESTIMATORS)
# A baseline over the whole rollout batch: no groups, any n_samples_per_prompt (1 included).
BATCH_BASELINE_ESTIMATORS = ("flash_reinforce",)

LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)

# Rollout/trainer mismatch corrections (algorithms.correction) and the statistics their masks
# can read.
ISCorrection = Literal["none", "tis", "icepop", "seq_mask", "seq_mask_tis"]
IS_CORRECTIONS: tuple[str, ...] = get_args(ISCorrection)
ISGating = Literal["ratio", "binary_kl", "tv"]
IS_GATINGS: tuple[str, ...] = get_args(ISGating)
GATED_CORRECTIONS = ("icepop", "seq_mask")  # they drop tokens or rows: any gating
SEQUENCE_CORRECTIONS = ("seq_mask", "seq_mask_tis")


def correction_problem(mode: str, low: float, high: float, gating: str = "ratio") -> str | None:
    """Why a correction mode, gating and thresholds do not go together (None: they do)."""
    if mode not in IS_CORRECTIONS:
        return f"unknown IS correction {mode!r}; expected one of {IS_CORRECTIONS}"
    if gating not in IS_GATINGS:
        return f"unknown IS gating {gating!r}; expected one of {IS_GATINGS}"
    if not 0.0 <= low < high:
        return f"IS thresholds need 0 <= LOW < HIGH, got LOW={low}, HIGH={high}"
    if gating == "ratio" or mode == "none":
        return None
    if mode not in GATED_CORRECTIONS:
        return (
            f"gating {gating} drops tokens or rows by a divergence; {mode} clamps the ratio "
            f"into [LOW, HIGH]: use one of {', '.join(GATED_CORRECTIONS)}"
        )
    if low > 0:
        return (
            f"gating {gating} bounds a divergence from above only: LOW must be 0 (give one "
            f"threshold, the bound), got LOW={low}"
        )
    return None


# On-policy distillation signals (algorithms.distill): the reverse-KL advantage, a KL loss term
# with one of Schulman's estimators, or a top-k KL with a tail bucket.
DistillLoss = Literal["advantage", "k1", "k2", "k3", "forward_kl_topk", "reverse_kl_topk"]
DISTILL_LOSSES: tuple[str, ...] = get_args(DistillLoss)
TOPK_DISTILL_LOSSES = ("forward_kl_topk", "reverse_kl_topk")
