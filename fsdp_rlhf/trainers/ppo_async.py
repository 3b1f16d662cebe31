"""`fsdp-rlhf ppo --async_train`: asynchronous PPO in one torchrun world (docs/async.md).

The last ``vllm_num_engines x vllm_tensor_parallel_size`` ranks only generate
(:mod:`fsdp_rlhf.trainers.ppo_async_rollout`); the others train, each step on a batch the
rollout ranks generated while the previous steps trained. A training step is the colocated
trainer's (:class:`~fsdp_rlhf.trainers.ppo.PPOTrainer`) with two phases swapped:

    receive    the step's batch from the rollout ranks (timing/train_wait: waiting for them)
    ...        scores (reward model), reference log-probs, values, advantages, updates
    publish    the new actor weights to the rollout ranks (timing/weight_sync)

and ``async/*`` metrics on how stale the batch was. Checkpoints hold what the colocated
trainer's do plus each rollout rank's prompt-sampler state after the last trained batch: a
resumed run regenerates the batches after it from the checkpointed weights, so no step runs
twice and none is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_rlhf.config import PPOConfig, async_rollout_ranks
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.distributed import weight_broadcast
from fsdp_rlhf.distributed.bridge import Bridge, Channel, Patience, PeerLost, PeerSlow
from fsdp_rlhf.distributed.delta_sync import DeltaSender, DeltaStats
from fsdp_rlhf.distributed.env import DistEnv, all_reduce_scalars, job_hosts, job_position
from fsdp_rlhf.distributed.heartbeat import peer_beats
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.prefetch import StageTimes, staged
from fsdp_rlhf.distributed.split_world import SplitWorld, init_split_world
from fsdp_rlhf.distributed.weight_broadcast import WeightLink
from fsdp_rlhf.rollout.weight_sync import (
    actor_buckets,
    hf_param_name,
    stream_adapter_weights,
    stream_merged_weights,
    tied_head_alias,
)
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo import PPOTrainer
from fsdp_rlhf.trainers.ppo_async_queue import (
    END,
    START,
    WEIGHTS,
    BatchPart,
    needed_version,
    reports_to,
    routes,
    staleness,
    stop_key,
)
from fsdp_rlhf.trainers.ppo_dynamic_filtering import concat_experiences
from fsdp_rlhf.trainers.ppo_metrics import StatCollector, throughput
from fsdp_rlhf.trainers.ppo_rewards import add_overlong_penalty, add_stop_properly_penalty
from fsdp_rlhf.trainers.ppo_rollout import adapter_sync
from fsdp_rlhf.trainers.ppo_setup import adapter_spec, engine_dtype, merged_lora_scaling, prepare

log = logging.getLogger("fsdp_rlhf")

# seconds closing waits for the rollout ranks to take "end" (at once, when nothing failed)
END_WAIT_S = 10.0


@dataclass
class AsyncJob:
    """This rank's view of the split world: who is who, and the links between the sides."""

    split: SplitWorld
    rank: int  # in the whole job
    bridge: Bridge
    link: WeightLink
    store: dist.Store


def main(cfg: PPOConfig, debug: bool = False) -> int:
    job: list[AsyncJob] = []

    def init(timeout_min: int) -> tuple[DistEnv, SplitWorld]:
        rank, world, _ = job_position()
        split = SplitWorld(
            world, async_rollout_ranks(cfg, world), cfg.rollout.vllm_tensor_parallel_size
        )
        env, store = init_split_world(split, timeout_min)
        # a live peer is waited for up to --dist_timeout_min; its heartbeat tells a dead one
        patience = Patience(60.0 * timeout_min, peer_beats(cfg.guard.heartbeat_timeout_s))
        bridge = Bridge.connect(store, rank, world, patience, split.describe)
        receivers = [split.rollout_rank(i) for i in range(split.rollout_ranks)]
        link = WeightLink.build(bridge, store, receivers, env.device, timeout_min)
        job.append(AsyncJob(split, rank, bridge, link, store))
        return env, split

    def build(cfg: PPOConfig, env: DistEnv, prepared, parallel: ParallelLayout):
        if job[0].split.is_rollout(job[0].rank):
            from fsdp_rlhf.trainers.ppo_async_rollout import RolloutWorker

            _, rows, kinds = prepared
            return RolloutWorker(cfg, env, job[0], rows, kinds["--pretrain"])
        return AsyncLearner(cfg, env, prepared, job[0], parallel)

    def run(trainer) -> int:
        if isinstance(trainer, AsyncLearner):
            return common.fit(trainer, cfg.ckpt.save_steps)
        return trainer.run()

    return common.launch(cfg, debug, prepare, build, init=init, run=run, beat_on_one_node=True)


class AsyncLearner(PPOTrainer):
    """A training rank of an asynchronous job (see the module docstring)."""

    def __init__(
        self, cfg: PPOConfig, env: DistEnv, prepared, job: AsyncJob, parallel: ParallelLayout
    ) -> None:
        self.job = job
        split = job.split
        self.routes = routes(cfg.batch.rollout_batch_size, split.rollout_ranks, env.world_size)
        self.my_routes = [r for r in self.routes if r.dest == env.rank]
        # each rollout rank's prompt-sampler state after the last trained batch (None: the
        # start of the data); those this rank accounts for; those of the batch in training
        self.rollout_samplers: list[dict] | None = None
        self.rollout_samplers_here: dict[int, dict] = {}
        self._batch_samplers: dict[int, dict] = {}
        self._ended = False
        self.delta_sender = None
        mode = cfg.weight_sync_mode(env.device.type, job_hosts())
        if not adapter_sync(cfg) and mode == "delta":
            self.delta_sender = DeltaSender(full_every=cfg.rollout.weight_sync_full_every)
        super().__init__(cfg, env, prepared, parallel)
        log.info(
            "asynchronous: ranks 0-%d train, %d-%d generate (%d engines x TP %d); batches "
            "at most %d weight version(s) old%s",
            split.training_ranks - 1,
            split.training_ranks,
            split.world_size - 1,
            split.num_engines,
            split.tp_size,
            cfg.asynchronous.async_queue_size,
            ", partial rollouts" if cfg.asynchronous.partial_rollout else "",
        )
        self._start_rollouts()

    # ------------------------------------------------------------------ the trainer's hooks

    def start_engine(self, tokenizer, max_images: int = 1) -> None:
        return None  # the rollout ranks hold the engines

    def draw_prompts(self) -> list[Prompt]:
        return []  # the rollout ranks draw them; the batch says which they were

    def actor_updated(self) -> None:
        pass  # every step publishes the new weights (update)

    def train_step(self, stop_agreed: Callable[[], bool]) -> bool:
        finished = super().train_step(lambda: stop_agreed() or self._rollout_stop_agreed())
        if finished:
            self._record_samplers()
        return finished

    def sample(self, prompts, stats: StatCollector):
        """This step's batch from the rollout ranks, scored."""
        parts = self._receive()
        exp = concat_experiences([p.rows for p in parts], self.models.tokenizer.pad_token_id)
        prompts = [self.prompts[i] for p in parts for i in p.prompts]
        metrics = self._reports(parts, stats)
        if exp.scores is None:  # the reward model lives here: score as the colocated step does
            self.score(exp, prompts)
            add_overlong_penalty(exp, self.cfg.algo, self.cfg.rollout.generate_max_len)
            add_stop_properly_penalty(exp, self.cfg.algo)
        self._staleness(exp, stats)
        return exp, prompts, metrics

    def update(self, exp: Experience, reuse_logprobs: bool) -> dict[str, float]:
        metrics = super().update(exp, reuse_logprobs)
        if self.step < self.total_steps:  # the rollout ranks generate with it
            sent = self.publish(self.step)
            # waiting for the rollout ranks to take the weights is waiting for the rollout
            waited = all_reduce_scalars({"w": sent.waited}, "max")["w"]
            times = self.timer.times
            times["train_wait"] = times.get("train_wait", 0.0) + waited
            times["weight_sync"] = sent.seconds - waited
            moving = max(sent.seconds - waited, 1e-9)
            metrics["async/weight_sync_gbps"] = sent.bytes / moving / 1e9
            metrics["async/weight_sync_wire_bytes"] = float(sent.bytes)
            if sent.delta is not None and sent.delta.elements:
                metrics["async/weight_sync_changed_frac"] = sent.delta.changed_frac
        return metrics

    def throughput(self, metrics: dict[str, float]) -> dict[str, float]:
        """e2e over every rank of the job, update over the training ranks, rollout over the
        rollout ranks (their generation time)."""
        tokens = metrics["response_length/mean"] + metrics["prompt_length/mean"]
        n = self.cfg.batch.rollout_batch_size * self.cfg.batch.n_samples_per_prompt
        split, times = self.job.split, self.timer.times
        rounds = metrics.get("dynamic_filter/gen_rounds", 1.0)
        rollout_tps = throughput(
            metrics["rollout/generated_length"],
            int(n * rounds),
            split.rollout_ranks,
            metrics.get("timing/rollout", 0.0),
        )
        return {
            "e2e_tps": throughput(tokens, n, split.world_size, times.get("all", 0.0)),
            "update_tps": throughput(tokens, n, split.training_ranks, times.get("update", 0.0)),
            "rollout_tps": rollout_tps,
            "vllm_tps": rollout_tps,
        }

    # ------------------------------------------------------------------ checkpoints

    def data_settings(self) -> dict[str, int]:
        generated = self.cfg.asynchronous.vllm_generate_batch_size
        return {
            **super().data_settings(),
            "generate_batch_size": generated or self.cfg.batch.rollout_batch_size,
        }

    def trainer_state(self) -> dict:
        """Also every rollout rank's sampler state (collective: gathered from the training
        ranks that received them); ``sampler`` is rollout rank 0's, for a colocated resume."""
        state = super().trainer_state()
        gathered: list[dict] = [{} for _ in range(self.env.world_size)]
        dist.all_gather_object(gathered, self.rollout_samplers_here)
        merged = {int(k): v for part in gathered for k, v in part.items()}
        if merged:
            samplers = [merged[i] for i in range(self.job.split.rollout_ranks)]
            state["sampler"] = samplers[0]
            state["async"] = {"samplers": samplers, "weight_version": self.step}
        return state

    def load_trainer_state(self, saved: dict) -> None:
        super().load_trainer_state(saved)
        samplers = saved.get("async", {}).get("samplers")
        if samplers is None or len(samplers) != self.job.split.rollout_ranks:
            # a colocated checkpoint, or other rollout ranks: every rank's shard of the
            # batches continues from the same position
            samplers = [saved["sampler"]] * self.job.split.rollout_ranks
        self.rollout_samplers = samplers
        self.rollout_samplers_here = {
            i: state
            for i, state in enumerate(samplers)
            if reports_to(i, self.routes) == self.env.rank
        }

    # ------------------------------------------------------------------ the rollout ranks

    @property
    def sender(self) -> bool:
        return self.env.rank == 0

    def _tell_rollout_ranks(self, header: dict, wait_s: float | None = None) -> None:
        if not self.sender:
            return
        bridge, what = self.job.bridge, f"sending the rollout ranks '{header['kind']}'"
        for r in self.job.link.receivers:
            bridge.send_object(header, r, Channel.CONTROL, wait=False, what=what)
        bridge.flush(what=what, wait_s=wait_s)

    def _start_rollouts(self) -> None:
        """Where the rollout ranks start (the resumed step and sampler states), then the
        weights they start from. Collective over the training ranks."""
        spec = adapter_spec(self.cfg, self.models.actor)
        self._tell_rollout_ranks(
            {
                "kind": START,
                "step": self.step,
                "total_steps": self.total_steps,
                "samplers": self.rollout_samplers,
                "adapter": None if spec is None else vars(spec),
            }
        )
        sent = self.publish(self.step)
        log.info(
            "asynchronous: rollout ranks start at step %d with weights of step %d (%.1f MB, "
            "%.1f s)",
            self.step + 1,
            self.step,
            sent.bytes / 1e6,
            sent.seconds,
        )

    def publish(self, version: int) -> weight_broadcast.PublishStats:
        """Send the actor's weights as version ``version`` (collective over the training
        ranks: the gathers, made one bucket ahead with --weight_sync_overlap)."""
        self._tell_rollout_ranks({"kind": WEIGHTS, "version": version})
        actor, dtype = self.models.actor, engine_dtype(self.cfg)
        overlap, times = self.cfg.rollout.weight_sync_overlap, StageTimes()
        device = self.env.device
        if self.delta_sender is not None:
            stats = DeltaStats()
            deltas = self.delta_sender.deltas(actor, dtype, rename=hf_param_name, stats=stats)
            return weight_broadcast.publish_delta(
                self.job.link,
                staged(deltas, times, overlap=overlap),
                sender=self.sender,
                aliases=tied_head_alias(actor),
                stats=stats,
            )
        if adapter_sync(self.cfg):
            stream = stream_adapter_weights(actor, dtype)
        elif (scaling := merged_lora_scaling(self.cfg)) is not None:
            stream = stream_merged_weights(actor, dtype, scaling)
        else:
            buckets = staged(actor_buckets(actor, dtype), times, overlap=overlap, device=device)
            stream = (w for bucket in buckets for w in bucket)
        return weight_broadcast.publish(self.job.link, stream, sender=self.sender)

    def _receive(self) -> list[BatchPart]:
        """This rank's routes of batch ``self.step``, in route order (timing/train_wait)."""
        parts = []
        with self.timer("train_wait"):
            for route in self.my_routes:
                src = self.job.split.rollout_rank(route.source)
                msg = self.job.bridge.recv_object(
                    src, Channel.EXPERIENCE, f"receiving batch {self.step}"
                )
                parts.append(BatchPart.from_message(msg, self.env.device))
        for route, part in zip(self.my_routes, parts, strict=True):
            if part.batch != self.step or len(part.prompts) != route.stop - route.start:
                raise RuntimeError(
                    f"rollout rank {route.source} sent batch {part.batch} with "
                    f"{len(part.prompts)} prompts; step {self.step} expected "
                    f"{route.stop - route.start}"
                )
            self._batch_samplers[route.source] = part.sampler
        return parts

    def _record_samplers(self) -> None:
        """The step is done: its batch's sampler states are the ones to resume from."""
        self.rollout_samplers_here = {
            r.source: self._batch_samplers[r.source]
            for r in self.routes
            if r.dest == self.env.rank and reports_to(r.source, self.routes) == self.env.rank
        }

    def _reports(self, parts: list[BatchPart], stats: StatCollector) -> dict[str, float]:
        """The rollout ranks' statistics (into ``stats``) and their metrics and timings,
        averaged over the rollout ranks (collective)."""
        mine = [p.report["metrics"] for p in parts if p.report is not None]
        for part in parts:
            if part.report is not None:
                stats.merge(part.report["stats"])
        everyone: list[list[dict]] = [[] for _ in range(self.env.world_size)]
        dist.all_gather_object(everyone, mine)  # the training ranks share no fixed key set
        reports = [r for rank_reports in everyone for r in rank_reports]
        keys = sorted({k for r in reports for k in r})
        return {k: sum(r.get(k, 0.0) for r in reports) / len(reports) for k in keys}

    def _staleness(self, exp: Experience, stats: StatCollector) -> None:
        """``async/*``: how many versions the batch's tokens lag behind the policy trained on
        them (the weights before this step's update: version ``step - 1``)."""
        trained = self.step - 1
        s = staleness(exp, trained)
        mask, lag = s["mask"], s["lag"].float()
        tokens = mask.sum()
        allowed = self.step - 1 - needed_version(self.step, self.cfg.asynchronous.async_queue_size)
        stats.add_weighted_mean(
            "async/staleness_mean", (lag * mask).sum() / tokens.clamp(min=1), tokens
        )
        stats.add_max("async/staleness_max", lag.where(mask, torch.zeros_like(lag)).amax())
        stats.add_weighted_mean(
            "async/off_policy_token_frac",
            ((lag > 0) & mask).sum() / tokens.clamp(min=1),
            tokens,
        )
        stats.add_mean("async/partial_response_frac", s["mixed"])
        worst = int(lag.where(mask, torch.zeros_like(lag)).amax()) if lag.numel() else 0
        if worst > allowed:
            raise RuntimeError(
                f"batch {self.step} holds tokens {worst} weight versions old, more than "
                f"--async_queue_size {allowed} allows"
            )

    def _rollout_stop_agreed(self) -> bool:
        """Whether a rollout rank got a stop signal (it sets a key in the job's store)."""
        seen = self.sender and self.job.store.check([stop_key()])
        return all_reduce_scalars({"stop": float(seen)}, "max")["stop"] > 0

    def close(self) -> None:
        """Tell the rollout ranks to end (their last batches, if any, are not trained on).
        They always listen for it, so it is taken at once unless something failed: then
        nothing waits for a failed step's sends, the end gets ``END_WAIT_S``, and the error
        that ends the job is the one reported."""
        try:
            if not self._ended:
                self._ended = True
                self.job.bridge.abandon_sends()
                self._tell_rollout_ranks({"kind": END, "step": self.step}, wait_s=END_WAIT_S)
        except (PeerLost, PeerSlow):
            pass
        finally:
            super().close()
