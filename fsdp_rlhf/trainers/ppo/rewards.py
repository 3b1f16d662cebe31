"""From scores to advantages on one PPO step: rule rewards, the KL term, the estimators and
the KL controller and its observation. Collectives are marked; every rank calls them in step."""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist

from fsdp_rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    distill_advantages,
    estimate_advantages,
    kl_estimate,
    kl_mean_parts,
    overlong_penalty,
    stop_properly_penalty,
)
from fsdp_rlhf.config import DistillConfig, PPOAlgoConfig
from fsdp_rlhf.distributed.env import all_reduce_scalars
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.stats import (
    global_masked_center,
    global_masked_mean,
    global_masked_whiten,
)
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.rule_reward import RewardFn, decode_responses

log = logging.getLogger("fsdp_rlhf")


def rule_scores(fn: RewardFn, exp: Experience, prompts, tokenizer, n_samples: int) -> torch.Tensor:
    """Decode responses and call the rule reward; prompt i owns rows i*n .. i*n+n-1."""
    T = exp.response_len
    responses = decode_responses(tokenizer, exp.input_ids[:, -T:], exp.response_mask)
    texts = [prompts[i // n_samples].text for i in range(exp.num_sequences)]
    labels = [prompts[i // n_samples].label for i in range(exp.num_sequences)]
    return fn([p + r for p, r in zip(texts, responses, strict=True)], texts, labels)


def _kl(exp: Experience, algo: PPOAlgoConfig) -> torch.Tensor:
    return kl_estimate(exp.old_logprobs, exp.ref_logprobs, kind=algo.kl_estimator) * (
        exp.response_mask
    )


def _global_mean(scores: torch.Tensor, group=None) -> torch.Tensor:
    """The mean score of the rollout batch over the data-parallel ranks (``group``: the
    layout's data group; None: every rank). Collective."""
    return global_masked_mean(scores, torch.ones_like(scores, dtype=torch.bool), group)


@torch.no_grad()
def compute_advantages(
    exp: Experience,
    algo: PPOAlgoConfig,
    kl_coef: float,
    n_samples_per_prompt: int,
    parallel: ParallelLayout | None = None,
) -> None:
    """Fill ``exp.rewards/advantages/returns``. Collective (global whitening over the
    layout's data group; None: every rank holds different rows).

    The KL penalty joins the reward unless ``--use_kl_loss`` puts it in the actor loss; only
    then may ``exp.old_logprobs`` still be missing (taken from the update's forward later).
    """
    coef = 0.0 if algo.use_kl_loss else kl_coef
    whiten = global_masked_whiten if algo.advantage_std_norm else global_masked_center
    group = parallel.data_group if parallel is not None else None
    kl = _kl(exp, algo) if coef != 0 else torch.zeros_like(exp.response_mask)
    out = estimate_advantages(
        algo.advantage_estimator,
        exp.scores,
        kl,
        coef,
        exp.response_mask,
        values=exp.values,
        gamma=algo.gamma,
        lam=algo.lam,
        n_samples_per_prompt=n_samples_per_prompt,
        whiten_fn=partial(whiten, group=group),
        mean_fn=partial(_global_mean, group=group),
    )
    exp.rewards, exp.advantages, exp.returns = out


@torch.no_grad()
def add_distill_advantages(exp: Experience, distill: DistillConfig) -> None:
    """``--distill_loss advantage``: each sampled token's advantage gains
    ``-distill_coef * (old_logprob - teacher_logprob)``, after the estimator (not whitened,
    not discounted: the per-token reverse KL of Thinking Machines' on-policy distillation,
    NeMo-RL's ``opd`` and slime's ``--use-opd``). Without a reward source the task advantages
    are zero and this is the whole signal. Nothing without a teacher or with a loss-term
    signal."""
    if exp.teacher_logprobs is None or distill.distill_loss != "advantage":
        return
    extra = distill_advantages(
        exp.old_logprobs, exp.teacher_logprobs, exp.response_mask, distill.distill_coef
    )
    exp.advantages = exp.advantages + extra


@torch.no_grad()
def observe_kl(
    exp: Experience, algo: PPOAlgoConfig, kl_ctl, parallel: ParallelLayout | None = None
) -> dict[str, float]:
    """KL(old || ref) of the global batch, fed to the KL controller. Collective (over the
    layout's data group; None: every rank holds different rows).

    The mean of per-sequence token means (as OpenRLHF and verl feed their controllers): every
    response counts once whatever its length; sequences without valid tokens are left out.
    """
    num, den = kl_mean_parts(_kl(exp, algo), exp.response_mask, mode="seq-mean-token-mean")
    group = parallel.data_group if parallel is not None else None
    total = all_reduce_scalars({"num": float(num), "den": float(den)}, "sum", group)
    mean_kl = total["num"] / max(total["den"], 1.0)
    dp_size = parallel.dp_size if parallel is not None else _world_size()
    kl_ctl.update(mean_kl, exp.num_sequences * dp_size)
    return {"actor/kl": mean_kl}


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@torch.no_grad()
def add_overlong_penalty(exp: Experience, algo: PPOAlgoConfig, max_len: int) -> None:
    """DAPO's soft overlong punishment added to ``exp.scores`` (``--overlong_buffer_len``).

    Added after ``--reward_clip_range`` clipping so the penalty keeps its documented size, and
    before dynamic filtering: groups are kept by the scores their advantages will see.
    """
    if algo.overlong_buffer_len is None:
        return
    lengths = exp.response_mask.sum(-1)
    penalty = overlong_penalty(
        lengths, max_len, algo.overlong_buffer_len, algo.overlong_penalty_factor
    )
    exp.scores = exp.scores + penalty.to(exp.scores)


@torch.no_grad()
def add_stop_properly_penalty(exp: Experience, algo: PPOAlgoConfig) -> None:
    """ProRL's penalty on truncated responses (``--stop_properly_penalty_coef``) applied to
    ``exp.scores``, after the overlong penalty (as OpenRLHF orders them) and before dynamic
    filtering. A multi-turn trajectory counts as truncated when its last model turn was."""
    coef = algo.stop_properly_penalty_coef
    if coef is None:
        return
    exp.scores = stop_properly_penalty(exp.scores, exp.truncated, coef)


def build_kl_controller(algo: PPOAlgoConfig) -> AdaptiveKLController | FixedKLController:
    """Adaptive (``--kl_target``) or fixed KL coefficient."""
    if algo.use_kl_loss and algo.kl_estimator == "k1" and not algo.kl_unbiased_gradient:
        log.warning(
            "--use_kl_loss with --kl_estimator k1: k1's gradient is zero in expectation, so the "
            "KL term barely constrains the actor; use k2 or k3"
        )
    if algo.kl_target is not None:
        return AdaptiveKLController(algo.init_kl_coef, algo.kl_target, algo.kl_horizon)
    return FixedKLController(algo.init_kl_coef)
