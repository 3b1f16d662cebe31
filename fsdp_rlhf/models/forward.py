"""Forward passes with the shapes trainers need: token values, sequence scores, token log-probs.

Position ids are always passed explicitly (``cumsum(attention_mask) - 1``) so left-padded
prompts get the same positions as unpadded ones: HF decoders derive positions from the cache
position, not from the mask. Vision-language models with images in the batch are the
exception: they compute their M-RoPE positions themselves (``models.vision``).

A model split by sequence parallelism (``models.ulysses``) runs every forward here on its
rank's slice of the rows; the functions return the same whole-row results on every rank of the
group.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from fsdp_rlhf.distributed.sequence_parallel import gather_sequence
from fsdp_rlhf.models.head import model_logprobs
from fsdp_rlhf.models.packing import pack_rows
from fsdp_rlhf.models.shared_prefix import (
    share_pair_prefixes,
    share_prompts,
    shared_prompt_inputs,
)
from fsdp_rlhf.models.ulysses import sequence_parallel_of, shard_inputs, sharded_logprobs
from fsdp_rlhf.models.vision import ImageBatch, VisionTokens, vision_model_inputs


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, L) positions counting only attended tokens."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B,) index of the last attended token of each row (any padding side)."""
    L = attention_mask.shape[-1]
    idx = torch.arange(L, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), idx, -1).max(-1).values


def padded_positions(attention_mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(B, L) index into the packed row (``pack_rows``) of every padded position.

    Attended positions map to their own token; padding maps to the nearest token of the same
    sequence, so every index is valid and gathers stay inside the row's sequence.
    """
    return cu_seqlens[:-1].unsqueeze(1) + position_ids_from_mask(attention_mask)


def token_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: bool = False,
    images: ImageBatch | None = None,
) -> torch.Tensor:
    """Scalar head applied at every position of a ``*ForSequenceClassification`` model.

    Under FSDP2 the root module's parameters (embeddings, final norm, head) are gathered only
    around the root's own ``forward`` and, in backward, only once the gradient reaches the
    root's outputs. So the model is called as a whole; a hook on the head captures the values
    at every position (HF returns one position), and the returned values are tied to the
    root's output so that its backward hook fires before the head's backward runs.

    Args:
        input_ids, attention_mask: (B, L).
        packed: run the rows as one packed row (the model must use
            ``models.attention.use_varlen_attention``); padding then costs nothing.
        images: a vision-language model's images of these rows (padded rows only): merged
            into the embeddings, the model's M-RoPE positions built from them.
    Returns:
        (B, L) float32 values (at padded positions: a neighbouring token's value).
    """
    if images is not None:
        if packed:
            raise ValueError("vision-language rows go through the model padded, one row each")
        tokens = VisionTokens.from_config(model.config)
        return row_values(model, vision_model_inputs(tokens, input_ids, attention_mask, images))
    if packed:
        row = pack_rows(input_ids, attention_mask)
        values = row_values(model, row.model_inputs())[0]
        return values[padded_positions(attention_mask, row.cu_seqlens)]
    return row_values(model, _padded_inputs(input_ids, attention_mask))


def _padded_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )


def row_values(model: nn.Module, inputs: dict) -> torch.Tensor:
    """The scalar head at every position of the (B, L) rows of ``inputs``: (B, L) float32. A
    sequence-parallel model computes its slice, gathered along the sequence."""
    sp = sequence_parallel_of(model)
    if sp is None:
        return _head_values(model, **inputs)
    if "pixel_values" in inputs:
        raise ValueError("vision-language rows are not split by sequence parallelism")
    L = inputs["input_ids"].shape[1]
    local = _head_values(model, **shard_inputs(model, inputs, sp))  # (B, ceil(L / N))
    return gather_sequence(local, 1, sp.group)[:, :L]


def _head_values(model: nn.Module, **inputs) -> torch.Tensor:
    """The scalar head's output at every position of ``model(**inputs)``: (B, L) float32."""
    captured: list[torch.Tensor] = []
    handle = model.score.register_forward_hook(lambda _m, _args, out: captured.append(out))
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    # out.logits (B, 1) are entries of the captured values, so the zero term changes nothing.
    return (captured[0] + 0.0 * out.logits.unsqueeze(1)).squeeze(-1).float()


def sequence_scores(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: bool = False,
    images: ImageBatch | None = None,
) -> torch.Tensor:
    """Reward of each sequence, read at its last attended token. (B, L) -> (B,).

    ``packed``: the rows go through the model as one packed row without padding (the model
    must use ``models.attention.use_varlen_attention``). ``images``: a VLM's images of the
    rows (padded rows only, see :func:`token_values`).
    """
    if packed and images is None:
        row = pack_rows(input_ids, attention_mask)
        return row_values(model, row.model_inputs())[0, row.last_index]
    values = token_values(model, input_ids, attention_mask, packed, images)
    idx = last_token_index(attention_mask)
    return values.gather(1, idx.unsqueeze(1)).squeeze(1)


def shared_pair_scores(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Rewards of B preference pairs, (2B, L) right-padded rows (B chosen, then B rejected) ->
    (2B,) in the same order, packed with each pair's common prefix run once
    (models.shared_prefix.share_pair_prefixes; the model must use varlen attention)."""
    row = share_pair_prefixes(input_ids, attention_mask)
    return row_values(model, row.model_inputs())[0, row.last_index]


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packed: bool = False,
    group_size: int = 1,
    images: ImageBatch | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the last ``response_len`` tokens of each row under a causal LM.

    The model's output layer sees only the positions that predict a response token when it
    takes ``logits_to_keep`` (HF causal LMs do), and computes the log-probs and entropies from
    their hidden states a block of the vocabulary at a time: no (B, T, V) logits exist, in the
    no-grad forwards and the update alike (``models.head``; models that post-process their
    logits make them once and read them chunk by chunk).

    Args:
        input_ids, attention_mask: (B, P + T), prompt left-padded, response right-padded.
        response_len: T.
        entropy_grad: whether the entropy is differentiable; without it (entropy only as a
            metric) its backward costs nothing.
        packed: run the rows as one packed row (see :func:`token_values`).
        group_size: > 1 when each run of that many consecutive rows shares its prompt: the
            prompt then goes through the model once per run (models.shared_prefix).
        images: a vision-language model's images of these rows (padded rows only).
    Returns:
        logprobs (B, T) float32, and entropy (B, T) when ``with_entropy``; at response
        padding the values are meaningless (callers mask them with ``response_mask``).
    """
    sp = sequence_parallel_of(model)
    if sp is not None and images is not None:
        raise ValueError("vision-language rows are not split by sequence parallelism")
    if sp is not None:  # each rank the positions of its slice, combined once
        inputs, index = response_positions(
            input_ids, attention_mask, response_len, packed, group_size
        )
        return sharded_logprobs(
            model,
            inputs,
            index,
            input_ids[:, -response_len:],
            sp,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            keep_logits=_takes_logits_to_keep(model),
        )
    inputs, index = response_inputs(
        model, input_ids, attention_mask, response_len, packed, group_size, images
    )
    return model_logprobs(
        model,
        inputs,
        input_ids[:, -response_len:],
        index,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )


def response_positions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    packed: bool = False,
    group_size: int = 1,
) -> tuple[dict, torch.Tensor]:
    """Whole-row model inputs of a batch (padded, packed or shared-prompt, as in
    :func:`response_inputs`) and the (B, T) flat position ``row * L + col`` in them whose
    prediction is each response token."""
    T = response_len
    if group_size > 1:
        rows = share_prompts(input_ids, attention_mask, T, group_size)
        inputs = {k: v for k, v in rows.model_inputs().items() if k != "logits_to_keep"}
        G, L = rows.input_ids.shape
        first = L - rows.logits_to_keep  # the row position of logit_index 0: the last prompt
        index = torch.arange(G, device=input_ids.device).view(G, 1, 1) * L + first
        return inputs, (index + rows.logit_index).view(G * group_size, T)
    if packed:
        row = pack_rows(input_ids, attention_mask)
        return row.model_inputs(), padded_positions(attention_mask, row.cu_seqlens)[:, -T - 1 : -1]
    B, L = input_ids.shape
    before = torch.arange(L - T - 1, L - 1, device=input_ids.device)
    rows = torch.arange(B, device=input_ids.device).unsqueeze(1) * L
    return _padded_inputs(input_ids, attention_mask), rows + before


def response_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    packed: bool = False,
    group_size: int = 1,
    images: ImageBatch | None = None,
) -> tuple[dict, torch.Tensor | None]:
    """The model inputs that make as few rows of logits as the model allows, and the row
    predicting each response token.

    Returns:
        ``(inputs, index)``: keyword arguments of the model (``logits_to_keep`` included when
        it takes it), and the (B, T) row of its logits ``reshape(-1, V)`` whose prediction is
        each of the T response tokens (logits at position i predict token i + 1); None when
        the logits are (B, T, V) already aligned with the response tokens.
    """
    T = response_len
    if images is not None and (packed or group_size > 1):
        raise ValueError("vision-language rows go through the model padded, one row each")
    if group_size > 1:
        return shared_prompt_inputs(share_prompts(input_ids, attention_mask, T, group_size))
    keep = _takes_logits_to_keep(model)
    if packed:
        row = pack_rows(input_ids, attention_mask)
        positions = padded_positions(attention_mask, row.cu_seqlens)[:, -T - 1 : -1]  # (B, T)
        if not keep:
            return row.model_inputs(), positions  # logits (1, T_packed, V)
        # only the rows that predict a response token (padding repeats a neighbour's row)
        rows, index = torch.unique(positions, return_inverse=True)
        return {**row.model_inputs(), "logits_to_keep": rows}, index
    if images is not None:
        tokens = VisionTokens.from_config(model.config)
        inputs = vision_model_inputs(tokens, input_ids, attention_mask, images)
    else:
        inputs = _padded_inputs(input_ids, attention_mask)
    B, L = input_ids.shape
    before = torch.arange(L - T - 1, L - 1, device=input_ids.device)  # positions predicting
    if keep:  # (B, T, V), aligned with the response tokens: read without any index
        return {**inputs, "logits_to_keep": before}, None
    rows = torch.arange(B, device=input_ids.device).unsqueeze(1) * L
    return inputs, rows + before  # logits (B, L, V)


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` computes logits only at chosen positions (``logits_to_keep``,
    an int or an index tensor: every HF causal LM since transformers 4.50)."""
    cls = type(model)
    if cls not in _KEEPS_LOGITS:
        _KEEPS_LOGITS[cls] = "logits_to_keep" in inspect.signature(model.forward).parameters
    return _KEEPS_LOGITS[cls]


_KEEPS_LOGITS: dict[type, bool] = {}
