"""What kind of model a checkpoint is, read once from its config without loading weights.

A run reads the kind of every model it loads in ``prepare`` (:func:`read_model_kinds`), checks
the rules table (``fsdp_rlhf.rules``) against it before anything loads, and carries it to what
needs it: whether the actor is a vision-language model (and its special tokens), dense or MoE
(and which router class its MoE layers use), hybrid (recurrent layers: Qwen3.5's gated delta
nets, Nemotron-H's Mamba2, LFM2's short convolutions), and its attention heads (per layer
where they differ: Gemma 4's global layers). Nothing downstream re-reads the config from disk
to ask.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_rlhf.errors import reading
from fsdp_rlhf.hf_config import (
    GATED_DELTA_NET,
    attention_layers,
    config_num_experts,
    has_recurrent_layers,
    recurrent_kinds,
)
from fsdp_rlhf.models.load import check_model_path, quiet_transformers
from fsdp_rlhf.models.vision import VisionTokens, is_vision_config


@dataclass(frozen=True)
class ModelKind:
    """One checkpoint's kind (see the module docstring).

    Attributes:
        path: the model folder (or hub name) as the user passed it.
        architecture: its ``architectures`` (or model type), for messages.
        heads, kv_heads: the text model's query and key/value attention heads (its top
            config's).
        attention: the distinct (heads, kv_heads) of its attention layers, read per layer
            (Gemma 4's global layers have their own; empty: ``heads, kv_heads`` everywhere).
        experts: routed experts per MoE layer (0: dense).
        router: the class name of its MoE routers (None: dense, or none found).
        linear_attention: it has recurrent layers of any kind (gated delta nets, Mamba2,
            short convolutions): a hybrid model.
        gated_delta_net: some of them are gated delta nets (Qwen3.5, Qwen3-Next).
        split_heads: the value heads of its recurrent layers when sequence parallelism can
            split them by heads (all of them Qwen3.5's gated delta nets,
            ``models.linear_attention``); 0 otherwise.
        vision: a vision-language model's special tokens (None: text-only).
        patches: a vision-language model's image patching (``vision_config``'s patch,
            temporal patch and spatial merge sizes and input channels; None: text-only).
    """

    path: str
    architecture: str
    heads: int
    kv_heads: int
    experts: int = 0
    router: str | None = None
    attention: tuple[tuple[int, int], ...] = ()
    linear_attention: bool = False
    gated_delta_net: bool = False
    split_heads: int = 0
    vision: VisionTokens | None = None
    patches: tuple[tuple[str, Any], ...] | None = None

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def is_vlm(self) -> bool:
        return self.vision is not None

    @property
    def label(self) -> str:
        """``dense``, ``MoE``, ``hybrid MoE VLM``...: what the rules table's rows name."""
        words = [w for w, on in (("hybrid", self.linear_attention), ("MoE", self.moe)) if on]
        words = words or ["dense"]
        return " ".join([*words, "VLM"] if self.is_vlm else words)


def kind_from_config(path: str, config: Any, trust_remote_code: bool = False) -> ModelKind:
    """The kind of ``config`` (an HF config object), the MoE router found on a meta-device
    build of the model (no storage, nothing read)."""
    # per layer: a heterogeneous config (Gemma 4) raises where its heads are read from the top
    layers = attention_layers(config)
    if layers:
        heads, kv_heads = layers[0].heads, layers[0].kv_heads
    else:  # no attention layer at all
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    experts = config_num_experts(config)
    recurrent = has_recurrent_layers(config)
    kinds = recurrent_kinds(config, trust_remote_code) if recurrent else set()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    split = kinds == {GATED_DELTA_NET} and text.model_type in SPLIT_BY_HEADS
    return ModelKind(
        path=path,
        architecture=",".join(getattr(config, "architectures", None) or [config.model_type]),
        heads=heads,
        kv_heads=kv_heads,
        experts=experts,
        router=_router_class(config, trust_remote_code) if experts else None,
        attention=tuple(sorted({(a.heads, a.kv_heads) for a in layers})),
        linear_attention=recurrent,
        gated_delta_net=GATED_DELTA_NET in kinds,
        split_heads=int(text.linear_num_value_heads) if split else 0,
        vision=VisionTokens.from_config(config) if is_vision_config(config) else None,
        patches=_patches(config) if is_vision_config(config) else None,
    )


# text model types whose gated delta nets sequence parallelism splits by heads (separate q/k/v,
# z, b, a projections; Qwen3-Next fuses and interleaves them)
SPLIT_BY_HEADS = ("qwen3_5_text", "qwen3_5_moe_text")

PATCH_KEYS = ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels")


def _patches(config: Any) -> tuple[tuple[str, Any], ...]:
    """(key, value) of a VLM's ``vision_config`` patching (:data:`PATCH_KEYS`)."""
    vision = getattr(config, "vision_config", None)
    return tuple((key, getattr(vision, key, None)) for key in PATCH_KEYS)


def _router_class(config: Any, trust_remote_code: bool) -> str | None:
    """The class name of the first MoE router of the causal LM ``config`` builds (on the
    meta device), or None when it has none that looks like one."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from fsdp_rlhf.models.routers import ROUTER_RULES as ROUTERS

    # a VLM MoE (Qwen3-VL-MoE) has no causal-LM class: its image-text-to-text one
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    with torch.device("meta"):
        try:
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
        except ValueError:  # no auto class maps it (Mistral 4): its architecture's own class
            arch = (getattr(config, "architectures", None) or [""])[0]
            cls = getattr(transformers, arch, None)
            if cls is None:
                return None
            model = cls(config)
    for module in model.modules():
        name = type(module).__name__
        if name in ROUTERS or (name.endswith("Router") and hasattr(module, "top_k")):
            return name
    return None


def read_model_kind(path: str, flag: str, trust_remote_code: bool = False) -> ModelKind:
    """The kind of the model ``flag`` names (its folder checked first, naming the flag)."""
    from transformers import AutoConfig

    check_model_path(path, flag)
    quiet_transformers()
    with reading("model config", path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return kind_from_config(path, config, trust_remote_code)


def read_model_kinds(
    paths: Mapping[str, str | None], trust_remote_code: bool = False
) -> dict[str, ModelKind]:
    """Flag -> kind of every model a run loads (``paths``: flag -> folder; None: not used)."""
    return {
        flag: read_model_kind(path, flag, trust_remote_code) for flag, path in paths.items() if path
    }
