"""The colocated source of a PPO step's experiences: this rank's engine, beside the actor.

Each step draws the rank's prompts, wakes the engine (syncing the actor's weights into it when
they changed), generates, puts it back to sleep and scores the responses; with
``--dynamic_filtering`` it repeats on fresh prompts until the batch holds only groups with a
learning signal. The engine starts before the models (:func:`start_engine`) and sleeps while
they load.
"""

from __future__ import annotations

import logging

import torch

from fsdp_rlhf.data.prompts import Prompt, PromptSampler
from fsdp_rlhf.models.vision import VisionTokens
from fsdp_rlhf.rollout import RolloutEngine, RolloutOutput, SamplingConfig
from fsdp_rlhf.rollout.groups import gather_rollouts
from fsdp_rlhf.trainers.experience import Experience, experience_from_rollout
from fsdp_rlhf.trainers.ppo.dynamic_filtering import dynamic_sample
from fsdp_rlhf.trainers.ppo.metrics import StatCollector, add_rollout_stats, throughput_metrics
from fsdp_rlhf.trainers.ppo.multiturn import build_multiturn, multiturn_rollout
from fsdp_rlhf.trainers.ppo.rewards import add_overlong_penalty, add_stop_properly_penalty
from fsdp_rlhf.trainers.ppo.rollout import (
    RolloutSession,
    delta_state,
    sampling_config,
    sleep_drops_weights,
)
from fsdp_rlhf.trainers.ppo.setup import (
    adapter_spec,
    build_engine,
    engine_dtype,
    merged_lora_scaling,
    unsynced_params,
)
from fsdp_rlhf.trainers.ppo.source import Sampled, SourceInputs
from fsdp_rlhf.trainers.ppo.vision import StepImages, check_responses

log = logging.getLogger("fsdp_rlhf")


def start_engine(
    cfg, env, tokenizer, max_images: int = 1, vision: VisionTokens | None = None
) -> RolloutEngine:
    """This rank's rollout engine, asleep; ``max_images`` per prompt and ``vision``, the
    actor's special tokens (a VLM; its kind, read in prepare).

    The engine first, then to sleep: vLLM sizes its memory from what is free when it starts,
    so with four resident models it would refuse to start (TRL's colocate order).
    """
    engine = build_engine(cfg, env, tokenizer, max_images, vision=vision)
    engine.sleep()
    log.info("rollout engine started and asleep; loading the models")
    return engine


class ColocatedSource:
    """Experiences generated on this rank (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, parts: SourceInputs) -> None:
        cfg, env = parts.cfg, parts.env
        self.cfg, self.env, self.parts = cfg, env, parts
        self.engine = engine
        self.session = RolloutSession(
            engine,
            parts.actor,
            parts.actor_optimizer,
            parts.timer,
            device=env.device,
            dtype=engine_dtype(cfg),
            sleep_drops_weights=sleep_drops_weights(cfg, env.device),
            adapter=adapter_spec(cfg, parts.actor),
            lora_scaling=merged_lora_scaling(cfg),
            unsynced=unsynced_params(cfg, parts.actor),
            delta=delta_state(cfg, env.device),
            overlap=cfg.rollout.weight_sync_overlap,
        )
        # the ranks of a sequence-parallel group draw the same prompts (their data shard)
        parallel = parts.parallel
        self.sampler = PromptSampler(
            len(parts.prompts),
            cfg.batch.rollout_batch_size,
            parallel.dp_rank,
            parallel.dp_size,
            cfg.seed,
        )
        self.multiturn = build_multiturn(cfg, parts.tokenizer, parts.timer)  # None: one turn
        self.pad_id = parts.tokenizer.pad_token_id

    # ------------------------------------------------------------------ the source

    def sample(self, step: int, stats: StatCollector) -> Sampled:
        """Rollout and score this step's prompts (and, with --dynamic_filtering, more)."""
        before = self.sampler.state_dict()

        def generate_and_score(batch: list[Prompt], round_: int):
            exp, metrics = self.rollout(batch, step, stats, round_)
            self.parts.score(exp, batch)
            add_overlong_penalty(exp, self.cfg.algo, self.cfg.rollout.generate_max_len)
            add_stop_properly_penalty(exp, self.cfg.algo)
            return exp, metrics

        prompts = self.draw()
        if not self.cfg.algo.dynamic_filtering:
            exp, metrics = generate_and_score(prompts, 0)
        else:
            n = self.cfg.batch.n_samples_per_prompt
            exp, prompts, metrics = dynamic_sample(
                prompts,
                self.draw,
                generate_and_score,
                self.cfg.algo,
                n,
                self.pad_id,
                self.parts.parallel.data_group,
            )
        return Sampled(exp, prompts, metrics, {"sampler_before": before})

    def settle(self, sampled: Sampled, trained: bool) -> None:
        if not trained:  # a resumed run redoes the step: its prompts go back to the sampler
            self.sampler.load_state_dict(sampled.position["sampler_before"])

    def after_update(self, step: int, actor_updated: bool) -> dict[str, float]:
        """A changed actor marks the engine stale: it syncs before its next rollout."""
        if actor_updated:
            self.session.actor_updated()
        return {}

    def throughput(self, metrics: dict[str, float], times: dict[str, float]) -> dict[str, float]:
        engine = self.cfg.rollout.rollout_engine
        return throughput_metrics(metrics, times, self.cfg, self.env.world_size, engine)

    def evaluate(self, evaluator, score, step: int) -> dict[str, float]:
        """This rank's engine evaluates its share (it syncs the new weights first)."""
        return evaluator.run(self.generate, score)

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, saved: dict) -> None:
        self.sampler.load_state_dict(saved["sampler"])

    def close(self) -> None:
        self.session.close()

    # ------------------------------------------------------------------ generation

    def draw(self) -> list[Prompt]:
        return [self.parts.prompts[i] for i in self.sampler.next_indices()]

    def rollout(
        self, prompts: list[Prompt], step: int, stats: StatCollector, round_: int = 0
    ) -> tuple[Experience, dict[str, float]]:
        metrics: dict[str, float] = {}
        sampling = sampling_config(self.cfg, step, round_)
        env_scores = images = None
        step_images: StepImages | None = self.parts.images
        if self.multiturn is not None:  # --env_file: the environment's rewards are the scores
            out, env_scores, prompt_images = self._multiturn(prompts, sampling, metrics, stats)
        elif step_images is not None:  # a VLM: each prompt's images, expanded prompt ids
            out, prompt_images = self._generate_with_images(prompts, sampling, metrics)
        else:
            out = self.generate(prompts, sampling, metrics)
        if step_images is not None:
            images = StepImages.rows(prompt_images, sampling.n)
            check_responses(out, step_images.vision.tokens)
        exp = experience_from_rollout(out, self.env.device)
        exp.images = images
        exp.scores = env_scores.to(self.env.device) if env_scores is not None else None
        # reduced with the step's other statistics: a collective here would make each rank
        # wait for the slowest one's generation before scoring (with sequence parallelism the
        # group's ranks hold the same rows: the mean over copies is the same)
        add_rollout_stats(stats, out)
        return exp, metrics

    def _multiturn(
        self,
        prompts: list[Prompt],
        sampling: SamplingConfig,
        metrics: dict[str, float],
        stats: StatCollector,
    ) -> tuple[RolloutOutput, torch.Tensor, list | None]:
        """Multi-turn trajectories of this rank's share of ``prompts`` (gathered over a
        sequence-parallel group), their summed rewards and, for a VLM, every prompt's images
        (sent with each turn)."""
        sp, ids, images = self.parts.sp, None, None
        if self.parts.images is not None:
            ids, images = self.parts.images.encode(prompts)
        out, env_scores = multiturn_rollout(
            self.multiturn,
            self.session,
            sp.share(prompts),
            sampling,
            metrics,
            stats,
            prompt_ids=None if ids is None else sp.share(ids),
            images=None if images is None else sp.share(images),
        )
        out, env_scores = gather_rollouts(out, sp, self.pad_id, env_scores)
        return out, env_scores, images

    def generate(
        self,
        prompts: list[Prompt],
        sampling: SamplingConfig,
        metrics: dict[str, float] | None = None,
        phase: str = "rollout",
    ) -> RolloutOutput:
        """Responses to this rank's data shard of ``prompts`` (with their images, for a VLM).
        With sequence parallelism each rank of a group generates its share of the group's
        prompts and every rank gets all the group's rows."""
        if self.parts.images is not None:
            return self._generate_with_images(prompts, sampling, metrics, phase)[0]
        ids = [p.ids for p in prompts]
        out = self.session.generate(self.parts.sp.share(ids), sampling, metrics, phase)
        return gather_rollouts(out, self.parts.sp, self.pad_id)[0]

    def _generate_with_images(
        self,
        prompts: list[Prompt],
        sampling: SamplingConfig,
        metrics: dict[str, float] | None,
        phase: str = "rollout",
    ) -> tuple[RolloutOutput, list]:
        """A VLM's :meth:`generate`: the rows and every prompt's images (processed on each rank
        of a sequence-parallel group, which trains on all the group's rows)."""
        ids, images = self.parts.images.encode(prompts)
        sp = self.parts.sp
        out = self.session.generate(
            sp.share(ids), sampling, metrics, phase, images=sp.share(images)
        )
        return gather_rollouts(out, sp, self.pad_id)[0], images
