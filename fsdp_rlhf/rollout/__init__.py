"""Rollout generation: the engine contract, HF and vLLM engines, TP groups and weight sync.

The ``vllm`` subpackage is not imported here: importing vLLM takes seconds and it must only
happen when the vLLM engine is used (``from fsdp_rlhf.rollout.vllm.engine import VLLMEngine``).
"""

from .engine import AdapterSpec, RolloutEngine, RolloutOutput, SamplingConfig
from .groups import RolloutGroups, build_rollout_groups
from .hf_engine import HFEngine
from .weight_sync import SyncStats, stream_actor_weights, sync_adapter, sync_weights

__all__ = [
    "AdapterSpec",
    "HFEngine",
    "RolloutEngine",
    "RolloutGroups",
    "RolloutOutput",
    "SamplingConfig",
    "SyncStats",
    "build_rollout_groups",
    "stream_actor_weights",
    "sync_adapter",
    "sync_weights",
]
