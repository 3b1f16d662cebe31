"""The config sections every command shares: precision and kernels, FSDP2 and sequence
parallelism, optimizer, checkpoints, logging, guards, vision inputs and LoRA.

Flat flag names are the ones in AIAK-RLHF / OpenRLHF launch scripts (``--train_batch_size``), so
their scripts run unchanged. Each component receives only its own section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from fsdp_rlhf.config_base import ConfigError, doc


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """How models are materialised: precision, attention kernel, recompute."""

    bf16: bool = doc(
        False,
        "bf16 parameters with fp32 gradient reduction (MixedPrecisionPolicy); also vLLM's dtype. "
        "Off by default (fp32), as OpenRLHF's --bf16 up to v0.6; a CUDA run without it says so "
        "at start.",
    )
    flash_attn: bool = doc(
        False,
        "Use flash_attention_2 (needs --bf16) when flash-attn and CUDA are present, else sdpa "
        "(warns); packed forwards then use its varlen kernel.",
    )
    gradient_checkpointing: bool = doc(False, "Recompute activations in backward to save memory.")
    gradient_checkpointing_policy: Literal["full", "selective"] = doc(
        "full",
        "What --gradient_checkpointing recomputes in the decoder layers: full (each layer's "
        "forward again; only its input is kept) or selective (the outputs of its matmuls and "
        "its attention are kept, the elementwise ops recomputed: more memory, less recompute).",
    )
    torch_compile: bool = doc(
        False,
        "torch.compile the decoder layers: on CUDA each whole layer as one graph (fullgraph; "
        "RMSNorm, rotary, SwiGLU and residuals fused around the matmuls and the varlen "
        "attention), on CPU each layer's norms, MLP and attention block.",
    )
    trust_remote_code: bool = doc(False, "Allow model code shipped inside checkpoint folders.")
    disable_fast_tokenizer: bool = doc(
        False, "Load the slow (Python) tokenizer instead of the Rust one."
    )
    float8: bool = doc(
        False,
        "torchao's float8 training (rowwise scaling) for the decoder layers' linear layers "
        "(CUDA, sm_89+, torchao installed).",
    )
    full_determinism: bool = doc(
        False,
        "Deterministic kernels where PyTorch has them (transformers.enable_full_determinism): "
        "slower, bitwise-repeatable runs on the same hardware.",
    )


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """Parallelism: FSDP2 sharding over all ranks (``zero_stage`` keeps DeepSpeed's vocabulary
    for migrating users), sequence parallelism inside groups of ranks, and expert parallelism
    of MoE layers inside groups of ranks."""

    zero_stage: int = doc(
        2, "3: reshard params after forward (ZeRO-3); 0-2: keep them gathered until backward ends."
    )
    adam_offload: bool = doc(False, "Keep optimizer states on CPU (FSDP2 CPUOffloadPolicy).")
    accumulate_gathered: Literal["auto", "on", "off"] = doc(
        "auto",
        "ZeRO-3 between the micro-batches of one optimizer step: keep each layer's gathered "
        "params and unsharded grads (one all-gather and one reduce-scatter per layer per step, "
        "as below ZeRO-3), or reshard after every forward and backward (off). auto: on where "
        "the memory model says the update fits that way (CUDA), off on CPU.",
    )
    sequence_parallel_size: int = doc(
        1,
        "Ulysses sequence parallelism: groups of N consecutive ranks share each micro-batch, "
        "each rank holding 1/N of every sequence (all-to-all around attention); N divides the "
        "world size and the attention heads, batch sizes count world / N data-parallel ranks. "
        "OpenRLHF's --ring_attn_size maps here.",
    )
    expert_parallel_size: int = doc(
        1,
        "Expert parallelism for MoE models: groups of E consecutive ranks split each MoE "
        "layer's routed experts (tokens go to their experts by all-to-all); the expert weights "
        "are sharded over the ranks holding the same experts, everything else over all ranks. "
        "E divides the world size and the experts per layer; dense models are unaffected. "
        "Other trainers' ep_size, expert_model_parallel_size and Molt's --fsdp.ep_size map here.",
    )

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.sequence_parallel_size < 1:
            raise ConfigError(
                f"sequence_parallel_size must be >= 1, got {self.sequence_parallel_size}"
            )
        if self.expert_parallel_size < 1:
            raise ConfigError(f"expert_parallel_size must be >= 1, got {self.expert_parallel_size}")

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks holding different data: ``world / sequence_parallel_size``; raises a
        ``ConfigError`` naming both numbers when N does not divide the world."""
        n = self.sequence_parallel_size
        if world_size % n:
            raise ConfigError(
                f"sequence_parallel_size ({n}) must divide the world size ({world_size})"
            )
        return world_size // n


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
    adam_eps: float = doc(1e-8, "AdamW epsilon.")
    l2: float = doc(0.0, "Decoupled weight decay.")
    max_norm: float = doc(1.0, "Gradient clipping norm (<= 0 disables).")

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be > 0, got {self.lr}")
        if not 0.0 <= self.lr_warmup_ratio < 1.0:
            raise ConfigError(f"lr_warmup_ratio must be in [0, 1), got {self.lr_warmup_ratio}")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"adam_betas needs 2 values, got {list(self.adam_betas)}")
        if self.adam_eps <= 0:
            raise ConfigError(f"adam_eps must be > 0, got {self.adam_eps}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where the final model goes and how resumable checkpoints are kept."""

    save_path: str = doc("./ckpt", "Final HF model folder (written atomically).")
    save_steps: int = doc(-1, "Write a resumable checkpoint every N steps (-1: never).")
    ckpt_path: str = doc("./ckpt/checkpoints", "Folder of resumable DCP checkpoints.")
    load_checkpoint: bool = doc(False, "Resume from the newest complete checkpoint in ckpt_path.")
    max_ckpt_num: int = doc(3, "Keep at most this many checkpoints.")
    max_ckpt_mem: float | None = doc(
        None,
        "GiB: after each save, delete the oldest checkpoints until those in ckpt_path total at "
        "most this (the newest is always kept; none or inf: no limit).",
    )
    save_hf_ckpt: bool = doc(
        False,
        "Also write a HF model into each checkpoint (step_N/hf; PPO's critic in step_N/hf/"
        "critic), rotated with it.",
    )

    def __post_init__(self) -> None:
        if self.max_ckpt_mem is not None and not self.max_ckpt_mem > 0:
            raise ConfigError(f"max_ckpt_mem must be > 0 GiB, got {self.max_ckpt_mem}")

    @property
    def max_ckpt_bytes(self) -> float | None:
        """``max_ckpt_mem`` in bytes; None when unlimited."""
        if self.max_ckpt_mem is None or math.isinf(self.max_ckpt_mem):
            return None
        return self.max_ckpt_mem * 2**30


FALSE_WORDS = ("", "false", "0", "no", "off", "none")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Console, TensorBoard and metrics.jsonl."""

    logging_steps: int = doc(1, "Log every N optimizer steps.")
    eval_steps: int = doc(-1, "Evaluate every N steps (-1: only at the end).")
    tensorboard: str | None = doc(None, "TensorBoard log folder (none: no TensorBoard).")
    use_wandb: str | None = doc(
        None,
        "Weights & Biases: an API key, or True to use WANDB_API_KEY / `wandb login` (none: off). "
        "Offline (a local run to `wandb sync`) without a key or a reachable server.",
        secret=True,
    )
    wandb_org: str | None = doc(None, "W&B entity (team or user; none: the key's default).")
    wandb_group: str | None = doc(None, "W&B run group.")
    wandb_project: str | None = doc(None, "W&B project (none: openrlhf_train_<command>).")
    wandb_run_name: str | None = doc(None, "W&B run name (none: <command>_<MMDD>T<HH:MM>).")

    def __post_init__(self) -> None:
        if self.logging_steps < 1:
            raise ConfigError(f"logging_steps must be >= 1, got {self.logging_steps}")
        if self.use_wandb is not None and self.use_wandb.strip().lower() in FALSE_WORDS:
            object.__setattr__(self, "use_wandb", None)  # --use_wandb False: off

    @property
    def wandb_enabled(self) -> bool:
        return self.use_wandb is not None


@dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """Failure handling: non-finite optimizer steps and how long a rank waits for the others."""

    max_bad_steps: int = doc(
        5,
        "Skip an optimizer step whose gradient norm is NaN/Inf; abort when more than this many "
        "come in a row (0: abort at the first).",
    )
    dist_timeout_min: int = doc(
        60,
        "Minutes a collective may wait for the other ranks before the job fails (--async_train: "
        "also the longest either side waits for the other while it is alive).",
    )
    heartbeat_timeout_s: float = doc(
        120.0,
        "Multi-node jobs: end every rank, naming the lost one, when a rank on another node "
        "sends no heartbeat (or the job's store no answer) for this many seconds; 0: off. "
        "--async_train: also when a rank it waits for sends none.",
    )

    def __post_init__(self) -> None:
        if self.max_bad_steps < 0:
            raise ConfigError(f"max_bad_steps must be >= 0, got {self.max_bad_steps}")
        if self.dist_timeout_min < 1:
            raise ConfigError(f"dist_timeout_min must be >= 1, got {self.dist_timeout_min}")
        if self.heartbeat_timeout_s != 0 and not 1 <= self.heartbeat_timeout_s:
            raise ConfigError(
                f"heartbeat_timeout_s must be 0 (off) or >= 1, got {self.heartbeat_timeout_s}"
            )


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """Vision-language models (a checkpoint whose config has vision_config): where each row's
    images are and what trains. Ignored for text-only models (a row with images is refused)."""

    image_key: str = doc(
        "images",
        "Key of each row's images: a path, base64 string, data URI or http(s) URL, or a list "
        "of them, one per {'type': 'image'} item of the chat prompt, in order.",
    )
    max_images_per_prompt: int = doc(
        0,
        "Most images one row may have (vLLM's limit_mm_per_prompt); a row with more is "
        "refused. 0: the most any row of the data has.",
    )
    freeze_visual_encoder: bool = doc(
        False,
        "Train the language model only: the vision encoder and its projector stay frozen (in "
        "ppo the actor's and a vision-language critic's) and are not synced into vLLM.",
    )

    def __post_init__(self) -> None:
        if self.max_images_per_prompt < 0:
            raise ConfigError(
                f"max_images_per_prompt must be >= 0, got {self.max_images_per_prompt}"
            )


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters (peft) in place of full fine-tuning of the actor, critic or reward model:
    the base stays frozen, the optimizer holds only the adapters (and a scalar head)."""

    lora_rank: int = doc(0, "LoRA rank r (0: off, full fine-tuning).")
    lora_alpha: int = doc(16, "LoRA alpha; adapter outputs are scaled by alpha / r.")
    target_modules: tuple[str, ...] = doc(
        ("all-linear",), "Module names that get adapters (all-linear: every decoder Linear)."
    )
    lora_dropout: float = doc(0.0, "Dropout on the adapters' input.")
    merge_lora: bool = doc(
        False,
        "Also export the base with the adapters merged in as a plain HF model (save_path); "
        "the adapter folder is always written (save_path/adapter).",
    )

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 0, got {self.lora_rank}")
        if self.lora_alpha <= 0:
            raise ConfigError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.target_modules:
            raise ConfigError("target_modules needs at least one module name")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise ConfigError("target_modules: all-linear stands alone (it names every Linear)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0
