"""Attention kernels registered with HF's ``AttentionInterface``, for the shapes trainers run.

- ``fsdp_rlhf_padded`` (every padded forward): HF's SDPA, except on CPU when a backward follows,
  where an explicit masked matmul-softmax-matmul is faster (SDPA's CPU flash kernel is slow in
  backward at these sizes). Scores in bf16 with the mask added inside the matmul (``baddbmm``)
  and the softmax in float32, as HF's eager attention does, are faster than float32 scores
  with ``masked_fill``. Without a backward SDPA stays: it is the faster one there. Timings:
  benchmarks/grpo_rm_vs_trl_intel-xeon-amx-2core_2026-11-22.md.
- ``fsdp_rlhf_varlen`` (``--packing_samples`` unless HF's flash_attention_2 runs): causal
  attention per sequence of a packed row (models.packing.pack_rows), so its cost is the sum of
  squared lengths rather than the row's length squared. On CUDA in half precision one varlen
  kernel call per layer does it for every sequence at once (``models.varlen``: torch's
  ``varlen_attn`` or flash-attn's, K/V unrepeated, no host sync); elsewhere, and for what no
  kernel takes, a loop over the sequences (:func:`varlen_loop`, the reference). With
  ``--flash_attn`` on CUDA, packed forwards keep HF's flash_attention_2, whose varlen kernel
  does the same.
- GRPO's shared-prompt rows (``models.shared_prefix``) through ``fsdp_rlhf_padded``: on the
  same varlen kernel where it runs (:func:`shared_prompt_varlen`: each response's keys are its
  prompt's and its own), else two masked attentions (:func:`shared_prompt_attention`).

Both fall back to SDPA's kernels for sequences longer than ``CPU_EXPLICIT_ATTENTION_MAX_LEN``,
whose memory does not grow with length squared.

Attention sinks (gpt-oss: transformers passes each head's learned sink logit as ``s_aux``): a
sink is one more score in every query's softmax, with no value, so it takes a share of the
attention and the rest shrinks. Every kernel here honours it (padded, shared-prompt, packed,
and Ulysses' inner call), through the explicit attention (SDPA has no sink input).

The registered names say what the kernels are without naming SDPA: transformers decides by
substring whether a model's attention "is SDPA" (``"sdpa" in attn_implementation``) and then
refuses the models that declare no SDPA support (gpt-oss, for its sinks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from fsdp_rlhf.models.varlen import (
    VarlenKernel,
    VarlenSegments,
    resolve_kernels,
    select_kernel,
)

PADDED_ATTENTION = "fsdp_rlhf_padded"
VARLEN_ATTENTION = "fsdp_rlhf_varlen"
# On CPU, sequences up to this long get an explicit attention when a backward follows. Packed,
# at these sizes it beats SDPA's math kernel (whose per-call scaling and masking ops dominate)
# and its flash kernel in forward + backward (timings in benchmarks/). Without a backward the
# flash kernel is fastest.
CPU_EXPLICIT_ATTENTION_MAX_LEN = 512
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _explicit_wanted(query: torch.Tensor, dropout: float, max_len: int) -> bool:
    return (
        query.device.type == "cpu"
        and torch.is_grad_enabled()
        and dropout == 0.0
        and max_len <= CPU_EXPLICIT_ATTENTION_MAX_LEN
    )


def _repeat_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Grouped-query attention: share each KV head among its query heads. (B, KV, L, D)."""
    if key.shape[1] == query.shape[1]:
        return key, value
    rep = query.shape[1] // key.shape[1]
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


def padded_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    grouped_response_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: q (B, H, L, D), k/v (B, KV, L, D), ``attention_mask`` None
    (plain causal) or (B, 1, L, >=L) bool, True where attended -> (B, L, H, D).

    With ``grouped_response_mask`` the rows are shared-prompt rows (models.shared_prefix) and
    ``attention_mask`` is their prompt mask: see :func:`shared_prompt_attention`.
    """
    sinks = kwargs.pop("s_aux", None)
    segments = kwargs.pop("grouped_segments", None)
    if grouped_response_mask is not None:
        kernel = None
        if segments is not None and sinks is None and dropout == 0.0:
            kernel = select_kernel(query)
        if kernel is not None:
            return shared_prompt_varlen(kernel, query, key, value, segments, scaling), None
        return shared_prompt_attention(
            query, key, value, attention_mask, grouped_response_mask, dropout, scaling, sinks
        ), None
    if sinks is None and not _explicit_wanted(query, dropout, key.shape[-2]):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    key, value = _repeat_kv(query, key, value)
    L, S = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        allowed = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)
    else:
        allowed = attention_mask[:, :, :, :S].bool()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _masked_attention(query, key, value, allowed, scale, dropout, True, sinks)
    return out.transpose(1, 2).contiguous(), None


def shared_prompt_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    dropout: float = 0.0,
    scaling: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over shared-prompt rows ``[prompt | response_1 | ... | response_s]``.

    The prompt attends causally to itself; each response attends to the prompt and causally
    to itself, never to its siblings: what each sample's own padded row would compute, with
    the prompt's queries, keys and values computed once. Two dense attentions, so the cost is
    ``P^2 + s T (P + T)`` rather than ``(P + s T)^2``.

    Args:
        query: (G, H, P + s*T, D); key/value: (G, KV, P + s*T, D).
        prompt_mask: (G, 1, 1, P) bool, True on real (not left-padding) prompt tokens.
        response_mask: (G*s, 1, 1, T) bool, True on attended response tokens.
        sinks: (H,) attention-sink logits, or None.
    Returns:
        (G, P + s*T, H, Dv).
    """
    key, value = _repeat_kv(query, key, value)
    G, H, L, D = query.shape
    P, T = prompt_mask.shape[-1], response_mask.shape[-1]
    s = response_mask.shape[0] // G
    scale = scaling if scaling is not None else D**-0.5
    explicit = sinks is not None or _explicit_wanted(query, dropout, P + T)
    tril_p = torch.ones(P, P, dtype=torch.bool, device=query.device).tril()
    # a left-padding query attends to itself: never a row with nothing allowed (NaN in SDPA)
    eye_p = torch.eye(P, dtype=torch.bool, device=query.device)
    prompt_allowed = (tril_p & prompt_mask) | eye_p  # (G, 1, P, P)

    def per_response(x: torch.Tensor) -> torch.Tensor:  # (G, H, s*T, D) -> (G*s, H, T, D)
        return x[:, :, P:].unflatten(2, (s, T)).transpose(1, 2).flatten(0, 1)

    def with_prompt(x: torch.Tensor) -> torch.Tensor:  # each response's keys: prompt + its own
        prompt = x[:, :, :P].unsqueeze(1).expand(G, s, H, P, x.shape[-1]).flatten(0, 1)
        return torch.cat([prompt, per_response(x)], dim=2)

    tril_t = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
    response_allowed = torch.cat(
        [
            prompt_mask.repeat_interleave(s, dim=0).expand(G * s, 1, T, P),
            tril_t & response_mask,
        ],
        dim=-1,
    )  # (G*s, 1, T, P + T)
    out_p = _masked_attention(
        query[:, :, :P],
        key[:, :, :P],
        value[:, :, :P],
        prompt_allowed,
        scale,
        dropout,
        explicit,
        sinks,
    )
    out_r = _masked_attention(
        per_response(query),
        with_prompt(key),
        with_prompt(value),
        response_allowed,
        scale,
        dropout,
        explicit,
        sinks,
    )  # (G*s, H, T, Dv)
    out_r = out_r.unflatten(0, (G, s)).transpose(1, 2).flatten(2, 3)  # (G, H, s*T, D)
    return torch.cat([out_p, out_r], dim=2).transpose(1, 2).contiguous()


def shared_prompt_varlen(
    kernel: VarlenKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: VarlenSegments,
    scaling: float | None = None,
) -> torch.Tensor:
    """:func:`shared_prompt_attention` as one varlen kernel call: each group's prompt and each
    of its responses a segment whose keys are ``[prompt | response]``
    (``models.varlen.shared_prompt_segments``); the prompt's K/V gathered once per response
    (KV heads only), no mask.

    Args:
        query: (G, H, P + s*T, D); key/value: (G, KV, P + s*T, D).
    Returns:
        (G, P + s*T, H, Dv): at left-padding positions zeros (they attend to nothing), at real
        positions what :func:`shared_prompt_attention` gives.
    """
    G, H, Lm, D = query.shape
    q = query.transpose(1, 2).reshape(G * Lm, H, D)
    k, v = (
        x.transpose(1, 2)
        .reshape(G * Lm, x.shape[1], x.shape[-1])
        .index_select(0, segments.key_index)
        for x in (key, value)
    )
    out = kernel.call(
        q, k, v, segments.cu_q, segments.cu_k, segments.max_q, segments.max_k, scaling, None
    )
    return out.view(G, Lm, H, value.shape[-1])


def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    dropout: float,
    explicit: bool,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (B, H, L, D), k/v (B, H, S, D), ``allowed`` (B, 1, L, S) bool -> (B, H, L, Dv);
    ``sinks`` (H,) attention-sink logits (explicit attention only)."""
    if not explicit and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale
        )
    B, H, L, D = q.shape
    S, Dv = k.shape[-2], v.shape[-1]
    # Additive mask in the input dtype, fused into the score matmul; a finite floor, not -inf: a
    # left-padding query attends to nothing, and an all -inf row would turn into NaN (then NaN
    # gradients, even where the loss masks that position out).
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min).expand(B, H, L, S)
    return _attend(
        q.reshape(B * H, L, D),
        k.reshape(B * H, S, D),
        v.reshape(B * H, S, Dv),
        bias.reshape(B * H, L, S),
        scale,
        None if sinks is None else sinks.repeat(B),
    ).view(B, H, L, Dv)


RowSpans = tuple[tuple[int, int], ...]


def row_spans(attention_mask: torch.Tensor) -> RowSpans | None:
    """Each row's ``[start, stop)`` of attended tokens when they form one run (left padding,
    tokens, right padding: every row the trainers build), else None. One host sync."""
    mask = attention_mask.bool()
    count = mask.sum(-1)
    start = mask.int().argmax(-1) * (count > 0)
    cols = torch.arange(mask.shape[-1], device=mask.device)
    run = (cols >= start[:, None]) & (cols < (start + count)[:, None])
    if not torch.equal(run, mask):
        return None
    return tuple(zip(start.tolist(), (start + count).tolist(), strict=True))


def span_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: RowSpans,
    dropout: float,
    scale: float,
) -> torch.Tensor:
    """Causal attention of padded rows without a mask: q (B, H, L, D), k/v (B, KV, L, D),
    ``spans`` each row's run of attended tokens (:func:`row_spans`) -> (B, H, L, D).

    Each row's run goes through SDPA with ``is_causal`` (rows without left padding together, in
    one call: a causal query never sees the right padding after it), so the kernel keeps
    nothing of size L x L for backward (an explicit mask would be kept, as an L x L bias per
    row, by every layer). Real tokens attend as under the padding mask; padding gets what the
    causal kernel gives it (0 at left padding, and at right padding of a row cut out)."""
    gqa = k.shape[1] != q.shape[1]

    def causal(q, k, v):
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )

    if all(start == 0 for start, _ in spans):
        return causal(q, k, v)
    L = q.shape[2]
    outs = []
    # unbind and split, not slicing: each slice's backward would allocate a zero gradient of
    # the whole batch
    for (start, stop), qb, kb, vb in zip(spans, q.unbind(0), k.unbind(0), v.unbind(0), strict=True):
        parts = [start, stop - start, L - stop]
        qs, ks, vs = (x.split(parts, dim=1)[1].unsqueeze(0) for x in (qb, kb, vb))
        out = causal(qs, ks, vs) if stop > start else qs
        outs.append(F.pad(out, (0, 0, start, L - stop)))
    return torch.cat(outs)


def varlen_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    shared_prefix_lens: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: q (1, H, T, D), k/v (1, KV, T, D) -> (1, T, H, D), causal
    attention within each ``cu_seq_lens_q`` segment (``max_length_q`` the longest); a
    sliding-window layer (Gemma 3's local layers: transformers passes ``sliding_window``)
    attends to its last ``sliding_window`` keys, itself included, as transformers' padded mask
    does.

    One varlen kernel call over the whole row where one takes these queries
    (``models.varlen.select_kernel``: CUDA, half precision, the window if any): K/V keep their
    KV heads and the offsets stay on the device. Otherwise, and for what no kernel takes
    (attention sinks, dropout, shared pair prefixes), a loop over the sequences
    (:func:`varlen_loop`).

    With ``shared_prefix_lens`` (B,) the segments are preference pairs that share a prefix
    (models.shared_prefix.SharedPairRow): segment 2i is the chosen sequence, segment 2i + 1 the
    rest of the rejected one, whose queries also attend to the first ``shared_prefix_lens[i]``
    keys of segment 2i, as they would in the rejected sequence's own row.
    ``s_aux`` (gpt-oss): (H,) attention-sink logits.
    """
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION} needs one packed row and cu_seq_lens_q (pack_rows)")
    kernel = None
    if kwargs.get("s_aux") is None and shared_prefix_lens is None and dropout == 0.0:
        kernel = select_kernel(query, sliding_window) if max_length_q is not None else None
    if kernel is None:
        out = varlen_loop(
            query, key, value, dropout, scaling, cu_seq_lens_q, shared_prefix_lens,
            sliding_window, kwargs.get("s_aux"),
        )  # fmt: skip
        return out, None
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D) views
    cu = cu_seq_lens_q
    out = kernel.call(q, k, v, cu, cu, max_length_q, max_length_q, scaling, sliding_window)
    return out.unsqueeze(0), None


# A Python loop over data-dependent lengths: traced, it would specialise on every batch's lengths.
# Compiled layers (models.compile) call it as an eager function instead.
@torch.compiler.disable
def varlen_loop(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    cu_seq_lens_q: torch.Tensor,
    shared_prefix_lens: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`varlen_sdpa` one sequence at a time (the CPU path and the reference): K/V
    repeated to the query heads, the offsets read on the host, one attention per sequence."""
    key, value = _repeat_kv(query, key, value)
    # split, not slicing: each slice's backward would allocate a zero gradient of the whole row
    lengths = cu_seq_lens_q.diff().tolist()
    explicit = sinks is not None or _explicit_wanted(query, dropout, max(lengths))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    qs, ks, vs = (x[0].split(lengths, dim=1) for x in (query, key, value))  # (H, n, D) each
    prefixes = [0] * len(lengths)  # keys each segment sees before its own
    if shared_prefix_lens is not None:
        prefixes[1::2] = shared_prefix_lens.tolist()
    parts = []
    for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        if prefixes[i]:  # a rejected rest: the pair's prefix keys first (segment i - 1)
            k = torch.cat([ks[i - 1][:, : prefixes[i]], k], dim=1)
            v = torch.cat([vs[i - 1][:, : prefixes[i]], v], dim=1)
        parts.append(_causal_attention(q, k, v, scale, dropout, explicit, sliding_window, sinks))
    return torch.cat(parts, dim=1).transpose(0, 1).unsqueeze(0).contiguous()


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dropout: float,
    explicit: bool,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence whose last ``n`` tokens are the queries: q (H, n, D),
    k/v (H, S >= n, D) -> (H, n, D); with ``window`` each query sees its last ``window`` keys
    (itself included) only; ``sinks`` (H,) attention-sink logits (explicit only)."""
    n, S = q.shape[1], k.shape[1]
    if window is not None and window < S:
        allowed = torch.ones(n, S, dtype=torch.bool, device=q.device)
        allowed = allowed.tril(S - n) & allowed.triu(S - n - window + 1)
        if explicit:
            bias = torch.zeros(n, S, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill(~allowed, float("-inf"))
            return _attend(q, k, v, bias.expand(q.shape[0], n, S), scale, sinks)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=allowed, dropout_p=dropout,
            scale=scale,
        )  # fmt: skip
        return out[0]
    if not explicit:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # SDPA's CPU flash kernel: 4D
        with sdpa_kernel(_SDPA_BACKENDS):
            if n == S:
                out = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=scale
                )
            else:  # SDPA's is_causal aligns the diagonal top-left; these queries are the last n
                allowed = torch.ones(n, S, dtype=torch.bool, device=q.device).tril(S - n)
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale
                )
        return out[0]
    causal = torch.full((n, S), float("-inf"), dtype=q.dtype, device=q.device).triu(S - n + 1)
    return _attend(q, k, v, causal.expand(q.shape[0], n, S), scale, sinks)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v`` over a batch of heads: q (N, L, D), k/v (N, S, D),
    bias (N, L, S) in q's dtype -> (N, L, D). Scores in the input dtype with the mask added
    inside the matmul, softmax in float32 (as HF's eager attention does), or float64 for float64
    inputs: their mask floor (float64's min) is -inf in float32, and a left-padding query's
    all -inf row would be NaN.

    ``sinks`` (N,): each head's attention-sink logit, one more score of every query's softmax
    whose probability is dropped (it has no value), as gpt-oss's eager attention computes it."""
    scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
        return torch.bmm(probs, v)
    N, L, S = scores.shape
    sink = sinks.to(scores.dtype).view(N, 1, 1).expand(N, L, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=softmax_dtype)
    return torch.bmm(probs[..., :S].to(q.dtype), v)


FLASH_ATTENTION = "flash_attention_2"


def varlen_attention_impl(device_type: str, flash_attn: bool, flash_attn_importable: bool) -> str:
    """The attention of packed forwards: HF's flash_attention_2 on CUDA when ``--flash_attn``
    and flash-attn is installed (one varlen kernel call per layer over the whole row, fed by the
    ``cu_seq_lens_*`` kwargs of ``PackedRow.model_inputs``), else :func:`varlen_sdpa`."""
    if device_type == "cuda" and flash_attn and flash_attn_importable:
        return FLASH_ATTENTION
    return VARLEN_ATTENTION


def flash_attn_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def use_varlen_attention(model: nn.Module, device_type: str | None = None) -> None:
    """Make an HF model's attention packing-aware; from then on every forward must be packed.

    A model loaded with flash_attention_2 (``models.load.attn_implementation``: --flash_attn,
    CUDA, flash-attn installed) keeps it: its varlen path already attends per sequence.
    ``device_type`` is where the model will run (default: cuda when available).
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    wants_flash = text_attention(model) == FLASH_ATTENTION
    impl = varlen_attention_impl(device_type, wants_flash, flash_attn_importable())
    if impl == VARLEN_ATTENTION:
        register_attention()
    if text_attention(model) != impl:
        set_text_attention(model, impl)
    # linear-attention layers (Qwen3.5) restart their recurrence at each sequence of the row
    from fsdp_rlhf.models.linear_attention import split_packed_linear_attention

    split_packed_linear_attention(model)


def text_attention(model: nn.Module) -> str:
    """The attention kernel of ``model``'s decoder (a VLM's language model; its vision tower
    keeps its own)."""
    return model.config.get_text_config()._attn_implementation


# The keywords of the text rows' attention (packed rows' offsets, the Ulysses context) that a
# VLM's forward also hands its vision tower, whose attention has its own.
_TEXT_ROW_KWARGS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "sequence_parallel",
)


def set_text_attention(model: nn.Module, impl: str) -> None:
    """Run ``model``'s decoder attention through ``impl``. A VLM's vision tower keeps its
    kernel (each image's patches, no causal mask) and no longer sees the text rows' attention
    keywords (``_TEXT_ROW_KWARGS``: transformers passes the forward's keywords on to the
    tower, whose flash-attn path would get ``cu_seq_lens_q`` twice)."""
    from fsdp_rlhf.distributed.vision_units import vision_tower

    if getattr(model.config, "vision_config", None) is None:
        model.set_attn_implementation(impl)
        return
    model.set_attn_implementation({"text_config": impl})
    tower = vision_tower(model)
    if tower is not None and _drop_text_row_kwargs not in tower._forward_pre_hooks.values():
        tower.register_forward_pre_hook(_drop_text_row_kwargs, with_kwargs=True)


def _drop_text_row_kwargs(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {k: v for k, v in kwargs.items() if k not in _TEXT_ROW_KWARGS}


def register_attention() -> None:
    """Make both kernels known to HF (idempotent). The padded one gets SDPA's mask format."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PADDED_ATTENTION, padded_sdpa)
    AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PADDED_ATTENTION, sdpa_mask)
    resolve_kernels()  # here, not in the first (maybe traced) forward
