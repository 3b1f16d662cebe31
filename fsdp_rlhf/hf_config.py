"""Facts read from an HF model config the way transformers' own models read them, for every
layer that needs them (the memory model, the attention kernels, the vLLM adapter).

Some 2026 configs are heterogeneous: Gemma 4 declares ``head_dim`` and ``num_key_value_heads``
per layer (its global layers have heads of 512 and their own KV heads), and transformers raises
``AmbiguousGlobalPerLayerAttributeError`` where code reads them from the top config. Everything
that sizes attention reads them per layer: :func:`attention_layers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def head_dim(config: Any) -> int:
    """Per-head size of an HF text config (an object or config.json's dict), derived as
    transformers' models do: Qwen2/2.5 config.json files have no ``head_dim`` key, others have
    it set to null. A heterogeneous config's (Gemma 4's) is per layer: use
    :func:`attention_layers`."""

    def get(key: str):
        return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

    value = get("head_dim")
    if value is not None:
        return int(value)
    return get("hidden_size") // get("num_attention_heads")


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def as_config(config: Any) -> Any:
    """A transformers config object for config.json's dict (parsed by transformers' own class
    for its ``model_type``, so its derived and per-layer attributes are what the model sees);
    an object is returned as it is."""
    if not isinstance(config, Mapping):
        return config
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[config["model_type"]]
    # as from_pretrained reads config.json: json's stand-ins for inf/nan decoded
    decode = getattr(cls, "_decode_special_floats", lambda obj: obj)
    return cls.from_dict(decode(dict(config)))


def config_num_experts(config: Any) -> int:
    """Routed experts per MoE layer of an HF config (0: a dense model)."""
    text = _text(config)
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(text, key, None)
        if value:
            if key == "num_experts" and getattr(text, "enable_moe_block", True) is False:
                continue  # Gemma 4 dense: the key is there, the MoE block is not
            blocks = _blocks(text)
            if "mlp" in blocks and "moe" not in blocks:
                continue  # Nemotron-H without MoE blocks still carries n_routed_experts
            return int(value)
    return 0


def _blocks(text: Any) -> list[str]:
    return list(getattr(text, "layer_types", None) or [])


# ---------------------------------------------------------------- per-layer attention


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer's shape as transformers' attention kernels see it: query heads,
    key/value heads, head size; and ``cache_width``, the elements one token adds to vLLM's KV
    cache of the layer (keys and values, or multi-head latent attention's one latent)."""

    index: int
    heads: int
    kv_heads: int
    head_dim: int
    cache_width: int

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


# layer types (transformers' ``layer_types`` names) that hold a KV cache
_ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


def _layer_config(text: Any, i: int) -> Any:
    view = getattr(text, "per_layer_config", None)
    if view is None or not getattr(text, "is_heterogeneous", False):
        return text
    return view[i]


def attention_layers(config: Any) -> list[AttentionLayer]:
    """Every attention layer of a text config (object or config.json's dict), with the head
    counts and head size transformers' model gives that layer: per layer where the config is
    heterogeneous (Gemma 4's global layers), the top config's otherwise. Layers of other kinds
    (gated delta nets, Mamba2, short convolutions, MLP-only blocks) are left out; a config
    without ``layer_types`` has attention in every layer."""
    text = _text(as_config(config))
    n = int(text.num_hidden_layers)
    types = _blocks(text) or ["full_attention"] * n
    out = []
    for i in range(n):
        if i < len(types) and types[i] not in _ATTENTION_TYPES:
            continue
        layer = _layer_config(text, i)
        heads = int(layer.num_attention_heads)
        kv = int(getattr(layer, "num_key_value_heads", None) or heads)
        latent = getattr(layer, "kv_lora_rank", None)
        if latent:  # multi-head latent attention (DeepSeek-V3): keys of nope + rope dims
            rope = int(getattr(layer, "qk_rope_head_dim", 0) or 0)
            size = int(layer.qk_nope_head_dim) + rope
            out.append(AttentionLayer(i, heads, heads, size, int(latent) + rope))
        else:
            size = head_dim(layer)
            out.append(AttentionLayer(i, heads, kv, size, 2 * kv * size))
    return out


# ---------------------------------------------------------------- recurrent layers

GATED_DELTA_NET = "gated_delta_net"
MAMBA = "mamba"
SHORT_CONV = "short_conv"
LINEAR_ATTENTION = "linear_attention"  # a recurrent kind not named above (e.g. lightning)

# transformers' module class names of each recurrent layer kind (substrings)
_RECURRENT_CLASSES = (
    ("GatedDeltaNet", GATED_DELTA_NET),
    ("Mamba", MAMBA),
    ("ShortConv", SHORT_CONV),
    ("LinearAttention", LINEAR_ATTENTION),
    ("Lightning", LINEAR_ATTENTION),
)


def recurrent_kinds(config: Any, trust_remote_code: bool = False) -> set[str]:
    """The kinds of recurrent (state-carrying, non-attention) layers a model has, read from the
    layer modules transformers builds for it (on the meta device: nothing is allocated):
    ``gated_delta_net`` (Qwen3.5, Qwen3-Next), ``mamba`` (Nemotron-H, Granite-4.0-H: which
    transformers 5.19 also labels ``"linear_attention"``), ``short_conv`` (LFM2's ``"conv"``
    layers), ``linear_attention`` for another kind. Empty for a transformer."""
    text = _text(as_config(config))
    types = set(_blocks(text))
    if not types - _ATTENTION_TYPES - {"mlp", "moe", "dense", "sparse"}:
        return set()
    return _module_kinds(text, trust_remote_code)


def _module_kinds(text: Any, trust_remote_code: bool) -> set[str]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text, trust_remote_code=trust_remote_code)
    kinds = set()
    for module in model.modules():
        name = type(module).__name__
        for part, kind in _RECURRENT_CLASSES:
            if part in name:
                kinds.add(kind)
                break
    return kinds


def has_recurrent_layers(config: Any) -> bool:
    """Whether a config declares recurrent layers (``layer_types`` other than attention and
    MLP blocks: gated delta nets, Mamba2, short convolutions), without building the model."""
    text = _text(as_config(config))
    return bool(set(_blocks(text)) - _ATTENTION_TYPES - {"mlp", "moe", "dense", "sparse"})


def has_linear_attention(config: Any) -> bool:
    """Whether an HF config has recurrent layers of any kind (see :func:`recurrent_kinds`)."""
    return has_recurrent_layers(config)
