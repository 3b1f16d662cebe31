"""What `train-rm`, `sft` and `dpo` share: training one model over a fixed, pre-tokenized
dataset, a resumable per-rank schedule of micro-batches per optimizer step.

:class:`OfflineTrainer` implements :class:`fsdp_rlhf.trainers.common.Trainer` around the
command's own pieces::

    update(batches) -> stats      one optimizer step over this rank's micro-batches
    evaluate() -> stats           eval metrics (collective), every eval_steps and at the end
    finish()                      final eval and the HF export

The data position is a function of the step counter (``DataPosition.from_global_step``), so a
resumed run continues the same order; a checkpoint written with other data, batch size or
seed is refused (``resume_state``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdp_rlhf.config import plan_offline_batches
from fsdp_rlhf.data.preference import PreferenceLoader, collate_pairs, eval_batches
from fsdp_rlhf.data.schedule import DataPosition, StepSchedule
from fsdp_rlhf.distributed import checkpoint as ckpt
from fsdp_rlhf.distributed.env import DistEnv, all_reduce_scalars
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.memory_plan import offline_accumulate_gathered
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.metrics import Progress
from fsdp_rlhf.models.kind import ModelKind
from fsdp_rlhf.models.load import check_expert_parallel
from fsdp_rlhf.models.lora import check_target_modules
from fsdp_rlhf.models.save import save_model
from fsdp_rlhf.optim import build_optimizer, build_scheduler
from fsdp_rlhf.rules import check_command, check_flags, model_paths
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.guards import BadStepGuard, guarded_step

if TYPE_CHECKING:  # imported where used: the GPU box runs without `datasets`
    import datasets

log = logging.getLogger(__name__)

RESUME_KEYS = ("train_pairs", "train_batch_size", "seed")


@dataclass(frozen=True)
class TrainData:
    """Tokenized train rows and eval rows (None: no evaluation), as ``prepare`` leaves them;
    ``vision``: a vision-language model's ``data.vision.VisionProcessor`` (None: text)."""

    tokenizer: Any
    train: datasets.Dataset
    eval: datasets.Dataset | None
    steps_per_epoch: int
    vision: Any = None
    # flag -> kind of every model the command loads (models.kind), read once in prepare
    kinds: dict[str, ModelKind] = field(default_factory=dict)

    @property
    def model(self) -> ModelKind:
        """``--pretrain``'s kind."""
        return self.kinds["--pretrain"]

    @property
    def saved_processor(self) -> Any:
        """What is saved beside the model: the processor of a VLM, else the tokenizer."""
        return self.vision.processor if self.vision is not None else self.tokenizer


def quiet_progress_bars() -> None:
    """tqdm bars of ``datasets`` would flood log files and other ranks' output."""
    if os.environ.get("RANK", "0") != "0" or not sys.stderr.isatty():
        import datasets

        datasets.disable_progress_bars()


def steps_per_epoch(num_train: int, cfg: Any, plan: Any, num_eval: int, rows: str) -> int:
    """Optimizer steps in one pass over ``num_train`` rows; logs the data plan. ``rows`` names
    the unit (``pairs``, ``samples``)."""
    steps = num_train // cfg.batch.train_batch_size
    if steps == 0:
        raise UserError(
            f"only {num_train} training {rows} (after dropping unusable rows), fewer than "
            f"--train_batch_size {cfg.batch.train_batch_size}"
        )
    log.info(
        "data: %d train %s, %d eval %s; %d steps/epoch x %d epochs; %d %s per rank per step in "
        "%d micro-batches of %d",
        num_train,
        rows,
        num_eval,
        rows,
        steps,
        cfg.batch.max_epochs,
        plan.batch_size_per_rank,
        rows,
        plan.grad_accum_steps,
        plan.micro_batch_size_per_rank,
    )
    return steps


def resume_state(cfg: Any, num_train: int, steps_per_epoch: int, step: int) -> dict[str, Any]:
    """Plain values saved with a checkpoint; resuming requires the same data and batch."""
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    return {
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "train_pairs": num_train,  # rows of the tokenized training set (pairs or samples)
        "train_batch_size": cfg.batch.train_batch_size,
        "seed": cfg.seed,
    }


def prepare_command(
    command: str,
    cfg: Any,
    world_size: int,
    prepare_data: Callable[[Any, Any, dict[str, ModelKind]], TrainData],
) -> tuple[Any, TrainData]:
    """``prepare`` of train-rm, sft and dpo (before the process group, no communication):
    batch plan, the rules table against the flags and the models' kinds (read here once),
    the experts against --expert_parallel_size, ``prepare_data(cfg, plan, kinds)``, LoRA
    targets."""
    quiet_progress_bars()
    check_flags(command, cfg)  # the rules table's rows of the flags alone, first
    plan = plan_offline_batches(cfg.batch, world_size, cfg.fsdp.sequence_parallel_size)
    kinds = check_command(command, cfg)
    paths = model_paths(command, cfg)
    check_expert_parallel(cfg.fsdp.expert_parallel_size, world_size, paths)
    data = prepare_data(cfg, plan, kinds)
    if cfg.lora.enabled:
        check_target_modules(cfg.model.pretrain, cfg.lora, cfg.backend.trust_remote_code)
    return plan, data


@dataclass
class MetricWindow:
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


class OfflineTrainer:
    """The model, its optimizer and schedule, the data schedule, metrics and checkpoints;
    ``step`` counts finished optimizer steps. Subclasses set ``command``, ``model_name``
    (its key in checkpoints), ``train_keys`` (console columns) and implement ``update``,
    ``evaluate`` and ``finish``.

    ``data`` has ``tokenizer``, ``train``, ``eval`` (may be None) and ``steps_per_epoch``.
    """

    command = ""
    model_name = "model"
    train_keys: list[str] = []

    def __init__(
        self,
        cfg: Any,
        env: DistEnv,
        plan: Any,
        data: Any,
        model: nn.Module,
        parallel: ParallelLayout,
        *,
        collate: Callable = collate_pairs,
        guard_name: str = "model",
    ) -> None:
        self.cfg, self.env, self.plan, self.data = cfg, env, plan, data
        self.parallel = parallel
        # ZeRO-3: each layer gathered once per optimizer step (--accumulate_gathered)
        total = torch.cuda.mem_get_info(env.device)[1] if env.device.type == "cuda" else 0
        self.gathered = offline_accumulate_gathered(cfg, env.world_size, env.device.type, total)
        self.model = model
        self.collate = collate
        self.optimizer = build_optimizer(model, cfg.optim)
        self.total_steps = data.steps_per_epoch * cfg.batch.max_epochs
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.trained = common.TrainedModels()
        self.trained.add(self.model_name, model, self.optimizer, self.scheduler)
        self.guard = BadStepGuard(cfg.guard.max_bad_steps, guard_name)
        current = resume_state(cfg, len(data.train), data.steps_per_epoch, 0)
        check = partial(ckpt.check_resumable, current=current, keys=list(RESUME_KEYS))
        saved = common.resume(cfg.ckpt, self.trained, check)
        self.step = int(saved["step"]) if saved else 0
        if saved:
            self.guard.load_state_dict(saved.get("guard", {}))
        # the ranks of a sequence-parallel group run the same rows: one data shard per group
        schedule = StepSchedule(
            len(data.train),
            cfg.batch.train_batch_size,
            parallel.dp_size,
            parallel.dp_rank,
            cfg.seed,
        )
        self.pad_id = data.tokenizer.pad_token_id
        self.loader = PreferenceLoader(
            data.train, schedule, plan.micro_batch_size_per_rank, self.pad_id, collate
        )
        self.metrics = common.open_metrics(cfg, env, self.step)
        self.progress = Progress(env.rank, self.total_steps, self.command, start=self.step)
        self.window = MetricWindow()
        self.started, self.first_step = time.monotonic(), self.step

    # ------------------------------------------------------------ the command's own pieces

    def update(self, batches: list) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        raise NotImplementedError

    def finish(self) -> None:
        """Final eval (when there is an eval set), then the HF model, atomically (rank 0 writes
        ``--save_path``; with LoRA the adapter folder, plus the merged model with
        ``--merge_lora``). train-rm overrides it to add its reward statistics."""
        if (stats := self.evaluate()) is not None:
            self.metrics.log(self.step, stats)
        path = self.export(self.cfg.ckpt.save_path)
        log.info("model saved to %s", path)

    def export(self, path) -> Path:
        """The HF model (collective): the final one, or a checkpoint's with --save_hf_ckpt."""
        return save_model(
            self.model,
            self.data.saved_processor,
            path,
            self.cfg.lora,
            base_path=self.cfg.model.pretrain,
        )

    # ------------------------------------------------------------ shared

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step (skipped by the guard on a NaN/Inf gradient norm), schedule; returns the
        global ``grad_norm`` and the ``lr`` the step used."""
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = guarded_step(
            self.model.parameters(),
            self.optimizer,
            self.scheduler,
            self.cfg.optim.max_norm,
            self.guard,
            self.step,
        )
        return {"grad_norm": grad_norm, "lr": lr}

    def train_step(self, stop_agreed: Callable[[], bool]) -> bool:
        """One optimizer step (short: the stop vote after it is enough)."""
        pos = DataPosition.from_global_step(self.step - 1, self.data.steps_per_epoch)
        self.window.add(self.update(self.loader.step_batches(pos)))
        self.progress.advance()
        if self.step % self.cfg.logging.logging_steps == 0:
            # the window's means, averaged over ranks (a collective)
            stats = {**all_reduce_scalars(self.window.pop(), op="mean"), **self.guard.metrics()}
            self.metrics.log(self.step, stats, self.train_keys, self._eta())
        every = self.cfg.logging.eval_steps
        # the last step is left to finish(), which always evaluates
        if every > 0 and self.step % every == 0 and self.step < self.total_steps:
            if (stats := self.evaluate()) is not None:
                self.metrics.log(self.step, stats)
        return True

    def eval_batches(self) -> list:
        """This rank's eval micro-batches (the same count on every rank; the same batches on
        the ranks of a sequence-parallel group)."""
        return list(
            eval_batches(
                self.data.eval,
                self.parallel.dp_size,
                self.parallel.dp_rank,
                self.plan.micro_batch_size_per_rank,
                self.pad_id,
                self.collate,
            )
        )

    def _eta(self) -> str:
        done, left = self.step - self.first_step, self.total_steps - self.step
        seconds = int((time.monotonic() - self.started) / max(done, 1) * left)
        h, rem = divmod(seconds, 3600)
        return f"{self.step}/{self.total_steps} eta {h}:{rem // 60:02d}:{rem % 60:02d}"

    def save_checkpoint(self) -> None:
        trainer_state = {
            **resume_state(self.cfg, len(self.data.train), self.data.steps_per_epoch, self.step),
            "guard": self.guard.state_dict(),
        }
        common.save(self.cfg.ckpt, self.step, self.trained, trainer_state, self.export)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
