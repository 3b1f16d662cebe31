"""A VLM's processor, as the trainers use it: render chat prompts, count and expand image
placeholders, process images into the tensors the model takes.

Token ids exist in two forms. The chat template writes ONE ``<|image_pad|>`` per image
(the *collapsed* form: what vLLM takes, expanding each placeholder itself); the model reads
each image's features into a run of ``t * h * w / merge**2`` of them (the *expanded* form:
what the trainer's forwards and the sequences of a rollout hold). :meth:`expand` and
:func:`collapse_runs` convert; an image's token count follows from its size alone
(:meth:`VisionProcessor.tokens_for_size`), so lengths are known before any image is decoded.

The processor needs torchvision (transformers builds Qwen-VL processors only with it); it is
imported here, lazily, so text-only runs never need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsdp_rlhf.errors import UserError, reading
from fsdp_rlhf.models.vision import ImageInputs, VisionTokens


def collapse_runs(ids: Sequence[int], token: int) -> list[int]:
    """Each run of ``token`` -> one ``token`` (the form vLLM expands again)."""
    out: list[int] = []
    for t in ids:
        if t == token and out and out[-1] == token:
            continue
        out.append(t)
    return out


def load_processor(path: str, trust_remote_code: bool = False):
    """``AutoProcessor`` of a VLM folder; one line when torchvision is missing."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        raise UserError(
            f"{path} is a vision-language model: its processor needs torchvision, which is not "
            "installed (`make install` installs torch and torchvision that run together)"
        )
    from transformers import AutoProcessor

    with reading("processor", path):
        return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


class VisionProcessor:
    """The processor of one VLM and its token ids.

    Args:
        processor: the model's ``AutoProcessor`` (tokenizer, image processor, chat template).
        tokens: the config's special token ids (:class:`~fsdp_rlhf.models.vision.VisionTokens`).
    """

    def __init__(self, processor, tokens: VisionTokens) -> None:
        self.processor = processor
        self.tokens = tokens
        self.image_processor = processor.image_processor

    @classmethod
    def from_pretrained(cls, path: str, trust_remote_code: bool = False) -> VisionProcessor:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        return cls(load_processor(path, trust_remote_code), VisionTokens.from_config(config))

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def chat_template(self) -> str | None:
        return getattr(self.processor, "chat_template", None) or getattr(
            self.tokenizer, "chat_template", None
        )

    def render(self, messages: list, generation_prompt: bool) -> str:
        """Chat messages (content strings or lists of typed items) -> text with one image
        placeholder per ``{"type": "image"}`` item."""
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def tokens_for_size(self, height: int, width: int) -> int:
        """Placeholder tokens of one image of this size after the processor's resize."""
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return patches // self.tokens.merge_size**2

    def process(self, images: Sequence[Any]) -> ImageInputs | None:
        """RGB PIL images of one sample -> its ``ImageInputs`` (None without images)."""
        if not images:
            return None
        out = self.image_processor(images=list(images), return_tensors="pt")
        return ImageInputs(
            pixel_values=out["pixel_values"].float().contiguous(),
            grid_thw=out["image_grid_thw"].long(),
        )

    def expand(self, ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        """Collapsed ids (one placeholder per image) -> expanded ids, image k's placeholder
        repeated ``counts[k]`` times. Raises if the placeholders and counts disagree."""
        image = self.tokens.image
        found = sum(1 for t in ids if t == image)
        if found != len(counts):
            raise ValueError(f"{found} image placeholders for {len(counts)} images")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == image:
                out.extend([image] * counts[k])
                k += 1
            else:
                out.append(t)
        return out

    def collapse(self, ids: Sequence[int]) -> list[int]:
        return collapse_runs(ids, self.tokens.image)

    def expand_row(
        self, value: Any, ids: list[int], mask: list[int] | None = None
    ) -> tuple[list[str], list[int], list[int]]:
        """A row's image references (as strings: what a tokenized dataset column holds), and
        its collapsed ids (and loss mask) with each placeholder expanded to its image's token
        count, found from the image's size (expanded tokens are never learned: mask 0)."""
        from fsdp_rlhf.data.images import image_refs, image_size, ref_string

        mask = [0] * len(ids) if mask is None else mask
        refs = [ref_string(r) for r in image_refs(value)]
        if not refs:
            return refs, ids, mask
        counts = [self.tokens_for_size(*image_size(r)) for r in refs]
        out_ids, out_mask, k = [], [], 0
        for t, m in zip(ids, mask, strict=True):
            if t == self.tokens.image and k < len(counts):
                out_ids += [t] * counts[k]
                out_mask += [0] * counts[k]
                k += 1
            else:
                out_ids.append(t)
                out_mask.append(m)
        if k != len(counts):
            raise UserError(f"{k} image placeholders in a rendered row for {len(counts)} images")
        return refs, out_ids, out_mask

    def last_image_token(self, ids: Sequence[int]) -> int:
        """Index of the last image token (-1 without one)."""
        image = self.tokens.image
        return max((j for j, t in enumerate(ids) if t == image), default=-1)


def image_token_runs(ids: torch.Tensor, token: int) -> int:
    """Number of runs of ``token`` in a 1-D id tensor (= images in an expanded row)."""
    hit = (ids == token).int()
    return int((hit[1:] > hit[:-1]).sum() + hit[:1].sum())
