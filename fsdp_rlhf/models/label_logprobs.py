"""Log-probs of selected label tokens under a causal LM, for SFT and DPO.

Trainers that learn from given text (not from sampled responses) score arbitrary token spans:
SFT the response or assistant tokens of each sample, DPO each side's response. The rows are
(N, L), right-padded, and ``label_mask`` (N, L) marks the tokens to score (never column 0,
which nothing predicts). Only the positions that predict a marked token go through the LM head
(HF's ``logits_to_keep`` with an index tensor): a prompt's logits are never materialised, and
the (R, V) logits of the R marked tokens are all the vocabulary-wide memory a forward needs.

The rows reach the model as a :class:`~fsdp_rlhf.models.inputs.ForwardInputs` (padded,
packed, or preference pairs with each pair's common prefix once; images; the
sequence-parallel slice): the same function of the weights up to float rounding, whichever
parts built it. A rejected token whose predicting position lies in a shared prefix is read
from the chosen segment, where the context is the same.

Shapes: N rows of L tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_rlhf.models.forward import logprobs_at
from fsdp_rlhf.models.inputs import ForwardInputs


def label_logprobs(
    model: nn.Module, inputs: ForwardInputs, label_mask: torch.Tensor
) -> torch.Tensor:
    """(N, L) float32 log-probs of each marked token given the tokens before it; 0 elsewhere.

    Args:
        inputs: the forward of (N, L) right-padded rows (``models.inputs``; shared pair
            prefixes need N = 2B: B chosen, then B rejected).
        label_mask: (N, L) bool, True on tokens to score (within the attended tokens, col >= 1).
    """
    label_mask = label_mask.bool() & inputs.attention_mask.bool()
    label_mask[:, 0] = False
    rows, cols = label_mask.nonzero(as_tuple=True)  # row-major: the order of the output
    labels = inputs.input_ids[rows, cols]
    out = torch.zeros(label_mask.shape, dtype=torch.float32, device=labels.device)
    lp, _ = logprobs_at(model, inputs, inputs.where[rows, cols - 1], labels)
    out[rows, cols] = lp.float()
    return out


def sequence_logprobs(
    model: nn.Module, inputs: ForwardInputs, label_mask: torch.Tensor
) -> torch.Tensor:
    """(N,) summed log-probs of each row's marked tokens (see :func:`label_logprobs`)."""
    return label_logprobs(model, inputs, label_mask).sum(-1)
