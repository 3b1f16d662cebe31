"""`fsdp-rlhf ppo`: PPO with a single controller per rank. Every rank runs this same loop::

    torchrun --nproc_per_node 8 -m fsdp_rlhf.cli ppo --pretrain SFT --reward_pretrain RM ...

One step = one rollout batch: the batch from the step's source of experiences (colocated: sync
weights into this rank's vLLM engine, generate, score; ``--async_train``: the queue the rollout
ranks fill, :mod:`~fsdp_rlhf.trainers.ppo.source`), old/ref log-probs and values, advantages,
critic update, actor update, the new weights to the source. Idle models leave the GPU between
phases. The loop (stop vote, checkpoints) is :func:`fsdp_rlhf.trainers.common.fit`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from torch import nn

import fsdp_rlhf.trainers.ppo.async_train as async_train
from fsdp_rlhf.algorithms import clip_scores
from fsdp_rlhf.config import PPOBatchPlan, PPOConfig
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.distributed import checkpoint as ckpt
from fsdp_rlhf.distributed import faults
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.memory_census import census_from_env, owners_of
from fsdp_rlhf.distributed.offload import (
    offload_model,
    offload_optimizer,
    onload_model,
    onload_optimizer,
)
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.models.inputs import InputSpec, row_layout
from fsdp_rlhf.models.kind import ModelKind
from fsdp_rlhf.models.load import load_tokenizer
from fsdp_rlhf.models.lora import adapters_disabled
from fsdp_rlhf.models.moe import MoEHooks
from fsdp_rlhf.models.save import save_model
from fsdp_rlhf.rollout import HFEngine
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.experience import (
    Experience,
    batched_logprobs,
    batched_scores,
    batched_values,
)
from fsdp_rlhf.trainers.guards import BadStepGuard, check_finite_scores
from fsdp_rlhf.trainers.micro_batches import MicroBatching
from fsdp_rlhf.trainers.ppo.colocated import ColocatedSource, start_engine
from fsdp_rlhf.trainers.ppo.eval import Evaluator, build_evaluator
from fsdp_rlhf.trainers.ppo.metrics import (
    StatCollector,
    collect_batch_stats,
    collect_distill_stats,
    log_samples,
)
from fsdp_rlhf.trainers.ppo.rewards import (
    add_distill_advantages,
    build_kl_controller,
    compute_advantages,
    observe_kl,
    rule_scores,
)
from fsdp_rlhf.trainers.ppo.setup import (
    build_ema,
    build_models,
    build_optimizers,
    build_prompts,
    check_ema_resumable,
    data_settings,
    offload_idle,
    prepare,
    prompt_group_size,
    update_accumulation,
)
from fsdp_rlhf.trainers.ppo.source import ExperienceSource, OpenSource, SourceInputs
from fsdp_rlhf.trainers.ppo.teacher import Teacher, teacher_spec
from fsdp_rlhf.trainers.ppo.update import (
    TrainedModel,
    UpdatePlan,
    reuse_update_logprobs,
    update_actor,
    update_critic,
    update_generator,
)
from fsdp_rlhf.trainers.ppo.vision import StepImages, image_limit

log = logging.getLogger("fsdp_rlhf")

CONSOLE_KEYS = [
    "critic/score/mean",
    "actor/kl_coef",
    "actor/ppo_kl",
    "actor/pg_loss",
    "critic/vf_loss",
    "response_length/mean",
    "e2e_tps",
    "timing/all",
]


def main(cfg: PPOConfig, debug: bool = False) -> int:
    """Colocated: every rank generates with its engine and trains. ``--async_train``: the job
    splits into training ranks, whose PPO step takes its batches from the rollout ranks'
    queue, and rollout ranks (:mod:`~fsdp_rlhf.trainers.ppo.async_train`)."""
    if cfg.asynchronous.async_train:
        return async_train.launch(cfg, debug, PPOTrainer)
    return common.launch(cfg, debug, prepare, build_colocated)


def build_colocated(cfg: PPOConfig, env: DistEnv, prepared, parallel: ParallelLayout) -> PPOTrainer:
    """A colocated rank: its engine, asleep before the models load, is the step's source."""
    tokenizer = load_tokenizer(cfg.models.pretrain, cfg.backend)
    _, rows, kinds = prepared
    vision = kinds["--pretrain"].vision  # read once in prepare (models.kind)
    engine = start_engine(cfg, env, tokenizer, image_limit(cfg.vision, rows), vision)
    open_source = partial(ColocatedSource, engine)
    return PPOTrainer(cfg, env, prepared, parallel, tokenizer, open_source)


class PPOTrainer:
    """The PPO step on one rank; its batches come from ``open_source``'s source."""

    def __init__(
        self,
        cfg: PPOConfig,
        env: DistEnv,
        prepared: tuple[PPOBatchPlan, list, dict[str, ModelKind]],
        parallel: ParallelLayout,
        tokenizer,
        open_source: OpenSource,
    ):
        self.cfg, self.env, self.parallel = cfg, env, parallel
        self.sp = parallel.sp  # the sequence-parallel group the forwards are split over
        self.plan, rows, kinds = prepared
        self.actor_kind = kinds["--pretrain"]  # read once in prepare (models.kind)
        common.write_run_config(cfg, env)
        # a vision-language actor: its processor decodes each step's images (None: text)
        self.images = None
        if self.actor_kind.is_vlm:
            self.images = StepImages.from_pretrained(cfg.models.pretrain, cfg.backend)
        # after the engine, which seeds torch per engine: fresh heads must match on all ranks
        torch.manual_seed(cfg.seed)
        self.models = build_models(cfg, env, tokenizer, parallel)
        # an MoE actor: router replay, routing statistics, the load-balancing loss (each rank
        # routing its slice of every row under sequence parallelism)
        self.moe = MoEHooks.attach(self.models.actor, self.sp, parallel.ep)
        self.prompts = build_prompts(cfg, rows, tokenizer, self.images)
        self.total_steps = self._total_steps()
        updates = self.total_steps * cfg.algo.ppo_epochs * self.plan.optimizer_steps_per_epoch
        self.optimizers, self.schedulers = build_optimizers(cfg, self.models, updates)
        self.ema = build_ema(cfg, self.models.actor, self.optimizers["actor"])  # None: off
        self._plan_forwards(cfg, parallel)
        self.teacher = None  # on-policy distillation's teacher, colocated or served
        if cfg.distill.enabled:
            spec = teacher_spec(self.models.teacher, self.actor_inputs)
            self.teacher = Teacher(cfg, env, self.models.teacher, spec)
        self.kl_ctl = build_kl_controller(cfg.algo)
        self.timer = PhaseTimer(env.device, census_from_env(env.device, self.memory_owners))
        self.source: ExperienceSource = open_source(
            SourceInputs(
                cfg,
                env,
                self.models.actor,
                self.optimizers["actor"],
                tokenizer,
                self.prompts,
                self.images,
                parallel,
                self.timer,
                self.score,
                self.total_steps,
            )
        )
        self.evaluator = build_evaluator(cfg, env, tokenizer, parallel, self.images)
        self.trained = self._trained_models()
        self.guards = {
            name: BadStepGuard(cfg.guard.max_bad_steps, name) for name in self.optimizers
        }
        self.step = 0
        self._resume()  # optimizer state is created here, while the engine sleeps
        offload_idle(
            self.models,
            self.optimizers,
            cfg.placement.ref_reward_offload,
            env.device,
            teacher_offload=cfg.distill.teacher_offload,
        )
        self.logger = common.open_metrics(cfg, env, self.step)
        log.info(
            "PPO: %d steps, %d prompts/step x %d samples, world %d (%d engines x TP %d, "
            "%d data-parallel x %d sequence-parallel)",
            self.total_steps,
            cfg.batch.rollout_batch_size,
            cfg.batch.n_samples_per_prompt,
            env.world_size,
            self.plan.num_engines,
            self.plan.tp_size,
            parallel.dp_size,
            parallel.sp.size,
        )

    def _plan_forwards(self, cfg: PPOConfig, parallel: ParallelLayout) -> None:
        """How each model's forwards are built and batched: prompt sharing, the input
        parts, the update plan and the no-grad micro-batches (logged once)."""
        self.group_size = prompt_group_size(cfg, self.plan, self.models.actor)
        # the parts each model's forwards are built from (models.inputs): the actor and the
        # reference share prompt passes when they can, take a VLM's images and the
        # sequence-parallel slice; the critic and the reward model take packed or padded rows
        vision = self.actor_kind.vision
        self.actor_inputs = InputSpec(
            row_layout(self.packed, self.group_size), self.group_size, vision, self.sp
        )
        # a VLM actor's critic and reward model are VLMs of its family (rules: vlm-*)
        self.scalar_inputs = InputSpec(row_layout(self.packed), vision=vision, sp=self.sp)
        gathered = update_accumulation(cfg, self.env)
        self.update_plan = UpdatePlan.from_config(
            cfg, self.plan, self.group_size, parallel, gathered
        )
        # the no-grad forwards' micro-batches: rows, or a token budget (--use_dynamic_batch)
        # (a token budget per GPU: a sequence-parallel group's micro-batch holds N times it)
        budget = cfg.batch.scoring_max_tokens
        self.scoring_batching = MicroBatching(
            self.plan.micro_rollout_batch_size,
            budget * self.sp.size if budget is not None else None,
            self.packed,
        )
        if cfg.batch.use_dynamic_batch:
            log.info(
                "dynamic batching: micro-batches of at most %d tokens per rank in the updates, "
                "%d in the no-grad forwards (%s)%s%s",
                cfg.batch.train_max_tokens_per_gpu,
                cfg.batch.scoring_max_tokens,
                "the sum of lengths, packed" if self.packed else "rows x the longest, padded",
                f"; groups of {self.group_size} rows sharing a prompt stay whole"
                if self.group_size > 1
                else "",
                f"; x {self.sp.size} per sequence-parallel micro-batch" if self.sp.enabled else "",
            )

    def memory_owners(self) -> dict[str, list[torch.Tensor]]:
        """The tensors the memory census (``FSDP_RLHF_MEMORY_CENSUS``) attributes the device's
        bytes to: each model's params and grads, each optimizer's state, the HF engine's copy
        and the actor's EMA."""
        m = self.models
        engine = getattr(self.source, "engine", None)  # the colocated source's
        models = {"actor": m.actor, "critic": m.critic, "ref": m.ref, "reward": m.reward}
        models["teacher"] = m.teacher
        models["engine copy"] = engine.model if isinstance(engine, HFEngine) else None
        ema = {"actor ema": list(self.ema.shadow.values())} if self.ema is not None else {}
        return owners_of(models, self.optimizers, ema)

    def _trained_models(self) -> common.TrainedModels:
        """What a checkpoint holds: each trained model with its optimizer and schedule."""
        trained = common.TrainedModels()
        for name in self.optimizers:  # "actor", and "critic" with GAE
            model = self.models.actor if name == "actor" else self.models.critic
            trained.add(name, model, self.optimizers[name], self.schedulers[name])
        if self.ema is not None:
            trained.extras["actor_ema"] = self.ema
        return trained

    def _total_steps(self) -> int:
        b = self.cfg.batch
        batches_per_epoch = len(self.prompts) // b.rollout_batch_size
        total = b.num_episodes * b.max_epochs * batches_per_epoch
        return min(total, b.max_steps) if b.max_steps > 0 else total

    # ------------------------------------------------------------------ one step

    def train_step(self, stop_agreed: Callable[[], bool]) -> bool:
        metrics = self.run_phases(stop_agreed)
        if metrics is None:
            return False
        last = self.step == self.total_steps
        if self.evaluator is not None and self.evaluator.due(self.step, self.total_steps):
            metrics.update(self.evaluate())
        # Every step goes to metrics.jsonl/TensorBoard; the console every logging_steps.
        console = self.step % self.cfg.logging.logging_steps == 0 or last
        self.logger.log(self.step, metrics, CONSOLE_KEYS, console=console)
        return True

    def run_phases(self, stop_agreed: Callable[[], bool]) -> dict[str, float] | None:
        """The step's phases; None when a stop was agreed after the rollout (nothing has
        changed but the engine's weights, which equal the actor's; the source takes its
        prompts back)."""
        stats = StatCollector()
        reuse = reuse_update_logprobs(
            self.cfg.algo,
            self.plan.optimizer_steps_per_epoch,
            self.actor_updates,
            distill=self.cfg.distill,
        )
        with self.timer("all"):
            # 1-2. the step's batch, scored (reward model and/or rule reward), from the source:
            #    the engine here (the actor's weights synced into it), or the rollout ranks'
            #    queue; with --dynamic_filtering, only groups with a learning signal
            sampled = self.source.sample(self.step, stats)
            exp, prompts = sampled.exp, sampled.prompts
            # a PPO step is long: vote again before the update, so a stop signal that came
            # during the rollout still leaves the whole window for the checkpoint
            if stop_agreed():
                self.source.settle(sampled, trained=False)
                return None
            # 3. reference log-probs, critic values, and the sampling policy's log-probs
            #    unless the actor update will supply them
            self.forward_old_ref_values(exp, old_logprobs=not reuse)
            # 4. KL-shaped rewards, advantages and returns; the KL controller observes
            #    KL(old || ref) as soon as the old log-probs exist
            with self.timer("adv"):
                compute_advantages(
                    exp,
                    self.cfg.algo,
                    self.kl_ctl.value,
                    self.cfg.batch.n_samples_per_prompt,
                    self.parallel,
                )
                # on-policy distillation's reverse-KL advantage of each sampled token
                add_distill_advantages(exp, self.cfg.distill)
                kl_metrics = (
                    {} if reuse else observe_kl(exp, self.cfg.algo, self.kl_ctl, self.parallel)
                )
            # 5. critic then actor updates
            faults.reached("training", self.step)
            update_metrics = self.update(exp, reuse)
            if reuse:
                kl_metrics = observe_kl(exp, self.cfg.algo, self.kl_ctl, self.parallel)
            # 6. the new weights to the source: the engine syncs them before its next rollout,
            #    or they are published to the rollout ranks
            update_metrics.update(self.source.after_update(self.step, self.actor_updates))
        self.source.settle(sampled, trained=True)
        asynchronous = self.cfg.asynchronous
        collect_batch_stats(
            stats,
            exp,
            trainer_old_logprobs=not self.rollout_logprobs_as_old,
            # the versions that sampled the tokens, against the policy this step starts from
            trained_version=self.step - 1 if asynchronous.async_train else None,
            max_lag=asynchronous.async_queue_size,
        )
        collect_distill_stats(stats, exp)
        metrics = {**sampled.metrics, **kl_metrics, **update_metrics, **stats.reduce()}
        metrics.update(self.source.throughput(metrics, self.timer.times))
        metrics.update(self.timer.pop())
        self.maybe_log_samples(exp, prompts)
        return metrics

    # ------------------------------------------------------------------ phases

    def score(self, exp: Experience, prompts: list[Prompt], n: int | None = None) -> None:
        """``exp.scores``; prompt i owns rows i*n .. i*n+n-1 (n: the training group size).
        Scores already set (an ``--env_file`` environment's rewards) are the base."""
        micro = self.scoring_batching
        scores = torch.zeros(exp.num_sequences, device=exp.input_ids.device)
        if exp.scores is not None:  # set by the rollout; --env_file excludes the others
            scores = exp.scores
        if self.models.reward is not None:
            with self.timer("reward_model"), self.onloaded(self.models.reward, "reward"):
                rm = batched_scores(self.models.reward, exp, micro, self.scalar_inputs)
            check_finite_scores(rm, self.step, f"reward model {self.cfg.models.reward_pretrain}")
            if self.models.reward_norm is not None:
                mean, std = self.models.reward_norm
                rm = (rm - mean) / std
            scores = scores + rm
        if self.models.rule_reward is not None:
            with self.timer("rule_reward"):
                n = n or self.cfg.batch.n_samples_per_prompt
                rule = rule_scores(self.models.rule_reward, exp, prompts, self.models.tokenizer, n)
                scores = scores + rule.to(scores.device)
        exp.scores = clip_scores(scores, self.cfg.algo.reward_clip_range)

    def forward_old_ref_values(self, exp: Experience, old_logprobs: bool) -> None:
        micro, temp = self.scoring_batching, self.cfg.rollout.temperature
        if self.rollout_logprobs_as_old:  # no trainer recomputation
            exp.old_logprobs = exp.engine_logprobs * exp.response_mask
        elif old_logprobs:
            with self.timer("old_log_p"):
                exp.old_logprobs = batched_logprobs(
                    self.models.actor, exp, micro, temp, self.actor_inputs, self.moe
                )
        with self.timer("reference_model"), self.reference() as ref:
            exp.ref_logprobs = batched_logprobs(ref, exp, micro, temp, self.actor_inputs)
        if self.teacher is not None:
            with self.timer("teacher"):
                self.teacher.score(exp, micro)
        if self.models.critic is not None:
            with self.timer("critic_model"):
                onload_model(self.models.critic, self.env.device)
                exp.values = batched_values(self.models.critic, exp, micro, self.scalar_inputs)

    def update(self, exp: Experience, reuse_logprobs: bool) -> dict[str, float]:
        metrics: dict[str, float] = {}
        cfg, device = self.cfg, self.env.device
        if self.models.critic is not None:
            with self.timer("update_critic"):
                critic = self._trained_model("critic")
                onload_optimizer(critic.optimizer, device)
                metrics.update(
                    update_critic(
                        critic,
                        exp,
                        cfg.algo,
                        self.update_plan,
                        self._generator(),
                        self.scalar_inputs,
                    )
                )
                offload_optimizer(critic.optimizer, device)
                offload_model(critic.model, device)
        if self.actor_updates:
            # the actor's Adam state left the device when the engine woke (RolloutSession.awake)
            # and comes back for this update only: scoring and the critic update ran without it
            with self.timer("actor_onload"):
                onload_optimizer(self.optimizers["actor"], device)
            with self.timer("update"):
                actor_metrics, old_logprobs = update_actor(
                    self._trained_model("actor"),
                    exp,
                    cfg.algo,
                    self.update_plan,
                    self._generator(),
                    spec=self.actor_inputs,
                    kl_coef=self.kl_ctl.value,
                    temperature=cfg.rollout.temperature,
                    reuse_logprobs=reuse_logprobs,
                    moe=self.moe,
                    aux_loss_coef=cfg.moe.aux_loss_coef,
                    distill=cfg.distill if self.teacher is not None else None,
                )
            metrics.update(actor_metrics)
            if self.moe is not None:
                metrics.update(self.moe.pop_metrics())
            if reuse_logprobs:
                exp.old_logprobs = old_logprobs
        metrics["actor/lr"] = self.schedulers["actor"].get_last_lr()[0]
        metrics["actor/kl_coef"] = self.kl_ctl.value
        return metrics

    def _trained_model(self, name: str) -> TrainedModel:
        optim_cfg = self.cfg.actor_optim if name == "actor" else self.cfg.critic_optim
        return TrainedModel(
            self.trained.models[name],
            self.optimizers[name],
            self.schedulers[name],
            optim_cfg.max_norm,
            self.guards[name],
            self.step,
        )

    def _generator(self) -> torch.Generator:
        # the same shuffle on the ranks of a sequence-parallel group (they hold the same rows)
        return update_generator(self.cfg.seed, self.step, self.parallel.dp_rank)

    @contextmanager
    def onloaded(self, model: nn.Module, name: str):
        """Onload a frozen model for one phase (timed as ``<name>_onload``) and, with
        ``--ref_reward_offload``, offload it again after use (``<name>_offload``)."""
        with self.timer(f"{name}_onload"):
            onload_model(model, self.env.device)
        yield model
        if self.cfg.placement.ref_reward_offload:
            with self.timer(f"{name}_offload"):
                offload_model(model, self.env.device)

    def reference(self):
        """The reference policy for one phase: the ref model, or with LoRA the actor with its
        adapters disabled (its frozen base: no second copy of the model)."""
        if self.models.ref is None:
            return adapters_disabled(self.models.actor)
        return self.onloaded(self.models.ref, "ref")

    def evaluate(self) -> dict[str, float]:
        """``eval/*`` on the held-out prompts; keeps the best actor (--save_best_metric)."""
        evaluator: Evaluator = self.evaluator
        metrics = self.source.evaluate(evaluator, self.score, self.step)
        # the phases eval ran (reward_model, resharding...) must not add to the next step's
        # timings; its total is timing/eval. (Eval also synced the new weights into the
        # engine, so the next step's rollout skips the sync and reports no weight_sync_gbps.)
        self.timer.pop()
        if evaluator.improved(metrics):
            evaluator.save_best(
                self.step,
                metrics,
                lambda path: self._export(self.models.actor, path),
            )
        return metrics

    # ------------------------------------------------------------------ i/o

    def maybe_log_samples(self, exp: Experience, prompts: list[Prompt]) -> None:
        every = self.cfg.sample_log_steps
        if every > 0 and (self.step % every == 0 or self.step == 1) and self.env.is_rank0:
            log_samples(
                self.logger,
                self.models.tokenizer,
                exp,
                prompts,
                step=self.step,
                n_samples=self.cfg.batch.n_samples_per_prompt,
                save_path=self.cfg.ckpt.save_path,
            )

    def save_checkpoint(self) -> None:
        common.save(self.cfg.ckpt, self.step, self.trained, self.trainer_state(), self._export_all)

    def data_settings(self) -> dict[str, int]:
        """What the checkpointed prompt order depends on (a resume must match them)."""
        return data_settings(self.cfg, len(self.prompts))

    def trainer_state(self) -> dict:
        """What a checkpoint holds besides the models, optimizers and schedules."""
        return {
            **self.data_settings(),
            **self.source.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(),
            "guards": {name: g.state_dict() for name, g in self.guards.items()},
            "enable_ema": self.ema is not None,
        }

    def _resume(self) -> None:
        current = self.data_settings()

        def check(path: Path) -> None:
            ckpt.check_resumable(path, current=current, keys=list(current))
            check_ema_resumable(path, self.ema is not None)

        saved = common.resume(self.cfg.ckpt, self.trained, check)
        if saved is None:
            return
        self.load_trainer_state(saved)

    def load_trainer_state(self, saved: dict) -> None:
        """The counterpart of :meth:`trainer_state`, after a resume."""
        self.step = int(saved["step"])
        self.source.load_state_dict(saved)
        self.kl_ctl.load_state_dict(saved["kl_ctl"])
        for name, state in saved.get("guards", {}).items():
            self.guards[name].load_state_dict(state)

    def finish(self) -> None:
        save_path = self.cfg.ckpt.save_path
        self._export_all(Path(save_path))
        log.info("saved %s to %s", "the actor's EMA" if self.ema else "actor", save_path)

    def _export_all(self, path: Path) -> None:
        """The final models into ``path`` (also a checkpoint's ``hf`` with --save_hf_ckpt):
        the actor, or its EMA with --enable_ema (OpenRLHF exports the EMA in its place), and
        the critic in ``critic/``."""
        if self.ema is None:
            self._export(self.models.actor, path)
        else:
            with self.ema.applied() as averaged:
                self._export(averaged, path)
        if self.models.critic is not None:
            self._export(self.models.critic, path / "critic", head="score")

    def _export(self, model: nn.Module, path, head: str | None = None) -> None:
        """The HF model, or with LoRA its adapter folder (and the merged model if asked); a
        VLM's processor (image processor, tokenizer, chat template) goes with the actor and
        the critic."""
        m = self.cfg.models
        base = m.pretrain if head is None else (m.critic_pretrain or m.reward_pretrain)
        processor = self.models.tokenizer
        if self.images is not None:  # a VLM critic's folder loads with the processor too
            processor = self.images.vision.processor
        save_model(model, processor, path, self.cfg.lora, base_path=base, head=head)

    def close(self) -> None:
        self.logger.close()
        self.source.close()

    # ------------------------------------------------------------------ properties

    @property
    def actor_updates(self) -> bool:
        """Whether this step trains the actor (``--freezing_actor_steps`` holds it back)."""
        return self.step > self.cfg.algo.freezing_actor_steps

    @property
    def rollout_logprobs_as_old(self) -> bool:
        """``--use_rollout_logprobs_as_old``: the engine's log-probs serve as the old ones
        (no trainer forward; the IS correction then has nothing to correct)."""
        return self.cfg.algo.use_rollout_logprobs_as_old

    @property
    def packed(self) -> bool:
        return self.cfg.batch.packing_samples
