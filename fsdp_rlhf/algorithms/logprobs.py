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


# ---------------------------------------------------------------- from the final hidden states


class _HeadLogProbs(torch.autograd.Function):
    """Label log-probs (and entropies) of ``rows @ weight.T`` read one block of vocabulary
    columns at a time, recomputed block by block in backward. See :func:`head_logprobs`."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, index, temperature, with_entropy, entropy_grad, block):
        rows = _hidden_rows(hidden, index)
        logp, log_norm, entropy = _head_forward(
            rows, weight, labels, temperature, with_entropy, block
        )
        ctx.save_for_backward(hidden, weight, labels, index, log_norm, entropy)
        ctx.temperature, ctx.block = temperature, block
        ctx.entropy_grad = with_entropy and entropy_grad
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, index, log_norm, entropy = ctx.saved_tensors
        t, block = ctx.temperature, ctx.block
        use_entropy = ctx.entropy_grad and grad_entropy is not None
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        rows = _hidden_rows(hidden, index)
        cd = log_norm.dtype
        grad_rows = torch.zeros(rows.shape, dtype=cd, device=rows.device) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        for start in range(0, weight.shape[0], block):
            stop = min(start + block, weight.shape[0])
            w = weight[start:stop]
            # the forward's own logits of this block (the same matmul), as log-probs
            logp = _block_logits(rows, w, t, cd).sub_(log_norm.unsqueeze(-1))
            if use_entropy:  # dH/dz = -p (log p + H): gz = p * (-(log p + H) g_H - g_lp)
                gz = logp.exp()
                factor = logp.add_(entropy.unsqueeze(-1)).mul_(-grad_entropy.unsqueeze(-1))
                if grad_logp is not None:
                    factor.sub_(grad_logp.unsqueeze(-1))
                gz.mul_(factor)
                del factor
            elif grad_logp is not None:  # dlogp/dz = onehot(label) - p
                gz = logp.exp_().mul_(-grad_logp.unsqueeze(-1))
            else:
                gz = logp.zero_()
            del logp
            if grad_logp is not None:
                inside = (labels >= start) & (labels < stop)
                col = (labels - start).clamp(0, stop - start - 1).unsqueeze(-1)
                gz.scatter_add_(-1, col, (grad_logp * inside).unsqueeze(-1).to(cd))
            if t != 1.0:
                gz.div_(t)
            gz = gz.to(weight.dtype)
            if grad_weight is not None:  # one matmul over every position: as nn.Linear's
                torch.mm(gz.t(), rows, out=grad_weight[start:stop])
            if grad_rows is not None:
                grad_rows += gz @ w
            del gz
        grad_hidden = None
        if grad_rows is not None:
            flat = hidden.reshape(-1, hidden.shape[-1])
            if index is None:
                grad_hidden = grad_rows.to(hidden.dtype).view_as(hidden)
            else:
                full = torch.zeros(flat.shape, dtype=cd, device=hidden.device)
                grad_hidden = full.index_add_(0, index, grad_rows).to(hidden.dtype)
                grad_hidden = grad_hidden.view_as(hidden)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _hidden_rows(hidden: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """(n, H): the hidden state predicting each label (rows of ``hidden`` at ``index``)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return flat if index is None else flat.index_select(0, index)


def _block_logits(rows: torch.Tensor, w: torch.Tensor, t: float, cd: torch.dtype) -> torch.Tensor:
    """(n, v) logits of one vocabulary block, ``/ t``, in the compute dtype (a new tensor)."""
    z = torch.nn.functional.linear(rows, w)
    z = z.to(cd) if z.dtype != cd else z
    return z.div_(t) if t != 1.0 else z


def _head_forward(
    rows: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    t: float,
    with_entropy: bool,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Online log-sum-exp over vocabulary blocks: (n,) label log-probs, log-normalisers and
    entropies (or None), each block's logits computed, used and freed on its own."""
    n, cd, dev = rows.shape[0], _compute_dtype(weight.dtype), rows.device
    peak = torch.full((n,), float("-inf"), dtype=cd, device=dev)
    total = torch.zeros(n, dtype=cd, device=dev)  # sum of exp(z - peak)
    dot = torch.zeros(n, dtype=cd, device=dev) if with_entropy else None  # sum exp(z-peak) z
    picked = torch.zeros(n, dtype=cd, device=dev)
    for start in range(0, weight.shape[0], block):
        stop = min(start + block, weight.shape[0])
        z = _block_logits(rows, weight[start:stop], t, cd)
        inside = (labels >= start) & (labels < stop)
        col = (labels - start).clamp(0, stop - start - 1).unsqueeze(-1)
        picked = torch.where(inside, z.gather(-1, col).squeeze(-1), picked)
        new_peak = torch.maximum(peak, z.amax(-1))
        rescale = (peak - new_peak).exp_()
        if dot is None:  # z is not needed after: exponentiate it in place
            total.mul_(rescale).add_(z.sub_(new_peak.unsqueeze(-1)).exp_().sum(-1))
        else:
            e = (z - new_peak.unsqueeze(-1)).exp_()
            total.mul_(rescale).add_(e.sum(-1))
            dot.mul_(rescale).add_(torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1))
            del e
        peak = new_peak
        del z
    log_norm = peak + total.log()
    entropy = log_norm - dot / total if dot is not None else None
    return picked - log_norm, log_norm, entropy


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    index: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`gathered_logprobs` of ``logits = hidden @ weight.T`` without the logits.

    An output layer's (N, V) logits are never materialised, nor their gradient: the
    vocabulary is read in blocks of columns, all positions at once, with a running
    log-sum-exp (and entropy) per position; the backward recomputes each block's logits with
    the same matmul and writes that block's rows of the weight's gradient in one matmul over
    every position (the precision of ``nn.Linear``'s own backward). What stays alive besides
    the inputs is (n,) per position; each block's temporaries are about ``CHUNK_ELEMENTS``.

    Args:
        hidden: (..., H) final hidden states, read as N = prod(...) rows.
        weight: (V, H) the output layer's weight (no bias).
        labels, index, temperature, with_entropy, entropy_grad: as :func:`gathered_logprobs`
            (``index`` picks rows of ``hidden`` instead of rows of logits).
        block_size: vocabulary columns per block; None: ``CHUNK_ELEMENTS`` / positions.

    Returns:
        (B, T) log-probs and (B, T) entropies or None; float32 for half-precision weights,
        otherwise ``weight.dtype``. Differentiable with respect to ``hidden`` and ``weight``.
    """
    if index is None and hidden.shape[:-1] != labels.shape:
        shapes = f"hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}"
        raise ValueError(f"{shapes}: hidden states do not match the labels")
    if index is not None and index.shape != labels.shape:
        raise ValueError(f"index {tuple(index.shape)} does not match labels {tuple(labels.shape)}")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not (V, {hidden.shape[-1]})")
    if block_size is None:
        block_size = max(1, CHUNK_ELEMENTS // max(labels.numel(), 1))
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    flat_index = None if index is None else index.reshape(-1)
    logp, entropy = _HeadLogProbs.apply(
        hidden,
        weight,
        labels.reshape(-1),
        flat_index,
        float(temperature),
        with_entropy,
        entropy_grad,
        block_size,
    )
    shape = labels.shape
    return logp.view(shape), entropy.view(shape) if entropy is not None else None
