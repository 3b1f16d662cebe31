"""`fsdp-rlhf train-rm`: pairwise (Bradley-Terry) reward-model training on FSDP2.

Table of contents, in call order::

    main            validate and tokenize (no communication), init the process group
    setup_run       model -> fully_shard -> AdamW + schedule -> resume from a checkpoint
    fit             for each step: train_step, maybe_log, maybe_evaluate, maybe_save
    finish          final evaluate, then the HF model with reward mean/std in config.json

Chosen and rejected sequences go through one forward as a (2B, L) batch. Every collective
(FSDP forward/backward, metric reductions, the stop vote) is reached by every rank in the
same order: branch conditions depend only on the step counter and agreed values.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field

import datasets
import torch.distributed as dist

from fsdp_rlhf.config import RMConfig, plan_rm_batches
from fsdp_rlhf.distributed.checkpoint import save_checkpoint
from fsdp_rlhf.distributed.env import all_reduce_scalars, init_distributed, teardown
from fsdp_rlhf.distributed.signals import GracefulStop
from fsdp_rlhf.metrics import Progress, setup_logging
from fsdp_rlhf.models.save import save_hf_model
from fsdp_rlhf.trainers.rm_data import prepare_rm_data
from fsdp_rlhf.trainers.rm_setup import RMRun, setup_run
from fsdp_rlhf.trainers.rm_steps import evaluate, train_step

log = logging.getLogger(__name__)

TRAIN_KEYS = ["loss", "acc", "chosen_reward", "reject_reward", "margin", "lr", "grad_norm"]


def main(cfg: RMConfig, debug: bool = False) -> int:
    """Train a reward model; returns the process exit code (0, also after a graceful stop)."""
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank, debug)
    if rank != 0 or not sys.stderr.isatty():
        datasets.disable_progress_bars()  # tqdm bars would flood log files and other ranks
    plan = plan_rm_batches(cfg.batch, int(os.environ.get("WORLD_SIZE", "1")))
    data = prepare_rm_data(cfg, plan)
    owns_group = not dist.is_initialized()
    env = init_distributed()
    try:
        run = setup_run(cfg, env, plan, data)
        return fit(run)
    finally:
        if owns_group:
            teardown()


@dataclass
class _Window:
    """Per-step metrics summed since the last log line."""

    sums: dict[str, float] = field(default_factory=dict)
    steps: int = 0

    def add(self, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.steps += 1

    def pop(self) -> dict[str, float]:
        out = {k: v / self.steps for k, v in self.sums.items()}
        self.sums, self.steps = {}, 0
        return out


def _eta(run: RMRun, started: float, first_step: int) -> str:
    done = run.global_step - first_step
    left = run.total_steps - run.global_step
    seconds = int((time.monotonic() - started) / max(done, 1) * left)
    h, rem = divmod(seconds, 3600)
    return f"{run.global_step}/{run.total_steps} eta {h}:{rem // 60:02d}:{rem % 60:02d}"


def fit(run: RMRun) -> int:
    """The training loop; returns 0 when done or stopped by a signal (after a checkpoint)."""
    cfg = run.cfg
    window, started, first_step = _Window(), time.monotonic(), run.global_step
    progress = Progress(run.env.rank, run.total_steps, "train-rm", start=run.global_step)
    with GracefulStop() as stop:
        for pos in run.loader.schedule.positions(run.start, cfg.batch.max_epochs):
            window.add(train_step(run, pos))
            run.global_step += 1
            progress.advance()
            maybe_log(run, window, _eta(run, started, first_step))
            maybe_evaluate(run)
            stopping = stop.agreed()
            maybe_save(run, force=stopping)
            if stopping:
                progress.close()
                run.metrics.close()
                log.warning("stop signal: checkpoint written at step %d, exiting", run.global_step)
                return 0
    progress.close()
    finish(run)
    return 0


def maybe_log(run: RMRun, window: _Window, eta: str) -> None:
    """Every ``logging_steps``: the window's means, averaged over ranks (a collective)."""
    if run.global_step % run.cfg.logging.logging_steps == 0:
        stats = all_reduce_scalars(window.pop(), op="mean")
        run.metrics.log(run.global_step, stats, TRAIN_KEYS, eta)


def maybe_evaluate(run: RMRun) -> None:
    """Evaluate every ``eval_steps``; the last step is left to ``finish``, which always does."""
    every = run.cfg.logging.eval_steps
    if every > 0 and run.global_step % every == 0 and run.global_step < run.total_steps:
        run.metrics.log(run.global_step, evaluate(run))


def maybe_save(run: RMRun, *, force: bool = False) -> None:
    """A resumable checkpoint every ``save_steps`` (and on ``force``, for a graceful stop)."""
    every = run.cfg.ckpt.save_steps
    if not force and not (every > 0 and run.global_step % every == 0):
        return
    path = save_checkpoint(
        run.cfg.ckpt.ckpt_path,
        run.global_step,
        models={"rm": run.model},
        optimizers={"rm": run.optimizer},
        schedulers={"rm": run.scheduler},
        trainer_state=run.resume_state(),
        keep=run.cfg.ckpt.max_ckpt_num,
    )
    log.info("checkpoint: %s", path)


def finish(run: RMRun) -> None:
    """Final eval, then the HF model (atomically) with the eval reward mean/std in config.json.

    ``normalize_reward`` is deliberately not written: whether to normalise is the PPO run's
    choice (``--normalize_reward``), made with the mean/std stored here.
    """
    stats = evaluate(run)
    run.metrics.log(run.global_step, stats)
    extra = {
        "reward_mean": stats["eval/reward_mean"],
        "reward_std": stats["eval/reward_std"],
        # OpenRLHF's loaders look the head up under this name; ours is always `score`.
        "value_head_prefix": "score",
    }
    path = save_hf_model(run.model, run.tokenizer, run.cfg.ckpt.save_path, extra_config=extra)
    run.metrics.close()
    log.info(
        "reward model saved to %s (reward_mean=%.4g, reward_std=%.4g)",
        path,
        extra["reward_mean"],
        extra["reward_std"],
    )
