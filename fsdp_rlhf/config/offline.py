"""The config trees of the offline commands: `fsdp-rlhf train-rm`, `sft`, `dpo` and `kd`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from fsdp_rlhf.config.common import (
    BackendConfig,
    CheckpointConfig,
    FSDPConfig,
    GuardConfig,
    LoggingConfig,
    LoraConfig,
    OptimConfig,
    VisionConfig,
)
from fsdp_rlhf.config_base import ConfigError, command_config, doc, section

# ---------------------------------------------------------------- train-rm


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


# ---------------------------------------------------------------- kd


@dataclass(frozen=True, kw_only=True)
class KDModelConfig:
    """The student to train and its frozen teacher."""

    pretrain: str = doc("", "Student model folder to train (or hub name when online).")
    teacher_pretrain: str = doc(
        "",
        "Teacher model folder: frozen, FSDP2-sharded over the ranks; its tokenizer must equal "
        "the student's (OpenRLHF's --teacher_model).",
    )
    teacher_offload: bool = doc(False, "Keep the teacher in host memory between its forwards.")


@dataclass(frozen=True, kw_only=True)
class KDLossConfig:
    """Knowledge distillation on dataset responses (Hinton et al. 2015; OpenRLHF train_kd)."""

    kd_coef: float = doc(
        0.4,
        "Weight of KL(teacher || student) over the vocabulary: loss = (1 - kd_coef) x NLL + "
        "kd_coef x KL, each a mean over the learned tokens.",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.kd_coef <= 1.0:
            raise ConfigError(f"kd_coef must be in [0, 1], got {self.kd_coef}")


@command_config
@dataclass(frozen=True, kw_only=True)
class KDConfig:
    """`fsdp-rlhf kd`."""

    FLAT_NAMES: ClassVar[dict[str, str]] = OPTIM_FLAT_NAMES

    model: KDModelConfig = section(KDModelConfig)
    backend: BackendConfig = section(BackendConfig)
    fsdp: FSDPConfig = section(FSDPConfig)
    data: SFTDataConfig = section(SFTDataConfig)
    vision: VisionConfig = section(VisionConfig)
    batch: SFTBatchConfig = doc(
        help="Batch sizes (global = summed over all ranks).",
        factory=lambda: SFTBatchConfig(max_epochs=1),  # OpenRLHF train_kd's one epoch
    )
    optim: OptimConfig = doc(help="AdamW and schedule.", factory=lambda: OptimConfig(lr=5e-6))
    loss: KDLossConfig = section(KDLossConfig)
    ckpt: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    guard: GuardConfig = section(GuardConfig)
    lora: LoraConfig = section(LoraConfig)
    seed: int = doc(42, "Seed for data order, init and dropout.")
