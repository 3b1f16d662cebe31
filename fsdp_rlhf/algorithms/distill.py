"""Distillation from a teacher's token distributions: on-policy signals for ``ppo`` and the
offline knowledge-distillation loss of ``kd``.

On-policy distillation (the student samples, the teacher scores every sampled token; Agarwal
et al. 2024, arXiv:2306.13649; Thinking Machines' "on-policy distillation", 2025) minimises the
reverse KL(student || teacher) on the student's own samples. With ``y_t`` the sampled token,
``s_t = log pi_S(y_t)`` and ``t_t = log pi_T(y_t)``, the choices here are:

* ``advantage`` (:func:`distill_advantages`): ``A_t += -coef * (s_t - t_t)``, a per-token
  advantage under the clipped policy loss (the sampled-token estimate of the reverse KL used as
  a reward: Thinking Machines, NeMo-RL's ``opd`` estimator, slime's ``--use-opd``, verl's
  ``use_policy_gradient``);
* ``k1`` / ``k2`` / ``k3`` (:func:`distill_kl`): Schulman's estimators of KL(student || teacher)
  from the sampled tokens, as a loss term ``coef * agg(k)`` (verl's ``loss_mode`` k1 / k2 /
  k3, k3 being its ``low_var_kl``);
* ``forward_kl_topk`` / ``reverse_kl_topk`` (:func:`topk_kl`): the KL between the two
  distributions restricted to the teacher's top-k tokens at each position plus one tail bucket
  holding the rest of the mass (verl's ``forward_kl_topk``, NeMo-RL's ``topk_logits_k`` with
  ``kl_type``, TRL's ``add_tail_bucket``).

Offline knowledge distillation (OpenRLHF's ``train_kd``, Hinton et al. 2015) trains on dataset
responses with ``(1 - kd_coef) * NLL + kd_coef * KL(teacher || student)`` over the whole
vocabulary (:func:`kd_forward_kl`): computed a block of positions at a time from each model's
final hidden states and output weight, so neither model's (positions, V) logits exist at once.

Shapes: B rows, T response positions, V vocabulary, k top-k tokens, n flattened positions.
"""

from __future__ import annotations

from typing import Literal

import torch

from .kl import kl_estimate
from .logprobs import CHUNK_ELEMENTS

# log of the smallest tail mass kept: a tail of exactly zero (k = V) would give 0 * log 0
_TAIL_FLOOR = 1e-30


def distill_advantages(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """The reverse-KL advantage of each sampled token, ``-coef * (s_t - t_t)``.

    Args:
        logprobs: (B, T) the sampling policy's log-probs of the sampled tokens (``s_t``).
        teacher_logprobs: (B, T) the teacher's log-probs of the same tokens (``t_t``).
        response_mask: (B, T) 1 on the tokens the student generated.
        coef: the weight of the signal (``--distill_coef``).

    Returns:
        (B, T) advantages to add to the task's, 0 off the mask; no gradient.
    """
    gap = (logprobs.detach() - teacher_logprobs.detach()) * response_mask
    return -coef * gap


def distill_kl(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    kind: Literal["k1", "k2", "k3"],
    *,
    old_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(student || teacher) from sampled tokens, as a loss term.

    ``k1 = s - t``, ``k2 = (s - t)^2 / 2``, ``k3 = exp(t - s) - 1 + (s - t)``
    (:func:`~fsdp_rlhf.algorithms.kl.kl_estimate` with the teacher in the reference's place,
    its value clamp straight-through). After the first optimizer step on a rollout batch the
    tokens are off-policy; with ``old_logprobs`` the gradient is importance-weighted
    (``min(pi / pi_old, 10) * (s - t) * grad s``, the unbiased KL gradient).

    Args:
        logprobs: (B, T) the student's log-probs (with grad).
        teacher_logprobs: (B, T) the teacher's log-probs of the same tokens.
        kind: ``k1``, ``k2`` or ``k3``.
        old_logprobs: (B, T) the sampling policy's log-probs (None: on-policy, the
            estimator's own gradient).

    Returns:
        (B, T) per-token values; the caller masks and aggregates them.
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"unknown distillation KL estimator {kind!r}; expected k1, k2 or k3")
    return kl_estimate(
        logprobs,
        teacher_logprobs.detach(),
        kind=kind,
        unbiased_gradient=old_logprobs is not None,
        old_logprobs=old_logprobs,
    )


def _with_tail(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """(..., k) log-probs of k tokens -> (..., k + 1) with the log of the rest of the mass."""
    mass = topk_logprobs.exp().sum(-1, keepdim=True)
    tail = torch.log1p(-mass.clamp(max=1.0)).clamp(min=torch.log(torch.tensor(_TAIL_FLOOR)))
    return torch.cat([topk_logprobs, tail], dim=-1)


def topk_kl(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    direction: Literal["forward", "reverse"],
) -> torch.Tensor:
    """KL over the teacher's top-k tokens plus a tail bucket, at every position.

    With ``p`` the teacher's and ``q`` the student's probabilities of the k tokens and the
    tails ``p_tail = 1 - sum p``, ``q_tail = 1 - sum q``:

    * ``forward``: ``sum_i p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)``;
    * ``reverse``: ``sum_i q_i (log q_i - log p_i) + q_tail (log q_tail - log p_tail)``.

    Both are KLs between two distributions over k + 1 outcomes, so they are >= 0, and with
    k = V (an empty tail) they equal the full-vocabulary KL.

    Args:
        logprobs: (..., k) the student's log-probs of the teacher's top-k tokens (with grad).
        teacher_logprobs: (..., k) the teacher's log-probs of them.
        direction: ``forward`` KL(teacher || student) or ``reverse`` KL(student || teacher).

    Returns:
        (...) per-position KL; differentiable with respect to ``logprobs``.
    """
    s = _with_tail(logprobs)
    t = _with_tail(teacher_logprobs.detach().to(s.dtype))
    if direction == "forward":
        return (t.exp() * (t - s)).sum(-1)
    if direction == "reverse":
        return (s.exp() * (s - t)).sum(-1)
    raise ValueError(f"unknown top-k KL direction {direction!r}; expected forward or reverse")


def topk_mass(teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """(...) the probability the teacher's top-k tokens hold, from (..., k) log-probs."""
    return teacher_logprobs.exp().sum(-1)


# ---------------------------------------------------------------- from hidden states


def _rows_per_chunk(vocab: int, chunk_size: int | None) -> int:
    size = chunk_size if chunk_size is not None else max(1, CHUNK_ELEMENTS // max(vocab, 1))
    if size <= 0:
        raise ValueError(f"chunk_size must be positive, got {size}")
    return size


def _chunk(hidden: torch.Tensor, index: torch.Tensor | None, start: int, stop: int):
    """Rows ``start:stop`` of the positions: of ``hidden`` itself, or at ``index``."""
    return hidden[start:stop] if index is None else hidden.index_select(0, index[start:stop])


def _log_softmax_rows(hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """(c, V) float32 log-probs of a chunk: ``hidden @ weight.T`` (or ``hidden`` as logits when
    ``weight`` is None), normalised over V."""
    z = hidden if weight is None else torch.nn.functional.linear(hidden, weight)
    return torch.log_softmax(z.float(), dim=-1)


@torch.no_grad()
def topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    k: int,
    index: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens at each position and their log-probs, a chunk of positions at
    a time (no (n, V) tensor).

    Args:
        hidden: (N, H) final hidden states, or (N, V) logits when ``weight`` is None.
        weight: (V, H) the output layer's weight, or None.
        k: tokens per position (at most V).
        index: (n,) the rows of ``hidden`` to read (may repeat); None: all N, in order.
        chunk_size: positions per chunk (None: about ``CHUNK_ELEMENTS`` / V).

    Returns:
        ``(logprobs, ids)``, both (n, k): float32 log-probs in descending order, token ids.
    """
    vocab = hidden.shape[-1] if weight is None else weight.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"top-k needs 1 <= k <= V ({vocab}), got {k}")
    n = hidden.shape[0] if index is None else index.numel()
    size = _rows_per_chunk(vocab, chunk_size)
    values = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(n, k, dtype=torch.long, device=hidden.device)
    for start in range(0, n, size):
        stop = min(start + size, n)
        top = _log_softmax_rows(_chunk(hidden, index, start, stop), weight).topk(k, dim=-1)
        values[start:stop], ids[start:stop] = top.values, top.indices
    return values, ids


class _PickedLogProbs(torch.autograd.Function):
    """Log-probs of k chosen tokens per position, recomputed a chunk at a time in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, index, size):
        n = ids.shape[0]
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, size):
            stop = min(start + size, n)
            rows = _chunk(hidden, index, start, stop)
            out[start:stop] = _log_softmax_rows(rows, weight).gather(-1, ids[start:stop])
        ctx.save_for_backward(hidden, weight, ids, index)
        ctx.size = size
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, ids, index = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = None
        if need_weight and weight is not None:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, ids.shape[0], ctx.size):
            stop = min(start + ctx.size, ids.shape[0])
            g = grad[start:stop].float()
            rows = _chunk(hidden, index, start, stop)
            # d log p_j / dz = onehot(j) - p, summed over the k picked tokens
            gz = _log_softmax_rows(rows, weight).exp_().mul_(-g.sum(-1, True))
            gz.scatter_add_(-1, ids[start:stop], g)
            _backprop_chunk(gz, rows, weight, index, start, stop, grad_hidden, grad_weight)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _backprop_chunk(gz, rows, weight, index, start, stop, grad_hidden, grad_weight) -> None:
    """A chunk's logit gradient (c, V) into the hidden states' gradient (at ``index``, or rows
    ``start:stop``) and the weight's."""
    if grad_hidden is not None:
        g = gz if weight is None else gz.to(weight.dtype) @ weight  # without weight: logits
        if index is None:
            grad_hidden[start:stop] = g.to(grad_hidden.dtype)
        else:
            grad_hidden.index_add_(0, index[start:stop], g.to(grad_hidden.dtype))
    if grad_weight is not None:
        grad_weight.addmm_(gz.t(), rows.float())


def picked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    ids: torch.Tensor,
    index: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probs of ``ids`` (k tokens per position, e.g. the teacher's top-k) under
    ``softmax(hidden @ weight.T)``, a chunk of positions at a time; backward recomputes each
    chunk, so nothing (n, V) is kept.

    Args:
        hidden: (N, H) hidden states with grad, or (N, V) logits when ``weight`` is None.
        weight: (V, H) the output layer's weight (with grad), or None.
        ids: (n, k) token ids.
        index: (n,) the row of ``hidden`` of each position (may repeat); None: n = N, in order.

    Returns:
        (n, k) float32 log-probs; differentiable with respect to ``hidden`` and ``weight``.
    """
    vocab = hidden.shape[-1] if weight is None else weight.shape[0]
    size = _rows_per_chunk(vocab, chunk_size)
    return _PickedLogProbs.apply(hidden, weight, ids, index, size)


class _ChunkedForwardKL(torch.autograd.Function):
    """Label log-probs and KL(teacher || student) per position, both models' logits made one
    chunk of positions at a time (and again in backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, labels, size):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        kl = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, size):
            stop = min(start + size, n)
            ls = _log_softmax_rows(hidden[start:stop], weight)
            lt = _log_softmax_rows(teacher_hidden[start:stop], teacher_weight)
            logp[start:stop] = ls.gather(-1, labels[start:stop].unsqueeze(-1)).squeeze(-1)
            kl[start:stop] = (lt.exp() * (lt - ls)).sum(-1)
            del ls, lt
        ctx.save_for_backward(hidden, weight, teacher_hidden, teacher_weight, labels)
        ctx.size = size
        return logp, kl

    @staticmethod
    def backward(ctx, grad_logp, grad_kl):
        hidden, weight, teacher_hidden, teacher_weight, labels = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = None
        if need_weight and weight is not None:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        n = hidden.shape[0]
        for start in range(0, n, ctx.size):
            stop = min(start + ctx.size, n)
            ps = _log_softmax_rows(hidden[start:stop], weight).exp_()
            gz = torch.zeros_like(ps)
            if grad_kl is not None:  # d KL / dz_S = p_S - p_T
                pt = _log_softmax_rows(teacher_hidden[start:stop], teacher_weight).exp_()
                gz.add_((ps - pt).mul_(grad_kl[start:stop].float().unsqueeze(-1)))
                del pt
            if grad_logp is not None:  # d log p_S(y) / dz_S = onehot(y) - p_S
                g = grad_logp[start:stop].float().unsqueeze(-1)
                gz.sub_(ps.mul_(g)).scatter_add_(-1, labels[start:stop].unsqueeze(-1), g)
            del ps
            rows = hidden[start:stop]
            _backprop_chunk(gz, rows, weight, None, start, stop, grad_hidden, grad_weight)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def kd_forward_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's label log-probs and KL(teacher || student) over the vocabulary at each
    position, from each model's final hidden states and output weight.

    Only a chunk of positions' logits exists at a time, for both models (about
    ``CHUNK_ELEMENTS`` each); the backward recomputes them. The two models may differ in
    hidden size; pass both weights cut to the same vocabulary (the tokenizer's ids: two
    checkpoints of one tokenizer may pad their embeddings to different sizes).

    Args:
        hidden: (n, H_S) the student's hidden states at the learned positions (with grad), or
            (n, V) logits when ``weight`` is None.
        weight: (V, H_S) the student's output weight (with grad), or None.
        teacher_hidden: (n, H_T) the teacher's hidden states (or (n, V) logits).
        teacher_weight: (V, H_T) the teacher's output weight, or None.
        labels: (n,) the dataset's next tokens.

    Returns:
        ``(logprobs, kl)``, both (n,) float32; ``-logprobs`` is the NLL. Differentiable with
        respect to ``hidden`` and ``weight`` only.
    """
    vocab = hidden.shape[-1] if weight is None else weight.shape[0]
    teacher_vocab = teacher_hidden.shape[-1] if teacher_weight is None else teacher_weight.shape[0]
    if vocab != teacher_vocab:
        raise ValueError(f"student vocabulary {vocab} != teacher vocabulary {teacher_vocab}")
    if teacher_hidden.shape[0] != hidden.shape[0] or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"positions: student {hidden.shape[0]}, teacher {teacher_hidden.shape[0]}, labels "
            f"{tuple(labels.shape)}"
        )
    size = _rows_per_chunk(vocab, chunk_size)
    return _ChunkedForwardKL.apply(
        hidden, weight, teacher_hidden.detach(), teacher_weight, labels, size
    )


def kd_loss(
    logprobs: torch.Tensor,
    kl: torch.Tensor,
    kd_coef: float,
    num_tokens: int | float | torch.Tensor,
) -> torch.Tensor:
    """``(1 - kd_coef) * NLL + kd_coef * KL`` summed over positions / ``num_tokens`` (the
    global count of learned tokens: summed over micro-batches and ranks it is the token mean).

    OpenRLHF's ``train_kd`` uses the cross-entropy ``-sum p_T log p_S`` for the KL term: the
    same gradient (it differs by the teacher's entropy, a constant of the student).

    Args:
        logprobs: (n,) the student's label log-probs at the learned positions.
        kl: (n,) KL(teacher || student) at the same positions.
        num_tokens: the normaliser.
    """
    return ((kd_coef - 1.0) * logprobs.sum() + kd_coef * kl.sum()) / num_tokens


def forward_kl_from_logits(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the last dimension, directly (small inputs; tests)."""
    ls = torch.log_softmax(logits.float(), -1)
    lt = torch.log_softmax(teacher_logits.float(), -1)
    return (lt.exp() * (lt - ls)).sum(-1)
