"""Supervised samples -> token ids and the mask of tokens the loss learns, and their collate.

A sample is rendered to one text plus the character spans the model should learn: the
response after the prompt (``--input_key`` / ``--output_key``), every assistant turn of a
conversation (``--multiturn``), the last message of a conversation, or the whole text
(``--pretrain_mode``). Tokens overlapping a span are learned, so a token merged across the
prompt/response boundary counts as response. The spans come from the tokenizer's character
offsets of the full text, so the ids are exactly what the model sees at inference time.
Chat templates close each assistant turn with their own end-of-turn token, which is learned;
plain text gets the tokenizer's EOS appended and learned.

Vision-language rows (a VLM's ``--image_key`` column, ``{"type": "image"}`` items in the
messages) are tokenized the same way, then each image placeholder is expanded to the image's
token count (known from its size) and never learned; the image references travel with the
sample and are decoded per micro-batch (:func:`collate_samples`). A row whose images would not
fit ``max_len`` whole is dropped, not cut.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from fsdp_rlhf.config import SFTDataConfig
from fsdp_rlhf.data.preference import right_pad
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.vision import ImageBatch

if TYPE_CHECKING:  # imported where used: the GPU box runs without `datasets`
    import datasets

    from fsdp_rlhf.data.vision import VisionProcessor

log = logging.getLogger(__name__)

Span = tuple[int, int]


# ---------------------------------------------------------------- checking raw rows


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) for m in value)


def _empty(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


def _turns_problem(messages: list, what: str, *, last_only: bool) -> str | None:
    if not messages:
        return f"{what} is an empty conversation"
    if any("content" not in m or "role" not in m for m in messages):
        return f"{what}: every message needs 'role' and 'content'"
    learned = [messages[-1]] if last_only else [m for m in messages if m["role"] == "assistant"]
    if not learned:
        return f"{what} has no assistant message to learn"
    if any(_empty(m["content"]) or m["content"] is None for m in learned):
        return f"{what} has an empty response message"
    return None


def row_problem(row: dict, cfg: SFTDataConfig) -> str | None:
    """Why one raw row cannot be trained on (missing/empty response, wrong type), or None."""
    inp = row[cfg.input_key]
    where_in = f"--input_key {cfg.input_key!r}"
    if not isinstance(inp, str) and not _is_messages(inp):
        return f"{where_in}: expected a string or a list of chat messages, got {type(inp).__name__}"
    if isinstance(inp, list) and not cfg.apply_chat_template:
        return f"{where_in}: chat messages need --apply_chat_template"
    if cfg.output_key is not None:
        out = row[cfg.output_key]
        where_out = f"--output_key {cfg.output_key!r}"
        if out is None or _empty(out):
            return f"{where_out}: empty response"
        if isinstance(out, list):
            if not cfg.apply_chat_template:
                return f"{where_out}: chat messages need --apply_chat_template"
            return _turns_problem(out, where_out, last_only=False)
        if not isinstance(out, str):
            return f"{where_out}: expected a string or chat messages, got {type(out).__name__}"
        return None
    if isinstance(inp, list):
        return _turns_problem(inp, where_in, last_only=not cfg.multiturn and not cfg.pretrain_mode)
    if _empty(inp):
        return f"{where_in}: empty text"
    if not cfg.pretrain_mode:
        return (
            f"{where_in}: a plain string needs --output_key for the response (or --pretrain_mode)"
        )
    return None


# ---------------------------------------------------------------- rendering


def _template(tokenizer, messages: list, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _after(full: str, prefix: str, what: str) -> Span:
    if not full.startswith(prefix):
        raise UserError(
            f"{what}: the chat template renders a conversation with a different prefix than "
            "its first turns rendered with add_generation_prompt=True; responses cannot be "
            "located (use --pretrain_mode or a template that renders turns incrementally)"
        )
    return len(prefix), len(full)


def _conversation(messages: list, tokenizer, *, last_only: bool) -> tuple[str, list[Span]]:
    full = _template(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if (last_only and i != len(messages) - 1) or (not last_only and m["role"] != "assistant"):
            continue
        before = _template(tokenizer, messages[:i], generation_prompt=True)
        upto = _template(tokenizer, messages[: i + 1])
        start, end = _after(upto, before, "--input_key")
        _after(full, upto, "--input_key")
        spans.append((start, end))
    return full, spans


def _as_messages(value: Any, role: str) -> list:
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def render_sample(row: dict, cfg: SFTDataConfig, tokenizer) -> tuple[str, list[Span]]:
    """The text of one checked row and the character spans the loss learns."""
    inp = row[cfg.input_key]
    out = row[cfg.output_key] if cfg.output_key is not None else None
    if cfg.apply_chat_template:
        if out is not None:
            prompt = _as_messages(inp, "user")
            before = _template(tokenizer, prompt, generation_prompt=True)
            full = _template(tokenizer, prompt + _as_messages(out, "assistant"))
            spans = [_after(full, before, "--output_key")]
        elif isinstance(inp, list):
            full, spans = _conversation(inp, tokenizer, last_only=not cfg.multiturn)
        else:  # pretrain mode, plain text
            full, spans = inp, []
    else:
        prompt = inp
        if cfg.input_template and not cfg.pretrain_mode:
            prompt = cfg.input_template.format(inp)
        full = prompt + (out or "")
        spans = [(len(prompt), len(full))]
    if cfg.pretrain_mode:
        spans = [(0, len(full))]
    return full, spans


# ---------------------------------------------------------------- tokenizing


def _overlaps(offset: tuple[int, int], spans: list[Span]) -> bool:
    s, e = offset
    return e > s and any(s < end and e > start for start, end in spans)


def _tokenize_batch(
    batch: dict[str, list],
    *,
    cfg: SFTDataConfig,
    tokenizer,
    vision: VisionProcessor | None = None,
    image_key: str | None = None,
) -> dict:
    n = len(batch[cfg.input_key])
    rendered = [
        render_sample({k: v[i] for k, v in batch.items()}, cfg, tokenizer) for i in range(n)
    ]
    special = not cfg.apply_chat_template  # templates hold the model's special tokens
    enc = tokenizer(
        [text for text, _ in rendered], add_special_tokens=special, return_offsets_mapping=True
    )
    out: dict[str, list] = {"input_ids": [], "loss_mask": []}
    if vision is not None:
        out["images"] = []
    for i, (ids, offsets, (_, spans)) in enumerate(
        zip(enc["input_ids"], enc["offset_mapping"], rendered, strict=True)
    ):
        mask = [int(_overlaps(o, spans)) for o in offsets]
        if not cfg.apply_chat_template and tokenizer.eos_token_id is not None:
            ids, mask = ids + [tokenizer.eos_token_id], mask + [1]
        refs: list[str] = []
        if vision is not None:
            refs, ids, mask = vision.expand_row(batch.get(image_key, [None] * n)[i], ids, mask)
            if refs and vision.last_image_token(ids) >= cfg.max_len:
                continue  # an image would be cut: dropped, counted by the caller
        ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
        mask[0] = 0  # nothing predicts the first token
        if not any(mask):
            continue  # the response was truncated away: counted by the caller
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        if vision is not None:
            out["images"].append(refs)
    return out


def tokenize_samples(
    dataset: datasets.Dataset,
    tokenizer,
    cfg: SFTDataConfig,
    *,
    what: str = "train",
    vision: VisionProcessor | None = None,
    image_key: str | None = None,
) -> tuple[datasets.Dataset, int]:
    """Render and tokenize every (checked) row once.

    Returns:
        ``(samples, dropped)``: columns ``input_ids`` (int32 lists of at most ``max_len``) and
        ``loss_mask`` (int8, 1 on learned tokens), with a VLM (``vision``) ``images`` (each
        row's image references), and the number of rows dropped because truncation to
        ``max_len`` left no learned token or would cut an image.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            "sft needs a fast (Rust) tokenizer: responses are located by character offsets"
        )
    import datasets

    columns = {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
    if vision is not None:
        columns["images"] = datasets.Sequence(datasets.Value("string"))
    features = datasets.Features(columns)
    tokenize = partial(
        _tokenize_batch, cfg=cfg, tokenizer=tokenizer, vision=vision, image_key=image_key
    )
    samples = dataset.map(
        tokenize,
        batched=True,
        remove_columns=dataset.column_names,
        features=features,
        keep_in_memory=True,  # every rank tokenizes the same data: no cache files to race on
        desc=f"tokenizing {what} samples",
    )
    dropped = len(dataset) - len(samples)
    if dropped:
        log.warning(
            "%s: dropped %d of %d rows whose response lies entirely beyond max_len=%d tokens",
            what,
            dropped,
            len(dataset),
            cfg.max_len,
        )
    return samples, dropped


# ---------------------------------------------------------------- batching


@dataclass(frozen=True)
class SFTBatch:
    """Right-padded sequences for one forward.

    Attributes:
        input_ids, attention_mask: (N, L) long.
        loss_mask: (N, L) bool, True on learned tokens.
        num_valid: rows 0..num_valid-1 are real; the rest pad an uneven eval shard.
        images: the rows' processed images (a VLM), or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    num_valid: int
    images: ImageBatch | None = None


def collate_samples(
    rows: dict[str, list],
    pad_id: int,
    num_valid: int | None = None,
    vision: VisionProcessor | None = None,
) -> SFTBatch:
    """Columns of N samples (``dataset[indices]``) -> an :class:`SFTBatch` (``vision``: decode
    and process the rows' images)."""
    seqs = rows["input_ids"]
    ids, attn = right_pad(seqs, pad_id)
    loss, _ = right_pad(rows["loss_mask"], 0)
    images = row_images(rows, vision)
    valid = len(seqs) if num_valid is None else num_valid
    return SFTBatch(ids, attn, loss.bool(), valid, images)


def row_images(rows: dict[str, list], vision: VisionProcessor | None) -> ImageBatch | None:
    """The ``images`` column of a micro-batch decoded and processed (None: no VLM)."""
    if vision is None or "images" not in rows:
        return None
    from fsdp_rlhf.data.images import load_images

    return ImageBatch([vision.process(load_images(refs)) for refs in rows["images"]])
