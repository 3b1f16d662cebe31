"""Shared-prefix forwards: tokens that several sequences start with go through the model once.

Two layouts. PPO groups (:func:`share_prompts`): GRPO-style rollouts sample ``n`` responses per
prompt, and a padded (B, P + T) batch computes every layer on each sample's copy of the prompt. Here
``s`` consecutive rows that share their prompt become one row ``[prompt | response_1 | ... |
response_s]`` of ``P + s*T`` tokens: the prompt's tokens go through the model once, each response
attends to the prompt's keys and causally to itself but never to its siblings (``models.attention``
reads the layout from the 4D prompt mask this module passes as the attention mask, or, where a
varlen kernel runs, from the same rows as varlen segments, ``models.varlen``). The result is
the same function of the weights as the padded forward, so log-probs, gradients and everything
downstream are unchanged up to float rounding; the work drops from ``s (P + T)`` to ``P + s T``
tokens per group (the bench's GRPO: 4 x (44 + 64) -> 44 + 4 x 64 tokens, 0.69x).

Position ids continue each response from its prompt's real length, as the padded row's
``cumsum(attention_mask) - 1`` does, so rotary embeddings see the same positions.

Preference pairs (:func:`share_pair_prefixes`, ``train-rm --packing_samples``): the chosen and
rejected sequences of a pair usually start with the same prompt; in the packed row the rejected
one keeps only its rest, which attends to the prefix in the chosen segment
(``models.attention.varlen_sdpa``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_rlhf.models.attention import PADDED_ATTENTION
from fsdp_rlhf.models.packing import PackedRow
from fsdp_rlhf.models.ulysses import base_attention
from fsdp_rlhf.models.varlen import VarlenSegments, shared_prompt_segments


def shared_group_size(n_samples: int, *batch_sizes: int) -> int:
    """Rows per shared-prompt group: the largest size that divides the samples per prompt and
    every batch the rows are cut into (micro-batches, minibatches), so each cut holds whole
    groups and each forward keeps its number of sequences. 1 means no sharing.

    >>> shared_group_size(4, 8, 16), shared_group_size(8, 2, 16), shared_group_size(4, 3, 12)
    (4, 2, 1)
    """
    return math.gcd(n_samples, *batch_sizes)


def sharing_blocker(model: nn.Module, packed: bool) -> str | None:
    """Why this model's forwards cannot share prompts, or None when they can."""
    if packed:
        return "--packing_samples packs sequences instead"
    if getattr(model.config, "vision_config", None) is not None:
        return "a vision-language model's prompts carry images the shared prompt pass lacks"
    impl = base_attention(model)  # inside Ulysses when the model is sequence-parallel
    if impl != PADDED_ATTENTION:
        return f"the model's attention is {impl} (flash-attn's kernels take no shared prefix)"
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"the model has {sorted(layer_types - {'full_attention'})} layers"
    return None


@dataclass(frozen=True)
class SharedPromptRows:
    """B = G * s padded rows as G shared-prompt rows.

    ``input_ids``/``position_ids`` (G, P' + s*T); ``prompt_mask`` (G, 1, 1, P') and
    ``response_mask`` (B, 1, 1, T) bool, True on the tokens attended (P' is the longest prompt
    of the batch: common left padding is cut); ``group_size`` s. ``logit_index`` (s, T) maps
    each response token to the position, among the last ``1 + s*T`` of the row, whose logits
    predict it. ``segments``: the same rows as varlen segments (each response's keys
    ``[prompt | response]``, ``models.varlen.shared_prompt_segments``), for one varlen kernel
    call per layer where one runs; the masks serve the masked path.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_mask: torch.Tensor
    group_size: int
    response_len: int
    segments: VarlenSegments | None = None

    @property
    def logits_to_keep(self) -> int:
        # the last prompt position (it predicts every response's first token) and the responses
        return 1 + self.group_size * self.response_len

    @property
    def logit_index(self) -> torch.Tensor:
        s, T = self.group_size, self.response_len
        index = torch.arange(s * T, device=self.input_ids.device).view(s, T)
        index[:, 0] = 0  # each response's first token is predicted by the prompt's last one
        return index

    def model_inputs(self) -> dict:
        return dict(
            input_ids=self.input_ids,
            attention_mask=self.prompt_mask,
            position_ids=self.position_ids,
            use_cache=False,
            logits_to_keep=self.logits_to_keep,
            # models.attention.padded_sdpa: this keyword selects the shared-prompt layout
            grouped_response_mask=self.response_mask,
            # and this one its varlen layout, where a varlen kernel runs (models.varlen)
            grouped_segments=self.segments,
        )


def share_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int, group_size: int
) -> SharedPromptRows:
    """(B, P + T) rows, prompts left-padded and responses right-padded, where each run of
    ``group_size`` consecutive rows shares one prompt -> :class:`SharedPromptRows`.

    Raises ValueError if the rows of a group do not share their prompt (ids and mask).
    """
    B, L = input_ids.shape
    s, T = group_size, response_len
    if B % s:
        raise ValueError(f"share_prompts: {B} rows do not split into groups of {s}")
    G, P = B // s, L - T
    prompt_ids = input_ids[:, :P].view(G, s, P)
    prompt_mask = attention_mask[:, :P].view(G, s, P)
    shared = (prompt_ids == prompt_ids[:, :1]).all() & (prompt_mask == prompt_mask[:, :1]).all()
    prompt_mask = prompt_mask[:, 0].bool()
    lengths = prompt_mask.sum(-1)
    # one copy to the host for both the check and the lengths (each read is a device sync)
    *lengths_host, shared_host = torch.cat([lengths, shared.long().view(1)]).tolist()
    if not shared_host:
        raise ValueError(f"share_prompts: rows of a group of {s} do not share their prompt")
    cut = P - max(lengths_host)  # left padding every prompt of the batch has
    prompt_ids, prompt_mask = prompt_ids[:, 0, cut:], prompt_mask[:, cut:]
    prompt_positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, P:].bool()
    # as cumsum(attention_mask) - 1 over the padded row continues after the prompt
    response_positions = lengths.repeat_interleave(s).unsqueeze(1) + response_mask.cumsum(-1) - 1
    responses = input_ids[:, P:].reshape(G, s * T)
    return SharedPromptRows(
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        position_ids=torch.cat(
            [prompt_positions, response_positions.clamp(min=0).reshape(G, s * T)], dim=1
        ),
        # contiguous: compiled blocks guard on strides, and slices' strides follow the padding
        prompt_mask=prompt_mask[:, None, None, :].contiguous(),
        response_mask=response_mask[:, None, None, :].contiguous(),
        group_size=s,
        response_len=T,
        segments=shared_prompt_segments(lengths, lengths_host, P - cut, s, T),
    )


def shared_prompt_inputs(rows: SharedPromptRows) -> tuple[dict, torch.Tensor]:
    """The model inputs of the shared rows and where each response token's prediction sits in
    their logits.

    Returns:
        ``(inputs, index)``: the model's keyword arguments (its logits are
        (G, 1 + s*T, V)), and (B, T) row of ``logits.reshape(-1, V)`` predicting each response
        token, in the padded rows' order (``models.head.model_logprobs`` reads them).
    """
    # A new prompt length per batch: compiled blocks (models.compile) take it as dynamic from
    # the first call instead of recompiling at the second length.
    torch._dynamo.maybe_mark_dynamic(rows.prompt_mask, 3)
    torch._dynamo.maybe_mark_dynamic(rows.response_mask, 3)
    G, K = rows.input_ids.shape[0], rows.logits_to_keep
    offsets = torch.arange(G, device=rows.input_ids.device).view(G, 1, 1) * K
    index = offsets + rows.logit_index.unsqueeze(0)  # (G, s, T)
    return rows.model_inputs(), index.view(G * rows.group_size, rows.response_len)


# ---------------------------------------------------------------- preference pairs


@dataclass(frozen=True)
class SharedPairRow:
    """B preference pairs packed into one row without padding, each pair's common prefix once:
    segments ``[prefix + chosen rest]`` and ``[rejected rest]`` of ``packed`` alternate, pair
    by pair; ``prefix_lens`` (B,) are the tokens each rejected rest attends to at the start of
    its chosen segment."""

    packed: PackedRow
    prefix_lens: torch.Tensor

    def model_inputs(self) -> dict:
        # models.attention.varlen_sdpa: this keyword selects the shared-prefix pairs
        return {**self.packed.model_inputs(), "shared_prefix_lens": self.prefix_lens}

    @property
    def last_index(self) -> torch.Tensor:
        """(2B,) last token of each chosen, then each rejected sequence."""
        ends = self.packed.last_index
        return torch.cat([ends[0::2], ends[1::2]])


def share_pair_prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SharedPairRow:
    """(2B, L) right-padded rows, B chosen then B rejected -> :class:`SharedPairRow`.

    The shared prefix of a pair is the longest run of equal leading tokens (the prompt, and any
    equal start of the two replies), less at least one token on each side: a score is read at
    each sequence's own last token.
    """
    B = input_ids.shape[0] // 2
    L = input_ids.shape[1]
    mask = attention_mask.bool()
    chosen, rejected = input_ids[:B], input_ids[B:]
    same = (chosen == rejected) & mask[:B] & mask[B:]
    common = same.long().cumprod(-1).sum(-1)
    lengths = mask.sum(-1)
    prefix = torch.minimum(common, torch.minimum(lengths[:B], lengths[B:]) - 1).clamp(min=0)
    cols = torch.arange(L, device=input_ids.device)
    keep_rejected = mask[B:] & (cols >= prefix.unsqueeze(1))
    # pair by pair: chosen i, then rejected i's rest
    ids = torch.stack([chosen, rejected], dim=1).reshape(2 * B, L)
    keep = torch.stack([mask[:B], keep_rejected], dim=1).reshape(2 * B, L)
    positions = (mask.long().cumsum(-1) - 1).view(2, B, L).transpose(0, 1).reshape(2 * B, L)
    segment_lens = keep.sum(-1)
    packed = PackedRow(
        input_ids=ids[keep].unsqueeze(0),
        position_ids=positions[keep].unsqueeze(0),
        cu_seqlens=torch.nn.functional.pad(segment_lens.cumsum(0), (1, 0)),
        max_len=int(segment_lens.max()),
    )
    return SharedPairRow(packed, prefix)
