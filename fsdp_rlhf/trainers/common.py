"""The skeleton every command (`sft`, `train-rm`, `dpo`, `ppo`) shares, in the order a run
meets it::

    launch            prepare (validate, no communication) -> process group -> build -> fit
    prepare_model     attention kernel, compile, FSDP2 shards, train or frozen mode
    load_and_prepare  rank 0 loads, every rank shards a skeleton filled from rank 0's copy
    write_run_config  <save_path>/config.yaml (credentials masked)
    resume            the newest checkpoint's models, optimizers and schedules
    open_metrics      console, metrics.jsonl, TensorBoard, W&B (a resumed run continues them)
    fit               step until done, vote on a stop signal, checkpoint every save_steps
    save              a resumable checkpoint of the run's models, optimizers and schedules

``launch`` builds the run's :class:`~fsdp_rlhf.distributed.layout.ParallelLayout` once, after
the process group, and hands it to ``build``: everything that depends on how ranks split the
work takes it as an argument.

A trainer (``build``'s result) is any object with ``step``, ``total_steps``,
``train_step(stop_agreed)``, ``save_checkpoint()``, ``finish()`` and ``close()``: the
offline commands' :class:`~fsdp_rlhf.trainers.offline.trainer.OfflineTrainer` and
:class:`~fsdp_rlhf.trainers.ppo.trainer.PPOTrainer`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fsdp_rlhf.allocator import allocator_hint, allocator_status
from fsdp_rlhf.config import BackendConfig, CheckpointConfig, FSDPConfig
from fsdp_rlhf.config_base import dump_yaml, redacted_dict
from fsdp_rlhf.cpu_bf16 import bf16_warning
from fsdp_rlhf.distributed import checkpoint as ckpt
from fsdp_rlhf.distributed.env import (
    DistEnv,
    init_distributed,
    job_position,
    launched_world_size,
    run_and_agree,
    teardown,
)
from fsdp_rlhf.distributed.exit_report import hold_termination, note_failing, note_prepared
from fsdp_rlhf.distributed.fsdp import build_mesh, describe_zero_stage, shard_model
from fsdp_rlhf.distributed.heartbeat import start_heartbeat
from fsdp_rlhf.distributed.layout import ParallelLayout, build_layout
from fsdp_rlhf.distributed.rank0_load import fill_from_rank0
from fsdp_rlhf.distributed.signals import GracefulStop, SaveTimer
from fsdp_rlhf.distributed.split_world import SplitWorld
from fsdp_rlhf.errors import UserError, WriteFault, writing
from fsdp_rlhf.metrics import MetricLogger, setup_logging, truncate_metrics
from fsdp_rlhf.metrics_wandb import check_wandb, open_wandb
from fsdp_rlhf.models.attention import use_varlen_attention
from fsdp_rlhf.models.compile import compile_blocks, whole_layer_problem
from fsdp_rlhf.models.ulysses import use_ulysses_attention

log = logging.getLogger("fsdp_rlhf")


class Trainer(Protocol):
    step: int  # finished steps
    total_steps: int

    def train_step(self, stop_agreed: Callable[[], bool]) -> bool:
        """One step; False when it was abandoned on an agreed stop before changing state."""
        ...

    def save_checkpoint(self) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


def launch(
    cfg: Any,
    debug: bool,
    prepare: Callable[[Any, int], Any],
    build: Callable[[Any, DistEnv, Any, ParallelLayout], Trainer],
    *,
    init: Callable[[int], tuple[DistEnv, SplitWorld | None]] | None = None,
    run: Callable[[Any], int] | None = None,
    beat_on_one_node: bool = False,
) -> int:
    """``main()`` of every command; returns the exit code (0, also after a graceful stop).

    ``prepare(cfg, world_size)`` runs before the process group, so bad input fails in seconds
    with one line; ``build(cfg, env, prepared, parallel)`` loads the models. ``init(timeout_min)``
    replaces the one process group over all ranks (asynchronous PPO splits the world; it
    returns the environment and the split) and ``run(trainer)`` the step loop (default
    :func:`fit`). ``beat_on_one_node``: heartbeats on a single node too (asynchronous PPO's
    ranks read them while they wait for each other).
    """
    setup_logging(int(os.environ.get("RANK", "0")), debug)
    if cfg.backend.full_determinism:
        from transformers import enable_full_determinism

        # warn_only: an op without a deterministic kernel warns instead of failing the run
        enable_full_determinism(cfg.seed, warn_only=True)
    world_size = launched_world_size()
    check_wandb(cfg.logging)
    prepared = prepare(cfg, world_size)
    note_prepared()  # a rank that failed validation need not wait for this one's message
    owns_group = not dist.is_initialized()  # a test may have made the group already
    split = None
    if init is None:
        env = init_distributed(cfg.guard.dist_timeout_min)
        if env.world_size != world_size:
            raise RuntimeError(f"world size {env.world_size} != WORLD_SIZE {world_size}")
    else:
        env, split = init(cfg.guard.dist_timeout_min)
    # a rollout rank's default group is its engine's ranks: the training layout is not its
    rollout = split is not None and split.is_rollout(job_position()[0])
    parallel = build_layout(
        1 if rollout else cfg.fsdp.sequence_parallel_size,
        1 if rollout else cfg.fsdp.expert_parallel_size,
        split=split,
        device_type=env.device.type,
    )
    if parallel.sp.enabled or parallel.ep.enabled or split is not None:
        log.info("parallel layout: %s", parallel.describe())
    # Multi-node: a host that vanishes ends every rank within a bound, not the collective timeout.
    heartbeat = start_heartbeat(
        cfg.guard.heartbeat_timeout_s, *job_position(), beat_on_one_node=beat_on_one_node
    )
    trainer = None
    try:
        trainer = build(cfg, env, prepared, parallel)
        code = fit(trainer, cfg.ckpt.save_steps) if run is None else run(trainer)
        if heartbeat is not None:
            heartbeat.stop(finished=True)
        return code
    except BaseException as e:
        hold_termination()  # torchrun may stop us any moment now: print the line first
        note_failing()  # before the teardown below breaks the other ranks' collectives
        if isinstance(e, WriteFault):  # a checkpoint or the export: name what the user has
            e.naming_checkpoint(ckpt.latest_checkpoint(cfg.ckpt.ckpt_path))
        lost = heartbeat is not None and isinstance(e, Exception) and heartbeat.explain(e)
        if lost and not debug:
            heartbeat.fail(lost)  # a peer's host is gone: one line, exit now
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if trainer is not None:
            trainer.close()  # a vLLM engine destroys the process group with it
        if owns_group:
            teardown()


def save_due(step: int, total_steps: int, save_steps: int) -> bool:
    return save_steps > 0 and (step % save_steps == 0 or step == total_steps)


def fit(trainer: Trainer, save_steps: int, also_stop: Callable[[], bool] | None = None) -> int:
    """Step until ``total_steps``; on SIGTERM/SIGUSR1 all ranks agree, checkpoint and exit 0.

    ``train_step(stop_agreed)`` may itself vote (PPO does, before its update) and return False
    when it abandoned the step without changing any state: the checkpoint is then the last
    finished step's, written only if it is not on disk already. ``also_stop``: another way a
    rank learns of a stop, counted in every vote (asynchronous PPO's rollout ranks, which do
    not vote, signal through the job's store).
    """
    saved_at = trainer.step
    with GracefulStop(also=also_stop) as stop:
        while trainer.step < trainer.total_steps:
            trainer.step += 1
            finished = trainer.train_step(stop.agreed)
            if not finished:
                trainer.step -= 1
            stopping = not finished or stop.agreed()  # collective: all ranks, same step
            due = finished and save_due(trainer.step, trainer.total_steps, save_steps)
            if due or (stopping and trainer.step != saved_at):
                trainer.save_checkpoint()
                saved_at = trainer.step
            if stopping:
                log.warning(
                    "stop signal: %s; checkpoint at step %d on disk, exiting (%.0f s after the "
                    "signal)",
                    "finished the step" if finished else "abandoned the step before its update",
                    trainer.step,
                    stop.seconds_since_signal() or 0.0,
                )
                return 0
    trainer.finish()
    return 0


def fp32_on_cuda_warning(device_type: str, bf16: bool) -> str | None:
    """The start-up line of a CUDA run without ``--bf16``, else None.

    ``--bf16`` stays off by default, as in OpenRLHF up to v0.6 and the AIAK scripts whose flag
    it is (every launcher here passes it); OpenRLHF v0.10+ replaced it with ``--param_dtype``,
    bf16 by default, so a script from there that leaves the dtype out would run in fp32 here
    without this line. On CPU fp32 is the right default (docs/cpu_notes.md).
    """
    if device_type != "cuda" or bf16:
        return None
    return (
        "no --bf16: this run trains in fp32 on the GPU (weights, activations and matmuls; PPO's "
        "vLLM engine generates in float32 too), with twice bf16's memory for weights and far "
        "below the GPU's bf16 speed; pass --bf16 (OpenRLHF v0.10+ is bf16 by default)"
    )


def log_startup(env: DistEnv, zero_stage: int, bf16: bool) -> None:
    log.info(describe_zero_stage(zero_stage))
    if env.is_rank0 and (fp32 := fp32_on_cuda_warning(env.device.type, bf16)):
        log.warning(fp32)
    if env.is_rank0 and (status := allocator_status()):
        log.info(status)
    if env.is_rank0 and (hint := allocator_hint(env.device.type)):
        log.warning(hint)
    if env.is_rank0 and (slow := bf16_warning(env.device.type, bf16)):
        log.warning(slow)


def prepare_model(
    model: nn.Module,
    env: DistEnv,
    fsdp: FSDPConfig,
    backend: BackendConfig,
    *,
    parallel: ParallelLayout,
    packed: bool,
    trainable: bool,
    grad_reduce: str = "mean",
) -> nn.Module:
    """Attention kernel (inside Ulysses with ``--sequence_parallel_size``), compiled blocks and
    FSDP2 shards over all ranks (an MoE model's experts split over ``parallel.ep``'s groups); train
    or frozen.

    Args:
        parallel: the run's parallel layout (its sequence-parallel size, data-parallel degree
            and expert-parallel groups).
        packed: micro-batches arrive packed into one row (``--packing_samples``).
        grad_reduce: ``"sum"`` when losses are normalised by a global count (PPO); ``"mean"``
            averages over the data-parallel ranks.
    """
    if packed:
        use_varlen_attention(model, env.device.type)
    if parallel.sp.size != fsdp.sequence_parallel_size:
        raise RuntimeError(
            f"--sequence_parallel_size {fsdp.sequence_parallel_size} but the layout has "
            f"{parallel.sp.size} (build_layout)"
        )
    if parallel.sp.enabled:
        use_ulysses_attention(model)
    if trainable and backend.float8:  # the rules table refused it where it cannot run
        from fsdp_rlhf.models.float8 import use_float8

        log.info("--float8: %d linear layers in rowwise float8 (torchao)", use_float8(model))
    if backend.torch_compile:
        whole = whole_layer_problem(
            model, env.device.type, backend.bf16, packed, parallel.sp.size
        )  # fmt: skip
        if whole is not None:
            log.info("torch.compile: each layer's children, not whole layers: %s", whole)
        compile_blocks(model, whole_layers=whole is None)
    # No model.to(env.device): fully_shard moves and shards one layer at a time, so the full
    # model never sits on the GPU (a 70B only has to fit the host).
    shard_model(
        model,
        build_mesh(env.device, env.world_size),
        fsdp,
        bf16=backend.bf16,
        grad_reduce=grad_reduce,
        cpu_offload=trainable and fsdp.adam_offload,
        frozen=not trainable,
        dp_size=parallel.dp_size,
        ep=parallel.ep,
    )
    if trainable:
        model.train()  # from_pretrained returns eval mode: no dropout, no grad checkpointing
    else:
        model.requires_grad_(False)
        model.eval()
    return model


def load_and_prepare(
    load: Callable[[bool], nn.Module],
    env: DistEnv,
    fsdp: FSDPConfig,
    backend: BackendConfig,
    *,
    parallel: ParallelLayout,
    what: str,
    packed: bool,
    trainable: bool,
    grad_reduce: str = "mean",
) -> nn.Module:
    """A model loaded and prepared (``prepare_model``) with one full copy in host memory per
    job: ``load(True)`` builds it with its weights, ``load(False)`` the same model on the meta
    device (adapters included). One rank loads and shards as it is. Several: rank 0 loads
    (its failure reaches every rank at once), every rank shards a skeleton, and rank 0's tensors
    fill the shards one at a time (``distributed.rank0_load``). ``what`` names the model in
    the error the other ranks raise when rank 0's load fails."""
    if env.world_size == 1:
        return prepare_model(
            load(True), env, fsdp, backend, parallel=parallel, packed=packed, trainable=trainable,
            grad_reduce=grad_reduce,
        )  # fmt: skip
    full = run_and_agree(lambda: load(True), f"loading {what}", only_rank0=True)
    model = prepare_model(
        load(False), env, fsdp, backend, parallel=parallel, packed=packed, trainable=trainable,
        grad_reduce=grad_reduce,
    )  # fmt: skip
    fill_from_rank0(model, full, env.device)
    del full
    return model


@dataclass
class TrainedModels:
    """The trained models with their optimizers and schedules, keyed alike: what a
    checkpoint restores besides the trainer's plain state. ``extras`` are other objects with
    ``state_dict`` and ``load_state_dict`` (an EMA of a model's shards), saved and restored
    like a schedule."""

    models: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def stateful_objects(self) -> dict[str, Any]:
        """Schedules and extras: what ``checkpoint`` saves through their ``state_dict``."""
        return {**self.schedulers, **self.extras}

    def add(self, name: str, model: nn.Module, optimizer=None, scheduler=None) -> None:
        self.models[name] = model
        if optimizer is not None:
            self.optimizers[name] = optimizer
        if scheduler is not None:
            self.schedulers[name] = scheduler


HF_CKPT_DIR = "hf"  # <ckpt_path>/step_N/hf: the --save_hf_ckpt export of that step


def save(
    ckpt_cfg: CheckpointConfig,
    step: int,
    trained: TrainedModels,
    trainer_state: dict,
    hf_export: Callable[[Path], None] | None = None,
) -> Path:
    """A resumable checkpoint at ``step`` (collective); warns when it took over half the
    window a stop signal leaves (see ``SaveTimer``).

    With ``--save_hf_ckpt``, ``hf_export(folder)`` (collective) writes the HF model(s) into
    ``step_N/hf`` before the checkpoint is marked complete: the export is as atomic as the
    checkpoint and rotates with it (``--max_ckpt_num``, ``--max_ckpt_mem``).
    """
    write_extra = None
    if ckpt_cfg.save_hf_ckpt:
        if hf_export is None:
            raise UserError("--save_hf_ckpt: this command has no HF export for its checkpoints")

        def write_extra(folder: Path) -> None:
            hf_export(folder / HF_CKPT_DIR)

    timer = SaveTimer()
    with timer(f"checkpoint at step {step}"):
        path = ckpt.save_checkpoint(
            ckpt_cfg.ckpt_path,
            step,
            models=trained.models,
            optimizers=trained.optimizers,
            schedulers=trained.stateful_objects,
            trainer_state=trainer_state,
            keep=ckpt_cfg.max_ckpt_num,
            max_bytes=ckpt_cfg.max_ckpt_bytes,
            write_extra=write_extra,
        )
    log.info("checkpoint: %s (%.1f s)", path, timer.last_s)
    return path


def write_run_config(cfg: Any, env: DistEnv) -> None:
    """``<save_path>/config.yaml``: the resolved config of this run (rank 0)."""
    if env.is_rank0:
        out = Path(cfg.ckpt.save_path)
        tmp = out / "config.yaml.tmp"
        with writing(out / "config.yaml"):
            out.mkdir(parents=True, exist_ok=True)
            tmp.write_text(dump_yaml(cfg))
            tmp.replace(out / "config.yaml")


def resume(
    ckpt_cfg: CheckpointConfig,
    trained: TrainedModels,
    check: Callable[[Path], None] | None = None,
) -> dict[str, Any] | None:
    """Restore the newest checkpoint when ``--load_checkpoint``; None for a fresh start.

    ``check(path)`` may refuse a checkpoint written with incompatible settings.
    Returns the trainer state saved with it (``step`` included).
    """
    path = ckpt.resolve_resume(ckpt_cfg.ckpt_path, ckpt_cfg.load_checkpoint)
    if path is None:
        if ckpt_cfg.load_checkpoint:
            log.info(
                "--load_checkpoint: no checkpoint in %s yet, starting fresh", ckpt_cfg.ckpt_path
            )
        return None
    if check is not None:
        check(path)
    saved = ckpt.load_checkpoint(
        path,
        models=trained.models,
        optimizers=trained.optimizers,
        schedulers=trained.stateful_objects,
    )
    log.info("resumed from %s at step %d", path, saved["step"])
    return saved


def open_metrics(cfg: Any, env: DistEnv, resumed_step: int) -> MetricLogger:
    """The run's metric sinks. A resumed run continues the interrupted run's metrics.jsonl,
    minus the rows it wrote after its last checkpoint (those steps are about to be redone).
    With ``--use_wandb``, rank 0 also starts a W&B run whose config is the redacted one of
    config.yaml (its default names come from the command: ``PPOConfig`` -> ``ppo``); a
    resumed run starts a new W&B run."""
    command = type(cfg).__name__.removesuffix("Config").lower()
    path = Path(cfg.ckpt.save_path) / "metrics.jsonl"
    if resumed_step > 0 and env.is_rank0:
        truncate_metrics(path, after_step=resumed_step)
    wandb_run = None
    if env.is_rank0 and cfg.logging.wandb_enabled:
        wandb_run = open_wandb(cfg.logging, command, redacted_dict(cfg), cfg.ckpt.save_path)
    return MetricLogger(
        env.rank,
        cfg.ckpt.save_path,
        cfg.logging.tensorboard,
        append=resumed_step > 0,
        wandb=wandb_run,
    )
