"""Padding-free forwards: a micro-batch's sequences packed into one row, attention per sequence.

A padded (N, L) batch computes every layer on N x L tokens; with the usual spread of lengths a
third or more are padding (the reward-model benchmark: 33%). Packing the attended tokens into
one (1, T) row removes that work. Attention must then stay inside each sequence: the attention
function registered here runs causal SDPA once per sequence, so its cost is the sum of squared
lengths, as in the padded batch, rather than T^2 (what a block-diagonal mask over the row costs).
HF models pass ``cu_seq_lens_q`` through to the attention function unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

VARLEN_ATTENTION = "fsdp_rlhf_varlen_sdpa"
# On CPU, for sequences up to this long, the plain (math) SDPA is the faster kernel when a
# backward follows: 1.6x forward + backward over the flash kernel at 8 x ~100 tokens, 8 heads of
# 64, bf16; without a backward the flash kernel is 2.8x faster (measured on the bench CPU).
# Longer sequences always get the flash kernel, whose memory does not grow with length squared.
CPU_MATH_SDPA_MAX_LEN = 512


def _backends(device: torch.device, max_len: int) -> list[SDPBackend]:
    if device.type == "cpu" and max_len <= CPU_MATH_SDPA_MAX_LEN and torch.is_grad_enabled():
        return [SDPBackend.MATH]
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class PackedRow:
    """N sequences as one row: ``input_ids``/``position_ids`` (1, T), ``cu_seqlens`` (N + 1,)
    offsets of each sequence, ``max_len`` the longest one."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int

    @property
    def last_index(self) -> torch.Tensor:
        """(N,) position of each sequence's last token in the row."""
        return self.cu_seqlens[1:] - 1

    def model_inputs(self) -> dict:
        cu = self.cu_seqlens
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
    """(N, L) rows padded on either side (one contiguous run of tokens each) -> one row."""
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    if (lengths == 0).any():
        raise ValueError("pack_rows: a row has no tokens")
    cu = F.pad(lengths.cumsum(0), (1, 0))
    starts = cu[:-1].repeat_interleave(lengths)
    positions = torch.arange(int(cu[-1]), device=input_ids.device) - starts
    return PackedRow(input_ids[mask].unsqueeze(0), positions.unsqueeze(0), cu, int(lengths.max()))


def varlen_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: q (1, H, T, D), k/v (1, KV, T, D) -> (1, T, H, D), causal
    attention within each ``cu_seq_lens_q`` segment."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION} needs one packed row and cu_seq_lens_q (pack_rows)")
    if key.shape[1] != query.shape[1]:  # grouped-query attention: share each KV head
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    # split, not slicing: each slice's backward would allocate a zero gradient of the whole row
    lengths = cu_seq_lens_q.diff().tolist()
    with sdpa_kernel(_backends(query.device, max(lengths))):
        parts = [
            F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling
            )
            for q, k, v in zip(
                query.split(lengths, dim=2),
                key.split(lengths, dim=2),
                value.split(lengths, dim=2),
                strict=True,
            )
        ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def use_varlen_attention(model: nn.Module) -> None:
    """Switch an HF model to :func:`varlen_sdpa`; from then on every forward must be packed."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa)
    model.set_attn_implementation(VARLEN_ATTENTION)
