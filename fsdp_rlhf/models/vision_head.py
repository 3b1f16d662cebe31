"""Scalar-head models (critic, reward model) on a vision-language model's language model.

transformers has a ``*ForSequenceClassification`` class for few VLMs (Qwen3.5 has one; Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE and Qwen3.5-MoE do not), so the class is built here, for any VLM whose
base model ``AutoModel`` knows, in the layout of transformers' own generic one
(``GenericForSequenceClassification``, which Qwen3.5's uses):

- ``model``: the VLM's base model (``<Family>Model``: the vision tower ``model.visual`` and the
  language model ``model.language_model``), exactly as in ``<Family>ForConditionalGeneration``;
- ``score``: ``nn.Linear(text hidden size, 1, bias=False)`` on the language model's last hidden
  states (after its final norm), where the LM head of the causal model would sit.

The image features are merged into the token embeddings by the base model, as in the causal
model; M-RoPE positions come from ``mm_token_type_ids``, ``image_grid_thw`` and the attention
mask (``models.vision.vision_model_inputs``), so values and scores read at any row position do
not depend on the row's padding.

Saved format (``save_pretrained``): the VLM's ``config.json`` with ``architectures``
``["<Family>ForSequenceClassification"]`` and ``num_labels`` 1, and safetensors holding the
causal checkpoint's ``model.visual.*`` and ``model.language_model.*`` tensors under the same
names plus ``score.weight`` (1, hidden); the processor beside them. A causal VLM checkpoint
loads into the class as it is (``lm_head`` is dropped, ``score`` initialised by the caller);
a saved scalar model loads back with :func:`vision_scalar_class` (or
``models.load.load_scalar_model``).
"""

from __future__ import annotations

from typing import Any

from fsdp_rlhf.models.vision import is_vision_config

_BUILT: dict[type, type] = {}


def vision_scalar_class(config: Any) -> type:
    """The scalar-head class of a VLM config: transformers' own ``*ForSequenceClassification``
    where ``AutoModelForSequenceClassification`` maps the config (Qwen3.5), else the one built
    here on the family's base model (see the module docstring)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    if not is_vision_config(config):
        raise ValueError(f"{type(config).__name__} is not a vision-language config")
    own = AutoModelForSequenceClassification._model_mapping
    if type(config) in own:
        return own[type(config)]
    if type(config) not in _BUILT:
        base = AutoModel._model_mapping[type(config)]  # e.g. Qwen2_5_VLModel
        _BUILT[type(config)] = _build(base)
    return _BUILT[type(config)]


def _build(base: type) -> type:
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.modeling_utils import PreTrainedModel

    # the family's PreTrainedModel: its config class, init and the no-split modules FSDP uses
    family = next(
        c
        for c in base.__mro__
        if c is not PreTrainedModel
        and issubclass(c, PreTrainedModel)
        and c.__name__.endswith("PreTrainedModel")
    )
    prefix = base.__name__.removesuffix("Model")
    cls = type(
        prefix + "ForSequenceClassification",
        (GenericForSequenceClassification, family),
        {"__module__": __name__, "__doc__": f"{family.__name__} with a scalar head (score)."},
    )
    # the checkpoint names of the family's causal model (Qwen2.5-VL writes the published
    # `model.layers.*`, `visual.*`): read from a causal checkpoint and written back the same way
    mapping = get_checkpoint_conversion_mapping(prefix + "ForConditionalGeneration")
    if mapping:
        register_checkpoint_conversion_mapping(cls.__name__, mapping, overwrite=True)
    return cls
