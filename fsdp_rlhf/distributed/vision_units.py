"""A vision-language model's vision tower as an FSDP unit of its own.

The tower (patch embedding, blocks, merger/projector) is sharded as one unit besides the
decoder layers, so its parameters are gathered only when images go through it. Every rank must
then issue the tower's collectives in every forward, images or not (:func:`tower_in_every_forward`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Where HF VLM classes keep the vision encoder (and its projector), first match wins.
TOWER_PATHS = ("model.visual", "visual", "model.vision_tower", "vision_tower", "model.vision_model")


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder (with its projector) of an HF VLM, or None for a text model."""
    for path in TOWER_PATHS:
        try:
            return model.get_submodule(path)
        except AttributeError:
            continue
    return None


def _tensor_sum(x: Any) -> torch.Tensor | None:
    """Sum of every tensor in a (nested) model output."""
    if isinstance(x, torch.Tensor):
        return x.float().sum()
    values = x.values() if isinstance(x, dict) else x if isinstance(x, list | tuple) else []
    parts = [t for t in (_tensor_sum(v) for v in values) if t is not None]
    return torch.stack(parts).sum() if parts else None


def dummy_image(vision_config: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest input the vision tower takes: one image of merge x merge patches, zeros.
    Returns ``(pixel_values (merge**2, C * T * p * p), grid_thw (1, 3))``."""
    merge = getattr(vision_config, "spatial_merge_size", 2)
    width = (
        getattr(vision_config, "in_channels", 3)
        * getattr(vision_config, "temporal_patch_size", 2)
        * getattr(vision_config, "patch_size", 14) ** 2
    )
    pixels = torch.zeros(merge * merge, width, device=device)
    return pixels, torch.tensor([[1, merge, merge]], device=device)


def tower_in_every_forward(model: nn.Module) -> None:
    """Run the vision tower in every forward of a sharded VLM, images or not.

    Under FSDP the tower is a unit whose parameters are gathered (and, in backward, whose
    gradients are reduced) only when it runs, and every rank must issue the same collectives
    in the same order. A micro-batch without images on one rank, beside one with images on
    another, would leave them waiting on different collectives. So a forward without images
    runs the tower on a dummy image where it would have run (before the language model), and
    adds 0 x its output to the hidden states: the same collectives, no effect on the result.
    """
    tower, inner = vision_tower(model), getattr(model, "model", None)
    language = getattr(inner, "language_model", None)
    if tower is None or language is None:
        return
    state: dict[str, Any] = {"images": True, "dummy": None}

    def note_images(_module, _args, kwargs):
        state["images"] = (
            kwargs.get("pixel_values") is not None
            or kwargs.get("pixel_values_videos") is not None
            or kwargs.get("past_key_values") is not None  # generation: images only at first
        )

    def run_tower(_module, args, kwargs):
        if state["images"]:
            return
        hidden = kwargs.get("inputs_embeds")
        device = hidden.device if hidden is not None else next(tower.parameters()).device
        pixels, grid = dummy_image(model.config.vision_config, device)
        state["dummy"] = _tensor_sum(tower(pixels, grid_thw=grid))

    def add_zero(_module, _args, _kwargs, output):
        dummy, state["dummy"] = state["dummy"], None
        if dummy is None:
            return output
        output.last_hidden_state = output.last_hidden_state + 0.0 * dummy.to(
            output.last_hidden_state.dtype
        )
        return output

    inner.register_forward_pre_hook(note_images, with_kwargs=True)
    language.register_forward_pre_hook(run_tower, with_kwargs=True)
    language.register_forward_hook(add_zero, with_kwargs=True)
