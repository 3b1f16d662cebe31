"""The pieces of one PPO step: experience assembly, advantages, and the two update loops."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fsdp_rlhf.algorithms import (
    aggregate_loss,
    dr_grpo,
    entropy_bonus,
    gae,
    grpo,
    kl_estimate,
    policy_loss,
    reinforce_plus_plus,
    rloo,
    shape_rewards,
    truncated_is_weights,
    value_loss,
)
from fsdp_rlhf.algorithms.advantages import discounted_returns
from fsdp_rlhf.config import PPOAlgoConfig, PPOBatchPlan, PPOConfig
from fsdp_rlhf.distributed.fsdp import accumulate, clip_grad_norm_
from fsdp_rlhf.distributed.offload import offload_model, onload_model
from fsdp_rlhf.distributed.stats import global_masked_mean, global_masked_whiten, global_token_count
from fsdp_rlhf.models.forward import response_logprobs, token_values
from fsdp_rlhf.rollout.engine import RolloutOutput, SamplingConfig
from fsdp_rlhf.trainers.experience import Experience, _chunks, minibatches
from fsdp_rlhf.trainers.ppo_metrics import (
    RunningAverages,
    StatCollector,
    explained_variance,
    reduce_explained_variance,
    throughput,
)
from fsdp_rlhf.trainers.rule_reward import RewardFn

if TYPE_CHECKING:
    from fsdp_rlhf.trainers.ppo import PPOTrainer


# ---------------------------------------------------------------- rollout -> experience


def sampling_config(cfg: PPOConfig, step: int) -> SamplingConfig:
    # A fresh seed per step (so a resumed run samples what the uninterrupted one did); the
    # engine derives per-request seeds from it, identical inside a TP group.
    return SamplingConfig.from_rollout_config(
        cfg.rollout, n=cfg.batch.n_samples_per_prompt, seed=cfg.seed * 100_003 + step
    )


def experience_from_rollout(out: RolloutOutput, device: torch.device) -> Experience:
    input_ids, attention_mask = out.sequences()
    return Experience(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_mask=out.response_mask.float().to(device),
        engine_logprobs=out.engine_logprobs.float().to(device),
    )


def truncated(finish_reasons: list[str]) -> torch.Tensor:
    """(N,) 1.0 for each response cut by ``generate_max_len`` rather than ending on EOS; its
    global mean is ``response_length/clip_ratio``."""
    return torch.tensor([float(r == "length") for r in finish_reasons])


def rule_scores(fn: RewardFn, exp: Experience, prompts, tokenizer, n_samples: int) -> torch.Tensor:
    """Decode responses and call the rule reward; prompt i owns rows i*n .. i*n+n-1."""
    T = exp.response_len
    responses = tokenizer.batch_decode(
        (exp.input_ids[:, -T:] * exp.response_mask.long()).tolist(), skip_special_tokens=True
    )
    texts = [prompts[i // n_samples].text for i in range(exp.num_sequences)]
    labels = [prompts[i // n_samples].label for i in range(exp.num_sequences)]
    return fn([p + r for p, r in zip(texts, responses, strict=True)], texts, labels)


# ---------------------------------------------------------------- advantages


def old_logprobs_from_update(cfg: PPOConfig, plan: PPOBatchPlan, actor_updates: bool) -> bool:
    """Whether the actor update can supply ``old_logprobs`` instead of a separate forward.

    With one epoch and one optimizer step per rollout batch, every micro-batch of the update
    runs on the weights the batch was scored with, so its detached log-probs are exactly the
    old ones (the ratio is 1, as verl and TRL also exploit). That holds only if nothing needs
    them before the update: not a KL penalty in the reward, nor an adaptive KL controller
    (it sets the coefficient the update uses).
    """
    a = cfg.algo
    kl_in_reward = not a.use_kl_loss and a.init_kl_coef != 0
    return (
        actor_updates
        and a.ppo_epochs == 1
        and plan.optimizer_steps_per_epoch == 1
        and a.kl_target is None
        and not kl_in_reward
    )


@torch.no_grad()
def compute_advantages(
    exp: Experience, algo: PPOAlgoConfig, kl_ctl, n_samples_per_prompt: int
) -> None:
    """Fill ``exp.rewards/advantages/returns``. Collective.

    ``exp.old_logprobs`` may still be missing when the KL term is not part of the reward.
    """
    mask = exp.response_mask
    coef = 0.0 if algo.use_kl_loss else kl_ctl.value
    if exp.old_logprobs is None:
        if coef != 0:
            raise ValueError("a KL penalty in the reward needs old_logprobs before advantages")
        kl = torch.zeros_like(mask)
    else:
        kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, kind=algo.kl_estimator) * mask
    exp.rewards = shape_rewards(exp.scores, kl, coef, mask)
    est = algo.advantage_estimator
    if est == "gae":
        adv, exp.returns = gae(exp.rewards, exp.values, mask, algo.gamma, algo.lam)
        exp.advantages = global_masked_whiten(adv, mask)
    elif est == "reinforce++":
        exp.advantages, exp.returns = reinforce_plus_plus(
            exp.rewards, mask, algo.gamma, whiten_fn=global_masked_whiten
        )
    else:
        # Each rank holds whole groups: the n samples of a prompt are contiguous rows.
        estimator = {"rloo": rloo, "grpo": grpo, "dr_grpo": dr_grpo}[est]
        group = estimator(exp.scores, mask, n_samples_per_prompt)
        # The KL penalty keeps its per-token place: its reward-to-go adds to the group baseline.
        kl_to_go = discounted_returns(-coef * kl, mask, algo.gamma)
        exp.advantages = (group + kl_to_go) * mask
        exp.returns = discounted_returns(exp.rewards, mask, algo.gamma)


@torch.no_grad()
def observe_kl(exp: Experience, algo: PPOAlgoConfig, kl_ctl) -> dict[str, float]:
    """Mean KL(old || ref) over the global batch; feeds the KL controller. Collective."""
    mask = exp.response_mask
    kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, kind=algo.kl_estimator) * mask
    mean_kl = float(global_masked_mean(kl, mask))
    n_global = exp.num_sequences * (
        torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    )
    kl_ctl.update(mean_kl, n_global)
    return {"actor/kl": mean_kl}


# ---------------------------------------------------------------- updates


def _update_loop(trainer: PPOTrainer, name: str, exp: Experience, loss_fn) -> dict[str, float]:
    """``ppo_epochs`` x shuffled minibatches x micro-batches; one optimizer step per minibatch.

    Losses are normalised by the minibatch's global token (or sequence) count and FSDP sums
    gradients across ranks, so every optimizer step sees the exact global token mean.
    """
    cfg, plan = trainer.cfg, trainer.plan
    model = trainer.models.actor if name == "actor" else trainer.models.critic
    opt, sched = trainer.optimizers[name], trainer.schedulers[name]
    optim_cfg = cfg.actor_optim if name == "actor" else cfg.critic_optim
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + trainer.step * 31 + trainer.env.rank)
    stats, norms = RunningAverages(), []
    for _ in range(cfg.algo.ppo_epochs):
        for idx in minibatches(exp.num_sequences, plan.train_batch_size_per_rank, gen):
            num_tokens = global_token_count(exp.response_mask[idx])
            num_seqs = cfg.batch.train_batch_size
            micros = _chunks(len(idx), plan.micro_train_batch_size)
            for i, sl in enumerate(micros):
                accumulate(model, i == len(micros) - 1, cfg.fsdp.zero_stage)
                rows = idx[sl]  # in exp, for loss functions that write results back
                loss, step_stats = loss_fn(exp.rows(rows), rows, num_tokens, num_seqs)
                loss.backward()
                stats.add(step_stats)
            norms.append(clip_grad_norm_(list(model.parameters()), optim_cfg.max_norm))
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
    out = stats.reduce()
    out["grad_norm" if name == "actor" else "critic/grad_norm"] = sum(norms) / max(len(norms), 1)
    return out


def update_actor(
    trainer: PPOTrainer, exp: Experience, fold_old_logprobs: bool = False
) -> dict[str, float]:
    """Actor updates. With ``fold_old_logprobs`` (see :func:`old_logprobs_from_update`) the
    update's own forward provides ``exp.old_logprobs``, filled in as it goes."""
    cfg, algo = trainer.cfg, trainer.cfg.algo
    kl_coef = trainer.kl_ctl.value
    if fold_old_logprobs:
        exp.old_logprobs = torch.zeros_like(exp.response_mask)

    def loss_fn(mb: Experience, rows: torch.Tensor, num_tokens, num_seqs):
        logprobs, entropy = response_logprobs(
            trainer.models.actor,
            mb.input_ids,
            mb.attention_mask,
            mb.response_len,
            temperature=cfg.rollout.temperature,
            with_entropy=True,
            entropy_grad=algo.entropy_loss_coef > 0,  # else a metric only
            packed=cfg.batch.packing_samples,
        )
        old_logprobs = mb.old_logprobs
        if fold_old_logprobs:
            old_logprobs = logprobs.detach() * mb.response_mask
            exp.old_logprobs[rows] = old_logprobs
        is_weights = None
        if algo.use_tis:
            is_weights, _ = truncated_is_weights(
                old_logprobs, mb.engine_logprobs, mb.response_mask, algo.tis_cap
            )
        agg = dict(loss_agg=algo.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
        loss, st = policy_loss(
            logprobs,
            old_logprobs,
            mb.advantages,
            mb.response_mask,
            clip_eps_low=algo.eps_clip,
            clip_eps_high=algo.eps_clip_high,
            dual_clip=algo.dual_clip,
            is_weights=is_weights,
            **agg,
        )
        stats = {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": st["pg_clipfrac"],
            "actor/ppo_kl": st["ppo_kl"],
        }
        kl = kl_estimate(logprobs, mb.ref_logprobs, kind=algo.kl_estimator)
        kl_loss = aggregate_loss(
            kl, mb.response_mask, mode=algo.loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs
        )
        if algo.use_kl_loss:
            loss = loss + kl_coef * kl_loss
        if algo.entropy_loss_coef > 0:
            loss = loss + entropy_bonus(entropy, mb.response_mask, algo.entropy_loss_coef, **agg)
        stats["actor/kl_loss"] = kl_loss.detach()
        stats["actor/entropy"] = _local_mean(entropy.detach(), mb.response_mask)
        return loss, stats

    out = _update_loop(trainer, "actor", exp, loss_fn)
    # pg_loss and kl_loss are fractions of a global mean: their sum over micro-batches and ranks
    # is the value; RunningAverages averaged them, so scale back to the sum.
    for key in ("actor/pg_loss", "actor/kl_loss"):
        out[key] *= _micro_steps_per_update(trainer) * trainer.env.world_size
    return out


def update_critic(trainer: PPOTrainer, exp: Experience) -> dict[str, float]:
    algo, packed = trainer.cfg.algo, trainer.cfg.batch.packing_samples
    T = exp.response_len

    def loss_fn(mb: Experience, rows: torch.Tensor, num_tokens, num_seqs):
        values = token_values(trainer.models.critic, mb.input_ids, mb.attention_mask, packed)
        values = values[:, -T - 1 : -1]
        loss, st = value_loss(
            values,
            mb.values,
            mb.returns,
            mb.response_mask,
            value_clip=algo.value_clip if algo.value_clip > 0 else None,
            loss_agg=algo.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": st["vf_clipfrac"]}

    out = _update_loop(trainer, "critic", exp, loss_fn)
    out["critic/vf_loss"] *= _micro_steps_per_update(trainer) * trainer.env.world_size
    out["critic/lr"] = trainer.schedulers["critic"].get_last_lr()[0]
    out["critic/vf_explained_var"] = reduce_explained_variance(
        explained_variance(exp.values, exp.returns, exp.response_mask)
    )
    return out


def _micro_steps_per_update(trainer: PPOTrainer) -> int:
    plan = trainer.plan
    return math.ceil(plan.train_batch_size_per_rank / plan.micro_train_batch_size)


def _local_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


# ---------------------------------------------------------------- metrics and samples


def collect_batch_stats(stats: StatCollector, exp: Experience) -> None:
    mask = exp.response_mask
    stats.add("critic/score", exp.scores)
    stats.add("critic/rewards", (exp.rewards * mask).sum(-1))
    stats.add("critic/advantages", exp.advantages, mask)
    stats.add("critic/returns", exp.returns, mask)
    if exp.values is not None:
        stats.add("critic/values", exp.values, mask)
    stats.add("response_length", mask.sum(-1))
    prompt_mask = exp.attention_mask[:, : -exp.response_len]
    stats.add("prompt_length", prompt_mask.sum(-1).float())
    diff = (exp.engine_logprobs - exp.old_logprobs).abs()
    stats.add("rollout/logprob_diff", diff, mask)


def throughput_metrics(
    metrics: dict[str, float], times: dict[str, float], cfg: PPOConfig, world_size: int
) -> dict[str, float]:
    tokens = metrics["response_length/mean"] + metrics["prompt_length/mean"]
    n = cfg.batch.rollout_batch_size * cfg.batch.n_samples_per_prompt
    return {
        "e2e_tps": throughput(tokens, n, world_size, times.get("all", 0.0)),
        "update_tps": throughput(tokens, n, world_size, times.get("update", 0.0)),
        "vllm_tps": throughput(tokens, n, world_size, times.get("rollout", 0.0)),
    }


def log_samples(trainer: PPOTrainer, exp: Experience, prompts, k: int = 3) -> None:
    """A few prompt/response/score triples to TensorBoard text and ``samples.jsonl``."""
    tok, T, n = trainer.models.tokenizer, exp.response_len, trainer.cfg.batch.n_samples_per_prompt
    rows = []
    for i in range(min(k, exp.num_sequences)):
        ids = exp.input_ids[i, -T:][exp.response_mask[i].bool()].tolist()
        rows.append(
            {
                "step": trainer.step,
                "prompt": prompts[i // n].text,
                "response": tok.decode(ids, skip_special_tokens=False),
                "score": float(exp.scores[i]),
            }
        )
    path = Path(trainer.cfg.ckpt.save_path) / "samples.jsonl"
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    body = "\n\n".join(
        f"**prompt**: {r['prompt']}\n\n**response**: {r['response']}\n\n**score**: {r['score']:.4f}"
        for r in rows
    )
    trainer.logger.text("samples", body, trainer.step)


class OnloadedModel:
    """Context: onload a frozen model (timed as ``<name>_onload``) and, with
    ``--ref_reward_offload``, offload it again after use (``<name>_offload``)."""

    def __init__(self, trainer: PPOTrainer, model, name: str) -> None:
        self.trainer, self.model, self.name = trainer, model, name

    def __enter__(self):
        with self.trainer.timer(f"{self.name}_onload"):
            onload_model(self.model, self.trainer.env.device)
        return self.model

    def __exit__(self, *exc) -> None:
        if self.trainer.cfg.placement.ref_reward_offload:
            with self.trainer.timer(f"{self.name}_offload"):
                offload_model(self.model, self.trainer.env.device)


__all__ = ["compute_advantages", "update_actor", "update_critic"]
