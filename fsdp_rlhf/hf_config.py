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
