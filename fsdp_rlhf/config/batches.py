"""Batch plans: the sizes derived from a command's batch config and the world (data-parallel
ranks, gradient accumulation, micro-batches and rollout samples per rank), with the checks that
they divide. Pure functions of a frozen config, never edits to it; they raise ``ConfigError``
naming the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp_rlhf.config.common import FSDPConfig
from fsdp_rlhf.config_base import ConfigError

if TYPE_CHECKING:
    from fsdp_rlhf.config.offline import PairBatchConfig, SFTBatchConfig
    from fsdp_rlhf.config.ppo import PPOConfig

# ---------------------------------------------------------------- train-rm, sft, dpo


@dataclass(frozen=True, kw_only=True)
class OfflineBatchPlan:
    """Sizes of `train-rm`, `sft` and `dpo` derived from the batch config and the world.
    ``dp_size``: ranks holding different data (the world, or world / sequence_parallel_size);
    per-rank sizes are per data rank."""

    world_size: int
    dp_size: int
    micro_batch_size_per_rank: int
    grad_accum_steps: int
    batch_size_per_rank: int


def plan_offline_batches(
    batch: PairBatchConfig | SFTBatchConfig, world_size: int, sequence_parallel_size: int = 1
) -> OfflineBatchPlan:
    """Gradient accumulation so that ``dp * micro * accum == train_batch_size``, with ``dp`` the
    data-parallel ranks (``world / sequence_parallel_size``: the ranks of one sequence-parallel
    group share their micro-batches)."""
    dp = FSDPConfig(sequence_parallel_size=sequence_parallel_size).data_parallel_size(world_size)
    per_step = dp * batch.micro_train_batch_size
    if batch.train_batch_size % per_step:
        raise ConfigError(
            f"train_batch_size ({batch.train_batch_size}) must be divisible by "
            f"{_dp_words(world_size, sequence_parallel_size)} ({dp}) x micro_train_batch_size "
            f"({batch.micro_train_batch_size})"
        )
    return OfflineBatchPlan(
        world_size=world_size,
        dp_size=dp,
        micro_batch_size_per_rank=batch.micro_train_batch_size,
        grad_accum_steps=batch.train_batch_size // per_step,
        batch_size_per_rank=batch.train_batch_size // dp,
    )


def _dp_words(world_size: int, sequence_parallel_size: int) -> str:
    """How an error names the data-parallel degree."""
    if sequence_parallel_size == 1:
        return "world size"
    return (
        f"data-parallel size (world {world_size} / sequence_parallel_size {sequence_parallel_size})"
    )


# ---------------------------------------------------------------- ppo


@dataclass(frozen=True, kw_only=True)
class PPOBatchPlan:
    """Sizes derived from the PPO config and the world (all per rank unless named global).

    ``dp_size``: ranks holding different rows (the world, or world / sequence_parallel_size:
    the ranks of a sequence-parallel group hold the same rows); the experience, minibatch and
    micro-batch sizes are per data rank. Generation stays per rank: each rank of a group
    generates its share of the group's prompts.
    """

    world_size: int
    dp_size: int
    tp_size: int
    num_engines: int
    micro_rollout_batch_size: int
    train_batch_size_per_rank: int
    micro_train_batch_size: int
    optimizer_steps_per_epoch: int
    # --async_train: the ranks that only generate (world_size above counts the others); 0
    # when every rank trains and holds an engine slice
    rollout_ranks: int = 0


def async_rollout_ranks(cfg: PPOConfig, world_size: int) -> int:
    """With ``--async_train``: the ranks that only generate (the world's last ones), checked
    against the world and the batch sizes they generate; raises ``ConfigError``."""
    b, r, a = cfg.batch, cfg.rollout, cfg.asynchronous
    tp = r.vllm_tensor_parallel_size
    if r.vllm_num_engines is None:
        raise ConfigError(
            "--async_train needs --vllm_num_engines: the rollout ranks are vllm_num_engines x "
            "vllm_tensor_parallel_size, the other ranks train"
        )
    rollout = r.vllm_num_engines * tp
    if tp < 1 or rollout < 1 or rollout >= world_size:
        raise ConfigError(
            f"--async_train: vllm_num_engines ({r.vllm_num_engines}) x vllm_tensor_parallel_size "
            f"({tp}) = {rollout} rollout ranks leave no training rank in a world of {world_size}"
        )
    generated = a.vllm_generate_batch_size or b.rollout_batch_size
    if generated < b.rollout_batch_size:
        raise ConfigError(
            f"vllm_generate_batch_size ({generated}) must be >= rollout_batch_size "
            f"({b.rollout_batch_size}): it is the prompts generated to fill one batch"
        )
    for name, value in (
        ("rollout_batch_size", b.rollout_batch_size),
        ("vllm_generate_batch_size", generated),
    ):
        if value % rollout:
            raise ConfigError(
                f"{name} ({value}) must be divisible by the {rollout} rollout ranks "
                f"(vllm_num_engines x vllm_tensor_parallel_size)"
            )
    return rollout


def plan_ppo_batches(cfg: PPOConfig, world_size: int) -> PPOBatchPlan:
    """Check divisibility and derive per-rank sizes; raises ``ConfigError`` naming the flags.

    With ``--async_train`` the per-rank sizes are the training ranks' (``world_size`` minus
    the rollout ranks)."""
    b, r = cfg.batch, cfg.rollout
    sp = cfg.fsdp.sequence_parallel_size
    tp = r.vllm_tensor_parallel_size
    rollout = 0
    if cfg.asynchronous.async_train:
        rollout = async_rollout_ranks(cfg, world_size)
        world_size -= rollout
    elif tp < 1 or world_size % tp:
        raise ConfigError(
            f"vllm_tensor_parallel_size ({tp}) must divide the world size ({world_size})"
        )
    elif r.vllm_num_engines is not None and r.vllm_num_engines * tp != world_size:
        raise ConfigError(
            f"vllm_num_engines ({r.vllm_num_engines}) x vllm_tensor_parallel_size ({tp}) must "
            f"equal the world size ({world_size}): every rank holds one engine slice"
        )
    dp = cfg.fsdp.data_parallel_size(world_size)  # --async_train: over the training ranks
    dp_words = _dp_words(world_size, sp)
    # every rank generates rollout_batch_size / world prompts (its share of its group's)
    if b.rollout_batch_size % world_size:
        raise ConfigError(
            f"rollout_batch_size ({b.rollout_batch_size}) must be divisible by the world size "
            f"({world_size})"
        )
    samples = b.rollout_batch_size * b.n_samples_per_prompt
    samples_per_rank = samples // dp
    if samples_per_rank % r.micro_rollout_batch_size:
        raise ConfigError(
            f"rollout samples per rank ({samples_per_rank} = rollout_batch_size x "
            f"n_samples_per_prompt / {dp_words if sp > 1 else 'world'}) must be divisible by "
            f"micro_rollout_batch_size "
            f"({r.micro_rollout_batch_size})"
        )
    per_step = dp * b.micro_train_batch_size
    if b.train_batch_size % per_step or samples % b.train_batch_size:
        raise ConfigError(
            f"train_batch_size ({b.train_batch_size}) must be divisible by {dp_words} x "
            f"micro_train_batch_size ({per_step}) and divide rollout_batch_size x "
            f"n_samples_per_prompt ({samples})"
        )
    return PPOBatchPlan(
        world_size=world_size,
        dp_size=dp,
        tp_size=tp,
        num_engines=(rollout or world_size) // tp,
        rollout_ranks=rollout,
        micro_rollout_batch_size=r.micro_rollout_batch_size,
        train_batch_size_per_rank=b.train_batch_size // dp,
        micro_train_batch_size=b.micro_train_batch_size,
        optimizer_steps_per_epoch=samples // b.train_batch_size,
    )
