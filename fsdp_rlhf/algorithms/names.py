"""The names of the advantage estimators and loss aggregations, defined once: the config tree
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
]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
CRITIC_ESTIMATORS = ("gae",)  # the others are critic-free
# Group-mean baselines over the n_samples_per_prompt samples of a prompt.
GROUP_ESTIMATORS = ("rloo", "grpo", "dr_grpo")
# One estimator under verl's name and OpenRLHF's: a group-mean baseline, then REINFORCE++.
BASELINE_ESTIMATORS = ("reinforce_plus_plus_baseline", "reinforce_baseline")
ESTIMATORS_NEEDING_GROUPS = (*GROUP_ESTIMATORS, *BASELINE_ESTIMATORS)

LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)
