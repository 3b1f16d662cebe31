"""A rollout rank of `fsdp-rlhf ppo --async_train`: generate batches ahead of the training
ranks, within the staleness bound (the schedule is in ``ppo.async_queue``).

Loop, for each batch ``j`` from the step resumed from::

    wait       for the weights of version j - 1 - K (timing/rollout_wait, timing/weight_load);
               older versions still queued for this rank are received, not loaded
    generate   step by step; with --partial_rollout, new weights are loaded between engine
               steps as they arrive (requests in flight continue under them) and at the next
               boundary; over-sampling stops at the first groups to finish
    score      rule rewards and environments here (the reward model lives on the training
               ranks); --dynamic_filtering generates more rounds until the groups carry signal
    send       each training rank its prompts' rows, this rank's statistics and timings

then it takes the remaining weight versions until training rank 0 says ``end`` (also how a
stopping job ends it, in the middle of a batch). With ``--eval_dataset`` a version published
for an evaluation is loaded at a batch boundary (never while requests are in flight) and
evaluated there on this rank's share of the eval prompts, rule-scored, before generation goes
on; the sums go to training rank 0. Each rollout rank takes versions at its own
pace: training rank 0 posts them to every rollout rank without waiting for any
(``distributed.weight_broadcast``), so a fast engine is not held back by a slow one. Without
partial rollouts batch ``j`` is sampled by exactly version ``j - 1 - K`` (after a resume at
step ``s``, by version ``s`` until ``j - 1 - K`` passes it): a run samples the same batches
from the same weights every time.

The engine never sleeps: nothing else shares its device. A stop signal here is passed on
through the job's store to the training ranks' vote, which checkpoints and ends the job.
Each batch generated and queued, and each version taken, goes into the run's ledger
(``ppo.async_ledger``: ``rollout<i>.jsonl``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

import numpy as np
import torch

import fsdp_rlhf.trainers.ppo.pairing as pairing
from fsdp_rlhf.algorithms import clip_scores
from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.data.prompts import Prompt, PromptSampler
from fsdp_rlhf.distributed import faults, weight_broadcast
from fsdp_rlhf.distributed.bridge import Channel
from fsdp_rlhf.distributed.delta_sync import Mirror
from fsdp_rlhf.distributed.env import DistEnv, all_reduce_scalars
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.signals import GracefulStop
from fsdp_rlhf.distributed.split_world import group_environment
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.models.kind import ModelKind
from fsdp_rlhf.models.load import load_tokenizer
from fsdp_rlhf.models.vision import ImageBatch
from fsdp_rlhf.rollout import AdapterSpec, RolloutOutput, SamplingConfig
from fsdp_rlhf.rollout.streaming import stream_rollout
from fsdp_rlhf.trainers.experience import Experience, experience_from_rollout
from fsdp_rlhf.trainers.ppo.async_ledger import LedgerWriter, ledger_folder, rollout_file
from fsdp_rlhf.trainers.ppo.async_queue import (
    END,
    START,
    WEIGHTS,
    BatchPart,
    first_then,
    needed_version,
    reports_to,
    route_ranks,
    routes,
    stop_key,
)
from fsdp_rlhf.trainers.ppo.dynamic_filtering import dynamic_sample
from fsdp_rlhf.trainers.ppo.eval import build_evaluator
from fsdp_rlhf.trainers.ppo.metrics import StatCollector, add_rollout_stats
from fsdp_rlhf.trainers.ppo.multiturn import build_multiturn, run_multiturn
from fsdp_rlhf.trainers.ppo.rewards import (
    add_overlong_penalty,
    add_stop_properly_penalty,
    rule_scores,
)
from fsdp_rlhf.trainers.ppo.rollout import sampling_config
from fsdp_rlhf.trainers.ppo.setup import build_engine, build_prompts
from fsdp_rlhf.trainers.ppo.vision import StepImages, check_responses, image_limit
from fsdp_rlhf.trainers.rule_reward import build_rule_reward

log = logging.getLogger("fsdp_rlhf")


class RolloutEnded(Exception):
    """Training rank 0 said ``end``: the run is over or stopping."""


def engine_seed(seed: int | None, engine: int) -> int | None:
    """A sampling seed of one engine's own (engines must not draw the same random numbers).
    Engine 0 keeps the step's seed: at equal weights, one engine samples the batches a
    one-rank colocated run does (the mechanics of the asynchronous step are compared on them)."""
    if seed is None or engine == 0:
        return seed
    return int(np.random.SeedSequence([seed, engine]).generate_state(1)[0])


class RolloutWorker:
    """One rollout rank (see the module docstring). ``run()`` is its whole life."""

    def __init__(self, cfg: PPOConfig, env: DistEnv, job, rows, actor: ModelKind) -> None:
        self.cfg, self.env, self.job = cfg, env, job
        split = job.split
        self.index = split.rollout_index(job.rank)
        self.engine_id = split.engine(job.rank)
        b = cfg.batch
        generated = cfg.asynchronous.vllm_generate_batch_size or b.rollout_batch_size
        self.keep = (
            b.rollout_batch_size // split.rollout_ranks
            if generated > b.rollout_batch_size
            else None
        )
        self.n = b.n_samples_per_prompt
        self.tokenizer = load_tokenizer(cfg.models.pretrain, cfg.backend)
        # a vision-language actor: the processor decodes each batch's images (None: text)
        self.images = None
        if actor.is_vlm:
            self.images = StepImages.from_pretrained(cfg.models.pretrain, cfg.backend)
        self.prompts = build_prompts(cfg, rows, self.tokenizer, self.images)
        self.prompt_index = {id(p): i for i, p in enumerate(self.prompts)}
        self.sampler = PromptSampler(
            len(self.prompts), generated, self.index, split.rollout_ranks, cfg.seed
        )
        self.timer = PhaseTimer(env.device)
        with group_environment(env):  # vLLM reads the rank of its world from the environment
            self.engine = build_engine(
                cfg,
                env,
                self.tokenizer,
                image_limit(cfg.vision, rows),
                vision=actor.vision,
                streaming=True,
                engine_id=self.engine_id,
            )
        # the reward model lives on the training ranks: then they score everything
        self.scores_here = not cfg.models.reward_pretrain
        url = cfg.models.remote_rm_url
        self.rule = (
            build_rule_reward(url, cfg.models.remote_rm_auth_env)
            if self.scores_here and url
            else None
        )
        self.multiturn = build_multiturn(cfg, self.tokenizer, self.timer)
        # the eval prompts' share of this rank (the rollout ranks split them as data ranks)
        share = ParallelLayout(world_size=split.rollout_ranks, rank=self.index)
        self.evaluator = build_evaluator(cfg, env, self.tokenizer, share, self.images)
        # a route's destination is a data-parallel rank: its sequence-parallel group
        self.sp_size = cfg.fsdp.sequence_parallel_size
        dp = split.training_ranks // self.sp_size
        self.table = routes(b.rollout_batch_size, split.rollout_ranks, dp)
        self.my_routes = [r for r in self.table if r.source == self.index]
        self.reports_to = reports_to(self.index, self.table)
        self.per_rank = b.rollout_batch_size // split.rollout_ranks
        self.version: int | None = None  # the weights in the engine (None: the pretrained)
        self.adapter: AdapterSpec | None = None
        # the weights last received, for delta syncs (empty until the first one, which is full)
        self.mirror = Mirror()
        self.stop: GracefulStop | None = None
        self._stop_told = False
        self.ledger: LedgerWriter | None = None  # opened at the start (its attempt)
        self.batch = 0  # the batch being generated
        self._drawn: list[int] = []  # the prompts it drew (over-sampling, filtering: more)
        self.header = self._expect_header()

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        with GracefulStop() as self.stop:
            try:
                start = self.header.result()
                if start["kind"] == END:  # a resumed run with no step left
                    return 0
                if start["kind"] != START:
                    raise RuntimeError(f"expected the start message, got {start['kind']}")
                self.header = self._expect_header()
                first, total = int(start["step"]) + 1, int(start["total_steps"])
                if start["samplers"] is not None:
                    self.sampler.load_state_dict(start["samplers"][self.index])
                if start.get("adapter") is not None:
                    self.adapter = AdapterSpec(**start["adapter"])
                folder, name = ledger_folder(self.cfg), rollout_file(self.index)
                self.ledger = LedgerWriter(folder, name, int(start["attempt"]))
                queue = self.cfg.asynchronous.async_queue_size
                partial = self.cfg.asynchronous.partial_rollout
                for batch in range(first, total + 1):
                    if partial:  # the newest weights that arrived
                        self._poll(boundary=True)
                    self._wait_for(max(needed_version(batch, queue), first - 1))
                    self._send(self.produce(batch))
                    self.job.bridge.flush(
                        keep=2 * len(self.my_routes) * (queue + 1), what="sending batches"
                    )
                    faults.reached("queued", batch)
                while True:  # the training ranks publish versions until their last step
                    self._take(self.header.result(), in_flight=False, load=False)
            except RolloutEnded:
                self.engine.abort_unfinished()
        return 0

    def produce(self, batch: int) -> list[tuple[int, dict]]:
        """Batch ``batch``'s messages, one per route: ``(training rank, message)``."""
        t0 = time.perf_counter()
        stats = StatCollector()
        self.batch, self._drawn = batch, []
        first = self._draw()
        if self.cfg.algo.dynamic_filtering:

            def generate_and_score(prompts: list[Prompt], round_: int):
                exp, _ = self._generate(prompts, batch, round_, stats, keep=None)
                return exp, {}

            pad = self.tokenizer.pad_token_id
            exp, prompts, metrics = dynamic_sample(
                first, self._draw, generate_and_score, self.cfg.algo, self.n, pad
            )
        else:
            exp, prompts = self._generate(first, batch, 0, stats, keep=self.keep)
            metrics = {}
            if self.keep is not None:
                metrics["async/dropped_groups"] = float(len(first) - len(prompts))
        seconds = time.perf_counter() - t0
        times = {k: v for k, v in self.timer.pop().items() if k.startswith("timing/")}
        times.pop("timing/rollout", None)  # the multi-turn runner's generation share
        report = {
            "stats": stats.export(),
            "metrics": {**metrics, **times, "timing/rollout": seconds},
        }
        self._record_generated(batch, exp, prompts)
        return self._messages(batch, exp, prompts, report)

    def _record_generated(self, batch: int, exp: Experience, prompts: list[Prompt]) -> None:
        """The ledger's ``generated``: the prompts kept (with their samples) and the prompts
        drawn for this batch but dropped (over-sampling's stragglers, filtered groups)."""
        kept = [self.prompt_index[id(p)] for p in prompts]
        dropped = list(self._drawn)
        for i in kept:
            dropped.remove(i)
        mask, span = exp.response_mask.bool(), []  # the weight versions that sampled it
        if exp.token_versions is not None and mask.any():
            versions = exp.token_versions[mask]
            span = [int(versions.min()), int(versions.max())]
        samples = [exp.num_sequences // max(len(kept), 1)] * len(kept)
        record = {"prompts": kept, "samples": samples, "dropped": dropped, "versions": span}
        self.ledger.record("generated", batch=batch, **record)

    # ------------------------------------------------------------------ generation

    def _draw(self) -> list[Prompt]:
        indices = self.sampler.next_indices()
        self._drawn.extend(indices)
        return [self.prompts[i] for i in indices]

    def _sampling(self, batch: int, round_: int) -> SamplingConfig:
        sampling = sampling_config(self.cfg, batch, round_)
        return replace(sampling, seed=engine_seed(sampling.seed, self.engine_id))

    def _generate(
        self,
        prompts: list[Prompt],
        batch: int,
        round_: int,
        stats: StatCollector,
        keep: int | None,
    ) -> tuple[Experience, list[Prompt]]:
        """One round: generate (step by step), then score here unless a reward model does.
        Returns the experience on the host and its prompts (fewer with ``keep``)."""
        sampling = self._sampling(batch, round_)
        env_scores, images = None, None
        if self.multiturn is not None:
            ids = per_prompt = None  # a VLM's prompts: expanded ids, images sent every turn
            if self.images is not None:
                ids, per_prompt = self.images.encode(prompts)
            out, env_scores = run_multiturn(
                self.multiturn,
                self._generate_turn,
                prompts,
                sampling,
                stats,
                prompt_ids=ids,
                images=per_prompt,
            )
            if per_prompt is not None:
                check_responses(out, self.images.vision.tokens)
                images = StepImages.rows(per_prompt, sampling.n)
        else:
            out, prompts, images = self._stream(prompts, sampling, keep)
        exp = experience_from_rollout(out, torch.device("cpu"))
        exp.scores = env_scores
        exp.images = images
        add_rollout_stats(stats, out)
        if self.scores_here:
            self._score(exp, prompts)
        return exp, prompts

    def _stream(
        self, prompts: list[Prompt], sampling: SamplingConfig, keep: int | None, poll=None
    ) -> tuple[RolloutOutput, list[Prompt], ImageBatch | None]:
        """Generate step by step; returns the kept prompts' samples, the kept prompts and,
        for a VLM, their rows' images (each prompt's decoded, processed and sent to the
        engine with it; the rows keep the processor's tensors for the training ranks).
        ``poll``: between engine steps (default: take what training rank 0 sent)."""
        ids, per_prompt = [p.ids for p in prompts], None
        if self.images is not None:
            ids, per_prompt = self.images.encode(prompts)
        streamed = stream_rollout(
            self.engine,
            ids,
            sampling,
            rank_in_engine=self.env.rank,
            pad_id=self.tokenizer.pad_token_id,
            poll=poll or self._poll,
            keep=keep,
            images=per_prompt,
        )
        out, kept = streamed.output, [prompts[i] for i in streamed.kept]
        if per_prompt is None:
            return out, kept, None
        check_responses(out, self.images.vision.tokens)
        rows = StepImages.rows([per_prompt[i] for i in streamed.kept], sampling.n)
        return out, kept, rows

    def _generate_turn(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, images=None
    ) -> RolloutOutput:
        """One turn of a multi-turn rollout (the runner's ``generate``; ``images``: each
        history's prompt images, a VLM's)."""
        return stream_rollout(
            self.engine,
            prompt_ids,
            sampling,
            rank_in_engine=self.env.rank,
            pad_id=self.tokenizer.pad_token_id,
            poll=self._poll,
            images=images,
        ).output

    def _score(self, exp: Experience, prompts: Sequence[Prompt]) -> None:
        """Rule reward (and the environment's rewards), clipped, then the length penalties:
        what the colocated step's scoring does without a reward model."""
        exp.scores = self._rule_scored(exp, prompts, self.n, timed=True)
        add_overlong_penalty(exp, self.cfg.algo, self.cfg.rollout.generate_max_len)
        add_stop_properly_penalty(exp, self.cfg.algo)

    def _rule_scored(
        self, exp: Experience, prompts: Sequence[Prompt], n: int, *, timed: bool
    ) -> torch.Tensor:
        """(N,) the environment's rewards (if any) plus the rule reward, clipped; ``timed``: the
        rule reward counts into the batch's ``timing/rule_reward``."""
        scores = exp.scores
        if scores is None:
            scores = torch.zeros(exp.num_sequences, device=exp.input_ids.device)
        if self.rule is not None:
            with self.timer("rule_reward") if timed else nullcontext():
                rule = rule_scores(self.rule, exp, prompts, self.tokenizer, n)
            scores = scores + rule.to(scores.device)
        return clip_scores(scores, self.cfg.algo.reward_clip_range)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, version: int) -> None:
        """Evaluate the weights in the engine (``version``, loaded at a batch boundary) on
        this rank's share of the eval prompts and send the sums to training rank 0, which
        waits for them at the end of that step. Not timed into the batches' reports."""
        t0 = time.perf_counter()
        sums = self.evaluator.local_sums(self._eval_generate, self._eval_score)
        message = {"version": version, "sums": sums, "seconds": time.perf_counter() - t0}
        what = f"sending the evaluation of version {version}"
        self.job.bridge.send_object(message, 0, Channel.EVAL, what=what)
        self.ledger.record("evaluated", version=version)

    def _eval_generate(self, prompts: list[Prompt], sampling: SamplingConfig, *_) -> RolloutOutput:
        """The evaluator's ``generate``: step by step under the same weights throughout (new
        weights wait for the next boundary; a stop signal is still passed on)."""

        def hold() -> int:
            self._tell_stop()
            return -1 if self.version is None else self.version

        return self._stream(prompts, sampling, keep=None, poll=hold)[0]

    def _eval_score(self, exp: Experience, prompts: Sequence[Prompt], n: int) -> None:
        """The colocated evaluation's scoring without a reward model (refused with one): the
        rule reward, clipped; no length penalties. Not timed into the next batch's report."""
        exp.scores = self._rule_scored(exp, prompts, n, timed=False)

    def _messages(
        self, batch: int, exp: Experience, prompts: list[Prompt], report: dict
    ) -> list[tuple[int, dict]]:
        if len(prompts) != self.per_rank:
            raise RuntimeError(f"batch {batch}: {len(prompts)} prompts, {self.per_rank} expected")
        out = []
        base = self.index * self.per_rank
        for route in self.my_routes:
            lo, hi = route.start - base, route.stop - base
            rows = exp.rows(torch.arange(lo * self.n, hi * self.n))
            indices = [self.prompt_index[id(p)] for p in prompts[lo:hi]]
            if pairing.enabled():  # each sample marked as sent, checked at the update
                rows.sample_marks = pairing.sample_marks(rows, indices, self.n)
            part = BatchPart(
                batch,
                rows,
                indices,
                self.sampler.state_dict(),
                report if route.dest == self.reports_to else None,
            )
            message = part.to_message()
            out.extend((rank, message) for rank in route_ranks(route.dest, self.sp_size))
        return out

    def _send(self, messages: list[tuple[int, dict]]) -> None:
        self._tell_stop()  # before the batch: the training ranks' vote on it sees the stop
        for dest, msg in messages:
            what = f"sending batch {msg['batch']}"
            self.job.bridge.send_object(msg, dest, Channel.EXPERIENCE, wait=False, what=what)
        self.ledger.record("queued", batch=messages[0][1]["batch"])

    # ------------------------------------------------------------------ weights and control

    def _expect_header(self):
        what = "waiting for new weights or the end of the run"
        return self.job.bridge.expect_object(0, Channel.CONTROL, what)

    def _poll(self, boundary: bool = False) -> int:
        """Between engine steps (and at batch boundaries with --partial_rollout): take what
        training rank 0 sent; new weights only with --partial_rollout (the newest that
        arrived: an older one still queued is received, not loaded). Returns the version
        sampling from now on. Collective over the engine's ranks (they must agree)."""
        self._tell_stop()
        if not boundary:
            faults.reached("generating", self.batch)
        partial = self.cfg.asynchronous.partial_rollout
        while self._header_ready():
            header = self.header.result()
            if header["kind"] == WEIGHTS and not partial:
                break  # taken when the batch that needs it starts (_wait_for)
            if header["kind"] == WEIGHTS and header.get("eval") and not boundary:
                break  # evaluated at the next boundary: no requests in flight then
            self._take(header, in_flight=not boundary, load=None)
        return -1 if self.version is None else self.version

    def _header_ready(self) -> bool:
        ready = self.header.ready()
        if self.env.world_size > 1:  # the engine's ranks take it at the same step, or none
            ready = all_reduce_scalars({"ready": float(ready)}, "min")["ready"] > 0
        return ready

    def _wait_for(self, version: int) -> None:
        """Until the engine holds ``version`` (the versions before it are received, not
        loaded: the next batch needs this one)."""
        with self.timer("rollout_wait"):
            while self.version is None or self.version < version:
                self._tell_stop()
                header = self.header.result()
                load = header["kind"] != WEIGHTS or int(header["version"]) >= version
                self._take(header, in_flight=False, load=load)

    def _take(self, header: dict, *, in_flight: bool, load: bool | None = True) -> None:
        """Act on one message from training rank 0 and start receiving the next. New
        weights are loaded into the engine if ``load`` (None: unless a newer version is
        already here), else only received; weights to evaluate are loaded and evaluated."""
        if header["kind"] == END:
            raise RolloutEnded
        if header["kind"] != WEIGHTS:
            raise RuntimeError(f"unexpected message {header['kind']!r} from training rank 0")
        self.header = self._expect_header()  # the next one, while these weights arrive
        evaluated = bool(header.get("eval"))
        if evaluated:
            load = True
        elif load is None:
            load = not self._header_ready()
        version = int(header["version"])
        with self.timer("weight_load"):
            weights = first_then(
                weight_broadcast.receive(self.job.link, self.mirror),
                lambda: faults.reached("syncing", version),
            )
            if not load:
                for _ in weights:
                    pass
            elif self.adapter is not None:
                self.engine.update_adapter(weights, self.adapter)
            else:
                self.engine.update_weights(weights, in_flight=in_flight)
        if load:
            self.version = version
        self.ledger.record("weights", version=version, loaded=load)
        if evaluated:
            self._evaluate(version)

    def _tell_stop(self) -> None:
        """A stop signal here reaches the training ranks' vote through the job's store."""
        if self.stop is not None and self.stop.requested and not self._stop_told:
            self._stop_told = True
            self.job.store.set(stop_key(), str(self.job.rank))
            log.warning(
                "stop signal on %s: passed to the training ranks",
                self.job.split.describe(self.job.rank),
            )

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        self.engine.close()
