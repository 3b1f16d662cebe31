"""Vision-language models (``AutoModelForImageTextToText``: Qwen2.5-VL, Qwen3-VL): detection,
the vision tower, the images that travel with each sample (the forward inputs they add are the
images part of ``models.inputs``).

A checkpoint is a VLM when its config has a ``vision_config`` (OpenRLHF's test). Its forward
takes, besides the tokens, the processed images of the batch:

- ``pixel_values`` (P, C * T * p * p): every image's patches, images in row order, each row's
  images in placeholder order;
- ``image_grid_thw`` (K, 3): (frames, patch rows, patch columns) of each of the K images; an
  image fills ``t * h * w / merge**2`` placeholder tokens (``<|image_pad|>``) in its row;
- ``mm_token_type_ids`` (B, L): 1 on image tokens, 2 on video tokens, 0 on text, from which the
  model builds its M-RoPE positions (3 position rows: time, height, width) over the attended
  tokens of each row, so ``position_ids`` is left to the model for padded rows. Rows the model
  cannot read them from (packed rows, sequence-parallel slices) get them computed beforehand
  by the model's own rule over the padded rows (:class:`ImagePositions`), then laid out as the
  tokens are.

:class:`ImageBatch` keeps each row's images apart so micro-batching (fixed or by token budget)
and minibatch shuffles pick them with their rows; the n samples of one prompt share one copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_rlhf.distributed.vision_units import vision_tower

# The logit of a suppressed token: finite, so that entropies (sum p log p, p = 0 there) stay
# finite (0 * -inf is NaN), and still 0 probability after any temperature: exp(-1e30) is 0.
SUPPRESSED_LOGIT = -1e30


def is_vision_config(config: Any) -> bool:
    """``vision_config`` in an HF config (object or dict)."""
    if isinstance(config, dict):
        return config.get("vision_config") is not None
    return getattr(config, "vision_config", None) is not None


@dataclass(frozen=True)
class VisionTokens:
    """The special token ids a VLM config names (None where it has no such token)."""

    image: int
    video: int | None = None
    start: int | None = None
    end: int | None = None
    merge_size: int = 2

    @classmethod
    def from_config(cls, config: Any) -> VisionTokens:
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        vision = get("vision_config") or {}
        merge = (
            vision.get("spatial_merge_size", 2)
            if isinstance(vision, dict)
            else getattr(vision, "spatial_merge_size", 2)
        )
        image = get("image_token_id", get("image_token_index"))
        if image is None:
            raise ValueError("the VLM config names no image_token_id")
        return cls(
            image=int(image),
            video=get("video_token_id"),
            start=get("vision_start_token_id"),
            end=get("vision_end_token_id"),
            merge_size=int(merge),
        )

    @property
    def placeholders(self) -> tuple[int, ...]:
        """Tokens that only the processor writes: the policy must never sample them (a
        sampled ``<|image_pad|>`` would ask the next forward for an image that does not
        exist; verl #7038)."""
        return tuple(t for t in (self.image, self.video, self.start, self.end) if t is not None)

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) -> (B, L) int: 1 on image tokens, 2 on video tokens, 0 elsewhere."""
        types = (input_ids == self.image).int()
        if self.video is not None:
            types = types + 2 * (input_ids == self.video).int()
        return types


def vision_prefix(model: nn.Module) -> str | None:
    """Qualified name of the vision tower (``model.visual``), or None."""
    tower = vision_tower(model)
    if tower is None:
        return None
    return next(name for name, m in model.named_modules() if m is tower)


def is_vision_param(prefix: str | None) -> Callable[[str], bool]:
    """Predicate on (HF-named) parameter names: inside the vision tower."""
    if prefix is None:
        return lambda name: False
    return lambda name: name.startswith(prefix + ".")


def freeze_vision_tower(model: nn.Module) -> int:
    """Freeze the vision encoder and its projector (``--freeze_visual_encoder``); returns the
    number of frozen parameters."""
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"{type(model).__name__} has no vision tower to freeze")
    n = 0
    for p in tower.parameters():
        p.requires_grad_(False)
        n += p.numel()
    return n


def suppress_tokens(model: nn.Module, token_ids: Sequence[int]) -> None:
    """Make ``token_ids`` impossible under the model: their logits become ``SUPPRESSED_LOGIT``
    at the LM head.

    The policy is then the model restricted to the other tokens, in the update, the old and
    reference log-probs and HF generation alike; vLLM gets the same restriction as a logit bias
    (``rollout.vllm.engine``), so engine and trainer log-probs describe one distribution.
    """
    ids = torch.as_tensor(sorted(set(token_ids)), dtype=torch.long)
    head = model.get_output_embeddings()

    def mask(_module, _args, logits: torch.Tensor) -> torch.Tensor:
        blocked = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        blocked[ids.to(logits.device)] = True
        return logits.masked_fill(blocked, SUPPRESSED_LOGIT)

    head.register_forward_hook(mask)


def prepare_policy(model: nn.Module, *, freeze_tower: bool = False) -> VisionTokens | None:
    """A causal LM as a trainer's policy: for a VLM, its placeholder tokens suppressed and,
    with ``freeze_tower``, its vision tower frozen. Returns the VLM's tokens (None: text)."""
    if not is_vision_config(model.config):
        return None
    tokens = VisionTokens.from_config(model.config)
    suppress_tokens(model, tokens.placeholders)
    if freeze_tower:
        freeze_vision_tower(model)
    return tokens


# ---------------------------------------------------------------- images with their rows


@dataclass(frozen=True)
class ImageInputs:
    """One sample's processed images (placeholder order).

    Attributes:
        pixel_values: (P, D) float32 patches of all its images.
        grid_thw: (K, 3) long, one row per image.
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def tokens(self, merge_size: int) -> list[int]:
        """Placeholder tokens each image fills."""
        return (self.grid_thw.prod(-1) // merge_size**2).tolist()

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


class ImageBatch:
    """The images of N rows, row i's in ``rows[i]`` (None: no image). Indexing with a tensor,
    list or slice picks rows, as ``Experience.rows`` does with its tensors."""

    def __init__(self, rows: Sequence[ImageInputs | None]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index) -> ImageBatch:
        if isinstance(index, slice):
            return ImageBatch(self.rows[index])
        if isinstance(index, torch.Tensor):
            index = index.tolist()
        if isinstance(index, int):
            index = [index]
        return ImageBatch([self.rows[i] for i in index])

    @staticmethod
    def cat(batches: Sequence[ImageBatch]) -> ImageBatch:
        return ImageBatch([r for b in batches for r in b.rows])

    @classmethod
    def repeat(cls, per_prompt: Sequence[ImageInputs | None], n: int) -> ImageBatch:
        """Prompt-major rows: each prompt's images for its ``n`` samples (shared, no copy)."""
        return cls([x for x in per_prompt for _ in range(n)])

    @property
    def any(self) -> bool:
        return any(r is not None for r in self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes of pixel values these rows hold (shared copies counted once)."""
        seen = {id(r): r.nbytes for r in self.rows if r is not None}
        return sum(seen.values())

    def to_payload(self) -> dict[str, Any]:
        """These rows' images as plain tensors on the host (a message between ranks): each
        distinct ``ImageInputs`` once (the n samples of a prompt share one), and per row the
        index of its images among them (-1: none). :meth:`from_payload` rebuilds the batch,
        the sharing included."""
        slot: dict[int, int] = {}
        unique: list[ImageInputs] = []
        index = []
        for r in self.rows:
            if r is None:
                index.append(-1)
                continue
            if id(r) not in slot:
                slot[id(r)] = len(unique)
                unique.append(r)
            index.append(slot[id(r)])
        return {
            "pixel_values": [r.pixel_values.cpu() for r in unique],
            "grid_thw": [r.grid_thw.cpu() for r in unique],
            "index": index,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> ImageBatch:
        unique = [
            ImageInputs(pixels, grid)
            for pixels, grid in zip(payload["pixel_values"], payload["grid_thw"], strict=True)
        ]
        return cls([None if i < 0 else unique[i] for i in payload["index"]])

    def model_kwargs(self, device: torch.device, dtype: torch.dtype | None = None) -> dict:
        """``pixel_values`` and ``image_grid_thw`` of these rows in order ({} without images)."""
        present = [r for r in self.rows if r is not None]
        if not present:
            return {}
        pixels = torch.cat([r.pixel_values for r in present]).to(device)
        if dtype is not None:
            pixels = pixels.to(dtype)
        grid = torch.cat([r.grid_thw for r in present]).to(device)
        return {"pixel_values": pixels, "image_grid_thw": grid}


# ---------------------------------------------------------------- M-RoPE positions


def rope_index(model: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The model's own M-RoPE rule (``get_rope_index`` of its base model, ``model.model``:
    one signature across transformers' Qwen-VL families)."""
    for m in (getattr(model, "model", None), model):
        if m is not None and hasattr(m, "get_rope_index"):
            return m.get_rope_index
    raise ValueError(f"{type(model).__name__} has no M-RoPE rule (get_rope_index)")


@dataclass(frozen=True)
class ImagePositions:
    """What a VLM's M-RoPE positions are computed from when the model cannot compute them
    itself (packed rows, sequence-parallel slices): the padded rows' token types (B, L) and
    the K images' grids (K, 3) in row order."""

    token_types: torch.Tensor
    grid_thw: torch.Tensor

    def positions(
        self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """(B, L) padded rows -> (3, B, L) positions (time, height, width) of each row's
        attended tokens counted from its first, by the model's rule (0 at padding)."""
        positions, _ = rope_index(model)(
            input_ids,
            mm_token_type_ids=self.token_types,
            image_grid_thw=self.grid_thw,
            attention_mask=attention_mask,
        )
        return positions
