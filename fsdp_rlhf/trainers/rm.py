"""`fsdp-rlhf train-rm`: pairwise (Bradley-Terry) reward-model training on FSDP2.

Table of contents, in call order (the loop itself is :func:`fsdp_rlhf.trainers.common.fit`)::

    prepare         validate and tokenize (no communication), before the process group
    RMTrainer       model -> fully_shard -> AdamW + schedule -> resume from a checkpoint
    train_step      one optimizer step, then log, evaluate every eval_steps
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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from fsdp_rlhf.config import RMBatchPlan, RMConfig, plan_rm_batches
from fsdp_rlhf.data.preference import PreferenceLoader, eval_batches
from fsdp_rlhf.data.schedule import DataPosition, StepSchedule
from fsdp_rlhf.distributed import checkpoint as ckpt
from fsdp_rlhf.distributed.env import DistEnv, all_reduce_scalars
from fsdp_rlhf.metrics import Progress
from fsdp_rlhf.models.lora import check_target_modules
from fsdp_rlhf.models.save import save_model
from fsdp_rlhf.optim import build_optimizer, build_scheduler
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.guards import BadStepGuard
from fsdp_rlhf.trainers.rm_data import RMData, prepare_rm_data
from fsdp_rlhf.trainers.rm_setup import RESUME_KEYS, build_model, resume_state
from fsdp_rlhf.trainers.rm_steps import evaluate, pair_layout, train_step

log = logging.getLogger(__name__)

TRAIN_KEYS = ["loss", "acc", "chosen_reward", "reject_reward", "margin", "lr", "grad_norm"]


def main(cfg: RMConfig, debug: bool = False) -> int:
    """Train a reward model; returns the process exit code (0, also after a graceful stop)."""
    return common.launch(cfg, debug, prepare, RMTrainer)


def prepare(cfg: RMConfig, world_size: int) -> tuple[RMBatchPlan, RMData]:
    import datasets

    if os.environ.get("RANK", "0") != "0" or not sys.stderr.isatty():
        datasets.disable_progress_bars()  # tqdm bars would flood log files and other ranks
    plan = plan_rm_batches(cfg.batch, world_size)
    data = prepare_rm_data(cfg, plan)  # checks --pretrain first
    if cfg.lora.enabled:
        check_target_modules(cfg.model.pretrain, cfg.lora, cfg.backend.trust_remote_code)
    return plan, data


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


class RMTrainer:
    """One reward model, its optimizer and schedule; ``step`` counts finished optimizer steps."""

    def __init__(self, cfg: RMConfig, env: DistEnv, prepared: tuple[RMBatchPlan, RMData]):
        self.cfg, self.env = cfg, env
        self.plan, self.data = prepared
        common.write_run_config(cfg, env)
        self.model = build_model(cfg, env, self.data.tokenizer.pad_token_id)
        self.layout = pair_layout(self.model, cfg.batch)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.total_steps = self.data.steps_per_epoch * cfg.batch.max_epochs
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.state = common.Stateful()
        self.state.add("rm", self.model, self.optimizer, self.scheduler)
        self.guard = BadStepGuard(cfg.guard.max_bad_steps, "reward model")
        current = resume_state(cfg, self.data, 0)
        check = partial(ckpt.check_resumable, current=current, keys=list(RESUME_KEYS))
        saved = common.resume(cfg.ckpt, self.state, check)
        self.step = int(saved["step"]) if saved else 0
        if saved:
            self.guard.load_state_dict(saved.get("guard", {}))
        schedule = StepSchedule(
            len(self.data.train), cfg.batch.train_batch_size, env.world_size, env.rank, cfg.seed
        )
        pad_id = self.data.tokenizer.pad_token_id
        self.loader = PreferenceLoader(
            self.data.train, schedule, self.plan.micro_batch_size_per_rank, pad_id
        )
        self.metrics = common.open_metrics(cfg, env, self.step)
        self.progress = Progress(env.rank, self.total_steps, "train-rm", start=self.step)
        self.window = _Window()
        self.started, self.first_step = time.monotonic(), self.step

    def train_step(self, stop_agreed: Callable[[], bool]) -> bool:
        """One optimizer step (short: the stop vote after it is enough)."""
        pos = DataPosition.from_global_step(self.step - 1, self.data.steps_per_epoch)
        batches = self.loader.step_batches(pos)
        stats = train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batches,
            self.cfg,
            self.env.device,
            self.guard,
            self.step,
            self.layout,
        )
        self.window.add(stats)
        self.progress.advance()
        if self.step % self.cfg.logging.logging_steps == 0:
            # the window's means, averaged over ranks (a collective)
            stats = {**all_reduce_scalars(self.window.pop(), op="mean"), **self.guard.metrics()}
            self.metrics.log(self.step, stats, TRAIN_KEYS, self._eta())
        every = self.cfg.logging.eval_steps
        # the last step is left to finish(), which always evaluates
        if every > 0 and self.step % every == 0 and self.step < self.total_steps:
            self.metrics.log(self.step, self.evaluate())
        return True

    def evaluate(self) -> dict[str, float]:
        env = self.env
        batches = eval_batches(
            self.data.eval,
            env.world_size,
            env.rank,
            self.plan.micro_batch_size_per_rank,
            self.data.tokenizer.pad_token_id,
        )
        return evaluate(self.model, batches, self.cfg, env.device, self.layout)

    def _eta(self) -> str:
        done, left = self.step - self.first_step, self.total_steps - self.step
        seconds = int((time.monotonic() - self.started) / max(done, 1) * left)
        h, rem = divmod(seconds, 3600)
        return f"{self.step}/{self.total_steps} eta {h}:{rem // 60:02d}:{rem % 60:02d}"

    def save_checkpoint(self) -> None:
        trainer_state = {
            **resume_state(self.cfg, self.data, self.step),
            "guard": self.guard.state_dict(),
        }
        common.save(self.cfg.ckpt, self.step, self.state, trainer_state)

    def finish(self) -> None:
        """Final eval, then the HF model (atomically) with the eval reward mean/std.

        ``normalize_reward`` is deliberately not written: whether to normalise is the PPO
        run's choice (``--normalize_reward``), made with the mean/std stored here.
        """
        stats = self.evaluate()
        self.metrics.log(self.step, stats)
        extra = {
            "reward_mean": stats["eval/reward_mean"],
            "reward_std": stats["eval/reward_std"],
            # OpenRLHF's loaders look the head up under this name; ours is always `score`.
            "value_head_prefix": "score",
        }
        path = save_model(
            self.model,
            self.data.tokenizer,
            self.cfg.ckpt.save_path,
            self.cfg.lora,
            base_path=self.cfg.model.pretrain,
            head="score",
            extra_config=extra,
        )
        if self.cfg.lora.enabled and not self.cfg.lora.merge_lora:
            log.warning(
                "%s holds the LoRA adapter only (adapter/); ppo --reward_pretrain needs a full "
                "model: train with --merge_lora",
                path,
            )
        log.info(
            "reward model saved to %s (reward_mean=%.4g, reward_std=%.4g)",
            path,
            extra["reward_mean"],
            extra["reward_std"],
        )

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
