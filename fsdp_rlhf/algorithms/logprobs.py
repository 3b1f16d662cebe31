"""Token log-probabilities and entropies from logits, one chunk of positions at a time.

The logits of a policy forward pass are the largest activation in RLHF: B * T * V with V around
150k (Qwen2: 151,936) is about 5 GB in float32 for 8 x 1024 tokens. Every full-size temporary
(an fp32 upcast, ``logits / temperature``, a ``log_softmax`` copy, the reshape of a sliced view)
costs that much again. Here ``log p(label) = z[label] - logsumexp(z)`` with ``z = logits / t``
is computed over chunks of positions: each chunk is gathered, upcast and scaled on its own, so the
float32 temporaries are bounded by the chunk (32 MiB each) whatever the batch.

Under autograd the chunks are recomputed in backward (:class:`_GatheredLogProbs`) instead of
kept, so the update keeps nothing but the logits themselves: autograd through ``logsumexp`` and
``softmax`` would save every chunk's fp32 input, one full fp32 copy again. The gradients are
the analytic ones: ``d logp/dz = onehot(label) - p`` and ``dH/dz = -p (log p + H)``.

Half-precision logits are upcast per chunk: logsumexp over 150k bf16 values loses several bits,
and that error lands directly in the PPO ratio.
"""

from __future__ import annotations

import torch

# Elements of one chunk's float32 temporaries: 32 MiB each, about 55 positions at V = 151,936.
# Each kernel still moves tens of MB (a GPU stays busy); the temporaries add to the peak on top
# of the logits, so they stay a small fraction of one fp32 copy.
CHUNK_ELEMENTS = 1 << 23


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scaled_rows(
    flat: torch.Tensor, index: torch.Tensor | None, start: int, stop: int, temperature: float
) -> torch.Tensor:
    """Rows ``start:stop`` of the output positions as ``z - max(z)``, ``z = logits / t`` in the
    compute dtype; a tensor of its own (one chunk-sized temporary), never a view of ``flat``."""
    chunk = flat[start:stop] if index is None else flat.index_select(0, index[start:stop])
    owned = chunk.dtype != _compute_dtype(flat.dtype) or index is not None
    z = chunk.to(_compute_dtype(flat.dtype))
    if temperature != 1.0:
        z = z.div_(temperature) if owned else z / temperature
        owned = True
    peak = z.amax(-1, keepdim=True)
    return z.sub_(peak) if owned else z - peak


def _normalise(shifted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, V) shifted logits -> (c, V) probabilities (a new tensor) and (c,) log-normaliser."""
    probs = shifted.exp()
    norm = probs.sum(-1)
    return probs.div_(norm.unsqueeze(-1)), norm.log_()


def _entropy(probs: torch.Tensor, shifted: torch.Tensor, log_norm: torch.Tensor) -> torch.Tensor:
    """H = log_norm - sum(p * shifted) (shift-invariant), as a batched dot: no (c, V) product."""
    return log_norm - torch.bmm(probs.unsqueeze(1), shifted.unsqueeze(2)).view(-1)


class _GatheredLogProbs(torch.autograd.Function):
    """Label log-probs (and entropies) of selected rows of ``logits``, recomputed per chunk in
    backward. See :func:`gathered_logprobs` for the arguments."""

    @staticmethod
    def forward(ctx, logits, labels, index, temperature, with_entropy, entropy_grad, chunk):
        flat = logits.reshape(-1, logits.shape[-1])
        n = labels.numel()
        dtype = _compute_dtype(logits.dtype)
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        entropy = torch.empty(n, dtype=dtype, device=logits.device) if with_entropy else None
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            shifted = _scaled_rows(flat, index, start, stop, temperature)
            picked = shifted.gather(-1, labels[start:stop].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                probs, log_norm = _normalise(shifted)
                entropy[start:stop] = _entropy(probs, shifted, log_norm)
                del probs
            else:  # the shifted chunk is not needed after: exponentiate it in place
                log_norm = shifted.exp_().sum(-1).log_()
            logp[start:stop] = picked - log_norm
            del shifted
        ctx.save_for_backward(logits, labels, index)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.entropy_grad = with_entropy and entropy_grad
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, index = ctx.saved_tensors
        t, chunk, n = ctx.temperature, ctx.chunk, labels.numel()
        flat = logits.reshape(-1, logits.shape[-1])
        # rows no label reads get no gradient; with index None every row is written
        grad = torch.zeros_like(flat) if index is not None else torch.empty_like(flat)
        use_entropy = ctx.entropy_grad and grad_entropy is not None
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            shifted = _scaled_rows(flat, index, start, stop, t)
            probs, log_norm = _normalise(shifted)
            if use_entropy:  # dH/dz = -p (log p + H), log p = shifted - log_norm
                h = _entropy(probs, shifted, log_norm)
                g_ent = grad_entropy[start:stop].unsqueeze(-1)
                shifted.sub_((log_norm - h).unsqueeze(-1)).mul_(probs).mul_(-g_ent)
            if grad_logp is not None:  # dlogp/dz = onehot(label) - p
                g_lp = grad_logp[start:stop].unsqueeze(-1)
                probs.mul_(-g_lp).scatter_add_(-1, labels[start:stop].unsqueeze(-1), g_lp)
            else:
                probs.zero_()
            gz = probs.add_(shifted) if use_entropy else probs
            if t != 1.0:
                gz.div_(t)
            if index is None:
                grad[start:stop] = gz
            else:
                grad.index_add_(0, index[start:stop], gz.to(grad.dtype))
            del shifted, probs, gz
        return grad.view_as(logits), None, None, None, None, None, None


def gathered_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    index: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``labels`` (and entropies) under ``softmax(logits / temperature)``.

    Args:
        logits: (..., V) unnormalised scores, read as N = prod(...) rows of V.
        labels: (B, T) token ids in ``[0, V)``.
        index: (B, T) row of ``logits`` (in ``[0, N)``) that predicts each label; None when
            ``logits`` is (B, T, V) and already aligned with ``labels``. Rows may repeat.
        temperature: divides the logits (per chunk, never as a full copy).
        with_entropy: also return the entropy at every position.
        entropy_grad: whether the entropy is differentiable (else a metric only).
        chunk_size: positions per chunk; None: as many as fit ``CHUNK_ELEMENTS``.

    Returns:
        (B, T) log-probs and (B, T) entropies or None; float32 for half-precision logits,
        otherwise ``logits.dtype``. Differentiable with respect to ``logits``.
    """
    vocab = logits.shape[-1]
    if index is None and logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if index is not None and index.shape != labels.shape:
        raise ValueError(f"index {tuple(index.shape)} does not match labels {tuple(labels.shape)}")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // vocab)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_index = None if index is None else index.reshape(-1)
    logp, entropy = _GatheredLogProbs.apply(
        logits,
        labels.reshape(-1),
        flat_index,
        float(temperature),
        with_entropy,
        entropy_grad,
        chunk_size,
    )
    shape = labels.shape
    return logp.view(shape), entropy.view(shape) if entropy is not None else None


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = 1024,
) -> torch.Tensor:
    """Log-probability of each label under the softmax of ``logits``.

    Args:
        logits: (B, T, V) unnormalised scores; position t must already be aligned with
            ``labels[:, t]`` (i.e. the caller has shifted the causal-LM logits).
        labels: (B, T) integer token ids in ``[0, V)``.
        chunk_size: Positions (of the B * T) processed at once; ``None``: all in one pass.

    Returns:
        (B, T) log-probabilities, float32 for half-precision logits, otherwise
        ``logits.dtype``. Differentiable with respect to ``logits``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if chunk_size is None:
        chunk_size = max(labels.numel(), 1)
    return gathered_logprobs(logits, labels, chunk_size=chunk_size)[0]


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = 1024) -> torch.Tensor:
    """Entropy of the softmax distribution at every position: ``logsumexp(z) - sum(p z)``.

    Args:
        logits: (B, T, V) unnormalised scores.
        chunk_size: Positions processed at once; ``None``: all in one pass.

    Returns:
        (B, T) entropies (float32 for half-precision logits). Differentiable.
    """
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    if chunk_size is None:
        chunk_size = max(labels.numel(), 1)
    return gathered_logprobs(logits, labels, with_entropy=True, chunk_size=chunk_size)[1]
