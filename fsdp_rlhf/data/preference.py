"""Preference pairs -> token ids, a resumable per-rank schedule, and the concatenated collate.

Texts are rendered and tokenized once, up front. A sequence never ends with a pad token, so
the score position is the same for every rule in use: our "last attended token", and HF's
"last non-pad token" that ``AutoModelForSequenceClassification`` (and vLLM) apply to
right-padded input.

How a sequence ends (:func:`tokenize_pairs`' ``template_ends_turns``):

* ``train-rm``: always with EOS (unless the tokenizer pads with EOS), the position the reward is
  read at, as OpenRLHF's reward dataset does; after a chat template too.
* ``dpo``: as ``sft`` (and TRL): with ``--apply_chat_template`` the template renders every
  reply as the assistant's turn (a string reply too) and its end-of-turn ends the sequence, so
  no EOS follows (``...<|im_end|>\n``, not ``...<|im_end|>\n<|im_end|>``); plain text ends
  with EOS.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # imported where used: the GPU box runs without `datasets`
    import datasets

from fsdp_rlhf.config import PreferenceDataConfig
from fsdp_rlhf.data.schedule import DataPosition, StepSchedule, eval_shard
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.vision import ImageBatch

if TYPE_CHECKING:
    from fsdp_rlhf.data.vision import VisionProcessor

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- rendering


def _template(tokenizer, messages: list, *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def _need_template(cfg: PreferenceDataConfig, flag: str, key: str) -> None:
    if not cfg.apply_chat_template:
        raise UserError(
            f"{flag} {key!r}: values are chat-message lists; add --apply_chat_template to render "
            "them with the tokenizer's chat template"
        )


def _check_type(value: Any, flag: str, key: str) -> None:
    if not isinstance(value, str | list):
        raise UserError(
            f"{flag} {key!r}: expected a string or a list of chat messages, got "
            f"{type(value).__name__}"
        )


def render_prompt(value: Any, cfg: PreferenceDataConfig, tokenizer) -> tuple[str, list | None]:
    """The prompt text, and its messages when a chat template renders it."""
    _check_type(value, "--prompt_key", str(cfg.prompt_key))
    if isinstance(value, list):
        _need_template(cfg, "--prompt_key", str(cfg.prompt_key))
        return _template(tokenizer, value, generation_prompt=True), value
    if cfg.apply_chat_template:
        messages = [{"role": "user", "content": value}]
        return _template(tokenizer, messages, generation_prompt=True), messages
    return (cfg.input_template.format(value) if cfg.input_template else value), None


def render_reply(
    value: Any,
    prompt: tuple[str, list | None] | None,
    cfg: PreferenceDataConfig,
    tokenizer,
    flag: str,
    key: str,
    *,
    string_as_turn: bool = False,
) -> tuple[str, bool]:
    """The full text of one side of a pair (prompt + reply, or the whole text without a
    prompt), and whether a chat template rendered its end.

    A message-list reply after a prompt is rendered as ``template(prompt + reply)``, which must
    start with the prompt rendered with its generation prompt: otherwise the chosen and rejected
    texts would not share the prompt the model is asked to continue. With ``string_as_turn``
    and ``--apply_chat_template`` a string reply after a prompt is the assistant's message,
    rendered the same way (as ``sft`` renders a string output); otherwise it is appended as is.
    """
    _check_type(value, flag, key)
    if isinstance(value, str):
        if prompt is None or not (string_as_turn and cfg.apply_chat_template):
            return (value if prompt is None else prompt[0] + value), False
        value = [{"role": "assistant", "content": value}]
    _need_template(cfg, flag, key)
    if prompt is None:
        return _template(tokenizer, value, generation_prompt=False), True
    prompt_text, prompt_messages = prompt
    if prompt_messages is None:
        raise UserError(f"{flag} {key!r}: message-list replies need message-list prompts")
    full = _template(tokenizer, prompt_messages + value, generation_prompt=False)
    if not full.startswith(prompt_text):
        raise UserError(
            f"{flag} {key!r}: the chat template renders prompt + reply with a different prefix "
            "than the prompt with add_generation_prompt=True, so the reply cannot be located; "
            "use a template that renders turns incrementally (--tokenizer_chat_template)"
        )
    return full, True


# ---------------------------------------------------------------- tokenizing


def finish_ids(
    ids: list[int], *, pad_id: int, eos_id: int, max_len: int, append_eos: bool = True
) -> list[int]:
    """Append EOS (with ``append_eos``, unless pad == EOS), truncate to ``max_len`` keeping the
    EOS, strip trailing pads.

    When pad == EOS an appended EOS would be read as padding by HF's last-non-pad rule, so none
    is appended. Trailing pad tokens are dropped for the same reason.
    """
    append_eos = append_eos and eos_id != pad_id
    if append_eos and (not ids or ids[-1] != eos_id):
        ids = ids + [eos_id]
    if len(ids) > max_len:
        ids = ids[: max_len - 1] + [eos_id] if append_eos else ids[:max_len]
    while ids and ids[-1] == pad_id:
        ids = ids[:-1]
    return ids


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Number of equal leading tokens of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prompt_length(chosen: list[int], rejected: list[int], prompt: list[int] | None) -> int:
    """Tokens of a pair that belong to its prompt: the prompt's tokens both sides start with
    (a merge across the prompt/reply boundary makes that fewer than the prompt's own count), or
    without a prompt the pair's common prefix; at least one token of each side is left over."""
    if prompt is None:
        n = common_prefix_len(chosen, rejected)
    else:
        n = min(common_prefix_len(prompt, chosen), common_prefix_len(prompt, rejected))
    return max(0, min(n, len(chosen) - 1, len(rejected) - 1))


def _tokenize_batch(
    batch: dict[str, list],
    *,
    cfg: PreferenceDataConfig,
    tokenizer,
    with_prompt_len: bool = False,
    vision: VisionProcessor | None = None,
    image_key: str | None = None,
    template_ends_turns: bool = False,
) -> dict:
    n = len(batch[cfg.chosen_key])
    chosen, rejected, prompts = [], [], []
    templated: list[tuple[bool, bool]] = []  # did a template render each side's end
    render = partial(render_reply, cfg=cfg, tokenizer=tokenizer, string_as_turn=template_ends_turns)
    for i in range(n):
        prompt = None
        if cfg.prompt_key is not None:
            prompt = render_prompt(batch[cfg.prompt_key][i], cfg, tokenizer)
            prompts.append(prompt[0])
        c, c_templated = render(
            batch[cfg.chosen_key][i], prompt, flag="--chosen_key", key=cfg.chosen_key
        )
        r, r_templated = render(
            batch[cfg.rejected_key][i], prompt, flag="--rejected_key", key=cfg.rejected_key
        )
        chosen.append(c)
        rejected.append(r)
        templated.append((c_templated, r_templated))
    # Template output already holds the model's special tokens (BOS); plain text gets them here.
    special = not cfg.apply_chat_template
    finish = partial(
        finish_ids,
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        max_len=cfg.max_len,
    )
    out: dict[str, list] = {"chosen_ids": [], "rejected_ids": []}
    if cfg.margin_key is not None:
        out["margin"] = []
    if with_prompt_len:
        out["prompt_len"] = []
    if vision is not None:
        out["images"] = []
    enc_c = tokenizer(chosen, add_special_tokens=special)["input_ids"]
    enc_r = tokenizer(rejected, add_special_tokens=special)["input_ids"]
    enc_p = tokenizer(prompts, add_special_tokens=special)["input_ids"] if prompts else None
    for i, (c, r) in enumerate(zip(enc_c, enc_r, strict=True)):
        p = enc_p[i] if enc_p else None
        refs: list[str] = []
        if vision is not None:  # each image placeholder expanded to the image's tokens
            value = batch.get(image_key, [None] * n)[i]
            refs, c, _ = vision.expand_row(value, c)
            _, r, _ = vision.expand_row(value, r)
            if p is not None:
                _, p, _ = vision.expand_row(value, p)
            if refs and max(map(vision.last_image_token, (c, r))) >= cfg.max_len - 1:
                continue  # truncation would cut an image: dropped, counted by the caller
        # a template's end-of-turn ends the sequence where template_ends_turns (dpo, as sft)
        c_end, r_end = (template_ends_turns and t for t in templated[i])
        c, r = finish(c, append_eos=not c_end), finish(r, append_eos=not r_end)
        if not c or not r or c == r:
            continue  # counted as dropped by the caller
        out["chosen_ids"].append(c)
        out["rejected_ids"].append(r)
        if vision is not None:
            out["images"].append(refs)
        if with_prompt_len:
            out["prompt_len"].append(prompt_length(c, r, p))
        if cfg.margin_key is not None:
            out["margin"].append(_margin(batch[cfg.margin_key][i], cfg.margin_key))
    return out


def _margin(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"--margin_key {key!r}: expected a number, got {value!r}")
    return float(value)


def tokenize_pairs(
    dataset: datasets.Dataset,
    tokenizer,
    cfg: PreferenceDataConfig,
    *,
    what: str = "train",
    with_prompt_len: bool = False,
    vision: VisionProcessor | None = None,
    image_key: str | None = None,
    template_ends_turns: bool = False,
) -> tuple[datasets.Dataset, int]:
    """Render and tokenize every pair once (``vision``: a VLM's processor; each pair's images,
    under ``image_key``, belong to its prompt and go with both sides). ``template_ends_turns``
    (dpo): with ``--apply_chat_template`` string replies are assistant turns and no EOS follows
    a template's end of turn (the module docstring); otherwise every sequence ends with EOS.

    Returns:
        ``(pairs, dropped)``: a dataset with ``chosen_ids`` and ``rejected_ids`` (int32 lists,
        each at most ``max_len`` long), ``margin`` (with ``--margin_key``) and ``prompt_len``
        (with ``with_prompt_len``: :func:`prompt_length`), and the number of pairs dropped
        because chosen and rejected were identical (or empty) after truncation.
    """
    import datasets

    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise UserError("the tokenizer has no EOS token: the reward is read at the EOS position")
    features = {
        "chosen_ids": datasets.Sequence(datasets.Value("int32")),
        "rejected_ids": datasets.Sequence(datasets.Value("int32")),
    }
    if cfg.margin_key is not None:
        features["margin"] = datasets.Value("float32")
    if with_prompt_len:
        features["prompt_len"] = datasets.Value("int32")
    if vision is not None:
        features["images"] = datasets.Sequence(datasets.Value("string"))
    tokenize = partial(
        _tokenize_batch,
        cfg=cfg,
        tokenizer=tokenizer,
        with_prompt_len=with_prompt_len,
        vision=vision,
        image_key=image_key,
        template_ends_turns=template_ends_turns,
    )
    pairs = dataset.map(
        tokenize,
        batched=True,
        remove_columns=dataset.column_names,
        features=datasets.Features(features),
        # In memory: every rank tokenizes the same data; no shared cache files to race on.
        keep_in_memory=True,
        desc=f"tokenizing {what} pairs",
    )
    dropped = len(dataset) - len(pairs)
    if dropped:
        log.warning(
            "%s: dropped %d of %d pairs whose chosen and rejected are identical (or empty) after "
            "truncation to max_len=%d",
            what,
            dropped,
            len(dataset),
            cfg.max_len,
        )
    return pairs, dropped


# ---------------------------------------------------------------- batching


@dataclass(frozen=True)
class PairBatch:
    """Chosen rows first, then rejected rows, right-padded, for one forward.

    Attributes:
        input_ids: (2B, L) long.
        attention_mask: (2B, L) long, 1 on tokens.
        margin: (B,) float32, or None without ``--margin_key``.
        num_valid: pairs 0..num_valid-1 are real; the rest pad an uneven eval shard.
        prompt_lens: (B,) long prompt tokens of each pair (DPO), or None.
        images: the 2B rows' images (a VLM: each pair's on both its rows), or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    margin: torch.Tensor | None
    num_valid: int
    prompt_lens: torch.Tensor | None = None
    images: ImageBatch | None = None

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (N, L) long ids padded on the right with ``pad_id``, and their (N, L)
    attention mask (1 on tokens)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def collate_pairs(
    rows: dict[str, list],
    pad_id: int,
    num_valid: int | None = None,
    vision: VisionProcessor | None = None,
) -> PairBatch:
    """Columns of B pairs (``dataset[indices]``) -> a :class:`PairBatch` of 2B sequences
    (``vision``: the pairs' images decoded and processed, once per pair)."""
    ids, mask = right_pad(rows["chosen_ids"] + rows["rejected_ids"], pad_id)
    margin = torch.tensor(rows["margin"], dtype=torch.float32) if "margin" in rows else None
    prompt_lens = torch.tensor(rows["prompt_len"]) if "prompt_len" in rows else None
    n = len(rows["chosen_ids"])
    images = None
    if vision is not None and "images" in rows:
        from fsdp_rlhf.data.images import load_images

        per_pair = [vision.process(load_images(refs)) for refs in rows["images"]]
        images = ImageBatch(per_pair + per_pair)
    valid = n if num_valid is None else num_valid
    return PairBatch(ids, mask, margin, valid, prompt_lens, images)


class PreferenceLoader:
    """Micro-batches of one optimizer step for this rank, from a :class:`StepSchedule`.

    ``collate(rows, pad_id)`` turns a micro-batch's columns into a batch (default: pairs;
    ``sft`` passes its own for single sequences)."""

    def __init__(
        self,
        pairs: datasets.Dataset,
        schedule: StepSchedule,
        micro_batch: int,
        pad_id: int,
        collate=collate_pairs,
    ) -> None:
        if schedule.per_rank % micro_batch:
            raise ValueError(f"{schedule.per_rank} rows per rank not divisible by {micro_batch}")
        self.pairs = pairs
        self.schedule = schedule
        self.micro_batch = micro_batch
        self.pad_id = pad_id
        self.collate = collate

    def step_batches(self, pos: DataPosition) -> list:
        """The gradient-accumulation micro-batches of step ``pos`` on this rank."""
        idx = self.schedule.rank_indices(pos.epoch, pos.step)
        chunks = [idx[i : i + self.micro_batch] for i in range(0, len(idx), self.micro_batch)]
        return [self.collate(self.pairs[c], self.pad_id) for c in chunks]


def eval_batches(
    pairs: datasets.Dataset,
    world_size: int,
    rank: int,
    micro_batch: int,
    pad_id: int,
    collate=collate_pairs,
) -> Iterator:
    """This rank's eval micro-batches (same count on every rank; see ``eval_shard``)."""
    for idx, valid in eval_shard(len(pairs), world_size, rank, micro_batch):
        yield collate(pairs[idx], pad_id, num_valid=valid)


def hold_out(
    pairs: datasets.Dataset, seed: int, fraction: float = 0.01, minimum: int = 8
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split off ``max(fraction * N, minimum)`` random pairs (at most half) as the eval set.

    Returns:
        ``(train, eval)``, disjoint.
    """
    n = len(pairs)
    n_eval = min(max(math.ceil(n * fraction), minimum), n // 2)
    order = np.random.default_rng([seed, 1_000_003]).permutation(n)
    return pairs.select(np.sort(order[n_eval:])), pairs.select(np.sort(order[:n_eval]))
