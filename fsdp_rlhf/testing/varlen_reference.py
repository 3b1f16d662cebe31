"""A CPU stand-in for the CUDA varlen kernels (``models.varlen``), registered as one op.

``fsdp_rlhf::varlen_attention_reference`` computes what ``varlen_attn`` / flash-attn compute
(causal within each segment, diagonal aligned bottom-right, optional sliding window, K/V with
fewer heads than the queries, zeros for a query without keys) with a loop over the segments,
in float32, inside the op. To autograd, the dispatcher and ``torch.compile`` it is one op with
a backward op, as the CUDA kernels are, so a test can run a model's packed forward and backward
on CPU through the same code path as on the GPU and count the calls.
"""

from __future__ import annotations

import torch

from fsdp_rlhf.models.varlen import VarlenKernel

OP = "fsdp_rlhf::varlen_attention_reference"


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    q0, k0 = cu_q.tolist(), cu_k.tolist()
    return zip(q0[:-1], q0[1:], k0[:-1], k0[1:], strict=True)


def _probs(qs, ks, scale: float, window: int) -> torch.Tensor:
    """(H, n, D), (H, S, D) float32 -> (H, n, S) attention probabilities, causal bottom-right
    (and windowed); a query without keys: a row of zeros."""
    n, S = qs.shape[1], ks.shape[1]
    allowed = torch.ones(n, S, dtype=torch.bool).tril(S - n)
    if window:
        allowed &= torch.ones(n, S, dtype=torch.bool).triu(S - n - window + 1)
    scores = (qs @ ks.transpose(1, 2)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)


def _heads(x: torch.Tensor, rep: int) -> torch.Tensor:  # (S, KV, D) -> (H, S, D) float32
    return x.float().transpose(0, 1).repeat_interleave(rep, dim=0)


def _attend(q, k, v, cu_q, cu_k, scale: float, window: int) -> torch.Tensor:
    """The loop: q (Tq, H, D), k/v (Tk, KV, D) -> (Tq, H, Dv) float32; ``window`` 0: none."""
    rep = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
    for a, b, c, d in _segments(cu_q, cu_k):
        probs = _probs(_heads(q[a:b], 1), _heads(k[c:d], rep), scale, window)
        out[a:b] = (probs @ _heads(v[c:d], rep)).transpose(0, 1)
    return out


def _attend_backward(grad, q, k, v, cu_q, cu_k, scale: float, window: int):
    """Gradients of :func:`_attend` (float32): dq (Tq, H, D), dk/dv (Tk, KV, D) summed over
    the query heads sharing each KV head."""
    H, KV = q.shape[1], k.shape[1]
    rep = H // KV
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.zeros(k.shape, dtype=torch.float32)
    dv = torch.zeros(v.shape, dtype=torch.float32)
    for a, b, c, d in _segments(cu_q, cu_k):
        qs, ks, vs = _heads(q[a:b], 1), _heads(k[c:d], rep), _heads(v[c:d], rep)
        probs = _probs(qs, ks, scale, window)  # (H, n, S)
        go = _heads(grad[a:b], 1)  # (H, n, Dv)
        dp = go @ vs.transpose(1, 2)
        ds = probs * (dp - (dp * probs).sum(-1, keepdim=True)) * scale
        dq[a:b] = (ds @ ks).transpose(0, 1)
        dk[c:d] = (ds.transpose(1, 2) @ qs).unflatten(0, (KV, rep)).sum(1).transpose(0, 1)
        dv[c:d] = (probs.transpose(1, 2) @ go).unflatten(0, (KV, rep)).sum(1).transpose(0, 1)
    return dq, dk, dv


@torch.library.custom_op(OP, mutates_args=())
def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    return _attend(q, k, v, cu_q, cu_k, scale, window).to(q.dtype)


@varlen_attention_reference.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


@torch.library.custom_op(OP + "_backward", mutates_args=())
def varlen_attention_reference_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _attend_backward(grad, q, k, v, cu_q, cu_k, scale, window)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@varlen_attention_reference_backward.register_fake
def _(grad, q, k, v, cu_q, cu_k, scale, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, _max_q, _max_k, scale, window = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.scale, ctx.window = scale, window


def _backward(ctx, grad):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.fsdp_rlhf.varlen_attention_reference_backward(
        grad, q, k, v, cu_q, cu_k, ctx.scale, ctx.window
    )
    return dq, dk, dv, None, None, None, None, None, None


varlen_attention_reference.register_autograd(_backward, setup_context=_setup)


def reference_kernel(calls: list | None = None, devices=("cpu", "cuda")) -> VarlenKernel:
    """The reference op as a :class:`VarlenKernel` for any dtype on ``devices``. ``calls``,
    when given, receives one ``(q, k, v, cu_q, cu_k, max_q, max_k)`` entry per call (the
    tests count calls and read the K/V heads and the offsets' dtype from them)."""

    def call(q, k, v, cu_q, cu_k, max_q, max_k, scale, window):
        if calls is not None:
            calls.append((q, k, v, cu_q, cu_k, max_q, max_k))
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return torch.ops.fsdp_rlhf.varlen_attention_reference(
            q, k, v, cu_q, cu_k, max_q, max_k, float(scale), window or 0
        )

    return VarlenKernel("reference (CPU loop as one op)", call, True, devices, None)
