"""The config trees of `fsdp-rlhf train-rm` and `fsdp-rlhf ppo`.

Flat flag names are the ones in AIAK-RLHF / OpenRLHF launch scripts (``--train_batch_size``), so
their scripts run unchanged. Each component receives only its own section. Derived sizes (gradient
accumulation, micro-batches per rank) come from the pure ``plan_*`` functions, never by editing a
config.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from fsdp_rlhf.algorithms.names import (
    AdvantageEstimator,
    ISGating,
    LossAgg,
    correction_problem,
)
from fsdp_rlhf.config_base import ConfigError, command_config, doc, section

# ---------------------------------------------------------------- shared sections


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
    torch_compile: bool = doc(
        False, "torch.compile each decoder layer's norms, MLP and attention block (fused kernels)."
    )
    trust_remote_code: bool = doc(False, "Allow model code shipped inside checkpoint folders.")
    disable_fast_tokenizer: bool = doc(
        False, "Load the slow (Python) tokenizer instead of the Rust one."
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
    dataset_split: str = doc("train", "Split to read from sources that have several.")
    eval_dataset: str | None = doc(None, "Held-out sources (default: 1% of train).")
    eval_split: str = doc("test", "Split to read from eval sources that have several.")
    prompt_key: str | None = doc(None, "Key of the prompt; none: chosen/rejected are full texts.")
    chosen_key: str = doc("chosen", "Key of the preferred response.")
    rejected_key: str = doc("rejected", "Key of the dispreferred response.")
    margin_key: str | None = doc(None, "Key of a per-pair margin for the loss.")
    apply_chat_template: bool = doc(False, "Render message lists with the tokenizer's template.")
    input_template: str | None = doc(
        None, "Template for the prompt, e.g. 'Human: {}\\nAssistant: '."
    )
    tokenizer_chat_template: str | None = doc(
        None, "A Jinja chat template replacing the tokenizer's (saved with the model)."
    )
    max_len: int = doc(512, "Truncate each tokenized text to this many tokens.")
    max_samples: int = doc(100_000_000, "Use at most this many pairs.")

    def __post_init__(self) -> None:
        if self.max_len < 2:
            raise ConfigError(f"max_len must be >= 2, got {self.max_len}")


@dataclass(frozen=True, kw_only=True)
class PairBatchConfig:
    """Batch sizes (global = summed over all ranks)."""

    train_batch_size: int = doc(128, "Pairs per optimizer step, global.")
    micro_train_batch_size: int = doc(8, "Pairs per forward/backward on one rank.")
    max_epochs: int = doc(1, "Passes over the training data.")
    packing_samples: bool = doc(
        False, "Pack each micro-batch into one row without padding (attention per sequence)."
    )
    share_prompt_prefix: bool = doc(
        True,
        "With --packing_samples, run the prefix a pair's chosen and rejected sequences share "
        "(the prompt) once per pair (same scores and gradients, fewer tokens); not with "
        "flash-attn.",
    )


@dataclass(frozen=True, kw_only=True)
class RMLossConfig:
    """Bradley-Terry loss options."""

    loss: Literal["sigmoid", "logexp"] = doc("sigmoid", "-logsigmoid(c - r - m) or log(1+e^(r-c)).")
    center_rewards_coefficient: float = doc(0.0, "Weight of the (c + r)^2 centering penalty.")


# The seed's flat optimiser flags of the one-model commands (train-rm, sft, dpo).
OPTIM_FLAT_NAMES: dict[str, str] = {
    "learning_rate": "optim.lr",
    "max_norm": "optim.max_norm",
    "adam_betas": "optim.adam_betas",
}


@command_config
@dataclass(frozen=True, kw_only=True)
class RMConfig:
    """`fsdp-rlhf train-rm`."""

    FLAT_NAMES: ClassVar[dict[str, str]] = OPTIM_FLAT_NAMES

    model: RMModelConfig = section(RMModelConfig)
    backend: BackendConfig = section(BackendConfig)
    fsdp: FSDPConfig = section(FSDPConfig)
    data: PreferenceDataConfig = section(PreferenceDataConfig)
    vision: VisionConfig = section(VisionConfig)
    batch: PairBatchConfig = section(PairBatchConfig)
    optim: OptimConfig = section(OptimConfig)
    loss: RMLossConfig = section(RMLossConfig)
    ckpt: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    guard: GuardConfig = section(GuardConfig)
    lora: LoraConfig = section(LoraConfig)
    seed: int = doc(42, "Seed for data order, init and dropout.")


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
class PPOModelsConfig:
    """The four models and where rewards come from."""

    pretrain: str = doc("", "SFT model: initial actor and the reference model.")
    reward_pretrain: str | None = doc(None, "Reward model folder (HF sequence classification).")
    critic_pretrain: str | None = doc(None, "Critic init (default: the reward model).")
    value_head_prefix: str = doc("score", "Value-head name to look for in reward/critic folders.")
    remote_rm_url: str | None = doc(
        None, "Rule reward: a .py file with reward_func(queries, prompts, labels), or an HTTP URL."
    )
    remote_rm_auth_env: str | None = doc(
        None, "Name of an environment variable whose value is sent as 'Authorization: Bearer'."
    )
    normalize_reward: bool = doc(False, "Normalise scores by the mean/std in the RM's config.")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where models live. By default everything is colocated on every rank (--async_train
    gives the vLLM engines ranks of their own); the flags are kept for AIAK-RLHF's scripts."""

    colocate_all: bool = doc(
        True,
        "All models and the vLLM engine share every GPU (with --async_train: the training "
        "models share the training ranks).",
    )
    num_nodes: int | None = doc(
        None, "Expected nodes; checked against the torchrun world (--async_train: training ranks)."
    )
    num_gpus_per_node: int | None = doc(None, "Expected ranks per node; checked likewise.")
    ref_reward_offload: bool = doc(False, "Keep reference and reward models in host memory.")


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Asynchronous training (docs/async.md): rollout ranks generate the next batches while the
    training ranks train on the current one."""

    async_train: bool = doc(
        False,
        "Split the world: the last vllm_num_engines x vllm_tensor_parallel_size ranks hold only "
        "vLLM engines and generate while the other ranks hold the models and train.",
    )
    async_queue_size: int = doc(
        1,
        "With --async_train: the most weight versions a batch's tokens may lag behind the policy "
        "trained on them (1: one-step-off-policy).",
    )
    partial_rollout: bool = doc(
        False,
        "With --async_train: generations in flight when new weights arrive are paused, the "
        "weights loaded, and continue under them; each token keeps the version that sampled it "
        "and its log-prob.",
    )
    vllm_generate_batch_size: int | None = doc(
        None,
        "With --async_train: prompts generated per step, global; above rollout_batch_size the "
        "first rollout_batch_size groups to finish are kept and the stragglers dropped.",
    )

    def __post_init__(self) -> None:
        if self.async_queue_size < 1:
            raise ConfigError(f"async_queue_size must be >= 1, got {self.async_queue_size}")
        if self.vllm_generate_batch_size is not None and self.vllm_generate_batch_size < 1:
            raise ConfigError(
                f"vllm_generate_batch_size must be >= 1, got {self.vllm_generate_batch_size}"
            )


@dataclass(frozen=True, kw_only=True)
class PromptDataConfig:
    """Prompt data for rollouts."""

    prompt_data: str = doc(
        "", "Comma-separated sources: JSON/JSONL/parquet file, folder, hub name."
    )
    prompt_data_probs: str = doc("1.0", "Comma-separated mixing probabilities, one per source.")
    prompt_split: str = doc("train", "Split to read from sources that have several.")
    input_key: str = doc("input", "Key of the prompt (string or chat-message list).")
    label_key: str | None = doc(None, "Key of a label passed to the rule reward.")
    input_template: str | None = doc(
        "Human: {}\nAssistant: ", "Template for raw prompts when no chat template is applied."
    )
    apply_chat_template: bool = doc(False, "Render prompts with the tokenizer's chat template.")
    prompt_max_len: int = doc(
        1024, "Prompts longer than this (tokens) are truncated from the left."
    )
    max_samples: int = doc(100_000, "Use at most this many prompts.")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Generation: engine, sampling, vLLM layout."""

    rollout_engine: Literal["vllm", "hf"] = doc("vllm", "vllm (default) or HF generate.")
    lora_sync: Literal["adapter", "merged"] = doc(
        "adapter",
        "With --lora_rank: adapter (vLLM serves the adapters, only they are synced) or merged "
        "(each adapted weight synced as W + (alpha/r) B A, like full fine-tuning: more bytes, "
        "base-model decode speed where vLLM's LoRA kernels are slow, as on CPU).",
    )
    weight_sync: Literal["auto", "delta", "full"] = doc(
        "auto",
        "How the actor's weights reach the engines: delta (after a first full sync, each rank "
        "sends only the elements that changed, checked by checksum; the engine side keeps a "
        "copy of the synced weights in host memory), full (every weight every time), or auto "
        "(delta when the job spans hosts, but colocated on CUDA and with LoRA; "
        "docs/weight_sync.md).",
    )
    weight_sync_full_every: int = doc(
        0, "With delta sync: every N-th sync is a full one (0: only the first after a start)."
    )
    weight_sync_overlap: bool = doc(
        True, "Gather the next weight bucket while the engine loads the current one."
    )
    vllm_num_engines: int | None = doc(None, "Engines = world / TP (checked when given).")
    vllm_tensor_parallel_size: int = doc(1, "TP size of each engine (contiguous ranks).")
    vllm_gpu_memory_utilization: float | None = doc(
        None,
        "Fraction of the whole GPU vLLM's pool takes at start-up and again at every wake, beside "
        "the resident shards (unset: the largest that the memory plan fits, at most 0.9; a value "
        "that does not fit is refused before the models load).",
    )
    vllm_enable_sleep: bool = doc(True, "Release vLLM memory between rollouts (GPU only).")
    # 2 by default: the actor's weights are streamed into the engine before every rollout, so
    # level 1's copy to host memory and back would be thrown away.
    vllm_sleep_level: int = doc(
        2, "2: discard weights while asleep (re-synced every step); 1: offload them to CPU."
    )
    vllm_kvcache_space_gib: float = doc(0.0, "CPU only: KV cache size (0: sized from the config).")
    enforce_eager: bool = doc(False, "Disable CUDA graphs in vLLM.")
    generate_max_len: int = doc(1024, "Max new tokens per response.")
    max_len: int | None = doc(
        None,
        "Tokens per sequence, prompt + response (OpenRLHF's --max_len): each response may use "
        "max_len minus its prompt's length, at most generate_max_len (none: generate_max_len).",
    )
    temperature: float = doc(1.0, "Sampling temperature.")
    top_p: float = doc(1.0, "Nucleus sampling.")
    top_k: int = doc(-1, "Top-k sampling (-1: off).")
    micro_rollout_batch_size: int = doc(8, "Sequences per forward in the scoring phases, per rank.")

    def __post_init__(self) -> None:
        if self.vllm_sleep_level not in (1, 2):
            raise ConfigError(f"vllm_sleep_level must be 1 or 2, got {self.vllm_sleep_level}")
        util = self.vllm_gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ConfigError(f"vllm_gpu_memory_utilization must be in (0, 1], got {util}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.max_len is not None and self.max_len < 2:
            raise ConfigError(f"max_len must be >= 2, got {self.max_len}")
        if self.weight_sync_full_every < 0:
            raise ConfigError(
                f"weight_sync_full_every must be >= 0, got {self.weight_sync_full_every}"
            )


@dataclass(frozen=True, kw_only=True)
class PPOBatchConfig:
    """Batch sizes; 'global' means summed over all ranks."""

    rollout_batch_size: int = doc(512, "Prompts per step, global.")
    n_samples_per_prompt: int = doc(1, "Responses sampled per prompt.")
    train_batch_size: int = doc(128, "Sequences per optimizer step, global.")
    micro_train_batch_size: int = doc(8, "Sequences per forward/backward on one rank.")
    max_epochs: int = doc(1, "Passes over the prompt data.")
    num_episodes: int = doc(1, "Repeat the whole schedule this many times.")
    max_steps: int = doc(-1, "Stop after this many steps (-1: run the data out).")
    packing_samples: bool = doc(
        False,
        "Pack each micro-batch into one row without padding for every training-side forward "
        "(attention per sequence).",
    )
    share_prompt_prefix: bool = doc(
        True,
        "With n_samples_per_prompt > 1, run each prompt through the actor and reference once for "
        "its samples in a micro-batch (same log-probs and gradients, fewer tokens). Not with "
        "--packing_samples or flash-attn; the log says when it is off.",
    )
    use_dynamic_batch: bool = doc(
        False,
        "Form micro-batches by token count instead of row count: each rank's rows sorted by "
        "length and bin-packed into micro-batches of at most --train_max_tokens_per_gpu "
        "(updates) / --rollout_max_tokens_per_gpu (no-grad forwards) tokens, each cut to its "
        "own longest row; --micro_train_batch_size / --micro_rollout_batch_size then do not "
        "apply. Same loss and gradients.",
    )
    train_max_tokens_per_gpu: int = doc(
        16192,
        "With --use_dynamic_batch: tokens per micro-batch of the updates on one rank (padded: "
        "rows x the longest; with --packing_samples: their sum); with --sequence_parallel_size "
        "N a micro-batch holds N times this, 1/N on each rank of its group.",
    )
    rollout_max_tokens_per_gpu: int | None = doc(
        None,
        "With --use_dynamic_batch: tokens per micro-batch of the no-grad forwards (old and "
        "reference log-probs, values, rewards); default --train_max_tokens_per_gpu.",
    )

    def __post_init__(self) -> None:
        for name in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")

    @property
    def scoring_max_tokens(self) -> int | None:
        """The no-grad forwards' token budget (None: fixed-size micro-batches)."""
        if not self.use_dynamic_batch:
            return None
        return self.rollout_max_tokens_per_gpu or self.train_max_tokens_per_gpu


GSPO_PAPER_CLIP = (3e-4, 4e-4)


def _pair(value: tuple[float, ...], name: str, *, ordered: bool = False) -> tuple[float, float]:
    if len(value) != 2:
        raise ConfigError(f"{name} needs 2 values (LOW HIGH), got {list(value)}")
    low, high = value
    if ordered and not low < high:
        raise ConfigError(f"{name} needs LOW < HIGH, got {list(value)}")
    return low, high


@dataclass(frozen=True, kw_only=True)
class PPOAlgoConfig:
    """PPO objective, advantages and KL."""

    advantage_estimator: AdvantageEstimator = doc(
        "gae",
        "gae needs a critic; the others are critic-free. reinforce_plus_plus_baseline (verl's "
        "name; reinforce_baseline is OpenRLHF's for the same): group-mean baseline, then "
        "REINFORCE++ batch whitening. flash_reinforce: score minus the rollout batch's mean "
        "score, no groups, no whitening (for n_samples_per_prompt 1).",
    )
    gamma: float = doc(1.0, "Discount factor.")
    advantage_std_norm: bool = doc(
        True,
        "Divide batch-whitened advantages (gae, reinforce++, reinforce_plus_plus_baseline) by "
        "their std; --no_advantage_std_norm only subtracts the mean.",
    )
    lam: float = doc(0.95, "GAE lambda.")
    eps_clip: float = doc(0.2, "Policy ratio clip (lower side).")
    eps_clip_high: float | None = doc(None, "Upper-side clip (default: eps_clip).")
    eps_clip_low_high: tuple[float, ...] = doc(
        (),
        "OpenRLHF's two-value form LOW HIGH (DAPO clip-higher, e.g. 0.2 0.28): sets eps_clip "
        "and eps_clip_high, overriding both.",
    )
    policy_loss_type: Literal["ppo", "gspo"] = doc(
        "ppo",
        "ppo: token-level ratio; gspo: sequence-level ratio (geometric mean of token ratios, "
        "GSPO), aggregated per sequence (seq-mean-token-mean).",
    )
    gspo_eps_clip_low_high: tuple[float, ...] = doc(
        (),
        "GSPO's clip range LOW HIGH on the sequence ratio (default: --eps_clip_low_high when "
        "given, else the paper's 3e-4 4e-4).",
    )
    value_clip: float = doc(0.2, "Value clip around old values (<= 0 disables).")
    dual_clip: float | None = doc(None, "Dual-clip constant c > 1 for negative advantages.")
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = doc("k1", "KL estimator (Schulman).")
    use_kl_loss: bool = doc(False, "KL in the actor loss instead of in the reward.")
    kl_unbiased_gradient: bool = doc(
        False,
        "With --use_kl_loss: keep the estimator's value but take the importance-weighted "
        "gradient of KL(policy || ref), min(pi/pi_old, 10) x log-ratio, the same for k1/k2/k3.",
    )
    init_kl_coef: float = doc(0.02, "KL coefficient (initial value when kl_target is set).")
    kl_target: float | None = doc(None, "Adaptive KL controller target (Ziegler et al.).")
    kl_horizon: int = doc(10000, "Adaptive KL controller horizon.")
    entropy_loss_coef: float = doc(0.0, "Entropy bonus weight.")
    reward_clip_range: float = doc(10.0, "Clip scores to [-x, x].")
    ppo_epochs: int = doc(1, "Passes over each rollout batch.")
    freezing_actor_steps: int = doc(-1, "Train only the critic for the first N steps.")
    loss_agg_mode: LossAgg = doc(
        "token-mean",
        "How per-token losses are averaged (global over ranks): token-mean; "
        "seq-mean-token-mean; seq-mean-token-sum; seq-mean-token-sum-norm (Dr. GRPO: token "
        "sums / generate_max_len, mean over sequences).",
    )
    is_correction: Literal[
        "none", "tis", "icepop", "seq_mask", "seq_mask_tis", "seq-mask", "seq-mask-tis"
    ] = doc(
        "none",
        "Rollout/trainer log-prob mismatch correction with ratio pi_old/pi_rollout: tis "
        "(weights clamped to [LOW, HIGH]), icepop (tokens outside [LOW, HIGH] get weight 0), "
        "seq_mask (rows whose geometric-mean ratio is outside [LOW, HIGH] get weight 0, others "
        "keep the ratio: OpenRLHF's seq-mask-tis), seq_mask_tis (the same rows rejected, others "
        "tis: verl's).",
    )
    is_correction_gating: ISGating = doc(
        "ratio",
        "What icepop and seq_mask compare with the thresholds: the ratio, or the sampled "
        "token's binary_kl or tv divergence between the two policies (a trust region: give "
        "one threshold, the upper bound).",
    )
    is_truncated_threshold: tuple[float, ...] = doc(
        (0.5, 5.0),
        "LOW HIGH thresholds of --is_correction, or one value HIGH (LOW 0).",
    )
    use_rollout_logprobs_as_old: bool = doc(
        False,
        "Bypass mode: the rollout engine's log-probs serve as the old log-probs (no trainer "
        "recomputation; the PPO ratio then corrects the mismatch itself).",
    )
    dynamic_filtering: bool = doc(
        False,
        "DAPO dynamic sampling: drop prompt groups whose scores are all equal (or, with "
        "--dynamic_filtering_reward_range, whose mean is outside it) and sample more.",
    )
    dynamic_filtering_reward_range: tuple[float, ...] = doc(
        (),
        "LOW HIGH: keep groups with LOW < mean score < HIGH (OpenRLHF's rule); empty: keep "
        "groups whose scores are not all equal (DAPO/verl's rule).",
    )
    max_num_gen_batches: int = doc(
        0,
        "Dynamic filtering: give up after this many generation rounds in one step and fill "
        "the batch with dropped groups (verl's name; 0: until full, capped at 32 rounds).",
    )
    overlong_buffer_len: int | None = doc(
        None,
        "DAPO overlong shaping: penalise responses longer than generate_max_len - this, "
        "linearly up to -overlong_penalty_factor at generate_max_len (none: off).",
    )
    overlong_penalty_factor: float = doc(1.0, "Largest overlong penalty (DAPO).")
    stop_properly_penalty_coef: float | None = doc(
        None,
        "ProRL: scores of responses cut by generate_max_len (no EOS): in [0, 1] they are "
        "multiplied by it, below 0 they are replaced by it (none: off).",
    )
    enable_ema: bool = doc(
        False,
        "Keep an exponential moving average of the actor's weights (updated after every actor "
        "optimizer step, checkpointed); it is the model exported to save_path.",
    )
    ema_beta: float = doc(0.992, "EMA decay: ema = beta * ema + (1 - beta) * actor.")

    def _set(self, **values) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)  # normalising a frozen dataclass at init

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"lambd must be in [0, 1], got {self.lam}")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"dual_clip must be > 1, got {self.dual_clip}")
        self._check_clips()
        self._check_is_correction()
        if self.dynamic_filtering_reward_range:
            _pair(
                self.dynamic_filtering_reward_range, "dynamic_filtering_reward_range", ordered=True
            )
        if self.max_num_gen_batches < 0:
            raise ConfigError(f"max_num_gen_batches must be >= 0, got {self.max_num_gen_batches}")
        if self.overlong_buffer_len is not None and self.overlong_buffer_len <= 0:
            raise ConfigError(f"overlong_buffer_len must be > 0, got {self.overlong_buffer_len}")
        if self.overlong_penalty_factor < 0:
            raise ConfigError(
                f"overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}"
            )
        coef = self.stop_properly_penalty_coef
        if coef is not None and coef > 1:
            raise ConfigError(
                f"stop_properly_penalty_coef must be in [0, 1] (a factor) or < 0 (a fixed "
                f"score), got {coef}"
            )
        if not 0.0 <= self.ema_beta < 1.0:
            raise ConfigError(f"ema_beta must be in [0, 1), got {self.ema_beta}")

    def _check_clips(self) -> None:
        if self.eps_clip_low_high:
            low, high = _pair(self.eps_clip_low_high, "eps_clip_low_high")
            self._set(eps_clip=low, eps_clip_high=high)
        if self.eps_clip < 0 or (self.eps_clip_high is not None and self.eps_clip_high < 0):
            raise ConfigError(
                f"eps_clip values must be >= 0, got {self.eps_clip}, {self.eps_clip_high}"
            )
        gspo = self.gspo_eps_clip_low_high or self.eps_clip_low_high or GSPO_PAPER_CLIP
        low, high = _pair(tuple(gspo), "gspo_eps_clip_low_high")
        if low < 0 or high < 0:
            raise ConfigError(f"gspo_eps_clip_low_high must be >= 0, got {[low, high]}")
        self._set(gspo_eps_clip_low_high=(low, high))

    def _check_is_correction(self) -> None:
        mode = self.is_correction.replace("-", "_")
        threshold = tuple(self.is_truncated_threshold)
        if len(threshold) == 1:  # an upper bound only (OpenRLHF 0.11.2's one-value form)
            threshold = (0.0, threshold[0])
        low, high = _pair(threshold, "is_truncated_threshold", ordered=True)
        if low < 0:
            raise ConfigError(f"is_truncated_threshold LOW must be >= 0, got {low}")
        if self.use_rollout_logprobs_as_old and mode != "none":
            raise ConfigError(
                f"--use_rollout_logprobs_as_old makes the PPO ratio correct the mismatch; "
                f"--is_correction {mode} would need the trainer's own old log-probs"
            )
        gating = self.is_correction_gating
        if mode == "none" and gating != "ratio":
            raise ConfigError(
                f"--is_correction_gating {gating} chooses what --is_correction icepop or "
                "seq_mask compares with the thresholds: add one of them"
            )
        problem = correction_problem(mode, low, high, gating)
        if problem is not None:
            raise ConfigError(
                f"--is_correction {mode} --is_correction_gating {gating} "
                f"--is_truncated_threshold {low:g} {high:g}: {problem}"
            )
        self._set(is_correction=mode, is_truncated_threshold=(low, high))


@dataclass(frozen=True, kw_only=True)
class PPOEvalConfig:
    """Evaluation on held-out prompts every --eval_steps (pass@1 / pass@k)."""

    eval_dataset: str | None = doc(
        None, "Held-out prompt sources, same format as prompt_data (none: no evaluation)."
    )
    eval_split: str = doc("train", "Split to read from eval sources that have several.")
    eval_n_samples_per_prompt: int = doc(4, "Responses sampled per eval prompt (n of pass@k).")
    eval_temperature: float = doc(0.6, "Sampling temperature for evaluation.")
    save_best_metric: str | None = doc(
        None,
        "Keep a copy of the model with the best value of this eval metric: pass@1 or pass@K "
        "with K <= eval_n_samples_per_prompt (none: off).",
    )

    def __post_init__(self) -> None:
        if self.eval_n_samples_per_prompt < 1:
            raise ConfigError(
                f"eval_n_samples_per_prompt must be >= 1, got {self.eval_n_samples_per_prompt}"
            )
        if self.eval_temperature < 0:
            raise ConfigError(f"eval_temperature must be >= 0, got {self.eval_temperature}")
        if self.save_best_metric is None:
            return
        match = re.fullmatch(r"(?:eval/)?pass@(\d+)", self.save_best_metric)
        if match is None or not 1 <= int(match[1]) <= self.eval_n_samples_per_prompt:
            raise ConfigError(
                f"save_best_metric must be pass@K with 1 <= K <= eval_n_samples_per_prompt "
                f"({self.eval_n_samples_per_prompt}), got {self.save_best_metric!r}"
            )


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """Multi-turn rollouts against a Python environment (``--env_file``); off without it."""

    env_file: str | None = doc(
        None,
        "A .py file with reset(prompt, label) and step(history, action) -> (observation, "
        "reward, done), or only reward_func(queries, prompts, labels) for one turn. Its "
        "rewards are the scores (replaces --reward_pretrain / --remote_rm_url).",
    )
    agent_func_path: str | None = doc(
        None,
        "An OpenRLHF agent file (AgentInstance with async reset/step, AgentExecutor = "
        "MultiTurnAgentExecutor(AgentInstance)), run unchanged as the environment; instead of "
        "--env_file.",
    )
    max_turns: int = doc(
        4, "Model turns per trajectory at most (with --env_file or --agent_func_path)."
    )
    max_total_len: int | None = doc(
        None,
        "Prompt + every model and environment turn, in tokens (none: prompt_max_len + "
        "max_turns * generate_max_len).",
    )
    env_timeout_s: float = doc(
        30.0, "Per reset/step call; a call over it ends its trajectory as a tool error."
    )

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_len is not None and self.max_total_len < 1:
            raise ConfigError(f"max_total_len must be >= 1, got {self.max_total_len}")
        if self.env_timeout_s <= 0:
            raise ConfigError(f"env_timeout_s must be > 0, got {self.env_timeout_s}")

    @property
    def source(self) -> tuple[str, str] | None:
        """``(flag, path)`` of the environment, or None for single-turn rollouts."""
        if self.env_file is not None:
            return "--env_file", self.env_file
        if self.agent_func_path is not None:
            return "--agent_func_path", self.agent_func_path
        return None


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-experts actors (docs/models.md#mixture-of-experts)."""

    router_replay: bool = doc(
        False,
        "Router replay (R3): the actor's training forwards route each token to the experts "
        "the rollout engine chose; the reference and the critic route for themselves.",
    )
    aux_loss_coef: float = doc(
        0.0, "Weight of the load-balancing loss (Switch Transformer's) in the actor loss."
    )

    def __post_init__(self) -> None:
        if self.aux_loss_coef < 0:
            raise ConfigError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


@command_config
@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """`fsdp-rlhf ppo`."""

    FLAT_NAMES: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "actor_learning_rate": "actor_optim.lr",
        "critic_learning_rate": "critic_optim.lr",
        "max_norm": ("actor_optim.max_norm", "critic_optim.max_norm"),
        "lr_warmup_ratio": ("actor_optim.lr_warmup_ratio", "critic_optim.lr_warmup_ratio"),
        "lr_scheduler": ("actor_optim.lr_scheduler", "critic_optim.lr_scheduler"),
        "adam_betas": ("actor_optim.adam_betas", "critic_optim.adam_betas"),
        "l2": ("actor_optim.l2", "critic_optim.l2"),
        "min_lr_ratio": ("actor_optim.min_lr_ratio", "critic_optim.min_lr_ratio"),
        "adam_eps": ("actor_optim.adam_eps", "critic_optim.adam_eps"),
        "lambd": "algo.lam",  # OpenRLHF's and AIAK's name (lambda is a Python keyword)
    }

    models: PPOModelsConfig = section(PPOModelsConfig)
    placement: PlacementConfig = section(PlacementConfig)
    asynchronous: AsyncConfig = section(AsyncConfig)
    backend: BackendConfig = section(BackendConfig)
    fsdp: FSDPConfig = section(FSDPConfig)
    data: PromptDataConfig = section(PromptDataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    batch: PPOBatchConfig = section(PPOBatchConfig)
    algo: PPOAlgoConfig = section(PPOAlgoConfig)
    eval: PPOEvalConfig = section(PPOEvalConfig)
    multiturn: MultiTurnConfig = section(MultiTurnConfig)
    moe: MoEConfig = section(MoEConfig)
    vision: VisionConfig = section(VisionConfig)
    actor_optim: OptimConfig = doc(help="Actor optimizer.", factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = doc(help="Critic optimizer.", factory=lambda: OptimConfig(lr=9e-6))
    ckpt: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    guard: GuardConfig = section(GuardConfig)
    lora: LoraConfig = section(LoraConfig)
    sample_log_steps: int = doc(10, "Every N steps log a few prompt/response/reward samples.")
    seed: int = doc(42, "Seed for data order, init and sampling.")

    def __post_init__(self) -> None:
        max_len = self.rollout.max_len
        if max_len is not None and self.data.prompt_max_len >= max_len:
            raise ConfigError(
                f"prompt_max_len ({self.data.prompt_max_len}) must be < max_len ({max_len}): "
                "max_len counts the prompt and its response"
            )
        buffer = self.algo.overlong_buffer_len
        if buffer is not None and buffer > self.rollout.generate_max_len:
            raise ConfigError(
                f"overlong_buffer_len ({buffer}) must be <= generate_max_len "
                f"({self.rollout.generate_max_len})"
            )
        # feature combinations that are refused are rows of the rules table (fsdp_rlhf.rules)
        mt = self.multiturn
        shortest = self.data.prompt_max_len + self.rollout.generate_max_len
        if mt.source is not None and mt.max_total_len is not None and mt.max_total_len < shortest:
            raise ConfigError(
                f"max_total_len ({mt.max_total_len}) must be >= prompt_max_len + "
                f"generate_max_len ({shortest}): the first turn must fit"
            )

    def weight_sync_mode(self, device_type: str, hosts: int = 1) -> str:
        """``"delta"`` or ``"full"``: how the actor's weights reach the engines on a job
        whose devices are ``device_type``, over ``hosts`` hosts (``--weight_sync``; LoRA's
        adapter sync moves only the adapters either way).

        Delta sync saves bytes on the wire and costs memory passes on both ends, so ``auto``
        uses it where the wire is a network: a job over several hosts. Not on one host (the
        gathers and the transfer to rollout ranks go through shared memory or NVLink:
        measured slower with delta on CPU, benchmarks/2026-11-27-weight-sync.md), not with
        LoRA (the adapters, or the merged weights, move whole) or the HF engine (itself a
        full copy), and not colocated on CUDA, where the engine side's copy lives in host
        memory and would cross PCIe into the engine at every sync (docs/weight_sync.md).
        """
        r = self.rollout
        if r.weight_sync != "auto":
            return r.weight_sync
        if self.lora.enabled or r.rollout_engine == "hf" or hosts < 2:
            return "full"
        if device_type == "cuda" and not self.asynchronous.async_train:
            return "full"
        return "delta"

    @property
    def total_len(self) -> int:
        """Token budget of one trajectory: prompt + all model and environment turns."""
        mt, r = self.multiturn, self.rollout
        if mt.source is None:
            longest = self.data.prompt_max_len + r.generate_max_len
            return longest if r.max_len is None else min(longest, r.max_len)
        if mt.max_total_len is not None:
            return mt.max_total_len
        return self.data.prompt_max_len + mt.max_turns * r.generate_max_len


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


# ---------------------------------------------------------------- sft and dpo


@dataclass(frozen=True, kw_only=True)
class PolicyModelConfig:
    """The causal LM to fine-tune."""

    pretrain: str = doc("", "Model folder to fine-tune (or hub name when online).")


@dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
    """Supervised data: prompt + response rows, chat conversations, or raw text."""

    dataset: str = doc("", "Comma-separated sources: JSON/JSONL/parquet file, folder, or hub name.")
    dataset_probs: str = doc("1.0", "Comma-separated mixing probabilities, one per source.")
    dataset_split: str = doc("train", "Split to read from sources that have several.")
    eval_dataset: str | None = doc(None, "Held-out sources for eval loss (none: no evaluation).")
    eval_split: str = doc("test", "Split to read from eval sources that have several.")
    input_key: str = doc(
        "input", "Key of the prompt (string or chat-message list; the whole text in pretrain mode)."
    )
    output_key: str | None = doc(
        None,
        "Key of the response (string or message list); none: input_key holds a conversation "
        "whose last message is the response (all assistant turns with --multiturn).",
    )
    input_template: str | None = doc(
        "User: {}\nAssistant: ",
        "Template for string prompts without --apply_chat_template (not in pretrain mode).",
    )
    apply_chat_template: bool = doc(False, "Render messages with the tokenizer's chat template.")
    tokenizer_chat_template: str | None = doc(
        None, "A Jinja chat template replacing the tokenizer's (saved with the model)."
    )
    multiturn: bool = doc(
        False, "input_key holds whole conversations: loss on every assistant turn."
    )
    pretrain_mode: bool = doc(
        False, "Loss on every token (continued pretraining), not on the responses only."
    )
    max_len: int = doc(2048, "Truncate each tokenized sample to this many tokens (from the right).")
    max_samples: int = doc(1_000_000, "Use at most this many rows.")

    def __post_init__(self) -> None:
        if self.max_len < 2:
            raise ConfigError(f"max_len must be >= 2, got {self.max_len}")


@dataclass(frozen=True, kw_only=True)
class SFTBatchConfig:
    """Batch sizes (global = summed over all ranks)."""

    train_batch_size: int = doc(128, "Samples per optimizer step, global.")
    micro_train_batch_size: int = doc(8, "Samples per forward/backward on one rank.")
    max_epochs: int = doc(2, "Passes over the training data.")
    packing_samples: bool = doc(
        True,
        "Pack each micro-batch into one row without padding (attention per sequence); "
        "--no_packing_samples pads instead.",
    )


@command_config
@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """`fsdp-rlhf sft`."""

    FLAT_NAMES: ClassVar[dict[str, str]] = OPTIM_FLAT_NAMES

    model: PolicyModelConfig = section(PolicyModelConfig)
    backend: BackendConfig = section(BackendConfig)
    fsdp: FSDPConfig = section(FSDPConfig)
    data: SFTDataConfig = section(SFTDataConfig)
    vision: VisionConfig = section(VisionConfig)
    batch: SFTBatchConfig = section(SFTBatchConfig)
    optim: OptimConfig = doc(help="AdamW and schedule.", factory=lambda: OptimConfig(lr=5e-6))
    ckpt: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    guard: GuardConfig = section(GuardConfig)
    lora: LoraConfig = section(LoraConfig)
    seed: int = doc(42, "Seed for data order, init and dropout.")


@dataclass(frozen=True, kw_only=True)
class DPOModelConfig:
    """The policy to train and its frozen reference."""

    pretrain: str = doc("", "SFT model to train (or hub name when online).")
    ref_pretrain: str | None = doc(
        None,
        "Reference model (none: the --pretrain weights; with --lora_rank the actor with its "
        "adapters disabled, no second copy).",
    )
    ref_offload: bool = doc(False, "Keep the reference model in host memory between forwards.")


@dataclass(frozen=True, kw_only=True)
class DPOLossConfig:
    """DPO (Rafailov et al. 2023), IPO (Azar et al. 2023), cDPO label smoothing, NLL term."""

    beta: float = doc(0.1, "Inverse temperature of the implicit reward beta * log(pi / pi_ref).")
    ipo: bool = doc(False, "IPO's squared loss (logits - 1/(2 beta))^2 instead of DPO's.")
    label_smoothing: float = doc(
        0.0, "cDPO: probability that a pair's preference label is flipped (0: plain DPO)."
    )
    nll_loss_coef: float = doc(
        0.0, "Weight of the chosen responses' per-token NLL added to the loss (Llama 3.1)."
    )

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.nll_loss_coef < 0:
            raise ConfigError(f"nll_loss_coef must be >= 0, got {self.nll_loss_coef}")


@command_config
@dataclass(frozen=True, kw_only=True)
class DPOConfig:
    """`fsdp-rlhf dpo`."""

    FLAT_NAMES: ClassVar[dict[str, str]] = OPTIM_FLAT_NAMES

    model: DPOModelConfig = section(DPOModelConfig)
    backend: BackendConfig = section(BackendConfig)
    fsdp: FSDPConfig = section(FSDPConfig)
    data: PreferenceDataConfig = section(PreferenceDataConfig)
    vision: VisionConfig = section(VisionConfig)
    batch: PairBatchConfig = doc(
        help="Batch sizes (global = summed over all ranks).",
        factory=lambda: PairBatchConfig(packing_samples=True),
    )
    optim: OptimConfig = section(OptimConfig)
    loss: DPOLossConfig = section(DPOLossConfig)
    ckpt: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    guard: GuardConfig = section(GuardConfig)
    lora: LoraConfig = section(LoraConfig)
    seed: int = doc(42, "Seed for data order, init and dropout.")

    def __post_init__(self) -> None:
        if self.data.margin_key is not None:
            raise ConfigError("--margin_key is train-rm's; DPO pairs carry no margin")
