"""One forward's inputs, composed from independent parts.

Every forward entry (``models.forward``: log-probs, values, scores; ``models.label_logprobs``)
takes a :class:`ForwardInputs` built here, never raw rows plus flags. A batch arrives as B
padded rows (any padding side, one contiguous run of tokens each) and goes through the model
as R model rows of Lm tokens, composed of:

- **rows** (one of :data:`RowLayout`): ``padded`` (the rows as they are); ``packed`` (the
  attended tokens of every row in one row, ``models.packing``; the model must use varlen
  attention); ``shared_prompts`` (PPO groups of s consecutive rows sharing a prompt, each group
  one row ``[prompt | s responses]``, ``models.shared_prefix.share_prompts``);
  ``shared_pairs`` (preference pairs packed with each pair's common prefix once,
  ``models.shared_prefix.share_pair_prefixes``);
- **images**: a vision-language model's pixel values and image grids, in row order, and its
  M-RoPE positions: left to the model (from the token types) for whole padded rows, else
  computed by the model's own rule over each padded row and laid out as its tokens are (packed
  rows: each segment its own positions; sequence-parallel slices: sliced with the tokens);
- **the sequence-parallel slice**: each rank of a group runs its 1/N of every model row
  (``models.ulysses.shard_inputs``), applied when the model is called.

Each rows part also records the correspondence between the two layouts, which is all the
entries need to read their outputs and all per-token inputs (router replay,
``models.moe``) need to be laid out, whatever the parts:

- ``where`` (B, L): the flat position ``r * Lm + c`` in the model rows of every padded token
  (a padding token maps to a token of its own sequence, so every index is valid);
- ``source`` (R, Lm): the flat position ``b * L + l`` in the padded rows that every model
  position holds (padding of the model rows maps to padding of the padded rows).

A new layout or modality is one more part here; the entries do not change.

Shapes: B padded rows of L tokens; R model rows of Lm tokens; s rows per shared prompt; T
response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from fsdp_rlhf.distributed.sequence_parallel import SequenceParallel
from fsdp_rlhf.models.packing import pack_rows
from fsdp_rlhf.models.shared_prefix import share_pair_prefixes, share_prompts
from fsdp_rlhf.models.ulysses import shard_inputs
from fsdp_rlhf.models.vision import ImageBatch, ImagePositions, VisionTokens

RowLayout = Literal["padded", "packed", "shared_prompts", "shared_pairs"]
ROW_LAYOUTS: tuple[str, ...] = ("padded", "packed", "shared_prompts", "shared_pairs")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, L) positions counting only attended tokens (left-padded prompts get the
    positions of unpadded ones: HF decoders derive theirs from the cache position)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B,) index of the last attended token of each row (any padding side)."""
    L = attention_mask.shape[-1]
    idx = torch.arange(L, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), idx, -1).max(-1).values


@dataclass(frozen=True)
class ModelRows:
    """What a rows part makes of B padded rows: the model's keyword arguments for R rows of
    Lm tokens (``input_ids`` (R, Lm) among them), ``where`` (B, L) and ``source`` (R, Lm) (see
    the module docstring)."""

    kwargs: dict
    where: torch.Tensor
    source: torch.Tensor


# ---------------------------------------------------------------- the rows parts


def padded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ModelRows:
    """The (B, L) rows as they are, positions counting attended tokens only."""
    B, L = input_ids.shape
    flat = torch.arange(B * L, device=input_ids.device).view(B, L)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return ModelRows(kwargs, flat, flat)


def packed_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ModelRows:
    """The attended tokens of the B rows as one (1, n) row (``models.packing.pack_rows``)."""
    row = pack_rows(input_ids, attention_mask)
    where = row.cu_seqlens[:-1].unsqueeze(1) + position_ids_from_mask(attention_mask)
    return ModelRows(row.model_inputs(), where, row.source.view(1, -1))


def shared_prompt_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int, group_size: int
) -> ModelRows:
    """G = B / s rows ``[prompt | s responses]`` of Lm = P' + s T tokens
    (``models.shared_prefix.share_prompts``; P' the longest prompt, common left padding cut)."""
    rows = share_prompts(input_ids, attention_mask, response_len, group_size)
    # A new prompt length per batch: compiled blocks (models.compile) take it as dynamic from
    # the first call instead of recompiling at the second length.
    torch._dynamo.maybe_mark_dynamic(rows.prompt_mask, 3)
    torch._dynamo.maybe_mark_dynamic(rows.response_mask, 3)
    B, L = input_ids.shape
    s, T = group_size, response_len
    G, Lm = rows.input_ids.shape
    P, P_kept = L - T, Lm - s * T
    cut = P - P_kept
    dev = input_ids.device
    b, col = torch.arange(B, device=dev).view(B, 1), torch.arange(L, device=dev).view(1, L)
    g, j = b // s, b % s
    in_prompt = g * Lm + (col - cut).clamp(min=0)
    in_response = g * Lm + P_kept + j * T + (col - P)
    where = torch.where(col < P, in_prompt, in_response)
    prompt_src = (
        (torch.arange(G, device=dev) * s * L).view(G, 1) + cut + torch.arange(P_kept, device=dev)
    )
    response_src = (torch.arange(B, device=dev) * L).view(B, 1) + P + torch.arange(T, device=dev)
    source = torch.cat([prompt_src, response_src.view(G, s * T)], dim=1)
    kwargs = {k: v for k, v in rows.model_inputs().items() if k != "logits_to_keep"}
    return ModelRows(kwargs, where, source)


def shared_pair_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ModelRows:
    """B preference pairs ((2B, L) right-padded rows: B chosen, then B rejected) as one packed
    row, each pair's common prefix once (``models.shared_prefix.share_pair_prefixes``). A
    rejected token inside the prefix is read from the chosen segment (the same context)."""
    shared = share_pair_prefixes(input_ids, attention_mask)
    cu, prefix = shared.packed.cu_seqlens, shared.prefix_lens
    N, L = input_ids.shape
    B = N // 2
    dev = input_ids.device
    pos = position_ids_from_mask(attention_mask)
    pair = torch.arange(N, device=dev).view(N, 1) % B
    chosen_seg = cu[2 * pair] + pos
    rejected_rest = cu[2 * pair + 1] + pos - prefix[pair]
    rejected = torch.arange(N, device=dev).view(N, 1) >= B
    where = torch.where(rejected & (pos >= prefix[pair]), rejected_rest, chosen_seg)
    mask = attention_mask.bool()
    cols = torch.arange(L, device=dev)
    keep_rejected = mask[B:] & (cols >= prefix.unsqueeze(1))
    keep = torch.stack([mask[:B], keep_rejected], dim=1).reshape(N, L)
    flat = torch.arange(N * L, device=dev).view(2, B, L).transpose(0, 1).reshape(N, L)
    source = flat[keep].view(1, -1)
    return ModelRows(shared.model_inputs(), where, source)


# ---------------------------------------------------------------- the images part


def with_images(
    rows: ModelRows,
    tokens: VisionTokens,
    input_ids: torch.Tensor,
    images: ImageBatch | None,
    whole_padded: bool,
) -> tuple[ModelRows, ImagePositions | None]:
    """A vision-language model's image inputs added to its rows: ``pixel_values`` and
    ``image_grid_thw`` of every row's images in row order (``ImageBatch.model_kwargs``: packed
    rows keep the rows' order, so each segment's placeholders meet its own images).

    ``whole_padded`` (padded rows, not split): ``mm_token_type_ids`` (B, L) too, from which the
    model computes its M-RoPE positions over the attended tokens, so ``position_ids`` is left
    to it. Otherwise the positions are computed beforehand (:class:`ImagePositions`, returned;
    ``ForwardInputs.model_kwargs``). Rows without any image keep the text positions."""
    mm = images.model_kwargs(input_ids.device) if images is not None else {}
    if not mm:
        return rows, None
    types = tokens.token_types(input_ids)
    kwargs = dict(rows.kwargs, **mm)
    if not whole_padded:
        return replace(rows, kwargs=kwargs), ImagePositions(types, mm["image_grid_thw"])
    del kwargs["position_ids"]
    kwargs["mm_token_type_ids"] = types
    return replace(rows, kwargs=kwargs), None


# ---------------------------------------------------------------- the composition


@dataclass(frozen=True)
class ForwardInputs:
    """One forward of B padded rows, as the model takes it (see the module docstring).

    Attributes:
        input_ids, attention_mask: (B, L) the padded rows (labels and last tokens are read
            from them).
        kwargs: the model's keyword arguments for whole model rows, ``input_ids`` (R, Lm).
        where: (B, L) flat position in the model rows of each padded token.
        source: (R, Lm) flat position in the padded rows of each model position.
        sp: the sequence-parallel group the forward is split over (None: whole rows).
        image_positions: a VLM's M-RoPE inputs where the model cannot compute the positions
            itself (packed rows, sequence-parallel slices; None: the kwargs hold them).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    kwargs: dict
    where: torch.Tensor
    source: torch.Tensor
    sp: SequenceParallel | None = None
    image_positions: ImagePositions | None = None

    @property
    def row_shape(self) -> tuple[int, int]:
        """(R, Lm)."""
        R, Lm = self.kwargs["input_ids"].shape
        return R, Lm

    def model_kwargs(self, model: nn.Module) -> dict:
        """The keyword arguments of this rank's forward: whole rows, or its slice of them
        under sequence parallelism (``models.ulysses.shard_inputs``). A VLM's M-RoPE positions
        computed here where needed (:meth:`mrope_positions`)."""
        kwargs = self.kwargs
        if self.image_positions is not None:
            kwargs = {**kwargs, "position_ids": self.mrope_positions(model)}
        if self.sp is None:
            return kwargs
        return shard_inputs(model, kwargs, self.sp)

    def mrope_positions(self, model: nn.Module) -> torch.Tensor:
        """(4, R, Lm): the model rows' text positions (each sequence's own, as the rows part
        made them), then the three M-RoPE rows (time, height, width) of every token, computed
        by the model's rule over each padded row and laid out as its tokens are."""
        if self.image_positions is None:
            raise ValueError("rows without images have text positions only")
        mrope = self.image_positions.positions(model, self.input_ids, self.attention_mask)
        arranged = self.arrange(mrope.permute(1, 2, 0)).permute(2, 0, 1)  # (3, R, Lm)
        text = self.kwargs["position_ids"].to(arranged.dtype)
        return torch.cat([text.unsqueeze(0), arranged])

    def arrange(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, L, ...), aligned with the padded rows, in the model rows' order:
        (R, Lm, ...) (whole rows; each rank slices its part where it is consumed)."""
        B, L = self.input_ids.shape
        flat = x.reshape(B * L, *x.shape[2:])
        return flat[self.source.reshape(-1)].view(*self.row_shape, *x.shape[2:])


@dataclass(frozen=True)
class InputSpec:
    """Which parts one model's forwards are built from: set once per model and run (the row
    layout its attention takes, a VLM's image tokens, the layout's sequence-parallel group),
    applied to every batch by :meth:`build`.

    Attributes:
        rows: the rows part (:data:`RowLayout`).
        group_size: s, rows per shared prompt (``shared_prompts`` only).
        vision: a vision-language model's special tokens (its images part); None: text.
        sp: the sequence-parallel group its forwards are split over (None or size 1: whole).
    """

    rows: RowLayout = "padded"
    group_size: int = 1
    vision: VisionTokens | None = None
    sp: SequenceParallel | None = None

    def __post_init__(self) -> None:
        if self.rows not in ROW_LAYOUTS:
            raise ValueError(f"unknown row layout {self.rows!r} (one of {ROW_LAYOUTS})")
        if (self.rows == "shared_prompts") != (self.group_size > 1):
            raise ValueError(f"rows {self.rows!r} with group_size {self.group_size}")

    def build(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        response_len: int | None = None,
        images: ImageBatch | None = None,
    ) -> ForwardInputs:
        """The forward inputs of (B, L) padded rows (``response_len`` T: the shared-prompt
        part's response length; ``images``: a VLM's, one entry per row)."""
        if images is not None and self.rows not in ("padded", "packed"):
            raise ValueError(f"vision-language rows go padded or packed, not {self.rows}")
        sp = self.sp if self.sp is not None and self.sp.enabled else None
        rows = _ROWS[self.rows](input_ids, attention_mask, response_len, self.group_size)
        positions = None
        if images is not None:
            if self.vision is None:
                raise ValueError("images for a model without vision tokens (a text model)")
            whole_padded = self.rows == "padded" and sp is None
            rows, positions = with_images(rows, self.vision, input_ids, images, whole_padded)
        return ForwardInputs(
            input_ids, attention_mask, rows.kwargs, rows.where, rows.source, sp, positions
        )


def _shared_prompts(ids, mask, response_len, group_size) -> ModelRows:
    if response_len is None:
        raise ValueError("shared_prompts rows need the response length")
    return shared_prompt_rows(ids, mask, response_len, group_size)


_ROWS: dict[str, Callable[..., ModelRows]] = {
    "padded": lambda ids, mask, _t, _s: padded_rows(ids, mask),
    "packed": lambda ids, mask, _t, _s: packed_rows(ids, mask),
    "shared_prompts": _shared_prompts,
    "shared_pairs": lambda ids, mask, _t, _s: shared_pair_rows(ids, mask),
}


def row_layout(packed: bool, group_size: int = 1) -> RowLayout:
    """The rows part of a PPO forward: shared prompts over packing over padding."""
    if group_size > 1:
        return "shared_prompts"
    return "packed" if packed else "padded"


def forward_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    packed: bool = False,
    group_size: int = 1,
    pairs: bool = False,
    response_len: int | None = None,
    images: ImageBatch | None = None,
    vision: VisionTokens | None = None,
    sp: SequenceParallel | None = None,
) -> ForwardInputs:
    """:meth:`InputSpec.build` in one call (tests, benchmarks, one-off forwards): rows shared
    per pair with ``pairs``, else per prompt with ``group_size`` > 1, else packed or padded."""
    rows = "shared_pairs" if pairs else row_layout(packed, group_size)
    spec = InputSpec(rows=rows, group_size=group_size if not pairs else 1, vision=vision, sp=sp)
    return spec.build(input_ids, attention_mask, response_len=response_len, images=images)
