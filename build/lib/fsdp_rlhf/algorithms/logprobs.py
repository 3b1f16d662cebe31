"""Token log-probabilities and entropies from logits without a full log-softmax copy.

The logits of a policy forward pass are the largest activation in RLHF (B * T * V with V
around 150k), so ``log_softmax(logits).gather(...)`` briefly doubles the peak memory. Here
``log p(label) = logit[label] - logsumexp(logits)``, computed over chunks of rows so that the
float32 temporaries are bounded by ``chunk_size * V`` elements whatever the batch size.

Half-precision logits are upcast per chunk: logsumexp over 150k bf16 values loses several
bits, and that error lands directly in the PPO ratio.
"""

from __future__ import annotations

import torch


def _row_chunks(flat: torch.Tensor, chunk_size: int | None) -> tuple[torch.Tensor, ...]:
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if chunk_size is None or flat.shape[0] <= chunk_size:
        return (flat,)
    # split() is a single autograd node, so backward concatenates the chunk gradients once
    # instead of materialising a full-size zero gradient per slice.
    return torch.split(flat, chunk_size, dim=0)


def _upcast(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.float() if chunk.dtype in (torch.float16, torch.bfloat16) else chunk


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
        chunk_size: Rows (of the B * T flattened positions) processed at once. ``None``
            processes everything in one pass.

    Returns:
        (B, T) log-probabilities, float32 for half-precision logits, otherwise
        ``logits.dtype``. Differentiable with respect to ``logits``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1, 1)
    logit_chunks = _row_chunks(flat_logits, chunk_size)
    label_chunks = torch.split(flat_labels, [c.shape[0] for c in logit_chunks], dim=0)
    out = []
    for logit_chunk, label_chunk in zip(logit_chunks, label_chunks, strict=True):
        chunk = _upcast(logit_chunk)
        picked = chunk.gather(-1, label_chunk).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(out).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = 1024) -> torch.Tensor:
    """Entropy of the softmax distribution at every position.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, which needs one softmax per chunk and no
    log-softmax copy.

    Args:
        logits: (B, T, V) unnormalised scores.
        chunk_size: Rows of the flattened (B * T, V) logits processed at once; ``None``
            processes everything in one pass.

    Returns:
        (B, T) entropies (float32 for half-precision logits). Differentiable; note that under
        autograd each chunk's softmax is kept for backward, so chunking bounds only the
        forward temporaries.
    """
    lead_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    out = []
    for logit_chunk in _row_chunks(flat_logits, chunk_size):
        chunk = _upcast(logit_chunk)
        lse = torch.logsumexp(chunk, dim=-1)
        probs = torch.exp(chunk - lse.unsqueeze(-1))
        out.append(lse - (probs * chunk).sum(dim=-1))
    return torch.cat(out).reshape(lead_shape)
