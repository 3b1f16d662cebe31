"""`train-rm` setup after the process group exists: model, optimizer, schedule, data loader,
metrics, and resuming from a checkpoint."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_rlhf.allocator import allocator_hint
from fsdp_rlhf.config import RMBatchPlan, RMConfig
from fsdp_rlhf.config_base import dump_yaml
from fsdp_rlhf.data.preference import PreferenceLoader
from fsdp_rlhf.data.schedule import DataPosition, StepSchedule
from fsdp_rlhf.distributed.checkpoint import load_checkpoint, resolve_resume
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.fsdp import build_mesh, describe_zero_stage, shard_model
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.metrics import MetricLogger
from fsdp_rlhf.models.attention import use_varlen_attention
from fsdp_rlhf.models.compile import compile_blocks
from fsdp_rlhf.models.load import load_scalar_model
from fsdp_rlhf.optim import build_optimizer, build_scheduler
from fsdp_rlhf.trainers.rm_data import RMData

log = logging.getLogger(__name__)


@dataclass
class RMRun:
    """Everything the training loop touches. ``global_step`` counts finished optimizer steps."""

    cfg: RMConfig
    env: DistEnv
    plan: RMBatchPlan
    data: RMData
    model: FSDPModule
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: PreferenceLoader
    metrics: MetricLogger
    total_steps: int
    start: DataPosition
    global_step: int

    @property
    def tokenizer(self):
        return self.data.tokenizer

    def resume_state(self) -> dict[str, Any]:
        return resume_state(self.cfg, self.data, self.global_step)


def resume_state(cfg: RMConfig, data: RMData, global_step: int) -> dict[str, Any]:
    """Plain values saved with a checkpoint; resuming requires the same data and batch."""
    pos = DataPosition.from_global_step(global_step, data.steps_per_epoch)
    return {
        "epoch": pos.epoch,
        "step_in_epoch": pos.step,
        "train_pairs": len(data.train),
        "train_batch_size": cfg.batch.train_batch_size,
        "seed": cfg.seed,
    }


def build_model(cfg: RMConfig, env: DistEnv, pad_token_id: int) -> FSDPModule:
    """Load the SFT model with a scalar head and shard it over all ranks."""
    log.info(describe_zero_stage(cfg.fsdp.zero_stage))
    if env.is_rank0 and (hint := allocator_hint(env.device.type)):
        log.warning(hint)
    # Same seed on every rank: a freshly initialised head must be identical everywhere,
    # because each rank keeps its own shard of its own copy.
    torch.manual_seed(cfg.seed)
    model = load_scalar_model(
        cfg.model.pretrain,
        cfg.backend,
        env.device,
        value_head_prefix=cfg.model.value_head_prefix,
    )
    # HF (and vLLM) score the last token that is not pad_token_id: use the tokenizer's pad.
    model.config.pad_token_id = pad_token_id
    if cfg.batch.packing_samples:
        use_varlen_attention(model)
    if cfg.backend.torch_compile:
        compile_blocks(model)
    shard_model(
        model,
        build_mesh(env.device, env.world_size),
        cfg.fsdp,
        bf16=cfg.backend.bf16,
        cpu_offload=cfg.fsdp.adam_offload,
    )
    model.train()  # from_pretrained returns eval mode (no dropout, no gradient checkpointing)
    # Different dropout masks per rank from here on.
    torch.manual_seed(cfg.seed + env.rank)
    return model


def _check_resumable(path: Path, current: dict[str, Any]) -> None:
    saved = json.loads((path / "trainer.json").read_text())
    diff = [k for k in ("train_pairs", "train_batch_size", "seed") if saved[k] != current[k]]
    if diff:
        got = ", ".join(f"{k} {saved[k]} -> {current[k]}" for k in diff)
        raise UserError(
            f"--load_checkpoint {path}: written with different data or batch settings ({got}); "
            "the data order could not continue. Restore them or start with a new --ckpt_path"
        )


def resume(cfg: RMConfig, data: RMData, model, optimizer, scheduler) -> int:
    """Restore model, optimizer, schedule and RNG from the newest checkpoint, if asked.

    Returns:
        The number of finished steps (0 for a fresh start); the data position follows from it.
    """
    ckpt = cfg.ckpt
    path = resolve_resume(ckpt.ckpt_path, ckpt.load_checkpoint)
    if path is None:
        if ckpt.load_checkpoint:
            log.info("--load_checkpoint: no checkpoint in %s yet, starting fresh", ckpt.ckpt_path)
        return 0
    _check_resumable(path, resume_state(cfg, data, 0))
    state = load_checkpoint(
        path, models={"rm": model}, optimizers={"rm": optimizer}, schedulers={"rm": scheduler}
    )
    log.info("resumed from %s at step %d", path, state["step"])
    return int(state["step"])


def setup_run(cfg: RMConfig, env: DistEnv, plan: RMBatchPlan, data: RMData) -> RMRun:
    """Model, optimizer and schedule, resumed when a checkpoint is found; metrics opened."""
    if env.world_size != plan.world_size:
        raise RuntimeError(f"world size {env.world_size} != planned {plan.world_size}")
    if env.is_rank0:
        Path(cfg.ckpt.save_path).mkdir(parents=True, exist_ok=True)
        (Path(cfg.ckpt.save_path) / "config.yaml").write_text(dump_yaml(cfg))
    model = build_model(cfg, env, data.tokenizer.pad_token_id)
    optimizer = build_optimizer(model, cfg.optim)
    total_steps = data.steps_per_epoch * cfg.batch.max_epochs
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    global_step = resume(cfg, data, model, optimizer, scheduler)
    schedule = StepSchedule(
        len(data.train), cfg.batch.train_batch_size, env.world_size, env.rank, cfg.seed
    )
    pad_id = data.tokenizer.pad_token_id
    return RMRun(
        cfg=cfg,
        env=env,
        plan=plan,
        data=data,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=PreferenceLoader(data.train, schedule, plan.micro_batch_size_per_rank, pad_id),
        # A resumed run continues the metrics of the interrupted one; a fresh run starts anew.
        metrics=MetricLogger(
            env.rank, cfg.ckpt.save_path, cfg.logging.tensorboard, append=global_step > 0
        ),
        total_steps=total_steps,
        start=DataPosition.from_global_step(global_step, data.steps_per_epoch),
        global_step=global_step,
    )
