"""Facts read from an HF model config the way transformers' own models read them, for every
layer that needs them (the memory model, the attention kernels, the vLLM adapter)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def head_dim(config: Any) -> int:
    """Per-head size of an HF text config (an object or config.json's dict), derived as
    transformers' models do: Qwen2/2.5 config.json files have no ``head_dim`` key, others have
    it set to null."""

    def get(key: str):
        return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

    value = get("head_dim")
    if value is not None:
        return int(value)
    return get("hidden_size") // get("num_attention_heads")


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_num_experts(config: Any) -> int:
    """Routed experts per MoE layer of an HF config (0: a dense model)."""
    text = _text(config)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(text, key, None)
        if value:
            return int(value)
    return 0


def has_linear_attention(config: Any) -> bool:
    """Whether an HF config has linear-attention (gated-delta-net) layers: Qwen3.5, Qwen3-Next."""
    return "linear_attention" in (getattr(_text(config), "layer_types", None) or [])
