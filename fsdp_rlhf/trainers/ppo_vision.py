"""PPO with a vision-language actor: what is refused and why, the rows' images checked before
any model loads, and each step's prompts turned into what the engine and the forwards take.

Refused by name, with the reason (one line, before heavy work):

- a critic (``--advantage_estimator gae``): transformers has no sequence-classification class
  for Qwen-VL models, so there is no value-head checkpoint format to load or save; GRPO, RLOO,
  REINFORCE++ and their baselines need none;
- ``--reward_pretrain``: a reward model would need the images too (same reason); use a rule
  reward (``--remote_rm_url``), which sees the prompt text and the label;
- ``--packing_samples``: a packed row would need M-RoPE positions per packed sequence and
  images regrouped per segment; padded rows carry both as the model computes them;
- multi-turn environments: the environment's turns carry no images.

``--share_prompt_prefix`` (on by default) is turned off with a log line: the shared prompt pass
has no image inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fsdp_rlhf.algorithms.names import CRITIC_ESTIMATORS
from fsdp_rlhf.config import PPOConfig, VisionConfig
from fsdp_rlhf.data.images import image_problem, image_refs, load_images
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.data.vision import VisionProcessor
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.vision import ImageBatch, ImageInputs, VisionTokens
from fsdp_rlhf.rollout.engine import PromptImages, RolloutOutput

log = logging.getLogger("fsdp_rlhf")

WHY_NO_CRITIC = (
    "a critic is a value head on the model, and transformers has no *ForSequenceClassification "
    "class for vision-language models to load or save one; use --advantage_estimator grpo, "
    "rloo, reinforce++ or reinforce++-baseline"
)


def refuse_unsupported(cfg: PPOConfig, model: str) -> None:
    """One line naming the first setting a vision-language actor cannot run with."""
    head = f"--pretrain {model} is a vision-language model"
    if cfg.algo.advantage_estimator in CRITIC_ESTIMATORS:
        estimator = cfg.algo.advantage_estimator
        raise UserError(f"{head}: --advantage_estimator {estimator}: " + WHY_NO_CRITIC)
    if cfg.models.critic_pretrain:
        raise UserError(f"{head}: --critic_pretrain: " + WHY_NO_CRITIC)
    if cfg.models.reward_pretrain:
        raise UserError(
            f"{head}: --reward_pretrain: a reward model would have to see the images, and "
            "there is no scalar-head format for VLMs; use a rule reward (--remote_rm_url)"
        )
    if cfg.batch.packing_samples:
        raise UserError(
            f"{head}: --packing_samples: packed rows would need M-RoPE positions and images "
            "per packed sequence; VLM rows go through the model padded (drop the flag)"
        )
    if cfg.multiturn.source is not None:
        raise UserError(
            f"{head}: {cfg.multiturn.source[0]}: multi-turn environments return text only; "
            "single-turn rollouts take images"
        )
    if cfg.asynchronous.async_train:
        raise UserError(
            f"{head}: --async_train: the step-by-step rollout engine of asynchronous training "
            "does not take images yet; drop --async_train"
        )
    if cfg.moe.router_replay:
        raise UserError(
            f"{head}: --router_replay: routing replay is not implemented for vision-language "
            "models (their prompts reach vLLM with the image placeholders collapsed); drop it"
        )


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
