"""Ulysses sequence parallelism for any HF decoder: an attention function, and forwards on slices.

With ``--sequence_parallel_size N`` the N ranks of a group (``distributed.sequence_parallel``)
run the same rows, each on its 1/N slice of every row: inputs are padded to a multiple of N and
sliced, position ids are each slice's global ones (rotary embeddings see the right positions),
and every layer outside attention is per token, so it runs on the slice unchanged. Attention
needs the whole sequence: :func:`ulysses_attention`, registered with HF's ``AttentionInterface``
as ``fsdp_rlhf_ulysses``, exchanges q/k/v so that each rank holds all positions of H/N heads
(an all-to-all), runs the model's own kernel on the whole row (padded, packed varlen with the
whole row's ``cu_seqlens``, the shared-prompt layout, or flash-attn), and exchanges the output
back. KV heads fewer than N are repeated first, so each rank gets the KV head its query heads
share. Activations, logits and the attention's q/k/v per rank shrink N-fold; the weights are
FSDP2's shards as before.

Outputs are read on the slices and combined once per forward: log-probs and entropies of the
positions each rank holds (from the output layer's input, ``models.forward.logprobs_at``
and ``models.head``) are summed over the group
(each entry lives on one rank), values are all-gathered along the sequence. Both backward
passes hand each rank the gradient of its own entries (every rank computes the same loss), so
the gradients summed by FSDP equal the unsplit forward's.

Shapes: B rows of L tokens; N ranks; ``Lr = ceil(L / N)`` tokens per rank; H query and KV
key/value heads of D; V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from fsdp_rlhf.distributed.sequence_parallel import SequenceParallel, all_to_all
from fsdp_rlhf.models.attention import (
    FLASH_ATTENTION,
    PADDED_ATTENTION,
    VARLEN_ATTENTION,
    RowSpans,
    _explicit_wanted,
    _masked_attention,
    _repeat_kv,
    padded_sdpa,
    register_attention,
    row_spans,
    set_text_attention,
    span_attention,
    text_attention,
    varlen_sdpa,
)

ULYSSES_ATTENTION = "fsdp_rlhf_ulysses"
# The name a Ulysses-wrapped model's attention runs under, per kernel inside: the model's own
# ``config._attn_implementation`` then says which kernel runs on whole rows (no attribute is
# stuck onto the model). No name holds "flash": transformers reads such names as flash-attn.
_ULYSSES_NAMES = {
    PADDED_ATTENTION: ULYSSES_ATTENTION,
    VARLEN_ATTENTION: f"{ULYSSES_ATTENTION}_varlen",
    FLASH_ATTENTION: f"{ULYSSES_ATTENTION}_fa2",
    "sdpa": f"{ULYSSES_ATTENTION}_hf_sdpa",
    "eager": f"{ULYSSES_ATTENTION}_eager",
}
_INNER_KERNELS = {name: inner for inner, name in _ULYSSES_NAMES.items()}


def head_problem(num_heads: int, kv_heads: int, n: int) -> str | None:
    """Why ``n``-way Ulysses cannot split these heads, or None. Query heads must divide by n;
    KV heads must divide by n or divide n (then they are repeated up to n)."""
    if num_heads % n:
        return f"{num_heads} attention heads do not divide by sequence_parallel_size {n}"
    if kv_heads % n and n % kv_heads:
        return f"{kv_heads} key/value heads neither divide by nor divide sequence_parallel_size {n}"
    return None


@dataclass(frozen=True)
class UlyssesContext:
    """What the attention of one sharded forward needs besides q/k/v (passed to the model as
    the ``sequence_parallel`` keyword, which HF hands to every attention call).

    ``seq_len`` L: tokens of each whole row (before padding to N * Lr). ``inner``: the
    attention the model runs without sequence parallelism. ``padding_mask`` (B, L) bool: for
    padded rows with padding, True on attended tokens; None for packed rows, shared-prompt rows
    (their 4D mask is the attention mask) and rows without padding. ``spans``: with
    ``padding_mask``, each row's run of attended tokens when every row has one
    (``models.attention.row_spans``; the padded kernel then needs no mask), else None.
    ``rank``: this rank's place in the group (which slice it holds). ``whole_rows``: the model
    got whole rows (a VLM: its image features merge into the whole rows' embeddings) and its
    language model takes this rank's slice (:func:`slice_language_inputs`).
    """

    group: ProcessGroup
    size: int
    seq_len: int
    inner: str
    padding_mask: torch.Tensor | None = None
    spans: RowSpans | None = None
    rank: int = 0
    whole_rows: bool = False


# ---------------------------------------------------------------- the attention function


def _seq_to_heads(x: torch.Tensor, n: int, group: ProcessGroup) -> torch.Tensor:
    """(B, H, Lr, D) sequence slice of all heads -> (B, H/n, n*Lr, D) all positions of this
    rank's heads."""
    B, H, Lr, D = x.shape
    x = x.view(B, n, H // n, Lr, D).transpose(0, 1)  # chunk j: the heads rank j gets
    y = all_to_all(x, group)  # chunk j: rank j's positions of my heads
    return y.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * Lr, D)


def _heads_to_seq(x: torch.Tensor, n: int, group: ProcessGroup) -> torch.Tensor:
    """(B, n*Lr, H/n, D) all positions of this rank's heads -> (B, Lr, H, D) this rank's
    positions of all heads."""
    B, L, Hn, D = x.shape
    x = x.view(B, n, L // n, Hn, D).transpose(0, 1)  # chunk j: the positions rank j holds
    y = all_to_all(x, group)  # chunk j: head group j of my positions
    return y.permute(1, 2, 0, 3, 4).reshape(B, L // n, n * Hn, D)


@torch.compiler.disable
def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sequence_parallel: UlyssesContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: q (B, H, Lr, D), k/v (B, KV, Lr, D) of this rank's slice ->
    (B, Lr, H, D), attending over the whole row through the model's own kernel."""
    sp = sequence_parallel
    if sp is None:
        raise ValueError(
            f"{ULYSSES_ATTENTION} needs the sequence_parallel keyword (models.ulysses.shard_inputs)"
        )
    n, L = sp.size, sp.seq_len
    if key.shape[1] < n:  # GQA with fewer KV heads than ranks: one (repeated) KV head per rank
        rep = n // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (_seq_to_heads(x, n, sp.group)[:, :, :L] for x in (query, key, value))
    kwargs.pop("position_ids", None)  # this slice's: the kernels below see whole rows
    if kwargs.get("s_aux") is not None:  # attention sinks (gpt-oss): this rank's heads' own
        kwargs["s_aux"] = kwargs["s_aux"].view(n, -1)[dist.get_rank(sp.group)]
    out = _inner_attention(module, q, k, v, attention_mask, dropout, scaling, sp, kwargs)
    out = F.pad(out, (0, 0, 0, 0, 0, query.shape[2] * n - L))  # (B, n*Lr, H/n, D)
    return _heads_to_seq(out, n, sp.group), None


def _inner_attention(module, q, k, v, attention_mask, dropout, scaling, sp, kwargs):
    """The model's own kernel over whole rows: q (B, H/n, L, D) -> (B, L, H/n, D)."""
    if sp.inner == FLASH_ATTENTION:
        mask = attention_mask if sp.padding_mask is None else sp.padding_mask.int()
        return _flash_whole_rows(module, q, k, v, mask, dropout, scaling, sp.inner, kwargs)
    if kwargs.get("cu_seq_lens_q") is not None:  # packed rows
        return varlen_sdpa(module, q, k, v, None, dropout, scaling, **kwargs)[0]
    if kwargs.get("grouped_response_mask") is not None:  # shared-prompt rows
        return padded_sdpa(module, q, k, v, attention_mask, dropout, scaling, **kwargs)[0]
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    return _padded_attention(
        q, k, v, sp.padding_mask, dropout, scaling, window, sp.spans, sinks=sinks
    )


def _flash_whole_rows(module, q, k, v, mask, dropout, scaling, kernel: str, kwargs):
    """transformers' flash-attention call with the kernel named: its ``flash_attention_forward``
    wrapper looks the kernel up by ``module.config._attn_implementation``, which names this
    module's Ulysses wrapper here, not a flash kernel. q (B, H/n, L, D) -> (B, L, H/n, D);
    ``mask`` (B, L) int padding mask or None (packed rows: ``cu_seq_lens_*`` in ``kwargs``)."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    kwargs = dict(kwargs)
    is_causal = kwargs.pop("is_causal", None)
    s_aux = kwargs.pop("s_aux", None)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return _flash_attention_forward(
        q,
        k,
        v,
        mask,
        query_length=q.shape[1],
        is_causal=is_causal if is_causal is not None else getattr(module, "is_causal", True),
        dropout=dropout,
        softmax_scale=scaling,
        sliding_window=kwargs.pop("sliding_window", None),
        softcap=kwargs.pop("softcap", None),
        target_dtype=get_target_dtype(q, module),
        attn_implementation=kernel,
        layer_idx=getattr(module, "layer_idx", None),
        s_aux=s_aux.to(q.dtype) if s_aux is not None else None,
        **kwargs,
    )


def _padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    window: int | None = None,
    spans: RowSpans | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of padded rows, padding keys masked: q (B, H, L, D), k/v (B, KV, L, D),
    ``padding_mask`` (B, L) bool or None -> (B, L, H, D). A padding query attends to itself
    (never to nothing: a row of no keys is NaN in SDPA), or without a mask (``spans``) gets what
    the causal kernel gives it (0 at left padding); real tokens are as in the unsplit forward.
    ``window``: a sliding-window layer's (Gemma 3's local layers), each query sees its last
    ``window`` keys only, as transformers' padded mask does. ``spans``: each row's run of
    attended tokens, for the mask-free path (SDPA's kernels then keep nothing of size L x L for
    backward; :func:`models.attention.span_attention`). ``sinks``: (H,) these heads'
    attention-sink logits (gpt-oss)."""
    L = q.shape[-2]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    explicit = sinks is not None or _explicit_wanted(q, dropout, L)
    windowed = window is not None and window < L
    if padding_mask is not None and spans is not None and not explicit and not windowed:
        return span_attention(q, k, v, spans, dropout, scale).transpose(1, 2).contiguous()
    # as HF's SDPA: GQA inside the kernel, no copies
    if padding_mask is None and not explicit and not windowed:
        gqa = k.shape[1] != q.shape[1]
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous()
    k, v = _repeat_kv(q, k, v)
    allowed = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    if windowed:
        allowed = allowed.triu(-(window - 1))
    if padding_mask is not None:
        eye = torch.eye(L, dtype=torch.bool, device=q.device)
        allowed = (allowed & padding_mask[:, None, None, :]) | eye  # (B, 1, L, L)
    else:
        allowed = allowed.expand(q.shape[0], 1, L, L)
    out = _masked_attention(q, k, v, allowed, scale, dropout, explicit, sinks)
    return out.transpose(1, 2).contiguous()


# ---------------------------------------------------------------- models and inputs


def use_ulysses_attention(model: nn.Module) -> None:
    """Route ``model``'s attention through :func:`ulysses_attention` around the kernel it uses
    now (call after the packed/padded choice); its forwards must then get the
    ``sequence_parallel`` keyword (:func:`shard_inputs`, which ``models.inputs`` applies for an
    input builder with a sequence-parallel part)."""
    from fsdp_rlhf.models.linear_attention import use_ulysses_linear_attention

    inner = text_attention(model)
    if inner not in _ULYSSES_NAMES:
        raise ValueError(f"sequence parallelism: no Ulysses wrapper for attention {inner!r}")
    register_attention()
    register_ulysses()
    set_text_attention(model, _ULYSSES_NAMES[inner])  # a VLM's tower keeps its own
    language = _language_model(model)
    if language is not None and slice_language_inputs not in language._forward_pre_hooks.values():
        language.register_forward_pre_hook(slice_language_inputs, with_kwargs=True)
    use_ulysses_linear_attention(model)  # gated delta nets: by heads over whole rows


def register_ulysses() -> None:
    """Make :func:`ulysses_attention` known to HF under each of its names (idempotent). No
    mask function is registered: HF then passes no mask (or a prepared 4D one unchanged), and
    the inner kernel gets the whole row's padding from :class:`UlyssesContext`."""
    from transformers import AttentionInterface

    for name in (ULYSSES_ATTENTION, *_ULYSSES_NAMES.values()):
        AttentionInterface.register(name, ulysses_attention)


def base_attention(model: nn.Module) -> str:
    """The attention kernel ``model`` runs on whole rows (inside Ulysses, when split)."""
    impl = text_attention(model)
    return _INNER_KERNELS.get(impl, impl)


def shard_inputs(model: nn.Module, inputs: dict, sp: SequenceParallel) -> dict:
    """Whole-row model inputs -> this rank's slice of them.

    ``input_ids``/``position_ids`` (B, L) are padded to N * Lr and sliced; a 2D
    ``attention_mask`` (padded rows) moves into the :class:`UlyssesContext` (HF gets none); a
    4D mask (shared-prompt rows) and the packed-row keywords pass through, describing the
    whole row as the inner kernel needs. A VLM (its language model found) gets its inputs whole
    (its images merge into the whole rows' embeddings, every rank running the vision tower),
    M-RoPE ``position_ids`` (3 or 4, B, L) included, and its language model slices the merged
    embeddings and positions (:func:`slice_language_inputs`).
    """
    L = inputs["input_ids"].shape[1]
    out = dict(inputs)
    padding = spans = None
    mask = out.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        out["attention_mask"] = None
        if not bool(mask.bool().all()):
            padding = mask.bool()
            spans = row_spans(padding)
    whole = _language_model(model) is not None
    context = UlyssesContext(
        sp.group, sp.size, L, base_attention(model), padding, spans, sp.rank, whole
    )
    if not whole:
        for name in ("input_ids", "position_ids"):
            out[name] = _slice_seq(out[name], context)
    out["sequence_parallel"] = context
    return out


def _slice_seq(x: torch.Tensor, sp: UlyssesContext, dim: int = -1) -> torch.Tensor:
    """``x`` with whole rows of L along ``dim`` -> this rank's Lr positions (padded first)."""
    dim = dim % x.dim()
    Lr = math.ceil(sp.seq_len / sp.size)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, Lr * sp.size - sp.seq_len]
    return F.pad(x, pad).narrow(dim, sp.rank * Lr, Lr)


def _language_model(model: nn.Module) -> nn.Module | None:
    """A VLM's language model (``model.model.language_model``: the Qwen-VL families' causal
    and scalar-head classes), or None for a text model."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    return getattr(getattr(model, "model", None), "language_model", None)


def slice_language_inputs(
    _module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    """Forward pre-hook of a VLM's language model under Ulysses: the whole rows' merged
    embeddings ``inputs_embeds`` (B, L, H) and ``position_ids`` ((B, L) or (3|4, B, L)) ->
    this rank's slice; Qwen3-VL's deepstack inputs (``visual_pos_masks`` (B, L) and each
    layer's features of the image tokens, in row order) -> those of the slice. Acts only on a
    forward whose ``sequence_parallel`` context says so (``UlyssesContext.whole_rows``)."""
    sp = kwargs.get("sequence_parallel")
    if sp is None or not sp.whole_rows:
        return None
    out = dict(kwargs)
    out["inputs_embeds"] = _slice_seq(kwargs["inputs_embeds"], sp, dim=1)
    if kwargs.get("position_ids") is not None:
        out["position_ids"] = _slice_seq(kwargs["position_ids"], sp)
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:
        B = visual.shape[0]
        order = (visual.reshape(-1).long().cumsum(0) - 1).view(B, -1)  # each token's feature
        local = _slice_seq(visual, sp)
        picked = _slice_seq(order, sp)[local]
        out["visual_pos_masks"] = local
        out["deepstack_visual_embeds"] = [x[picked] for x in kwargs["deepstack_visual_embeds"]]
    return args, out


def local_range(seq_len: int, sp: SequenceParallel) -> tuple[int, int]:
    """``[start, stop)`` of the row positions this rank holds (the padding tail included)."""
    Lr = math.ceil(seq_len / sp.size)
    return sp.rank * Lr, (sp.rank + 1) * Lr


@torch.compiler.disable
def combine_disjoint(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over the group of tensors whose entries are each computed on one rank (0 elsewhere);
    differentiable, each rank's gradient being the result's (every rank computes the same
    loss from it)."""
    return _CombineDisjoint.apply(x, group)


class _CombineDisjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
