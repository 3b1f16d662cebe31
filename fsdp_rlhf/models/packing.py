"""Padding-free forwards: a micro-batch's sequences packed into one row, attention per sequence.

A padded (N, L) batch computes every layer on N x L tokens; with the usual spread of lengths a
third or more are padding (the reward-model benchmark: 33%). Packing the attended tokens into
one (1, T) row removes that work. Attention must then stay inside each sequence
(models.attention.varlen_sdpa: one varlen kernel call per layer on CUDA, ``models.varlen``, or
flash_attention_2's). HF models pass ``cu_seq_lens_q/k`` and ``max_length_q/k`` through to the
attention function unchanged: the offsets are int32 on the device, the longest length a host
int read here, once per micro-batch, so no layer reads anything back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedRow:
    """N sequences as one row: ``input_ids``/``position_ids`` (1, T), ``cu_seqlens`` (N + 1,)
    offsets of each sequence, ``max_len`` the longest one (a host int: varlen kernels size
    their launch by it), ``source`` where each token was in the padded rows."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    source: torch.Tensor | None = None  # (T,) flat position in the (N, L) rows of each token

    @property
    def last_index(self) -> torch.Tensor:
        """(N,) position of each sequence's last token in the row."""
        return self.cu_seqlens[1:] - 1

    def model_inputs(self) -> dict:
        # flash-attn's varlen kernel takes int32 offsets only (HF passes these through as is)
        cu = self.cu_seqlens.to(torch.int32)
        return dict(
            input_ids=self.input_ids,
            position_ids=self.position_ids,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=self.max_len,
            max_length_k=self.max_len,
        )


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRow:
    """(N, L) rows padded on either side (one contiguous run of tokens each) -> one row.

    One host sync (the lengths, read once: the row's size and its longest sequence); the
    tokens are gathered at positions computed on the device, where boolean indexing would
    read the mask's count again."""
    N, L = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    lengths_host = lengths.tolist()
    if not lengths_host or min(lengths_host) == 0:
        raise ValueError("pack_rows: a row has no tokens")
    total = sum(lengths_host)
    cu = F.pad(lengths.cumsum(0), (1, 0))
    dev = input_ids.device
    starts = cu[:-1].repeat_interleave(lengths, output_size=total)
    positions = torch.arange(total, device=dev) - starts
    first = mask.int().argmax(-1)  # each row's first token
    row_start = torch.arange(N, device=dev) * L + first
    source = row_start.repeat_interleave(lengths, output_size=total) + positions
    return PackedRow(
        input_ids.reshape(-1)[source].unsqueeze(0),
        positions.unsqueeze(0),
        cu,
        max(lengths_host),
        source,
    )
