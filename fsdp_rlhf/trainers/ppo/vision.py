"""PPO with a vision-language actor: the rows' images checked before any model loads, and each
step's prompts turned into what the engine and the forwards take.

What a vision-language actor does not combine with (a text-only or other-family critic or
reward model) is refused by the rules table (``fsdp_rlhf.rules``,
rows ``vlm-*``), before any model loads. Under ``--async_train`` the rollout ranks encode each
batch's prompts here too (``ppo.async_rollout``). A VLM critic or reward model holds its head on
the language model (``models.vision_head``).
``--share_prompt_prefix`` (on by default) is turned off with a log line: the shared prompt pass
has no image inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fsdp_rlhf.config import VisionConfig
from fsdp_rlhf.data.images import image_problem, image_refs, load_images
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.data.vision import VisionProcessor
from fsdp_rlhf.models.vision import ImageBatch, ImageInputs, VisionTokens
from fsdp_rlhf.rollout.engine import PromptImages, RolloutOutput

log = logging.getLogger("fsdp_rlhf")


def scalar_model_problem(actor: str, path: str, trust_remote_code: bool) -> str | None:
    """Why the critic or reward model at ``path`` cannot score a VLM actor's rows, or None."""
    from transformers import AutoConfig

    from fsdp_rlhf.errors import reading
    from fsdp_rlhf.models.vision import is_vision_config

    configs = []
    for p in (actor, path):
        with reading("model config", p):
            configs.append(AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code))
    mine, theirs = configs
    if not is_vision_config(theirs):
        return (
            "is text-only: it would score the image placeholders without the images; pass a "
            "vision-language checkpoint (its value head goes on the language model, docs/vlm.md)"
        )
    if VisionTokens.from_config(theirs) != VisionTokens.from_config(mine):
        return "names other image tokens than --pretrain (another model family?)"
    sizes = ("patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels")
    for key in sizes:
        a, b = (getattr(c.vision_config, key, None) for c in (mine, theirs))
        if a != b:
            return f"takes other image patches than --pretrain (vision_config.{key} {b} != {a})"
    return None


def row_check(cfg: VisionConfig, input_key: str, text_only: bool):
    """A ``data.sources.RowCheck`` for prompts: images against placeholders (see
    :func:`fsdp_rlhf.data.images.image_problem`)."""

    def check(row: dict) -> str | None:
        if input_key not in row:
            return None  # the missing key is reported by name after loading
        return image_problem(
            row.get(input_key),
            row.get(cfg.image_key),
            cfg.image_key,
            cfg.max_images_per_prompt,
            text_only=text_only,
        )

    return check


def most_images(rows, image_key: str) -> int:
    """The largest image count of any row (vLLM's per-prompt limit when none is given)."""
    if image_key not in rows.column_names:
        return 0
    return max((len(image_refs(v)) for v in rows[image_key]), default=0)


def image_limit(cfg: VisionConfig, rows) -> int:
    """Images per prompt the engine must accept (at least 1 for a VLM)."""
    return max(1, cfg.max_images_per_prompt or most_images(rows, cfg.image_key))


class StepImages:
    """Each step's prompts with their images decoded and processed (only the drawn prompts:
    the data's images are never all in memory)."""

    def __init__(self, vision: VisionProcessor) -> None:
        self.vision = vision

    @classmethod
    def from_pretrained(cls, path: str, backend) -> StepImages:
        return cls(VisionProcessor.from_pretrained(path, backend.trust_remote_code))

    def encode(
        self, prompts: Sequence[Prompt]
    ) -> tuple[list[list[int]], list[PromptImages | None]]:
        """Expanded prompt ids and each prompt's images (None: a text prompt)."""
        ids, images = [], []
        for p in prompts:
            if not p.images:
                ids.append(list(p.ids))
                images.append(None)
                continue
            decoded = load_images(p.images)
            inputs = self.vision.process(decoded)
            counts = inputs.tokens(self.vision.tokens.merge_size)
            if tuple(counts) != p.image_tokens:  # the header's size and the decoded one differ
                raise ValueError(f"image token counts {counts} != {list(p.image_tokens)}")
            ids.append(self.vision.expand(p.ids, counts))
            images.append(PromptImages(images=tuple(decoded), inputs=inputs))
        return ids, images

    @staticmethod
    def rows(images: Sequence[PromptImages | None], n: int) -> ImageBatch:
        """The prompt-major rows' images (n samples per prompt share one copy)."""
        inputs: list[ImageInputs | None] = [im.inputs if im else None for im in images]
        return ImageBatch.repeat(inputs, n)


def check_responses(out: RolloutOutput, tokens: VisionTokens) -> None:
    """The engines never sample a placeholder token (suppressed in both); one in a response
    would make the next forward look for an image that does not exist, so it stops here."""
    import torch

    blocked = torch.as_tensor(tokens.placeholders)
    hit = torch.isin(out.response_ids, blocked) & out.response_mask.bool()
    if bool(hit.any()):
        row = int(hit.any(-1).nonzero()[0])
        raise RuntimeError(
            f"the rollout engine sampled an image placeholder token in response {row}: the "
            "placeholder suppression did not take effect"
        )
