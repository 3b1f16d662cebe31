"""The config trees of every command, split by command; every name is re-exported here, so
``from fsdp_rlhf.config import PPOConfig`` is the one way to import them.

    common.py    the sections every command shares (backend, FSDP2 and sequence parallelism,
                 optimizer, checkpoints, logging, guards, vision inputs, LoRA)
    offline.py   `train-rm`, `sft`, `dpo` and `kd`
    ppo.py       `ppo` (rollout, algorithm, eval, multi-turn, MoE, asynchronous training)
    batches.py   batch plans: per-rank sizes derived from a batch config and the world, and the
                 checks that they divide

Flat flag names are the ones in AIAK-RLHF / OpenRLHF launch scripts (``--train_batch_size``), so
their scripts run unchanged. Each component receives only its own section. Derived sizes (gradient
accumulation, micro-batches per rank) come from the pure ``plan_*`` functions, never by editing a
config. The machinery (defaults < YAML < flags, strict checking) is :mod:`fsdp_rlhf.config_base`.
"""

from fsdp_rlhf.config.batches import (
    OfflineBatchPlan,
    PPOBatchPlan,
    async_rollout_ranks,
    plan_offline_batches,
    plan_ppo_batches,
)
from fsdp_rlhf.config.common import (
    FALSE_WORDS,
    BackendConfig,
    CheckpointConfig,
    FSDPConfig,
    GuardConfig,
    LoggingConfig,
    LoraConfig,
    OptimConfig,
    VisionConfig,
)
from fsdp_rlhf.config.offline import (
    OPTIM_FLAT_NAMES,
    DPOConfig,
    DPOLossConfig,
    DPOModelConfig,
    KDConfig,
    KDLossConfig,
    KDModelConfig,
    PairBatchConfig,
    PolicyModelConfig,
    PreferenceDataConfig,
    RMConfig,
    RMLossConfig,
    RMModelConfig,
    SFTBatchConfig,
    SFTConfig,
    SFTDataConfig,
)
from fsdp_rlhf.config.ppo import (
    GSPO_PAPER_CLIP,
    AsyncConfig,
    DistillConfig,
    MoEConfig,
    MultiTurnConfig,
    PlacementConfig,
    PPOAlgoConfig,
    PPOBatchConfig,
    PPOConfig,
    PPOEvalConfig,
    PPOModelsConfig,
    PromptDataConfig,
    RolloutConfig,
)
from fsdp_rlhf.config_base import ConfigError

__all__ = [
    "FALSE_WORDS",
    "GSPO_PAPER_CLIP",
    "OPTIM_FLAT_NAMES",
    "AsyncConfig",
    "BackendConfig",
    "CheckpointConfig",
    "ConfigError",
    "DPOConfig",
    "DPOLossConfig",
    "DPOModelConfig",
    "DistillConfig",
    "FSDPConfig",
    "GuardConfig",
    "KDConfig",
    "KDLossConfig",
    "KDModelConfig",
    "LoggingConfig",
    "LoraConfig",
    "MoEConfig",
    "MultiTurnConfig",
    "OfflineBatchPlan",
    "OptimConfig",
    "PPOAlgoConfig",
    "PPOBatchConfig",
    "PPOBatchPlan",
    "PPOConfig",
    "PPOEvalConfig",
    "PPOModelsConfig",
    "PairBatchConfig",
    "PlacementConfig",
    "PolicyModelConfig",
    "PreferenceDataConfig",
    "PromptDataConfig",
    "RMConfig",
    "RMLossConfig",
    "RMModelConfig",
    "RolloutConfig",
    "SFTBatchConfig",
    "SFTConfig",
    "SFTDataConfig",
    "VisionConfig",
    "async_rollout_ranks",
    "plan_offline_batches",
    "plan_ppo_batches",
]
