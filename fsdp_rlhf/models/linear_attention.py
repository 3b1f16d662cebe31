"""Linear-attention layers (Qwen3.5's and Qwen3-Next's gated delta net) in packed forwards.

A gated-delta-net layer carries a recurrent state (and a short causal convolution) along the
sequence. In a packed row (``models.packing``) that state must restart at every sequence
boundary. flash-linear-attention's kernels take the boundaries (transformers passes
``cu_seq_lens_q`` on as ``cu_seqlens``); transformers' pure-PyTorch fallbacks, used when that
package is absent (every CPU install), ignore them and would carry one sequence's state into
the next. :func:`split_packed_linear_attention` makes each such layer run every sequence of a
packed row on its own, so packed forwards equal padded ones with either implementation.

Shapes: hidden states (1, T, H) packed, ``cu_seq_lens_q`` (N + 1,) offsets of N sequences.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

LINEAR_ATTENTION = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
_PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in LINEAR_ATTENTION]


def split_packed_linear_attention(model: nn.Module) -> int:
    """Make every linear-attention layer of ``model`` honour packed-row boundaries (see the
    module docstring); returns how many layers it changed (idempotent)."""
    count = 0
    for layer in linear_attention_layers(model):
        if getattr(layer, "_fsdp_rlhf_per_sequence", False):
            continue
        layer.forward = _per_sequence(layer.forward)
        layer._fsdp_rlhf_per_sequence = True
        count += 1
    return count


def _per_sequence(forward):
    @functools.wraps(forward)
    def run(hidden_states: torch.Tensor, *args, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or hidden_states.shape[0] != 1:
            return forward(hidden_states, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in _PACKING_KEYS}
        rest["attention_mask"] = None  # a packed row has no padding
        lengths = cu.diff().tolist()
        parts = [forward(seq, *args, **rest) for seq in hidden_states.split(lengths, dim=1)]
        return torch.cat(parts, dim=1)

    return run
