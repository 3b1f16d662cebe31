"""Forward passes with the shapes trainers need: token log-probs, token values, sequence scores.

Every entry takes a :class:`~fsdp_rlhf.models.inputs.ForwardInputs` (``models.inputs``: padded
or packed rows, shared prompts or pair prefixes, images, the sequence-parallel slice) and reads
its outputs through the inputs' ``where`` map, so no entry knows which parts built them. A
sequence-parallel forward runs on this rank's slice of the model rows and returns the same
whole-row results on every rank of the group.

Shapes: B padded rows of L tokens (``inputs.input_ids``); R model rows of Lm tokens; T
response tokens; V vocabulary.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_rlhf.algorithms import kd_forward_kl, picked_logprobs, topk_logprobs
from fsdp_rlhf.distributed.sequence_parallel import gather_sequence
from fsdp_rlhf.models.head import head_call, model_logprobs
from fsdp_rlhf.models.inputs import ForwardInputs, last_token_index, position_ids_from_mask
from fsdp_rlhf.models.ulysses import combine_disjoint, local_range

__all__ = [
    "ForwardInputs",
    "last_token_index",
    "logprobs_at",
    "position_ids_from_mask",
    "head_inputs_at",
    "kd_at",
    "response_logprobs",
    "row_values",
    "sequence_scores",
    "token_values",
    "topk_at",
]


def response_logprobs(
    model: nn.Module,
    inputs: ForwardInputs,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    picked_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs of the last ``response_len`` tokens of each padded row under a causal LM.

    Args:
        inputs: the forward of (B, P + T) rows, prompts left-padded, responses right-padded.
        response_len: T.
        entropy_grad: whether the entropy is differentiable; without it (entropy only as a
            metric) its backward costs nothing.
        picked_ids: (B, T, k) further tokens per response position whose log-probs
            (temperature 1) the same forward returns third (a teacher's top-k tokens).
    Returns:
        logprobs (B, T) float32, and entropy (B, T) when ``with_entropy``; at response
        padding the values are meaningless (callers mask them with ``response_mask``). With
        ``picked_ids`` also their (B, T, k) log-probs.
    """
    T = response_len
    return logprobs_at(
        model,
        inputs,
        response_positions(inputs, T),
        inputs.input_ids[:, -T:],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        picked_ids=picked_ids,
    )


def logprobs_at(
    model: nn.Module,
    inputs: ForwardInputs,
    index: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    picked_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs (and entropies) of ``labels`` predicted at model-row positions ``index``.

    Only the positions some label needs reach the output layer when the model takes
    ``logits_to_keep`` (HF causal LMs do), and it computes the log-probs and entropies from
    their hidden states a block of the vocabulary at a time: no (R, k, V) logits exist
    (``models.head``; models that post-process their logits make them once and read them
    chunk by chunk). Under sequence parallelism each rank computes the entries whose position
    it holds, combined once over the group.

    Args:
        index: (...) flat position ``r * Lm + c`` in the model rows predicting each label
            (``inputs.where`` of the position before it); may repeat.
        labels: (...) token ids, the shape of ``index``.
        picked_ids: (..., k) more token ids per position, whose log-probs (temperature 1,
            ``algorithms.picked_logprobs``) the same forward returns third.
    Returns:
        (...) float32 log-probs and entropies (or None), the same on every rank of a group;
        with ``picked_ids`` also their (..., k) log-probs.
    """
    _, Lm = inputs.row_shape
    sp = inputs.sp
    start, stop = local_range(Lm, sp) if sp is not None else (0, Lm)
    flat, target = index.reshape(-1), labels.reshape(-1)
    row, col = flat // Lm, flat % Lm
    mine = None
    if sp is not None:
        mine = ((col >= start) & (col < stop)).nonzero().squeeze(1)
        row, col, target = row[mine], col[mine] - start, target[mine]
    kwargs = inputs.model_kwargs(model)
    R = inputs.row_shape[0]
    if _takes_logits_to_keep(model):
        cols, slot = torch.unique(col, return_inverse=True)
        kwargs = {**kwargs, "logits_to_keep": cols}  # logits (R, k, V)
        per_row = cols.numel()
        rows = row * per_row + slot
    else:
        per_row = stop - start  # logits (R, Lm / N, V)
        rows = row * per_row + col
    aligned = rows.numel() == R * per_row and torch.equal(rows, _arange(rows))
    extra = None
    if picked_ids is not None:
        k = picked_ids.shape[-1]
        ids = picked_ids.reshape(-1, k)
        ids = ids if mine is None else ids[mine]

        def extra(hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
            return picked_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, ids, rows)

    out = model_logprobs(
        model,
        kwargs,
        # each logit row read once, in order: no gather (and a cheaper backward)
        target.view(R, per_row) if aligned else target,
        None if aligned else rows,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        extra=extra,
    )
    lp, ent = out[0].reshape(-1), out[1].reshape(-1) if out[1] is not None else None
    if sp is not None:
        lp, ent = (_combine(x, mine, flat, sp.group) for x in (lp, ent))
    lp, ent = lp.view(index.shape), ent.view(index.shape) if ent is not None else None
    if picked_ids is None:
        return lp, ent
    picked = _spread(out[2], mine, flat.numel(), sp)
    return lp, ent, picked.view(picked_ids.shape)


def _head_rows(model: nn.Module, inputs: ForwardInputs, index: torch.Tensor):
    """Where the output layer's rows answer ``index`` (flat model-row positions): the model's
    kwargs (``logits_to_keep`` when it takes it), the flat row of its head output for each of
    this rank's entries, and which entries of ``index.reshape(-1)`` this rank computes (None:
    all; under sequence parallelism those whose position it holds)."""
    _, Lm = inputs.row_shape
    sp = inputs.sp
    start, stop = local_range(Lm, sp) if sp is not None else (0, Lm)
    flat = index.reshape(-1)
    row, col = flat // Lm, flat % Lm
    mine = None
    if sp is not None:
        mine = ((col >= start) & (col < stop)).nonzero().squeeze(1)
        row, col = row[mine], col[mine] - start
    kwargs = inputs.model_kwargs(model)
    if _takes_logits_to_keep(model):
        cols, slot = torch.unique(col, return_inverse=True)
        return {**kwargs, "logits_to_keep": cols}, row * cols.numel() + slot, mine
    return kwargs, row * (stop - start) + col, mine


def _spread(x: torch.Tensor, mine: torch.Tensor | None, n: int, sp) -> torch.Tensor:
    """This rank's entries (at ``mine`` of n) combined over the sequence-parallel group."""
    if mine is None:
        return x
    out = torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device).index_put((mine,), x)
    return combine_disjoint(out, sp.group)


def response_positions(inputs: ForwardInputs, response_len: int) -> torch.Tensor:
    """(B, T) the model-row positions predicting each of the last ``response_len`` tokens."""
    return inputs.where[:, -response_len - 1 : -1]


@torch.no_grad()
def topk_at(
    model: nn.Module, inputs: ForwardInputs, index: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely next tokens at model-row positions ``index`` (as :func:`logprobs_at`)
    and their log-probs (temperature 1): ``(logprobs, ids)``, each ``index.shape + (k,)``, the
    same on every rank of a sequence-parallel group. No (positions, V) tensor with a fusable
    output layer (``algorithms.topk_logprobs``, a chunk of positions at a time)."""
    kwargs, rows, mine = _head_rows(model, inputs, index)
    ids: list[torch.Tensor] = []

    def run(flat: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        values, picked = topk_logprobs(flat.reshape(-1, flat.shape[-1]), weight, k, rows)
        ids.append(picked)
        return values

    values = head_call(model, kwargs, run, lambda logits: run(logits, None))
    n = index.numel()
    values = _spread(values, mine, n, inputs.sp)
    picked = _spread(ids[0], mine, n, inputs.sp)
    return values.view(*index.shape, k), picked.view(*index.shape, k)


@torch.no_grad()
def head_inputs_at(
    model: nn.Module, inputs: ForwardInputs, index: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the output layer makes the logits from at model-row positions ``index`` (n,): the
    (n, H) final hidden states and a copy of its (vocab, H) weight's first ``vocab`` rows, or,
    when the model's logits must be made (``models.head``), the (n, vocab) logits and None.
    The same on every rank of a sequence-parallel group. Knowledge distillation's teacher side:
    kept for the student's forward, where both models' logits are made a chunk at a time."""
    kwargs, rows, mine = _head_rows(model, inputs, index)
    weights: list[torch.Tensor] = []

    def hidden(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # a copy: FSDP2 frees the gathered weight when the forward ends
        weights.append(weight[:vocab].detach().clone())
        return flat.reshape(-1, flat.shape[-1]).index_select(0, rows)

    def logits(flat: torch.Tensor) -> torch.Tensor:
        return flat.reshape(-1, flat.shape[-1]).index_select(0, rows)[:, :vocab]

    out = _spread(head_call(model, kwargs, hidden, logits), mine, index.numel(), inputs.sp)
    return out, weights[0] if weights else None


def kd_at(
    model: nn.Module,
    inputs: ForwardInputs,
    index: torch.Tensor,
    labels: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor | None],
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's side of knowledge distillation at model-row positions ``index`` (n,):
    the log-probs of ``labels`` (n,) and KL(teacher || student) over the first ``vocab``
    tokens (``algorithms.kd_forward_kl``: both models' logits a chunk of positions at a time),
    with grad; ``teacher`` is :func:`head_inputs_at`'s answer. The same on every rank of a
    sequence-parallel group."""
    kwargs, rows, mine = _head_rows(model, inputs, index)
    t_rows, t_weight = teacher
    if mine is not None:
        t_rows, labels = t_rows[mine], labels.reshape(-1)[mine]

    def run(flat: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        picked = flat.reshape(-1, flat.shape[-1]).index_select(0, rows)
        if weight is None:
            picked = picked[:, :vocab]
        else:
            weight = weight[:vocab]
        return torch.stack(kd_forward_kl(picked, weight, t_rows, t_weight, labels.reshape(-1)))

    out = head_call(model, kwargs, run, lambda logits: run(logits, None))
    out = _spread(out.t(), mine, index.numel(), inputs.sp)
    return out[:, 0], out[:, 1]


def _arange(like: torch.Tensor) -> torch.Tensor:
    return torch.arange(like.numel(), device=like.device)


def _combine(x: torch.Tensor | None, mine: torch.Tensor, flat: torch.Tensor, group):
    """This rank's entries ``x`` at ``mine`` of ``flat``, summed with the group's others."""
    if x is None:
        return None
    out = torch.zeros(flat.shape, dtype=x.dtype, device=x.device).index_put((mine,), x)
    return combine_disjoint(out, group)


def row_values(model: nn.Module, inputs: ForwardInputs) -> torch.Tensor:
    """A ``*ForSequenceClassification`` model's scalar head at every position of the model
    rows: (R, Lm) float32. A sequence-parallel forward computes its slice, gathered along the
    sequence.

    Under FSDP2 the root module's parameters (embeddings, final norm, head) are gathered only
    around the root's own ``forward`` and, in backward, only once the gradient reaches the
    root's outputs. So the model is called as a whole; a hook on the head captures the values
    at every position (HF returns one position), and the returned values are tied to the
    root's output so that its backward hook fires before the head's backward runs.
    """
    local = _head_values(model, **inputs.model_kwargs(model))
    if inputs.sp is None:
        return local
    _, Lm = inputs.row_shape
    return gather_sequence(local, 1, inputs.sp.group)[:, :Lm]


def _head_values(model: nn.Module, **kwargs) -> torch.Tensor:
    """The scalar head's output at every position of ``model(**kwargs)``: (R, Lm) float32
    (this rank's slice of them under sequence parallelism).

    A VLM split after its embedding (``UlyssesContext.whole_rows``) has whole rows of ``L``
    input ids but its head sees this rank's slice, and HF pools the head's output at the
    whole-row position of each row's last token: the output goes on padded to ``L`` (zeros;
    the pooled values only enter as 0 x, below)."""
    captured: list[torch.Tensor] = []
    sp = kwargs.get("sequence_parallel")
    whole = sp.seq_len if sp is not None and sp.whole_rows else 0

    def capture(_module, _args, out: torch.Tensor) -> torch.Tensor:
        captured.append(out)
        return F.pad(out, (0, 0, 0, max(0, whole - out.shape[1])))

    handle = model.score.register_forward_hook(capture)
    try:
        out = model(**kwargs)
    finally:
        handle.remove()
    # out.logits (R, 1) are entries of the captured values, so the zero term changes nothing.
    return (captured[0] + 0.0 * out.logits.unsqueeze(1)).squeeze(-1).float()


def token_values(model: nn.Module, inputs: ForwardInputs) -> torch.Tensor:
    """The scalar head at every padded position: (B, L) float32 (at padding: a token of the
    same sequence's value)."""
    return row_values(model, inputs).reshape(-1)[inputs.where]


def sequence_scores(model: nn.Module, inputs: ForwardInputs) -> torch.Tensor:
    """Reward of each padded row, read at its last attended token: (B,) float32."""
    last = last_token_index(inputs.attention_mask).unsqueeze(1)
    return row_values(model, inputs).reshape(-1)[inputs.where.gather(1, last).squeeze(1)]


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` computes logits only at chosen positions (``logits_to_keep``,
    an int or an index tensor: every HF causal LM since transformers 4.50)."""
    cls = type(model)
    if cls not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[cls] = "logits_to_keep" in inspect.signature(model.forward).parameters
    return _KEEPS_LOGITS[cls]


_KEEPS_LOGITS: dict[type, bool] = {}
