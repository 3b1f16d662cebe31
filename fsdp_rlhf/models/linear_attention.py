"""Linear-attention layers (Qwen3.5's and Qwen3-Next's gated delta net) in packed forwards and
under Ulysses sequence parallelism.

A gated-delta-net layer carries a recurrent state (and a short causal convolution) along the
sequence. In a packed row (``models.packing``) that state must restart at every sequence
boundary. flash-linear-attention's kernels take the boundaries (transformers passes
``cu_seq_lens_q`` on as ``cu_seqlens``); transformers' pure-PyTorch fallbacks, used when that
package is absent (every CPU install), ignore them and would carry one sequence's state into
the next. :func:`split_packed_linear_attention` makes each such layer run every sequence of a
packed row on its own, so packed forwards equal padded ones with either implementation.

Under sequence parallelism (``models.ulysses``) each rank holds a slice of every row, but the
recurrence must run along the whole row. Ulysses splits attention by heads; a gated delta net's
heads are independent too (each value head reads one key head, its own gate and decay), and its
output projection sums over heads. :func:`use_ulysses_linear_attention` makes each layer, when
its forward gets the ``sequence_parallel`` context: all-gather the rows' hidden states (B, L, D),
run the layer on the whole rows for this rank's H/N value heads only (their slice of every
projection, of the convolution's channels, of the gates), and reduce-scatter the partial
output projections back to this rank's slice (B, L/N, D). Each head is computed on one rank,
so the result is the unsplit layer's; the backward is the same collectives the other way.
Qwen3.5's layout only (separate q/k/v, z, b, a projections); Qwen3-Next's fused,
group-interleaved projections and Mamba2 are left to the rules table.

Shapes: hidden states (1, T, H) packed, ``cu_seq_lens_q`` (N + 1,) offsets of N sequences.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fsdp_rlhf.distributed.sequence_parallel import gather_rows, reduce_scatter_rows

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
        if cu is None or hidden_states.shape[0] != 1 or kwargs.get("sequence_parallel"):
            return forward(hidden_states, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in _PACKING_KEYS}
        rest["attention_mask"] = None  # a packed row has no padding
        lengths = cu.diff().tolist()
        parts = [forward(seq, *args, **rest) for seq in hidden_states.split(lengths, dim=1)]
        return torch.cat(parts, dim=1)

    return run


# ---------------------------------------------------------------- sequence parallelism


def ulysses_splits_heads(layer: nn.Module) -> bool:
    """Whether :func:`use_ulysses_linear_attention` can split ``layer`` by heads (Qwen3.5's
    separate projections)."""
    return all(hasattr(layer, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


def use_ulysses_linear_attention(model: nn.Module) -> int:
    """Make every gated-delta-net layer of ``model`` run by heads across the sequence-parallel
    group when its forward gets the ``sequence_parallel`` keyword (module docstring); returns
    how many layers it changed (idempotent). Raises for a recurrent layer it cannot split."""
    count = 0
    for layer in linear_attention_layers(model):
        if getattr(layer, "_fsdp_rlhf_ulysses", False):
            continue
        if not ulysses_splits_heads(layer):
            raise ValueError(
                f"sequence parallelism: {type(layer).__name__} cannot be split by heads "
                "(only Qwen3.5's gated delta net is)"
            )
        layer.forward = _by_heads(layer, layer.forward)
        layer._fsdp_rlhf_ulysses = True
        count += 1
    return count


@dataclass(frozen=True)
class HeadSlice:
    """One rank's share of a gated delta net: its value heads ``[v0, v1)`` and the key heads
    ``[k0, k1)`` they read (shared with a neighbour when a key head serves value heads on two
    ranks). Indices into the layer's parameters; ``k_of_v``: each local value head's local key
    head."""

    qkv: torch.Tensor  # channels of in_proj_qkv and the convolution: q, k, v of these heads
    v_heads: torch.Tensor  # rows of in_proj_b / in_proj_a, entries of A_log / dt_bias
    v_rows: torch.Tensor  # rows of in_proj_z, columns of out_proj
    k_of_v: torch.Tensor
    key_channels: int
    value_channels: int


def head_slice(layer: nn.Module, n: int, rank: int, device: torch.device) -> HeadSlice:
    """Rank ``rank`` of ``n``'s heads of ``layer`` (its value heads must divide by ``n``)."""
    hv, hk = layer.num_v_heads, layer.num_k_heads
    dk, dv = layer.head_k_dim, layer.head_v_dim
    if hv % n:
        raise ValueError(f"{hv} linear-attention value heads do not divide by {n}")
    per, ratio = hv // n, hv // hk
    v0, v1 = rank * per, (rank + 1) * per
    k0, k1 = v0 // ratio, (v1 - 1) // ratio + 1

    def span(start: int, stop: int, width: int, base: int = 0) -> torch.Tensor:
        return torch.arange(base + start * width, base + stop * width, device=device)

    key_dim = layer.key_dim
    qkv = torch.cat([span(k0, k1, dk), span(k0, k1, dk, key_dim), span(v0, v1, dv, 2 * key_dim)])
    k_of_v = torch.arange(v0, v1, device=device) // ratio - k0
    return HeadSlice(
        qkv=qkv,
        v_heads=torch.arange(v0, v1, device=device),
        v_rows=span(v0, v1, dv),
        k_of_v=k_of_v,
        key_channels=(k1 - k0) * dk,
        value_channels=per * dv,
    )


def _by_heads(layer: nn.Module, forward):
    @functools.wraps(forward)
    def run(hidden_states: torch.Tensor, *args, **kwargs):
        ctx = kwargs.get("sequence_parallel")
        if ctx is None:
            return forward(hidden_states, *args, **kwargs)
        if args or kwargs.get("cache_params") is not None:
            raise RuntimeError("sequence parallelism splits training forwards only (no cache)")
        return sequence_parallel_forward(layer, hidden_states, ctx, kwargs.get("cu_seq_lens_q"))

    return run


def sequence_parallel_forward(
    layer: nn.Module, hidden_states: torch.Tensor, ctx, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """``layer`` on this rank's slice (B, Lr, D) of rows of ``ctx.seq_len`` tokens: the whole
    rows gathered, this rank's heads run over them, the partial outputs reduce-scattered.
    ``cu_seqlens``: a packed row's sequence offsets (each sequence runs alone)."""
    whole = gather_rows(hidden_states, ctx.group)  # (B, N * Lr, D)
    L = ctx.seq_len
    heads = head_slice(layer, ctx.size, dist.get_rank(ctx.group), whole.device)
    x = whole[:, :L]
    if cu_seqlens is not None and x.shape[0] == 1:
        ends = cu_seqlens.tolist()
        parts = [_heads_forward(layer, x[:, a:b], None, heads) for a, b in itertools.pairwise(ends)]
        out = torch.cat(parts, dim=1)
    else:
        out = _heads_forward(layer, x, ctx.padding_mask, heads)
    out = F.pad(out, (0, 0, 0, whole.shape[1] - out.shape[1]))  # the slices' padding tail
    return reduce_scatter_rows(out, ctx.group)


def _heads_forward(
    layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None, h: HeadSlice
) -> torch.Tensor:
    """transformers' gated-delta-net forward (no cache) for the heads of ``h`` over whole rows
    ``x`` (B, L, D), through the module's own kernels: its part of the output projection."""
    hf = sys.modules[type(layer).__module__]  # the kernels transformers resolved for it
    x = hf.apply_mask_to_padding_states(x, mask)
    B, L, _ = x.shape
    mixed = F.linear(x, layer.in_proj_qkv.weight[h.qkv]).transpose(1, 2)
    z = F.linear(x, layer.in_proj_z.weight[h.v_rows]).reshape(B, L, -1, layer.head_v_dim)
    b = F.linear(x, layer.in_proj_b.weight[h.v_heads])
    a = F.linear(x, layer.in_proj_a.weight[h.v_heads])
    bias = None if layer.conv1d.bias is None else layer.conv1d.bias[h.qkv]
    weight = layer.conv1d.weight.squeeze(1)[h.qkv]
    mixed = hf.causal_conv1d_fn(mixed, weight, bias, activation=layer.activation)
    query, key, value = torch.split(
        mixed.transpose(1, 2), [h.key_channels, h.key_channels, h.value_channels], dim=-1
    )
    query = query.reshape(B, L, -1, layer.head_k_dim).index_select(2, h.k_of_v)
    key = key.reshape(B, L, -1, layer.head_k_dim).index_select(2, h.k_of_v)
    value = value.reshape(B, L, -1, layer.head_v_dim)
    beta = b.sigmoid()
    g = -layer.A_log[h.v_heads].float().exp() * F.softplus(a.float() + layer.dt_bias[h.v_heads])
    core, _ = hf.torch_chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return F.linear(core.reshape(B, L, -1), layer.out_proj.weight[:, h.v_rows])
