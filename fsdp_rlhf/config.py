"""The config trees of `fsdp-rlhf train-rm` and `fsdp-rlhf ppo`.

Flat flag names are the ones in AIAK-RLHF / OpenRLHF launch scripts (``--train_batch_size``), so
their scripts run unchanged. Each component receives only its own section. Derived sizes (gradient
accumulation, micro-batches per rank) come from the pure ``plan_*`` functions, never by editing a
config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from fsdp_rlhf.config_base import ConfigError, doc, section

# ---------------------------------------------------------------- shared sections


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """How models are materialised: precision, attention kernel, recompute."""

    bf16: bool = doc(False, "bf16 parameters with fp32 gradient reduction (MixedPrecisionPolicy).")
    flash_attn: bool = doc(
        False, "Use flash_attention_2 when flash-attn and CUDA are present, else sdpa (warns)."
    )
    gradient_checkpointing: bool = doc(False, "Recompute activations in backward to save memory.")
    trust_remote_code: bool = doc(False, "Allow model code shipped inside checkpoint folders.")


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """FSDP2 sharding. ``zero_stage`` keeps DeepSpeed's vocabulary for migrating users."""

    zero_stage: int = doc(
        2, "3: reshard params after forward (ZeRO-3); 0-2: keep them gathered until backward ends."
    )
    adam_offload: bool = doc(False, "Keep optimizer states on CPU (FSDP2 CPUOffloadPolicy).")

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with warmup and a cosine-to-min-lr (or constant) schedule."""

    lr: float = doc(1e-5, "Peak learning rate.")
    lr_warmup_ratio: float = doc(0.03, "Fraction of total steps spent warming up linearly.")
    lr_scheduler: Literal["cosine_with_min_lr", "constant_with_warmup", "linear"] = doc(
        "cosine_with_min_lr", "Schedule after warmup."
    )
    min_lr_ratio: float = doc(0.1, "Floor of the cosine schedule, as a fraction of the peak.")
    adam_betas: tuple[float, ...] = doc((0.9, 0.95), "AdamW betas.")
    l2: float = doc(0.0, "Decoupled weight decay.")
    max_norm: float = doc(1.0, "Gradient clipping norm (<= 0 disables).")

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be > 0, got {self.lr}")
        if not 0.0 <= self.lr_warmup_ratio < 1.0:
            raise ConfigError(f"lr_warmup_ratio must be in [0, 1), got {self.lr_warmup_ratio}")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"adam_betas needs 2 values, got {list(self.adam_betas)}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where the final model goes and how resumable checkpoints are kept."""

    save_path: str = doc("./ckpt", "Final HF model folder (written atomically).")
    save_steps: int = doc(-1, "Write a resumable checkpoint every N steps (-1: never).")
    ckpt_path: str = doc("./ckpt/checkpoints", "Folder of resumable DCP checkpoints.")
    load_checkpoint: bool = doc(False, "Resume from the newest complete checkpoint in ckpt_path.")
    max_ckpt_num: int = doc(3, "Keep at most this many checkpoints.")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Console, TensorBoard and metrics.jsonl."""

    logging_steps: int = doc(1, "Log every N optimizer steps.")
    eval_steps: int = doc(-1, "Evaluate every N steps (-1: only at the end).")
    tensorboard: str | None = doc(None, "TensorBoard log folder (none: no TensorBoard).")

    def __post_init__(self) -> None:
        if self.logging_steps < 1:
            raise ConfigError(f"logging_steps must be >= 1, got {self.logging_steps}")


# ---------------------------------------------------------------- train-rm


@dataclass(frozen=True, kw_only=True)
class RMModelConfig:
    """The SFT model a reward model starts from, and its value head."""

    pretrain: str = doc("", "SFT model folder (or hub name when online).")
    value_head_prefix: str = doc("score", "Name of the value head module in saved checkpoints.")


@dataclass(frozen=True, kw_only=True)
class PreferenceDataConfig:
    """Pairwise preference data."""

    dataset: str = doc("", "Comma-separated sources: JSON/JSONL/parquet file, folder, or hub name.")
    dataset_probs: str = doc("1.0", "Comma-separated mixing probabilities, one per source.")
    eval_dataset: str | None = doc(None, "Held-out sources (default: 1% of train).")
    prompt_key: str | None = doc(None, "Key of the prompt; none: chosen/rejected are full texts.")
    chosen_key: str = doc("chosen", "Key of the preferred response.")
    rejected_key: str = doc("rejected", "Key of the dispreferred response.")
    margin_key: str | None = doc(None, "Key of a per-pair margin for the loss.")
    apply_chat_template: bool = doc(False, "Render message lists with the tokenizer's template.")
    input_template: str | None = doc(None, "Template for the prompt, e.g. 'Human: {}\\nAssistant: '.")
    max_len: int = doc(512, "Truncate each tokenized text to this many tokens.")
    max_samples: int = doc(100_000_000, "Use at most this many pairs.")

    def __post_init__(self) -> None:
        if self.max_len < 2:
            raise ConfigError(f"max_len must be >= 2, got {self.max_len}")


@dataclass(frozen=True, kw_only=True)
class RMBatchConfig:
    """Batch sizes (global = summed over all ranks)."""

    train_batch_size: int = doc(128, "Pairs per optimizer step, global.")
    micro_train_batch_size: int = doc(8, "Pairs per forward/backward on one rank.")
    max_epochs: int = doc(1, "Passes over the training data.")


@dataclass(frozen=True, kw_only=True)
class RMLossConfig:
    """Bradley-Terry loss options."""

    loss: Literal["sigmoid", "logexp"] = doc("sigmoid", "-logsigmoid(c - r - m) or log(1+e^(r-c)).")
    center_rewards_coefficient: float = doc(0.0, "Weight of the (c + r)^2 centering penalty.")


@dataclass(frozen=True, kw_only=True)
class RMConfig:
    """`fsdp-rlhf train-rm`."""

    FLAG_ALIASES: ClassVar[dict[str, str]] = {
        "learning_rate": "optim.lr",
        "max_norm": "optim.max_norm",
        "adam_betas": "optim.adam_betas",
    }

    model: RMModelConfig = section(RMModelConfig)
    backend: BackendConfig = section(BackendConfig)
    fsdp: FSDPConfig = section(FSDPConfig)
    data: PreferenceDataConfig = section(PreferenceDataConfig)
    batch: RMBatchConfig = section(RMBatchConfig)
    optim: OptimConfig = section(OptimConfig)
    loss: RMLossConfig = section(RMLossConfig)
    ckpt: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    seed: int = doc(42, "Seed for data order, init and dropout.")


@dataclass(frozen=True, kw_only=True)
class RMBatchPlan:
    """Sizes derived from the batch config and the world."""

    world_size: int
    micro_batch_size_per_rank: int
    grad_accum_steps: int
    batch_size_per_rank: int


def plan_rm_batches(batch: RMBatchConfig, world_size: int) -> RMBatchPlan:
    """Gradient accumulation so that ``world * micro * accum == train_batch_size``."""
    per_step = world_size * batch.micro_train_batch_size
    if batch.train_batch_size % per_step:
        raise ConfigError(
            f"train_batch_size ({batch.train_batch_size}) must be divisible by world size "
            f"({world_size}) x micro_train_batch_size ({batch.micro_train_batch_size})"
        )
    return RMBatchPlan(
        world_size=world_size,
        micro_batch_size_per_rank=batch.micro_train_batch_size,
        grad_accum_steps=batch.train_batch_size // per_step,
        batch_size_per_rank=batch.train_batch_size // world_size,
    )
