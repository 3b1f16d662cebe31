"""The PPO updates: ``ppo_epochs`` x shuffled minibatches x micro-batches, for the actor and
the critic. Every function takes the model, its optimizer and schedule and the config sections
it reads; none sees the trainer.

Losses are normalised by the minibatch's global token (or sequence) count and FSDP sums
gradients across ranks (``grad_reduce="sum"``), so every optimizer step sees the exact global
mean however the batch is sharded and split into micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

import fsdp_rlhf.trainers.ppo.pairing as pairing
from fsdp_rlhf.algorithms import (
    aggregate_loss,
    behaviour_ratio_stats,
    distill_kl,
    entropy_bonus,
    gspo_loss,
    kl_estimate,
    policy_loss,
    rollout_correction,
    staleness_clip,
    topk_kl,
    value_loss,
)
from fsdp_rlhf.config import DistillConfig, PPOAlgoConfig, PPOBatchPlan, PPOConfig
from fsdp_rlhf.distributed.env import all_reduce_scalars
from fsdp_rlhf.distributed.fsdp import accumulate
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.stats import global_token_count
from fsdp_rlhf.models.forward import response_logprobs, token_values
from fsdp_rlhf.models.inputs import ForwardInputs, InputSpec
from fsdp_rlhf.models.moe import MoEHooks, routing_scope
from fsdp_rlhf.trainers.experience import Experience, micro_batches, minibatches
from fsdp_rlhf.trainers.guards import BadStepGuard, finite_mean, guarded_step
from fsdp_rlhf.trainers.micro_batches import MicroBatching
from fsdp_rlhf.trainers.ppo.metrics import (
    RunningAverages,
    explained_variance,
    reduce_explained_variance,
)

# loss_fn(micro_batch, its forward inputs, num_tokens, num_seqs) -> (loss, detached stats)
LossFn = Callable[
    [Experience, ForwardInputs, int, int], tuple[torch.Tensor, dict[str, torch.Tensor]]
]
# scope(micro_batch, its forward inputs, counted) -> held over its forward and backward
Scope = Callable[[Experience, ForwardInputs, bool], AbstractContextManager]


@dataclass(frozen=True)
class UpdatePlan:
    """How one rollout batch is cut into optimizer steps, for either model."""

    ppo_epochs: int
    global_batch_size: int  # sequences per optimizer step over all ranks (train_batch_size)
    batch_size_per_rank: int
    micro_batch_size: int
    world_size: int
    zero_stage: int
    packed: bool
    norm_len: int  # the constant of --loss_agg_mode seq-mean-token-sum-norm (generate_max_len)
    # consecutive rows sharing one pass of their prompt (models.shared_prefix); minibatches
    # and micro-batches keep them together
    group_size: int = 1
    # --use_dynamic_batch: micro-batches of at most this many tokens (trainers.micro_batches);
    # per sequence-parallel group: --train_max_tokens_per_gpu x its ranks
    max_tokens: int | None = None
    # the run's parallel layout: the data group the token counts and sums reduce over
    parallel: ParallelLayout = ParallelLayout()
    # ZeRO-3: each layer gathered once per optimizer step (--accumulate_gathered, resolved)
    gathered: bool = False

    @property
    def batching(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_size, self.max_tokens, self.packed, self.group_size)

    @classmethod
    def from_config(
        cls,
        cfg: PPOConfig,
        plan: PPOBatchPlan,
        group_size: int = 1,
        parallel: ParallelLayout | None = None,
        gathered: bool = False,
    ) -> UpdatePlan:
        dynamic = cfg.batch.use_dynamic_batch
        sp = plan.world_size // plan.dp_size  # a group's ranks each hold 1/sp of its tokens
        return cls(
            ppo_epochs=cfg.algo.ppo_epochs,
            global_batch_size=cfg.batch.train_batch_size,
            batch_size_per_rank=plan.train_batch_size_per_rank,
            micro_batch_size=plan.micro_train_batch_size,
            world_size=plan.world_size,
            zero_stage=cfg.fsdp.zero_stage,
            packed=cfg.batch.packing_samples,
            norm_len=cfg.rollout.generate_max_len,
            group_size=group_size,
            max_tokens=cfg.batch.train_max_tokens_per_gpu * sp if dynamic else None,
            parallel=parallel if parallel is not None else ParallelLayout(),
            gathered=gathered,
        )


@dataclass(frozen=True)
class TrainedModel:
    """One trained model (an entry of :class:`~fsdp_rlhf.trainers.common.TrainedModels`) with
    what its optimizer steps need: optimizer, schedule, clipping norm and the guard that skips
    non-finite steps (``step`` is the PPO step, for its message)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    max_norm: float
    guard: BadStepGuard
    step: int


def reuse_update_logprobs(
    algo: PPOAlgoConfig,
    optimizer_steps_per_epoch: int,
    actor_updates: bool,
    distill: DistillConfig | None = None,
) -> bool:
    """Whether the actor update's own forward can supply ``old_logprobs``, saving a forward.

    With one epoch and one optimizer step per rollout batch, every micro-batch of the update
    runs on the weights the batch was sampled with, so its detached log-probs are exactly the
    old ones (the ratio is 1, as verl and TRL also exploit). That holds only if nothing needs
    them before the update: not a KL penalty in the reward, nor an adaptive KL controller (it
    sets the coefficient the update uses), nor distillation's reverse-KL advantage (it is
    part of the advantages). Never with ``--use_rollout_logprobs_as_old`` (verl's bypass mode):
    the engine's log-probs are the old ones there.
    """
    distill_advantage = distill is not None and distill.enabled
    distill_advantage = distill_advantage and distill.distill_loss == "advantage"
    return (
        actor_updates
        and not distill_advantage
        and not algo.use_rollout_logprobs_as_old
        and algo.ppo_epochs == 1
        and optimizer_steps_per_epoch == 1
        and algo.kl_target is None
        and not kl_in_reward(algo)
    )


def kl_in_reward(algo: PPOAlgoConfig) -> bool:
    return not algo.use_kl_loss and algo.init_kl_coef != 0


def _update_loop(
    opt: TrainedModel,
    exp: Experience,
    plan: UpdatePlan,
    generator: torch.Generator,
    loss_fn: LossFn,
    spec: InputSpec,
    on_micro: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    sum_keys: tuple[str, ...] = (),
    scope: Scope | None = None,
) -> tuple[dict[str, float], float]:
    """Run the epochs; returns the rank-averaged loss statistics and the mean grad norm of
    the optimizer steps taken (a non-finite norm skips its step, see ``guarded_step``).
    Each micro-batch's forward inputs are built by ``spec`` (``models.inputs``).

    ``sum_keys`` are loss terms that are fractions of the step's global mean: their sum over
    micro-batches and ranks, averaged over the optimizer steps, is the value.
    ``on_micro(rows, logprobs)`` sees each micro-batch's row indices in ``exp`` after its
    backward (the actor collects its log-probs through it; dynamic micro-batches give them
    cut to their own response length). ``scope(mb, inputs, counted)`` is held over each
    micro-batch's forward and backward (an MoE actor's router replay; ``counted`` False for a
    padding micro-batch).
    """
    stats, norms = RunningAverages(), []
    for _ in range(plan.ppo_epochs):
        for idx in minibatches(
            exp.num_sequences, plan.batch_size_per_rank, generator, plan.group_size
        ):
            minibatch = exp.rows(idx)
            num_tokens = global_token_count(minibatch.response_mask, plan.parallel.data_group)
            micros = list(micro_batches(minibatch, plan.batching))
            for i, (rows, mb) in enumerate(micros):
                accumulate(opt.model, i == len(micros) - 1, plan.zero_stage, plan.gathered)
                inputs = mb.forward_inputs(spec)
                held = scope(mb, inputs, rows is not None) if scope is not None else nullcontext()
                with held:
                    loss, step_stats = loss_fn(mb, inputs, num_tokens, plan.global_batch_size)
                    logprobs = step_stats.pop("logprobs", None)
                    # padding: the collectives run, nothing is learned
                    (loss * 0.0 if rows is None else loss).backward()
                if rows is None:
                    continue
                if on_micro is not None:
                    on_micro(idx[rows], logprobs)
                stats.add(step_stats)
            norms.append(
                guarded_step(
                    opt.model.parameters(),
                    opt.optimizer,
                    opt.scheduler,
                    opt.max_norm,
                    opt.guard,
                    opt.step,
                )
            )
    reduced = stats.reduce(sum_keys=sum_keys, steps=len(norms), data_group=plan.parallel.data_group)
    return reduced, finite_mean(norms)


def off_policy_mode(algo: PPOAlgoConfig) -> str:
    """``--off_policy_correction`` as the update applies it: ``none``, ``behaviour`` or
    ``decoupled`` (an unresolved ``auto``, a config built without its placement, is the
    colocated default)."""
    mode = algo.off_policy_correction
    if mode == "auto":
        return "behaviour" if algo.use_rollout_logprobs_as_old else "none"
    return mode


def ratio_anchor(algo: PPOAlgoConfig, old_logprobs: torch.Tensor, mb: Experience) -> torch.Tensor:
    """The log-probs the PPO ratio is taken against: the behaviour policy's (each token's engine
    log-prob, its own version's) with ``--off_policy_correction behaviour``, else the trainer's
    old ones (with bypass mode those already are the engine's)."""
    if off_policy_mode(algo) == "behaviour" and not algo.use_rollout_logprobs_as_old:
        return mb.engine_logprobs * mb.response_mask
    return old_logprobs


def clip_range(
    algo: PPOAlgoConfig, mb: Experience, trained_version: int | None
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """PPO's ``(clip_eps_low, clip_eps_high)``: around the behaviour policy, widened per token
    by its staleness (``staleness_clip``: ``trained_version`` minus the version that sampled
    it; asynchronous training), else the flags' range."""
    low, high = algo.eps_clip, algo.eps_clip_high
    if off_policy_mode(algo) != "behaviour" or mb.token_versions is None:
        return staleness_clip(low, high, None)
    if trained_version is None:
        raise ValueError("a batch with weight versions needs the version it is trained from")
    lag = (trained_version - mb.token_versions) * mb.response_mask.long()
    return staleness_clip(low, high, lag)


def _correction(
    algo: PPOAlgoConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, mb: Experience
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token weights of the policy loss and their ``rollout_corr/*`` stats: the rollout
    correction (``--is_correction``), or decoupled PPO's behaviour weights ``pi_old /
    pi_behaviour``, tokens above ``--behaviour_weight_cap`` dropped (AReaL's; ``icepop`` over
    ``[0, cap]``).

    With ``--use_rollout_logprobs_as_old`` the old log-probs *are* the engine's, so the mismatch
    is measured against the update's own (detached) log-probs instead: on the first minibatch of
    the first epoch those are the trainer's old ones.
    """
    trainer = logprobs.detach() if algo.use_rollout_logprobs_as_old else old_logprobs
    mode, gating = algo.is_correction, algo.is_correction_gating
    low, high = algo.is_truncated_threshold
    if off_policy_mode(algo) == "decoupled":
        mode, gating, low, high = "icepop", "ratio", 0.0, algo.behaviour_weight_cap
    weights, st = rollout_correction(
        trainer, mb.engine_logprobs, mb.response_mask, mode, low, high, gating
    )
    return weights, {f"rollout_corr/{k}": v for k, v in st.items()}


def _policy_term(
    algo: PPOAlgoConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mb: Experience,
    is_weights: torch.Tensor | None,
    agg: dict,
    clip: tuple | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's token-ratio loss (``clip``: its ``(eps_low, eps_high)``, default the flags'), or
    GSPO's sequence-ratio loss (``--policy_loss_type gspo``, its own range)."""
    if algo.policy_loss_type == "gspo":
        low, high = algo.gspo_eps_clip_low_high
        loss, st = gspo_loss(
            logprobs,
            old_logprobs,
            mb.advantages,
            mb.response_mask,
            clip_eps_low=low,
            clip_eps_high=high,
            is_weights=is_weights,
            **agg,
        )
        extra = {"actor/seq_clipfrac": st["seq_clipfrac"], "actor/seq_ratio": st["seq_ratio_mean"]}
    else:
        low, high = clip if clip is not None else (algo.eps_clip, algo.eps_clip_high)
        loss, st = policy_loss(
            logprobs,
            old_logprobs,
            mb.advantages,
            mb.response_mask,
            clip_eps_low=low,
            clip_eps_high=high,
            dual_clip=algo.dual_clip,
            is_weights=is_weights,
            **agg,
        )
        extra = {}
    stats = {"actor/pg_clipfrac": st["pg_clipfrac"], "actor/ppo_kl": st["ppo_kl"], **extra}
    return loss, stats


def _actor_loss_fn(
    model: nn.Module,
    algo: PPOAlgoConfig,
    kl_coef: float,
    temperature: float,
    plan: UpdatePlan,
    reuse_logprobs: bool,
    moe: MoEHooks | None = None,
    aux_loss_coef: float = 0.0,
    distill: DistillConfig | None = None,
    trained_version: int | None = None,
) -> LossFn:
    term = _distill_term(distill)
    topk = distill is not None and distill.topk

    def loss_fn(mb: Experience, inputs: ForwardInputs, num_tokens: int, num_seqs: int):
        logprobs, entropy, *picked = response_logprobs(
            model,
            inputs,
            mb.response_len,
            temperature=temperature,
            with_entropy=True,
            entropy_grad=algo.entropy_loss_coef > 0,  # else a metric only
            # a top-k distillation loss: the student's log-probs of the teacher's top-k tokens
            picked_ids=mb.teacher_topk_ids if topk else None,
        )
        old_logprobs = logprobs.detach() * mb.response_mask if reuse_logprobs else mb.old_logprobs
        is_weights, corr_stats = _correction(algo, logprobs, old_logprobs, mb)
        agg = dict(
            loss_agg=algo.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_len=plan.norm_len,
        )
        anchor = ratio_anchor(algo, old_logprobs, mb)
        clip = clip_range(algo, mb, trained_version)
        loss, pg_stats = _policy_term(algo, logprobs, anchor, mb, is_weights, agg, clip)
        behaviour = behaviour_ratio_stats(
            logprobs, mb.engine_logprobs, mb.advantages, mb.response_mask, *clip
        )
        kl = kl_estimate(
            logprobs,
            mb.ref_logprobs,
            kind=algo.kl_estimator,
            unbiased_gradient=algo.kl_unbiased_gradient,
            old_logprobs=old_logprobs,
        )
        kl_loss = aggregate_loss(kl, mb.response_mask, mode=algo.loss_agg_mode, **_counts(agg))
        stats = {
            "actor/pg_loss": loss.detach(),
            **pg_stats,
            "actor/kl_loss": kl_loss.detach(),
            # a fraction of the step's global token mean, like the losses: the same whatever
            # the split into micro-batches (summed over them, see _update_loop)
            "actor/entropy": (entropy.detach() * mb.response_mask).sum() / max(num_tokens, 1),
            **corr_stats,
            **{f"actor/{k}": v for k, v in behaviour.items()},
            "logprobs": old_logprobs,
        }
        if algo.use_kl_loss:
            loss = loss + kl_coef * kl_loss
        if term is not None:  # a distillation loss term (not the advantage signal)
            per_token = term(mb, logprobs, picked[0] if picked else None)
            distill_loss = aggregate_loss(
                per_token, mb.response_mask, mode=algo.loss_agg_mode, **_counts(agg)
            )
            stats["distill/loss"] = distill_loss.detach()
            loss = loss + distill.distill_coef * distill_loss
        if algo.entropy_loss_coef > 0:
            loss = loss + entropy_bonus(entropy, mb.response_mask, algo.entropy_loss_coef, **agg)
        if moe is not None:
            loss = loss + _moe_aux_term(moe, mb, num_tokens, aux_loss_coef, stats)
        return loss, stats

    return loss_fn


def _moe_aux_term(
    moe: MoEHooks, mb: Experience, num_tokens: int, aux_loss_coef: float, stats: dict
) -> torch.Tensor | float:
    """``aux_loss_coef`` x the load-balancing loss, weighted by the micro-batch's share of the
    step's tokens (summed over micro-batches and ranks: the token-weighted mean of the
    micro-batches' losses); the loss goes to ``stats`` whatever the coefficient."""
    aux = moe.aux_loss() * (mb.response_mask.sum() / max(num_tokens, 1))
    stats["moe/aux_loss"] = aux.detach()
    return aux_loss_coef * aux if aux_loss_coef > 0 else 0.0


def _distill_term(distill: DistillConfig | None):
    """``term(mb, logprobs, picked) -> (B, T)`` per-token distillation loss of a loss-term
    signal (``--distill_loss k1 / k2 / k3 / forward_kl_topk / reverse_kl_topk``), or None (no
    teacher, or the advantage signal). The sampled-token estimators take the update's own
    log-probs (at the rollout temperature); the top-k KLs the student's log-probs of the
    teacher's top-k tokens (``picked``, temperature 1 as the teacher's), made by the same
    forward's output layer."""
    if distill is None or distill.distill_loss == "advantage":
        return None
    kind = distill.distill_loss
    if kind in ("k1", "k2", "k3"):
        return lambda mb, logprobs, picked: distill_kl(logprobs, mb.teacher_logprobs, kind)
    direction = "forward" if kind == "forward_kl_topk" else "reverse"
    return lambda mb, logprobs, picked: topk_kl(picked, mb.teacher_topk_logprobs, direction)


def _counts(agg: dict) -> dict:
    """The normaliser arguments of ``aggregate_loss`` (it names the mode ``mode``)."""
    return {k: agg[k] for k in ("num_tokens", "num_seqs", "norm_len")}


def update_actor(
    actor: TrainedModel,
    exp: Experience,
    algo: PPOAlgoConfig,
    plan: UpdatePlan,
    generator: torch.Generator,
    *,
    spec: InputSpec,
    kl_coef: float,
    temperature: float,
    reuse_logprobs: bool = False,
    moe: MoEHooks | None = None,
    aux_loss_coef: float = 0.0,
    distill: DistillConfig | None = None,
) -> tuple[dict[str, float], torch.Tensor | None]:
    """The actor's policy-gradient updates on one rollout batch.

    Args:
        exp: this rank's batch; ``old_logprobs`` may be None when ``reuse_logprobs``.
        spec: the parts the actor's forwards are built from (``models.inputs``).
        reuse_logprobs: take the old log-probs from this update's own forward (see
            :func:`reuse_update_logprobs`); they are returned rather than written into ``exp``.
        moe: an MoE actor's router hooks: its forwards replay ``exp.routed_experts`` when set,
            count routing statistics, and add ``aux_loss_coef`` x the load-balancing loss.
        distill: with a teacher whose signal is a loss term, ``distill_coef`` x that term is
            added (``exp.teacher_*`` set); None: none.

    Returns:
        ``(metrics, old_logprobs)``: the (N, T) log-probs the update used as old ones when
        ``reuse_logprobs``, else None.
    """
    # the policy this step starts from: version step - 1 (asynchronous batches' tokens carry
    # the versions that sampled them)
    loss_fn = _actor_loss_fn(
        actor.model,
        algo,
        kl_coef,
        temperature,
        plan,
        reuse_logprobs,
        moe,
        aux_loss_coef,
        distill,
        trained_version=actor.step - 1,
    )
    collected = torch.zeros_like(exp.response_mask) if reuse_logprobs else None

    def keep(rows: torch.Tensor, logprobs: torch.Tensor) -> None:
        if collected is not None:
            collected[rows, : logprobs.shape[1]] = logprobs

    def scope(mb: Experience, inputs: ForwardInputs, counted: bool):
        return routing_scope(moe, mb.routed_experts, inputs, collect=counted)

    sums = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")
    if distill is not None and distill.distill_loss != "advantage":
        sums += ("distill/loss",)
    if moe is not None:
        sums += ("moe/aux_loss",)
    audited = [0]
    if exp.sample_marks is not None:  # the pairing audit: each row against its marks
        unchecked = loss_fn

        def loss_fn(mb, inputs, num_tokens, num_seqs):
            audited[0] += pairing.check_rows(mb, actor.step)
            return unchecked(mb, inputs, num_tokens, num_seqs)

    out, grad_norm = _update_loop(
        actor, exp, plan, generator, loss_fn, spec, keep, sums, scope if moe is not None else None
    )
    if exp.sample_marks is not None:
        rows = all_reduce_scalars({"rows": audited[0]}, "sum", plan.parallel.data_group)
        out["pairing/rows_checked"] = rows["rows"]
    out["actor/grad_norm"] = grad_norm
    out.update(actor.guard.metrics("actor/"))
    out["grad_norm"] = grad_norm  # MindSpeed RL's name for the actor's norm, kept as an alias
    return out, collected


def update_critic(
    critic: TrainedModel,
    exp: Experience,
    algo: PPOAlgoConfig,
    plan: UpdatePlan,
    generator: torch.Generator,
    spec: InputSpec,
) -> dict[str, float]:
    """Value-function updates on one rollout batch (``exp.values`` and ``exp.returns`` set),
    the critic's forwards built by ``spec`` (``models.inputs``)."""

    def loss_fn(mb: Experience, inputs: ForwardInputs, num_tokens: int, num_seqs: int):
        T = mb.response_len
        values = token_values(critic.model, inputs)
        loss, st = value_loss(
            values[:, -T - 1 : -1],
            mb.values,
            mb.returns,
            mb.response_mask,
            value_clip=algo.value_clip if algo.value_clip > 0 else None,
            loss_agg=algo.loss_agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_len=plan.norm_len,
        )
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": st["vf_clipfrac"]}

    out, grad_norm = _update_loop(
        critic, exp, plan, generator, loss_fn, spec, None, ("critic/vf_loss",)
    )
    out["critic/grad_norm"] = grad_norm
    out.update(critic.guard.metrics("critic/"))
    out["critic/lr"] = critic.scheduler.get_last_lr()[0]
    out["critic/vf_explained_var"] = reduce_explained_variance(
        explained_variance(exp.values, exp.returns, exp.response_mask), plan.parallel.data_group
    )
    return out


def update_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The minibatch shuffle of one step on one rank: a resumed run shuffles as the
    uninterrupted one did."""
    return torch.Generator().manual_seed(seed * 7919 + step * 31 + rank)
