"""Prompt data for rollouts: render once, tokenize once, deal global batches to ranks.

Each step takes ``rollout_batch_size`` prompts (global) in a seeded per-epoch order; rank r gets
the r-th contiguous slice. The position (epoch, batch index) is all a resume needs.

With a vision-language model a prompt also keeps its image references (decoded when the
prompt is drawn) and each image's token count, known from its size: a prompt's length is its
expanded length, and a prompt longer than ``prompt_max_len`` is dropped rather than cut (a cut
could split an image's tokens from its pixels).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_rlhf.config import PromptDataConfig
from fsdp_rlhf.data.schedule import StepSchedule
from fsdp_rlhf.errors import UserError

if TYPE_CHECKING:
    from fsdp_rlhf.data.vision import VisionProcessor

log = logging.getLogger("fsdp_rlhf")


def check_chat_template(tokenizer, model_path: str) -> None:
    """One clear line, before any heavy work, when ``--apply_chat_template`` cannot work."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"--apply_chat_template: the tokenizer of {model_path} has no chat template; "
            "drop the flag (prompts then use --input_template) or use a chat model's tokenizer"
        )


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids (left-truncated to ``prompt_max_len``), text and label.

    With images: ``ids`` hold one placeholder per image (collapsed), ``images`` the image
    references in placeholder order and ``image_tokens`` each image's token count.
    """

    ids: list[int]
    text: str
    label: Any
    images: tuple = ()
    image_tokens: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        """Tokens the model sees: each image placeholder expanded."""
        return len(self.ids) - len(self.image_tokens) + sum(self.image_tokens)


def render_prompt(value: Any, tokenizer, cfg: PromptDataConfig, vision=None) -> str:
    """A prompt as text: chat template for message lists (or when asked), else the template.
    A VLM's processor (``vision``) renders chat prompts with image items."""
    if cfg.apply_chat_template:
        messages = value if isinstance(value, list) else [{"role": "user", "content": value}]
        if vision is not None:
            return vision.render(messages, generation_prompt=True)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if isinstance(value, list):
        raise UserError(
            f"--input_key {cfg.input_key} holds chat messages; pass --apply_chat_template"
        )
    text = str(value)
    return cfg.input_template.format(text) if cfg.input_template else text


def _with_images(
    ids: list[int], text: str, label: Any, refs: list, vision: VisionProcessor
) -> Prompt:
    from fsdp_rlhf.data.images import image_size

    tokens = tuple(vision.tokens_for_size(*image_size(ref)) for ref in refs)
    return Prompt(ids=ids, text=text, label=label, images=tuple(refs), image_tokens=tokens)


def tokenize_prompts(
    rows, tokenizer, cfg: PromptDataConfig, vision: VisionProcessor | None = None, image_key=None
) -> list[Prompt]:
    """Render and tokenize every row; keeps the last ``prompt_max_len`` tokens of long prompts.

    Empty prompts are dropped. Both cases are counted and logged: silently cut prompts (a
    lost instruction at the start) are a common cause of puzzling rewards. With a VLM
    (``vision``, images under ``image_key``) a prompt with images that is too long is dropped.
    """
    from fsdp_rlhf.data.images import image_refs

    out = []
    truncated = dropped = too_long = 0
    for row in rows:
        text = render_prompt(row[cfg.input_key], tokenizer, cfg, vision)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            dropped += 1
            continue
        label = row[cfg.label_key] if cfg.label_key else None
        refs = image_refs(row.get(image_key)) if vision is not None and image_key else []
        if refs:
            prompt = _with_images(ids, text, label, refs, vision)
            if prompt.length > cfg.prompt_max_len:
                too_long += 1
                continue
            out.append(prompt)
            continue
        truncated += len(ids) > cfg.prompt_max_len
        out.append(Prompt(ids=ids[-cfg.prompt_max_len :], text=text, label=label))
    if too_long:
        log.warning(
            "%d prompts with images are longer than --prompt_max_len %d (images expanded to "
            "their tokens) and are dropped: cutting them could split an image",
            too_long,
            cfg.prompt_max_len,
        )
    log.info(
        "prompts: %d kept, %d truncated from the left to --prompt_max_len %d, %d empty dropped",
        len(out),
        truncated,
        cfg.prompt_max_len,
        dropped,
    )
    if truncated:
        log.warning(
            "%d of %d prompts are longer than --prompt_max_len %d and lose their beginning",
            truncated,
            len(out),
            cfg.prompt_max_len,
        )
    return out


class PromptSampler:
    """This rank's prompts step after step, over as many epochs as asked for: a
    :class:`~fsdp_rlhf.data.schedule.StepSchedule` plus the position, which is all a resume
    needs."""

    def __init__(
        self, num_prompts: int, global_batch: int, rank: int, world_size: int, seed: int
    ) -> None:
        if num_prompts < global_batch:
            raise UserError(
                f"prompt data has {num_prompts} prompts, fewer than rollout_batch_size "
                f"({global_batch})"
            )
        self.schedule = StepSchedule(num_prompts, global_batch, world_size, rank, seed)
        self.epoch = 0
        self.index = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.schedule.steps_per_epoch

    def next_indices(self) -> list[int]:
        """This rank's prompt indices for the next step (wraps into the next epoch)."""
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        self.index += 1
        return self.schedule.rank_indices(self.epoch, self.index - 1)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
