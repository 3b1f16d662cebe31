"""`fsdp-rlhf ppo`: colocated single-controller PPO. Every rank runs this same loop::

    torchrun --nproc_per_node 8 -m fsdp_rlhf.cli ppo --pretrain SFT --reward_pretrain RM ...

One step = one rollout batch: sync weights into vLLM, generate, score, old/ref log-probs and
values, advantages, critic update, actor update. Idle models leave the GPU between phases.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fsdp_rlhf.algorithms import AdaptiveKLController, FixedKLController, clip_scores
from fsdp_rlhf.config import PPOBatchPlan, PPOConfig
from fsdp_rlhf.config_base import dump_yaml
from fsdp_rlhf.data.prompts import Prompt, PromptSampler
from fsdp_rlhf.distributed import checkpoint as ckpt
from fsdp_rlhf.distributed.env import DistEnv, init_distributed, teardown
from fsdp_rlhf.distributed.offload import (
    offload_model,
    offload_optimizer,
    onload_model,
    onload_optimizer,
)
from fsdp_rlhf.distributed.signals import GracefulStop
from fsdp_rlhf.metrics import MetricLogger, PhaseTimer, setup_logging, truncate_metrics
from fsdp_rlhf.models.save import save_hf_model
from fsdp_rlhf.rollout import sync_weights
from fsdp_rlhf.trainers import ppo_step
from fsdp_rlhf.trainers.experience import (
    Experience,
    batched_logprobs,
    batched_scores,
    batched_values,
)
from fsdp_rlhf.trainers.ppo_metrics import StatCollector
from fsdp_rlhf.trainers.ppo_setup import (
    build_engine,
    build_models,
    build_optimizers,
    build_prompts,
    engine_dtype,
    preflight,
)

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
    plan, rows = preflight(cfg)  # bad input fails here, before any model is loaded
    env = init_distributed()
    setup_logging(env.rank, debug)
    trainer = PPOTrainer(cfg, env, plan, rows)
    try:
        trainer.train()
    finally:
        trainer.close()  # shuts the engine down; vLLM destroys the process group with it
        teardown()
    return 0


class PPOTrainer:
    def __init__(self, cfg: PPOConfig, env: DistEnv, plan: PPOBatchPlan, rows) -> None:
        self.cfg, self.env, self.plan = cfg, env, plan
        torch.manual_seed(cfg.seed)
        self.models = build_models(cfg, env)
        self.prompts = build_prompts(cfg, rows, self.models.tokenizer)
        self.sampler = PromptSampler(
            len(self.prompts), cfg.batch.rollout_batch_size, env.rank, env.world_size, cfg.seed
        )
        per_pass = cfg.batch.max_epochs * self.sampler.batches_per_epoch
        self.total_steps = cfg.batch.num_episodes * per_pass
        if cfg.batch.max_steps > 0:
            self.total_steps = min(self.total_steps, cfg.batch.max_steps)
        updates = self.total_steps * cfg.algo.ppo_epochs * plan.optimizer_steps_per_epoch
        self.optimizers, self.schedulers = build_optimizers(cfg, self.models, updates)
        a = cfg.algo
        self.kl_ctl = (
            AdaptiveKLController(a.init_kl_coef, a.kl_target, a.kl_horizon)
            if a.kl_target is not None
            else FixedKLController(a.init_kl_coef)
        )
        if a.use_kl_loss and a.kl_estimator == "k1":
            log.warning(
                "--use_kl_loss with --kl_estimator k1: k1's gradient is zero in "
                "expectation, so the KL term barely constrains the actor; use k2 or k3"
            )
        self.engine = build_engine(cfg, env, self.models.tokenizer)
        self.timer = PhaseTimer(env.device)
        resume_from = ckpt.resolve_resume(cfg.ckpt.ckpt_path, cfg.ckpt.load_checkpoint)
        if resume_from is not None and env.is_rank0:
            # rows a crashed run wrote after its last checkpoint are about to be redone
            truncate_metrics(
                Path(cfg.ckpt.save_path) / "metrics.jsonl",
                after_step=int(resume_from.name.split("_")[-1]),
            )
        self.logger = MetricLogger(
            env.rank, cfg.ckpt.save_path, cfg.logging.tensorboard, append=resume_from is not None
        )
        self.step = 0
        self.actor_version, self.engine_version = 0, -1
        self._resume(resume_from)
        if env.is_rank0:
            Path(cfg.ckpt.save_path).mkdir(parents=True, exist_ok=True)
            (Path(cfg.ckpt.save_path) / "config.yaml").write_text(dump_yaml(cfg))

    # ------------------------------------------------------------------ loop

    def train(self) -> None:
        log.info(
            "PPO: %d steps, %d prompts/step x %d samples, world %d (%d engines x TP %d)",
            self.total_steps,
            self.cfg.batch.rollout_batch_size,
            self.cfg.batch.n_samples_per_prompt,
            self.env.world_size,
            self.plan.num_engines,
            self.plan.tp_size,
        )
        with GracefulStop() as stop:
            while self.step < self.total_steps:
                self.step += 1
                prompts = [self.prompts[i] for i in self.sampler.next_indices()]
                metrics = self.train_step(prompts)
                last = self.step == self.total_steps
                # Every step goes to metrics.jsonl/TensorBoard; the console every logging_steps.
                console = self.step % self.cfg.logging.logging_steps == 0 or last
                self.logger.log(self.step, metrics, CONSOLE_KEYS, console=console)
                if stop.agreed():  # collective: all ranks stop at the same step
                    self.save_checkpoint()
                    log.info("stop signal: checkpoint at step %d written, exiting", self.step)
                    return
                save_every = self.cfg.ckpt.save_steps
                if save_every > 0 and (self.step % save_every == 0 or last):
                    self.save_checkpoint()
        self.save_final()

    def train_step(self, prompts: list[Prompt]) -> dict[str, float]:
        stats = StatCollector()
        with self.timer("all"):
            # 1. rollout: current actor weights into the engine, then sample responses
            exp, rollout_metrics = self.rollout(prompts, stats)
            # 2. score: reward model and/or rule reward
            self.score(exp, prompts)
            # 3. log-probs of the sampling policy (unless the update yields them) and the
            #    reference, critic values
            fold = ppo_step.old_logprobs_from_update(self.cfg, self.plan, self.actor_updates)
            self.forward_old_ref_values(exp, old_logprobs=not fold)
            # 4. KL-shaped rewards, advantages and returns
            with self.timer("adv"):
                ppo_step.compute_advantages(
                    exp, self.cfg.algo, self.kl_ctl, self.cfg.batch.n_samples_per_prompt
                )
                kl_metrics = {} if fold else ppo_step.observe_kl(exp, self.cfg.algo, self.kl_ctl)
            # 5. critic then actor updates
            update_metrics = self.update(exp, fold_old_logprobs=fold)
            if fold:
                kl_metrics = ppo_step.observe_kl(exp, self.cfg.algo, self.kl_ctl)
        ppo_step.collect_batch_stats(stats, exp)
        metrics = {**rollout_metrics, **kl_metrics, **update_metrics, **stats.reduce()}
        metrics.update(
            ppo_step.throughput_metrics(metrics, self.timer.times, self.cfg, self.env.world_size)
        )
        metrics.update(self.timer.pop())
        self.maybe_log_samples(exp, prompts, metrics)
        return metrics

    # ------------------------------------------------------------------ phases

    def rollout(
        self, prompts: list[Prompt], stats: StatCollector
    ) -> tuple[Experience, dict[str, float]]:
        metrics: dict[str, float] = {}
        offload_optimizer(self.optimizers["actor"], self.env.device)
        with self.timer("resharding_to_infer"):
            self.engine.wake_up(["weights"])
            if self.engine_version != self.actor_version or self.weights_discarded_by_sleep:
                sync = sync_weights(self.models.actor, self.engine, engine_dtype(self.cfg))
                self.engine_version = self.actor_version
                metrics["rollout/weight_sync_gbps"] = sync.bytes_per_s / 1e9
            self.engine.wake_up(["kv_cache"])
        with self.timer("rollout"):
            out = self.engine.generate(
                [p.ids for p in prompts], ppo_step.sampling_config(self.cfg, self.step)
            )
        with self.timer("resharding_to_train"):
            self.engine.sleep()
            onload_optimizer(self.optimizers["actor"], self.env.device)
        exp = ppo_step.experience_from_rollout(out, self.env.device)
        # reduced with the step's other statistics: a collective here would make each rank
        # wait for the slowest one's generation before scoring
        stats.add_mean("response_length/clip_ratio", ppo_step.truncated(out.finish_reasons))
        return exp, metrics

    def score(self, exp: Experience, prompts: list[Prompt]) -> None:
        micro = self.plan.micro_rollout_batch_size
        scores = torch.zeros(exp.num_sequences, device=exp.input_ids.device)
        if self.models.reward is not None:
            with self.timer("reward_model"), self.onloaded(self.models.reward, "reward"):
                rm = batched_scores(self.models.reward, exp, micro, self.packed)
            if self.models.reward_norm is not None:
                mean, std = self.models.reward_norm
                rm = (rm - mean) / std
            scores = scores + rm
        if self.models.rule_reward is not None:
            with self.timer("rule_reward"):
                scores = scores + ppo_step.rule_scores(
                    self.models.rule_reward,
                    exp,
                    prompts,
                    self.models.tokenizer,
                    self.cfg.batch.n_samples_per_prompt,
                ).to(scores.device)
        exp.scores = clip_scores(scores, self.cfg.algo.reward_clip_range)

    def forward_old_ref_values(self, exp: Experience, old_logprobs: bool) -> None:
        micro, temp = self.plan.micro_rollout_batch_size, self.cfg.rollout.temperature
        if old_logprobs:
            with self.timer("old_log_p"):
                exp.old_logprobs = batched_logprobs(
                    self.models.actor, exp, micro, temp, self.packed
                )
        with self.timer("reference_model"), self.onloaded(self.models.ref, "ref"):
            exp.ref_logprobs = batched_logprobs(self.models.ref, exp, micro, temp, self.packed)
        if self.models.critic is not None:
            with self.timer("critic_model"):
                onload_model(self.models.critic, self.env.device)
                exp.values = batched_values(self.models.critic, exp, micro, self.packed)

    def update(self, exp: Experience, fold_old_logprobs: bool) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.models.critic is not None:
            with self.timer("update_critic"):
                onload_optimizer(self.optimizers["critic"], self.env.device)
                metrics.update(ppo_step.update_critic(self, exp))
                offload_optimizer(self.optimizers["critic"], self.env.device)
                offload_model(self.models.critic, self.env.device)
        if self.actor_updates:
            with self.timer("update"):
                metrics.update(ppo_step.update_actor(self, exp, fold_old_logprobs))
            self.actor_version += 1
        metrics["actor/lr"] = self.schedulers["actor"].get_last_lr()[0]
        metrics["actor/kl_coef"] = self.kl_ctl.value
        return metrics

    def onloaded(self, model, name: str):
        """Onload a frozen model for one phase; offload it after when ``--ref_reward_offload``."""
        return ppo_step.OnloadedModel(self, model, name)

    # ------------------------------------------------------------------ i/o

    def maybe_log_samples(self, exp: Experience, prompts, metrics) -> None:
        every = self.cfg.sample_log_steps
        if every > 0 and (self.step % every == 0 or self.step == 1) and self.env.is_rank0:
            ppo_step.log_samples(self, exp, prompts)

    def _stateful(self) -> tuple[dict, dict, dict]:
        models = {"actor": self.models.actor}
        if self.models.critic is not None:
            models["critic"] = self.models.critic
        return models, self.optimizers, self.schedulers

    def save_checkpoint(self) -> None:
        models, optimizers, schedulers = self._stateful()
        path = ckpt.save_checkpoint(
            self.cfg.ckpt.ckpt_path,
            self.step,
            models=models,
            optimizers=optimizers,
            schedulers=schedulers,
            keep=self.cfg.ckpt.max_ckpt_num,
            trainer_state={
                "sampler": self.sampler.state_dict(),
                "kl_ctl": self.kl_ctl.state_dict(),
            },
        )
        log.info("checkpoint: %s", path)

    def _resume(self, path: Path | None) -> None:
        if path is None:
            return
        models, optimizers, schedulers = self._stateful()
        state = ckpt.load_checkpoint(
            path, models=models, optimizers=optimizers, schedulers=schedulers
        )
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.engine_version = -1  # the engine still holds the initial weights: sync at once
        log.info("resumed from %s at step %d", path, self.step)

    def save_final(self) -> None:
        save_hf_model(self.models.actor, self.models.tokenizer, self.cfg.ckpt.save_path)
        if self.models.critic is not None:
            save_hf_model(
                self.models.critic, self.models.tokenizer, Path(self.cfg.ckpt.save_path) / "critic"
            )
        log.info("saved actor to %s", self.cfg.ckpt.save_path)

    @property
    def actor_updates(self) -> bool:
        """Whether this step trains the actor (``--freezing_actor_steps`` holds it back)."""
        return self.step > self.cfg.algo.freezing_actor_steps

    @property
    def packed(self) -> bool:
        return self.cfg.batch.packing_samples

    @property
    def weights_discarded_by_sleep(self) -> bool:
        """Sleep level 2 drops the engine's weights: every rollout needs a full sync."""
        r = self.cfg.rollout
        return self.env.device.type == "cuda" and r.vllm_enable_sleep and r.vllm_sleep_level == 2

    def close(self) -> None:
        self.logger.close()
        self.engine.close()
