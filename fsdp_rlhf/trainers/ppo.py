"""`fsdp-rlhf ppo`: colocated single-controller PPO. Every rank runs this same loop::

    torchrun --nproc_per_node 8 -m fsdp_rlhf.cli ppo --pretrain SFT --reward_pretrain RM ...

One step = one rollout batch: sync weights into vLLM, generate, score, old/ref log-probs and
values, advantages, critic update, actor update. Idle models leave the GPU between phases.
The loop (stop vote, checkpoints) is :func:`fsdp_rlhf.trainers.common.fit`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from fsdp_rlhf.algorithms import clip_scores
from fsdp_rlhf.config import PPOBatchPlan, PPOConfig
from fsdp_rlhf.data.prompts import Prompt, PromptSampler
from fsdp_rlhf.distributed import checkpoint as ckpt
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
from fsdp_rlhf.rollout import HFEngine, RolloutEngine, RolloutOutput, SamplingConfig
from fsdp_rlhf.rollout.groups import gather_rollouts
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.experience import (
    Experience,
    batched_logprobs,
    batched_scores,
    batched_values,
    experience_from_rollout,
)
from fsdp_rlhf.trainers.guards import BadStepGuard, check_finite_scores
from fsdp_rlhf.trainers.micro_batches import MicroBatching
from fsdp_rlhf.trainers.ppo_dynamic_filtering import dynamic_sample
from fsdp_rlhf.trainers.ppo_eval import Evaluator, build_evaluator
from fsdp_rlhf.trainers.ppo_metrics import (
    StatCollector,
    add_rollout_stats,
    collect_batch_stats,
    log_samples,
    throughput_metrics,
)
from fsdp_rlhf.trainers.ppo_multiturn import build_multiturn, multiturn_rollout
from fsdp_rlhf.trainers.ppo_rewards import (
    add_overlong_penalty,
    add_stop_properly_penalty,
    build_kl_controller,
    compute_advantages,
    observe_kl,
    rule_scores,
)
from fsdp_rlhf.trainers.ppo_rollout import (
    RolloutSession,
    delta_state,
    sampling_config,
    sleep_drops_weights,
)
from fsdp_rlhf.trainers.ppo_setup import (
    adapter_spec,
    build_ema,
    build_engine,
    build_models,
    build_optimizers,
    build_prompts,
    check_ema_resumable,
    data_settings,
    engine_dtype,
    merged_lora_scaling,
    offload_idle,
    prepare,
    prompt_group_size,
    unsynced_params,
)
from fsdp_rlhf.trainers.ppo_update import (
    TrainedModel,
    UpdatePlan,
    reuse_update_logprobs,
    update_actor,
    update_critic,
    update_generator,
)
from fsdp_rlhf.trainers.ppo_vision import StepImages, check_responses, image_limit

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
    if cfg.asynchronous.async_train:
        from fsdp_rlhf.trainers import ppo_async

        return ppo_async.main(cfg, debug)
    return common.launch(cfg, debug, prepare, PPOTrainer)


class PPOTrainer:
    def __init__(
        self,
        cfg: PPOConfig,
        env: DistEnv,
        prepared: tuple[PPOBatchPlan, list, dict[str, ModelKind]],
        parallel: ParallelLayout,
    ):
        self.cfg, self.env, self.parallel = cfg, env, parallel
        self.sp = parallel.sp  # the sequence-parallel group the forwards are split over
        self.plan, rows, kinds = prepared
        self.actor_kind = kinds["--pretrain"]  # read once in prepare (models.kind)
        common.write_run_config(cfg, env)
        tokenizer = load_tokenizer(cfg.models.pretrain, cfg.backend)
        # a vision-language actor: its processor decodes each step's images (None: text)
        self.images = None
        if self.actor_kind.is_vlm:
            self.images = StepImages.from_pretrained(cfg.models.pretrain, cfg.backend)
        engine = self.start_engine(tokenizer, image_limit(cfg.vision, rows))
        # after the engine, which seeds torch per engine: fresh heads must match on all ranks
        torch.manual_seed(cfg.seed)
        self.models = build_models(cfg, env, tokenizer, parallel)
        # an MoE actor: router replay, routing statistics, the load-balancing loss (each rank
        # routing its slice of every row under sequence parallelism)
        self.moe = MoEHooks.attach(self.models.actor, self.sp, parallel.ep)
        self.prompts = build_prompts(cfg, rows, tokenizer, self.images)
        # the ranks of a sequence-parallel group draw the same prompts (their data shard)
        self.sampler = PromptSampler(
            len(self.prompts),
            cfg.batch.rollout_batch_size,
            parallel.dp_rank,
            parallel.dp_size,
            cfg.seed,
        )
        self.total_steps = self._total_steps()
        updates = self.total_steps * cfg.algo.ppo_epochs * self.plan.optimizer_steps_per_epoch
        self.optimizers, self.schedulers = build_optimizers(cfg, self.models, updates)
        self.ema = build_ema(cfg, self.models.actor, self.optimizers["actor"])  # None: off
        self._plan_forwards(cfg, parallel)
        self.kl_ctl = build_kl_controller(cfg.algo)
        self.evaluator = build_evaluator(cfg, env, tokenizer, parallel, self.images)
        self.timer = PhaseTimer(env.device, census_from_env(env.device, self.memory_owners))
        self.rollout_session = None if engine is None else self._session(engine)
        self.multiturn = build_multiturn(cfg, tokenizer, self.timer)  # None: single turn
        self.trained = self._trained_models()
        self.guards = {
            name: BadStepGuard(cfg.guard.max_bad_steps, name) for name in self.optimizers
        }
        self.step = 0
        self._resume()  # optimizer state is created here, while the engine sleeps
        offload_idle(self.models, self.optimizers, cfg.placement.ref_reward_offload, env.device)
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
        self.update_plan = UpdatePlan.from_config(cfg, self.plan, self.group_size, parallel)
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

    def start_engine(self, tokenizer, max_images: int = 1) -> RolloutEngine | None:
        """This rank's rollout engine, asleep (None: the rank generates nothing, as the
        training ranks of ``--async_train``); ``max_images`` per prompt (a VLM).

        The engine first, then to sleep: vLLM sizes its memory from what is free when it
        starts, so with four resident models it would refuse to start (TRL's colocate order).
        """
        vision = self.actor_kind.vision
        engine = build_engine(self.cfg, self.env, tokenizer, max_images, vision=vision)
        engine.sleep()
        log.info("rollout engine started and asleep; loading the models")
        return engine

    def memory_owners(self) -> dict[str, list[torch.Tensor]]:
        """The tensors the memory census (``FSDP_RLHF_MEMORY_CENSUS``) attributes the device's
        bytes to: each model's params and grads, each optimizer's state, the HF engine's copy
        and the actor's EMA."""
        m = self.models
        engine = getattr(self.rollout_session, "engine", None)
        models = {"actor": m.actor, "critic": m.critic, "ref": m.ref, "reward": m.reward}
        models["engine copy"] = engine.model if isinstance(engine, HFEngine) else None
        ema = {"actor ema": list(self.ema.shadow.values())} if self.ema is not None else {}
        return owners_of(models, self.optimizers, ema)

    def _session(self, engine: RolloutEngine) -> RolloutSession:
        return RolloutSession(
            engine,
            self.models.actor,
            self.optimizers["actor"],
            self.timer,
            device=self.env.device,
            dtype=engine_dtype(self.cfg),
            sleep_drops_weights=sleep_drops_weights(self.cfg, self.env.device),
            adapter=adapter_spec(self.cfg, self.models.actor),
            lora_scaling=merged_lora_scaling(self.cfg),
            unsynced=unsynced_params(self.cfg, self.models.actor),
            delta=delta_state(self.cfg, self.env.device),
            overlap=self.cfg.rollout.weight_sync_overlap,
        )

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
        total = b.num_episodes * b.max_epochs * self.sampler.batches_per_epoch
        return min(total, b.max_steps) if b.max_steps > 0 else total

    # ------------------------------------------------------------------ one step

    def train_step(self, stop_agreed: Callable[[], bool]) -> bool:
        sampler_state = self.sampler.state_dict()
        metrics = self.run_phases(self.draw_prompts(), stop_agreed)
        if metrics is None:
            # a resumed run must redo this step: the prompts drawn (more than one batch with
            # --dynamic_filtering) go back to the sampler
            self.sampler.load_state_dict(sampler_state)
            return False
        last = self.step == self.total_steps
        if self.evaluator is not None and self.evaluator.due(self.step, self.total_steps):
            metrics.update(self.evaluate())
        # Every step goes to metrics.jsonl/TensorBoard; the console every logging_steps.
        console = self.step % self.cfg.logging.logging_steps == 0 or last
        self.logger.log(self.step, metrics, CONSOLE_KEYS, console=console)
        return True

    def draw_prompts(self) -> list[Prompt]:
        return [self.prompts[i] for i in self.sampler.next_indices()]

    def run_phases(
        self, prompts: list[Prompt], stop_agreed: Callable[[], bool]
    ) -> dict[str, float] | None:
        """The step's phases; None when a stop was agreed after the rollout (nothing has
        changed but the engine's weights, which equal the actor's)."""
        stats = StatCollector()
        reuse = reuse_update_logprobs(
            self.cfg.algo, self.plan.optimizer_steps_per_epoch, self.actor_updates
        )
        with self.timer("all"):
            # 1-2. rollout (current actor weights into the engine, sample responses) and score
            #    (reward model and/or rule reward); with --dynamic_filtering, repeated on fresh
            #    prompts until the batch holds only groups with a learning signal
            exp, prompts, rollout_metrics = self.sample(prompts, stats)
            # a PPO step is long: vote again before the update, so a stop signal that came
            # during the rollout still leaves the whole window for the checkpoint
            if stop_agreed():
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
                kl_metrics = (
                    {} if reuse else observe_kl(exp, self.cfg.algo, self.kl_ctl, self.parallel)
                )
            # 5. critic then actor updates
            update_metrics = self.update(exp, reuse)
            if reuse:
                kl_metrics = observe_kl(exp, self.cfg.algo, self.kl_ctl, self.parallel)
        collect_batch_stats(stats, exp, trainer_old_logprobs=not self.rollout_logprobs_as_old)
        metrics = {**rollout_metrics, **kl_metrics, **update_metrics, **stats.reduce()}
        metrics.update(self.throughput(metrics))
        metrics.update(self.timer.pop())
        self.maybe_log_samples(exp, prompts)
        return metrics

    def throughput(self, metrics: dict[str, float]) -> dict[str, float]:
        return throughput_metrics(
            metrics, self.timer.times, self.cfg, self.env.world_size, engine_name=self.engine_name
        )

    # ------------------------------------------------------------------ phases

    def sample(
        self, prompts: list[Prompt], stats: StatCollector
    ) -> tuple[Experience, list[Prompt], dict[str, float]]:
        """Rollout and score this step's prompts (and, with --dynamic_filtering, more)."""

        def generate_and_score(batch: list[Prompt], round_: int):
            exp, metrics = self.rollout(batch, stats, round_)
            self.score(exp, batch)
            add_overlong_penalty(exp, self.cfg.algo, self.cfg.rollout.generate_max_len)
            add_stop_properly_penalty(exp, self.cfg.algo)
            return exp, metrics

        if not self.cfg.algo.dynamic_filtering:
            exp, metrics = generate_and_score(prompts, 0)
            return exp, prompts, metrics
        n, pad_id = self.cfg.batch.n_samples_per_prompt, self.models.tokenizer.pad_token_id
        return dynamic_sample(
            prompts,
            self.draw_prompts,
            generate_and_score,
            self.cfg.algo,
            n,
            pad_id,
            self.parallel.data_group,
        )

    def rollout(
        self, prompts: list[Prompt], stats: StatCollector, round_: int = 0
    ) -> tuple[Experience, dict[str, float]]:
        metrics: dict[str, float] = {}
        sampling = sampling_config(self.cfg, self.step, round_)
        env_scores = images = None
        if self.images is not None:  # a VLM: each prompt's images, expanded prompt ids
            ids, prompt_images = self.images.encode(prompts)
            out = self.rollout_session.generate(ids, sampling, metrics, images=prompt_images)
            images = StepImages.rows(prompt_images, sampling.n)
            check_responses(out, self.images.vision.tokens)
        elif self.multiturn is None:
            out = self.generate(prompts, sampling, metrics)
        else:  # --env_file: the environment's rewards are the scores
            out, env_scores = multiturn_rollout(
                self.multiturn,
                self.rollout_session,
                self.sp.share(prompts),
                sampling,
                metrics,
                stats,
            )
            out, env_scores = gather_rollouts(out, self.sp, self.pad_id, env_scores)
        exp = experience_from_rollout(out, self.env.device)
        exp.images = images
        exp.scores = env_scores.to(self.env.device) if env_scores is not None else None
        # reduced with the step's other statistics: a collective here would make each rank
        # wait for the slowest one's generation before scoring (with sequence parallelism the
        # group's ranks hold the same rows: the mean over copies is the same)
        add_rollout_stats(stats, out)
        return exp, metrics

    @property
    def pad_id(self) -> int:
        return self.models.tokenizer.pad_token_id

    def score(self, exp: Experience, prompts: list[Prompt], n: int | None = None) -> None:
        """``exp.scores``; prompt i owns rows i*n .. i*n+n-1 (n: the training group size)."""
        micro = self.scoring_batching
        scores = torch.zeros(exp.num_sequences, device=exp.input_ids.device)
        if self.multiturn is not None:  # set by the rollout; --env_file excludes the others
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
                )
            metrics.update(actor_metrics)
            if self.moe is not None:
                metrics.update(self.moe.pop_metrics())
            if reuse_logprobs:
                exp.old_logprobs = old_logprobs
            self.actor_updated()
        metrics["actor/lr"] = self.schedulers["actor"].get_last_lr()[0]
        metrics["actor/kl_coef"] = self.kl_ctl.value
        return metrics

    def actor_updated(self) -> None:
        """The actor's weights changed: the engine syncs them before its next rollout."""
        self.rollout_session.actor_updated()

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
        metrics = evaluator.run(self.generate, self.score)
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

    def generate(
        self,
        prompts: list[Prompt],
        sampling: SamplingConfig,
        metrics: dict[str, float] | None = None,
        phase: str = "rollout",
    ) -> RolloutOutput:
        """Responses to this rank's data shard of ``prompts`` (with their images, for a VLM).
        With sequence parallelism each rank of a group generates its share of the group's
        prompts and every rank gets all the group's rows (VLMs refuse sequence parallelism)."""
        if self.images is not None:
            ids, images = self.images.encode(prompts)
            return self.rollout_session.generate(ids, sampling, metrics, phase, images=images)
        ids = [p.ids for p in prompts]
        out = self.rollout_session.generate(self.sp.share(ids), sampling, metrics, phase)
        return gather_rollouts(out, self.sp, self.pad_id)[0]

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
            "sampler": self.sampler.state_dict(),
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
        self.sampler.load_state_dict(saved["sampler"])
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
        if self.rollout_session is not None:
            self.rollout_session.close()

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

    @property
    def engine_name(self) -> str:
        return self.cfg.rollout.rollout_engine
