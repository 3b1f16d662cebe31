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
# On CPU, sequences up to this long get an explicit attention (two batched matmuls and a
# softmax per sequence) when a backward follows: per layer at 8 x ~100 tokens, 8 heads of 64,
# bf16, forward + backward take 9.7 ms against 10.7-12.8 ms for SDPA's math kernel (whose
# per-call scaling and masking ops dominate at these sizes) and 20 ms for its flash kernel.
# Without a backward the flash kernel is fastest (2.1 ms). Longer sequences always use SDPA's
# kernels, whose memory does not grow with length squared.
CPU_EXPLICIT_ATTENTION_MAX_LEN = 512
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    explicit = (
        query.device.type == "cpu"
        and torch.is_grad_enabled()
        and dropout == 0.0
        and max(lengths) <= CPU_EXPLICIT_ATTENTION_MAX_LEN
    )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    pieces = zip(
        query.split(lengths, dim=2),
        key.split(lengths, dim=2),
        value.split(lengths, dim=2),
        strict=True,
    )
    if explicit:
        parts = [_causal_attention(q[0], k[0], v[0], scale).unsqueeze(0) for q, k, v in pieces]
    else:
        with sdpa_kernel(_SDPA_BACKENDS):
            parts = [
                F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=scale
                )
                for q, k, v in pieces
            ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of one sequence: q/k/v (H, n, D) -> (H, n, D).

    Scores in the input dtype, softmax in float32 (as HF's eager attention does).
    """
    n = q.shape[1]
    causal = torch.full((n, n), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    scores = torch.baddbmm(causal.expand(q.shape[0], n, n), q, k.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, v)


def use_varlen_attention(model: nn.Module) -> None:
    """Switch an HF model to :func:`varlen_sdpa`; from then on every forward must be packed."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa)
    model.set_attn_implementation(VARLEN_ATTENTION)
