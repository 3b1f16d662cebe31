"""`fsdp-rlhf ppo --async_train`: asynchronous PPO in one torchrun world (docs/async.md).

The last ``vllm_num_engines x vllm_tensor_parallel_size`` ranks only generate
(:mod:`fsdp_rlhf.trainers.ppo.async_rollout`); the others train, each step on a batch the
rollout ranks generated while the previous steps trained. A training rank runs the PPO step
with :class:`AsyncSource` as its source of experiences:

    sample          the step's batch from the rollout ranks (timing/train_wait: waiting for
                    them), scored where the reward model lives, and ``async/*`` metrics on how
                    stale it is
    ...             reference log-probs, values, advantages, updates (the PPO step's own)
    after_update    the new actor weights to the rollout ranks (timing/weight_sync)
    evaluate        (--eval_dataset, its steps) the rollout ranks' evaluation of them

Checkpoints hold what a colocated run's do plus each rollout rank's prompt-sampler state after
the last trained batch: a resumed run regenerates the batches after it from the checkpointed
weights (the queue is not saved; the checkpoint says from which batch on), so no step runs
twice and none is skipped. The run's ledger (``ppo.async_ledger``) records which prompts were
generated, queued and trained, by which attempt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import fsdp_rlhf.trainers.ppo.pairing as pairing
from fsdp_rlhf.config import PPOConfig, async_rollout_ranks
from fsdp_rlhf.distributed import faults, weight_broadcast
from fsdp_rlhf.distributed.bridge import Bridge, Channel, Patience, PeerLost, PeerSlow
from fsdp_rlhf.distributed.delta_sync import DeltaSender, DeltaStats
from fsdp_rlhf.distributed.env import (
    DistEnv,
    all_reduce_scalars,
    broadcast_object,
    job_hosts,
    job_position,
)
from fsdp_rlhf.distributed.heartbeat import peer_beats
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.prefetch import StageTimes, staged
from fsdp_rlhf.distributed.sequence_parallel import gather_objects
from fsdp_rlhf.distributed.split_world import SplitWorld, init_split_world
from fsdp_rlhf.distributed.weight_broadcast import WeightLink
from fsdp_rlhf.models.load import load_tokenizer
from fsdp_rlhf.rollout.weight_sync import (
    actor_buckets,
    hf_param_name,
    kept_params,
    stream_adapter_weights,
    stream_merged_weights,
    tied_head_alias,
)
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo.async_ledger import (
    TRAIN,
    LedgerWriter,
    attempts,
    generated_after,
    ledger_folder,
)
from fsdp_rlhf.trainers.ppo.async_queue import (
    END,
    START,
    WEIGHTS,
    BatchPart,
    Route,
    first_then,
    needed_version,
    reports_to,
    routes,
    staleness,
    stop_key,
)
from fsdp_rlhf.trainers.ppo.async_rollout import RolloutWorker
from fsdp_rlhf.trainers.ppo.dynamic_filtering import concat_experiences
from fsdp_rlhf.trainers.ppo.eval import Evaluator, eval_due, finish_eval
from fsdp_rlhf.trainers.ppo.metrics import StatCollector, throughput
from fsdp_rlhf.trainers.ppo.rewards import add_overlong_penalty, add_stop_properly_penalty
from fsdp_rlhf.trainers.ppo.rollout import adapter_sync
from fsdp_rlhf.trainers.ppo.setup import (
    adapter_spec,
    engine_dtype,
    merged_lora_scaling,
    prepare,
    unsynced_params,
)
from fsdp_rlhf.trainers.ppo.source import OpenSource, Sampled, SourceInputs

log = logging.getLogger("fsdp_rlhf")

# seconds closing waits for the rollout ranks to take "end" (at once, when nothing failed)
END_WAIT_S = 10.0

# (cfg, env, prepared, parallel, tokenizer, open_source) -> the PPO trainer of a training rank
BuildTrainer = Callable[[PPOConfig, DistEnv, Any, ParallelLayout, Any, OpenSource], common.Trainer]


@dataclass
class AsyncJob:
    """This rank's view of the split world: who is who, and the links between the sides."""

    split: SplitWorld
    rank: int  # in the whole job
    bridge: Bridge
    link: WeightLink
    store: dist.Store


def launch(cfg: PPOConfig, debug: bool, build_trainer: BuildTrainer) -> int:
    """The asynchronous job through the shared skeleton (``common.launch``): the split world
    instead of one process group; a rollout rank runs :class:`RolloutWorker`, a training rank
    the PPO trainer that ``build_trainer`` makes, fed by :class:`AsyncSource`."""
    job: list[AsyncJob] = []
    sources: list[AsyncSource] = []

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
        # versions on their way to the rollout ranks at once: the staleness bound's
        depth = cfg.asynchronous.async_queue_size + 1
        link = WeightLink.build(bridge, store, receivers, env.device, timeout_min, depth)
        job.append(AsyncJob(split, rank, bridge, link, store))
        return env, split

    def open_source(parts: SourceInputs) -> AsyncSource:
        sources.append(AsyncSource(job[0], parts))
        return sources[0]

    def build(cfg: PPOConfig, env: DistEnv, prepared, parallel: ParallelLayout):
        if job[0].split.is_rollout(job[0].rank):
            _, rows, kinds = prepared
            return RolloutWorker(cfg, env, job[0], rows, kinds["--pretrain"])
        tokenizer = load_tokenizer(cfg.models.pretrain, cfg.backend)
        return build_trainer(cfg, env, prepared, parallel, tokenizer, open_source)

    def run(trainer) -> int:
        if isinstance(trainer, RolloutWorker):
            return trainer.run()
        # a stop signal on a rollout rank reaches the training ranks' vote through the store
        return common.fit(trainer, cfg.ckpt.save_steps, also_stop=sources[0].rollout_stopped)

    return common.launch(cfg, debug, prepare, build, init=init, run=run, beat_on_one_node=True)


class AsyncSource:
    """A training rank's source of experiences: the rollout ranks' queue (module docstring)."""

    def __init__(self, job: AsyncJob, parts: SourceInputs) -> None:
        cfg, env = parts.cfg, parts.env
        self.cfg, self.env, self.job, self.parts = cfg, env, job, parts
        split = job.split
        # routes end at data-parallel ranks: the ranks of a sequence-parallel group all get
        # their group's rows; its first rank alone adds them to the ledger
        parallel = parts.parallel
        self.sp = parallel.sp
        self.dp_rank, self.lead = parallel.dp_rank, parallel.sp.rank == 0
        self.routes = routes(cfg.batch.rollout_batch_size, split.rollout_ranks, parallel.dp_size)
        self.my_routes = [r for r in self.routes if r.dest == self.dp_rank]
        # each rollout rank's prompt-sampler state after the last trained batch (None: the
        # start of the data), and those this rank accounts for
        self.rollout_samplers: list[dict] | None = None
        self.rollout_samplers_here: dict[int, dict] = {}
        self.trained_step = 0  # the last step trained (the weights a resume starts from)
        self.ledger: LedgerWriter | None = None  # training rank 0's, from the start
        self.started = False
        self._ended = False
        self.delta_sender = None
        mode = cfg.weight_sync_mode(env.device.type, job_hosts())
        if not adapter_sync(cfg) and mode == "delta":
            self.delta_sender = DeltaSender(full_every=cfg.rollout.weight_sync_full_every)
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

    # ------------------------------------------------------------------ the source

    def sample(self, step: int, stats: StatCollector) -> Sampled:
        """Step ``step``'s batch from the rollout ranks, scored."""
        if not self.started:
            self.start(step - 1)
        received = self._receive(step)
        parts = [part for _, part in received]
        exp = concat_experiences([p.rows for p in parts], self.parts.tokenizer.pad_token_id)
        prompts = [self.parts.prompts[i] for p in parts for i in p.prompts]
        metrics = self._reports(parts, stats)
        if exp.scores is None:  # the reward model lives here: score as the colocated step does
            self.parts.score(exp, prompts)
            add_overlong_penalty(exp, self.cfg.algo, self.cfg.rollout.generate_max_len)
            add_stop_properly_penalty(exp, self.cfg.algo)
        self._staleness(exp, stats, step)
        samplers = {route.source: part.sampler for route, part in received}
        groups = [(i, p.rows.num_sequences // len(p.prompts)) for p in parts for i in p.prompts]
        if groups:  # the pairing audit's marks, if the rollout ranks sent them
            pairing.check_groups(exp, [g[0] for g in groups], groups[0][1], step)
        position = {"step": step, "samplers": samplers, "groups": groups}
        return Sampled(exp, prompts, metrics, position)

    def settle(self, sampled: Sampled, trained: bool) -> None:
        """A trained batch's sampler states are the ones a resume starts from, and its prompts
        go into the ledger (collective over the training ranks when ``trained``)."""
        if trained:
            step = self.trained_step = sampled.position["step"]
            self.rollout_samplers_here = {
                source: state
                for source, state in sampled.position["samplers"].items()
                if reports_to(source, self.routes) == self.dp_rank
            }
            everyone: list[list] = [[] for _ in range(self.env.world_size)]
            dist.all_gather_object(everyone, sampled.position["groups"] if self.lead else [])
            if self.ledger is not None:
                groups = sorted(g for rank_groups in everyone for g in rank_groups)
                prompts, samples = [g[0] for g in groups], [g[1] for g in groups]
                self.ledger.record("trained", step=step, prompts=prompts, samples=samples)

    def after_update(self, step: int, actor_updated: bool) -> dict[str, float]:
        """Every step but the last publishes the actor (the rollout ranks count versions by
        step, changed or not); each rollout rank takes it when it is ready for it. A step
        that ends with an evaluation publishes it marked, the last one included: the
        rollout ranks evaluate those weights (:meth:`evaluate`)."""
        evaluated = eval_due(self.cfg, step, self.parts.total_steps)
        if step >= self.parts.total_steps and not evaluated:
            return {}
        sent = self.publish(step, evaluated=evaluated)
        # waiting for rollout ranks to take weights (over NCCL, or beyond the schedule's bound
        # over gloo) is waiting for the rollout
        waited = all_reduce_scalars({"w": sent.waited}, "max")["w"]
        times = self.parts.timer.times
        times["train_wait"] = times.get("train_wait", 0.0) + waited
        times["weight_sync"] = sent.seconds - waited
        moving = max(sent.seconds - waited, 1e-9)
        metrics = {"async/weight_sync_gbps": sent.bytes / moving / 1e9}
        metrics["async/weight_sync_wire_bytes"] = float(sent.bytes)
        if sent.delta is not None and sent.delta.elements:
            metrics["async/weight_sync_changed_frac"] = sent.delta.changed_frac
        return metrics

    def throughput(self, metrics: dict[str, float], times: dict[str, float]) -> dict[str, float]:
        """e2e over every rank of the job, update over the training ranks, rollout over the
        rollout ranks (their generation time)."""
        tokens = metrics["response_length/mean"] + metrics["prompt_length/mean"]
        n = self.cfg.batch.rollout_batch_size * self.cfg.batch.n_samples_per_prompt
        split = self.job.split
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

    def evaluate(self, evaluator: Evaluator, score, step: int) -> dict[str, float]:
        """``eval/*`` of version ``step``: each rollout rank evaluated its share of the eval
        prompts when it loaded those weights (published marked by :meth:`after_update`) and
        sent its sums to training rank 0 (collective over the training ranks). The wait for
        them is ``timing/eval``; the rollout ranks' own time ``timing/eval_rollout``."""
        start = time.perf_counter()
        summed = None
        if self.sender:
            split, parts = self.job.split, []
            for i in range(split.rollout_ranks):
                part = self.job.bridge.recv_object(
                    split.rollout_rank(i), Channel.EVAL, f"receiving step {step}'s evaluation"
                )
                if part["version"] != step:
                    raise RuntimeError(
                        f"rollout rank {i} sent the evaluation of version {part['version']}; "
                        f"step {step} expected its own; report it"
                    )
                parts.append(part)
            sums = {k: sum(p["sums"][k] for p in parts) for k in parts[0]["sums"]}
            summed = (sums, max(p["seconds"] for p in parts))
        sums, seconds = broadcast_object(summed)
        metrics = finish_eval(sums)
        metrics["timing/eval"] = time.perf_counter() - start
        metrics["timing/eval_rollout"] = seconds
        return metrics

    def state_dict(self) -> dict:
        """Every rollout rank's sampler state (collective: gathered from the training ranks
        that received them); ``sampler`` is rollout rank 0's, for a colocated resume."""
        gathered: list[dict] = [{} for _ in range(self.env.world_size)]
        dist.all_gather_object(gathered, self.rollout_samplers_here)
        merged = {int(k): v for part in gathered for k, v in part.items()}
        if not merged:  # nothing trained yet: the start of the data
            return {"sampler": {"epoch": 0, "index": 0}}
        samplers = [merged[i] for i in range(self.job.split.rollout_ranks)]
        # the queue (batches generated, queued or in generation after this step) is not
        # saved: a resume generates every batch from the next one on again, from the
        # samplers' positions and this step's weights
        return {
            "sampler": samplers[0],
            "async": {
                "samplers": samplers,
                "weight_version": self.trained_step,
                "regenerated_from_batch": self.trained_step + 1,
            },
        }

    def load_state_dict(self, saved: dict) -> None:
        samplers = saved.get("async", {}).get("samplers")
        if samplers is None or len(samplers) != self.job.split.rollout_ranks:
            # a colocated checkpoint, or other rollout ranks: every rank's shard of the
            # batches continues from the same position
            samplers = [saved["sampler"]] * self.job.split.rollout_ranks
        self.rollout_samplers = samplers
        self.rollout_samplers_here = {
            i: state
            for i, state in enumerate(samplers)
            if reports_to(i, self.routes) == self.dp_rank
        }

    def close(self) -> None:
        """Tell the rollout ranks to end (their last batches, if any, are not trained on).
        Once started they always listen for it, so it is taken at once unless something
        failed: then nothing waits for a failed step's sends, the end gets ``END_WAIT_S``,
        and the error that ends the job is the one reported. Before the start (a resumed run
        with no step left) a rollout rank may still be starting its engine: it is waited
        for as for any message."""
        if self.ledger is not None:
            self.ledger.close()
        try:
            if not self._ended:
                self._ended = True
                self.job.link.abandon()  # taken before "end" unless something failed
                self.job.bridge.abandon_sends()
                wait_s = END_WAIT_S if self.started else None
                self._tell_rollout_ranks({"kind": END}, wait_s=wait_s)
        except (PeerLost, PeerSlow):
            pass

    # ------------------------------------------------------------------ the rollout ranks

    @property
    def sender(self) -> bool:
        return self.env.rank == 0

    def rollout_stopped(self) -> bool:
        """Whether a rollout rank got a stop signal (it sets a key in the job's store; this
        rank's side of the training ranks' stop vote)."""
        return self.sender and self.job.store.check([stop_key()])

    def _tell_rollout_ranks(self, header: dict, wait_s: float | None = None) -> None:
        if not self.sender:
            return
        bridge, what = self.job.bridge, f"sending the rollout ranks '{header['kind']}'"
        for r in self.job.link.receivers:
            bridge.send_object(header, r, Channel.CONTROL, wait=False, what=what)
        bridge.flush(what=what, wait_s=wait_s)

    def start(self, step: int) -> None:
        """Where the rollout ranks start (the step resumed from and their sampler states),
        then the weights they start from. Collective over the training ranks."""
        self.started, self.trained_step = True, step
        spec = adapter_spec(self.cfg, self.parts.actor)
        attempt = self._open_ledger(step) if self.sender else 0
        self._tell_rollout_ranks(
            {
                "kind": START,
                "step": step,
                "total_steps": self.parts.total_steps,
                "samplers": self.rollout_samplers,
                "adapter": None if spec is None else vars(spec),
                "attempt": attempt,
            }
        )
        sent = self.publish(step)
        log.info(
            "asynchronous: rollout ranks start at step %d with weights of step %d (%.1f MB, "
            "%.1f s)",
            step + 1,
            step,
            sent.bytes / 1e6,
            sent.seconds,
        )

    def _open_ledger(self, step: int) -> int:
        """Training rank 0's ledger, from this attempt's ``start``: the step it starts after,
        and the batches after it that an interrupted attempt had generated (they are
        generated again). Returns the attempt."""
        folder = ledger_folder(self.cfg)
        attempt = attempts(folder) + 1
        again = generated_after(folder, step)
        self.ledger = LedgerWriter(folder, TRAIN, attempt)
        self.ledger.record("start", step=step, regenerated=again)
        if step > 0:
            log.info(
                "asynchronous resume at step %d (attempt %d): batches %d on are generated "
                "again from step %d's weights%s",
                step,
                attempt,
                step + 1,
                step,
                f" (an interrupted attempt had generated batches {again})" if again else "",
            )
        return attempt

    def publish(self, version: int, evaluated: bool = False) -> weight_broadcast.PublishStats:
        """Send the actor's weights as version ``version`` (collective over the training
        ranks: the gathers, made one bucket ahead with --weight_sync_overlap); each rollout
        rank takes it when it is ready (``evaluated``: and evaluates it then)."""
        header = {"kind": WEIGHTS, "version": version, "eval": evaluated}
        actor, dtype = self.parts.actor, engine_dtype(self.cfg)
        overlap, times = self.cfg.rollout.weight_sync_overlap, StageTimes()
        device = self.env.device
        syncing = partial(faults.reached, "syncing", version)  # a fault point (tests)
        skip = unsynced_params(self.cfg, actor)  # a frozen vision tower: the engines keep theirs
        if self.delta_sender is not None:
            stats = DeltaStats()
            deltas = self.delta_sender.deltas(
                actor, dtype, kept_params(skip), rename=hf_param_name, stats=stats
            )
            sent = weight_broadcast.publish_delta(
                self.job.link,
                first_then(staged(deltas, times, overlap=overlap), syncing),
                sender=self.sender,
                aliases=tied_head_alias(actor),
                header=header,
                stats=stats,
            )
            return self._published(version, sent)
        if adapter_sync(self.cfg):
            stream = stream_adapter_weights(actor, dtype)
        elif (scaling := merged_lora_scaling(self.cfg)) is not None:
            stream = stream_merged_weights(actor, dtype, scaling, skip)
        else:
            buckets = actor_buckets(actor, dtype, skip)
            buckets = staged(buckets, times, overlap=overlap, device=device)
            stream = (w for bucket in buckets for w in bucket)
        stream = first_then(stream, syncing)
        sent = weight_broadcast.publish(self.job.link, stream, sender=self.sender, header=header)
        return self._published(version, sent)

    def _published(
        self, version: int, sent: weight_broadcast.PublishStats
    ) -> weight_broadcast.PublishStats:
        if self.ledger is not None:
            self.ledger.record("published", version=version)
        return sent

    def _receive(self, step: int) -> list[tuple[Route, BatchPart]]:
        """This rank's routes of batch ``step`` and their parts, in route order
        (timing/train_wait)."""
        parts = []
        with self.parts.timer("train_wait"):
            for route in self.my_routes:
                src = self.job.split.rollout_rank(route.source)
                msg = self.job.bridge.recv_object(
                    src, Channel.EXPERIENCE, f"receiving batch {step}"
                )
                parts.append(BatchPart.from_message(msg, self.env.device))
        for route, part in zip(self.my_routes, parts, strict=True):
            if part.batch != step or len(part.prompts) != route.stop - route.start:
                raise RuntimeError(
                    f"rollout rank {route.source} sent batch {part.batch} with "
                    f"{len(part.prompts)} prompts; step {step} expected "
                    f"{route.stop - route.start}"
                )
        if self.sp.enabled:  # a group's ranks split the same rows: they must hold the same
            held = gather_objects([p.prompts for p in parts], self.sp)
            if any(h != held[0] for h in held):
                raise RuntimeError(
                    f"batch {step}: the ranks of a sequence-parallel group received different "
                    f"prompts ({held}); report it"
                )
        return list(zip(self.my_routes, parts, strict=True))

    def _reports(self, parts: list[BatchPart], stats: StatCollector) -> dict[str, float]:
        """The rollout ranks' statistics (into ``stats``) and their metrics and timings,
        averaged over the rollout ranks (collective)."""
        mine = [p.report["metrics"] for p in parts if p.report is not None]
        for part in parts:
            if part.report is not None:
                stats.merge(part.report["stats"])
        # the reports reach some training ranks only: every rank reduces the same names
        names: list = [None] * self.env.world_size
        dist.all_gather_object(names, stats.names())
        for other in names:
            stats.include(other)
        everyone: list[list[dict]] = [[] for _ in range(self.env.world_size)]
        dist.all_gather_object(everyone, mine)  # the training ranks share no fixed key set
        reports = [r for rank_reports in everyone for r in rank_reports]
        keys = sorted({k for r in reports for k in r})
        return {k: sum(r.get(k, 0.0) for r in reports) / len(reports) for k in keys}

    def _staleness(self, exp: Experience, stats: StatCollector, step: int) -> None:
        """``async/*``: how many versions the batch's tokens lag behind the policy trained on
        them (the weights before this step's update: version ``step - 1``)."""
        s = staleness(exp, step - 1)
        mask, lag = s["mask"], s["lag"].float()
        tokens = mask.sum()
        allowed = step - 1 - needed_version(step, self.cfg.asynchronous.async_queue_size)
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
                f"batch {step} holds tokens {worst} weight versions old, more than "
                f"--async_queue_size {allowed} allows"
            )
