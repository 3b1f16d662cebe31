"""Log-probs of selected label tokens under a causal LM, for SFT and DPO.

Trainers that learn from given text (not from sampled responses) score arbitrary token spans:
SFT the response or assistant tokens of each sample, DPO each side's response. The rows are
(N, L), right-padded, and ``label_mask`` (N, L) marks the tokens to score (never column 0,
which nothing predicts). Only the positions that predict a marked token go through the LM head
(HF's ``logits_to_keep`` with an index tensor): a prompt's logits are never materialised, and
the (R, V) logits of the R marked tokens are all the vocabulary-wide memory a forward needs.

Three layouts, the same function of the weights up to float rounding:

- ``padded``: the (N, L) batch as is.
- ``packed``: the rows' tokens as one packed row (``models.packing``; varlen attention).
- ``shared``: preference pairs (B chosen rows, then B rejected rows) packed with each pair's
  common prefix once (``models.shared_prefix.share_pair_prefixes``). A rejected token whose
  predicting position lies in the shared prefix reads it from the chosen segment, where the
  context is the same.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from fsdp_rlhf.algorithms import logprobs_from_logits
from fsdp_rlhf.models.forward import _takes_logits_to_keep, position_ids_from_mask
from fsdp_rlhf.models.packing import pack_rows
from fsdp_rlhf.models.shared_prefix import share_pair_prefixes
from fsdp_rlhf.models.ulysses import sequence_parallel_of, sharded_logprobs
from fsdp_rlhf.models.vision import ImageBatch, VisionTokens, vision_model_inputs

Layout = Literal["padded", "packed", "shared"]


def label_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    label_mask: torch.Tensor,
    layout: Layout = "padded",
    images: ImageBatch | None = None,
) -> torch.Tensor:
    """(N, L) float32 log-probs of each marked token given the tokens before it; 0 elsewhere.

    Args:
        input_ids, attention_mask: (N, L), right-padded.
        label_mask: (N, L) bool, True on tokens to score (within the attended tokens, col >= 1).
        layout: see the module docstring; ``shared`` needs N = 2B (B chosen, then B rejected)
            and, like ``packed``, a model using ``models.attention.use_varlen_attention``.
        images: a vision-language model's images of the rows (``padded`` only).
    """
    label_mask = label_mask.bool() & attention_mask.bool()
    label_mask[:, 0] = False
    rows, cols = label_mask.nonzero(as_tuple=True)  # row-major: the order of the output
    labels = input_ids[rows, cols]
    out = torch.zeros(label_mask.shape, dtype=torch.float32, device=input_ids.device)
    sp = sequence_parallel_of(model)
    if images is not None and (layout != "padded" or sp is not None):
        raise ValueError("vision-language rows go through the model padded, whole")
    if sp is not None:  # each rank the tokens of its slice (models.ulysses), combined once
        if layout == "padded":
            inputs = dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask),
                use_cache=False,
            )
            index = rows * input_ids.shape[1] + cols - 1
        else:
            inputs, index = _packed_inputs(input_ids, attention_mask, rows, cols - 1, layout)
        keep = _takes_logits_to_keep(model)
        out[rows, cols] = sharded_logprobs(model, inputs, index, labels, sp, keep_logits=keep)[0]
        return out
    if images is not None:
        tokens = VisionTokens.from_config(model.config)
        logits = model(**vision_model_inputs(tokens, input_ids, attention_mask, images)).logits
        picked = logits[rows, cols - 1]
    elif layout == "padded":
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).logits
        picked = logits[rows, cols - 1]
    else:
        inputs, positions = _packed_inputs(input_ids, attention_mask, rows, cols - 1, layout)
        picked = model(**inputs, logits_to_keep=positions).logits[0]
    out[rows, cols] = logprobs_from_logits(picked, labels).float()
    return out


def _packed_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    layout: Layout,
) -> tuple[dict, torch.Tensor]:
    """Model inputs of the packed row, and the row position holding each (row, col) token."""
    if layout == "packed":
        row = pack_rows(input_ids, attention_mask)
        return row.model_inputs(), row.cu_seqlens[rows] + cols
    if layout != "shared":
        raise ValueError(f"unknown layout {layout!r}")
    shared = share_pair_prefixes(input_ids, attention_mask)
    cu, prefix = shared.packed.cu_seqlens, shared.prefix_lens
    B = input_ids.shape[0] // 2
    pair = rows % B
    chosen_pos = cu[2 * pair] + cols
    rejected_rest = cu[2 * pair + 1] + cols - prefix[pair]
    in_prefix = cols < prefix[pair]
    pos = torch.where((rows < B) | in_prefix, chosen_pos, rejected_rest)
    return shared.model_inputs(), pos


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    label_mask: torch.Tensor,
    layout: Layout = "padded",
    images: ImageBatch | None = None,
) -> torch.Tensor:
    """(N,) summed log-probs of each row's marked tokens (see :func:`label_logprobs`)."""
    return label_logprobs(model, input_ids, attention_mask, label_mask, layout, images).sum(-1)
