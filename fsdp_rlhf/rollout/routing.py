"""The experts a rollout engine routed each token to, per MoE layer (router replay, R3).

An MoE router picks each token's top-k experts from logits that differ by rounding between the
engine and the trainer; a near tie then goes one way in the engine and the other in the trainer,
and that token's log-prob differs by far more than rounding (NeMo-RL #4243, Megatron-LM #4168).
Router replay hands the engine's choices to the trainer's forwards of the same tokens.

Engine-independent: the vLLM adapter records what its forwards routed (:class:`StepRecord`,
one per engine step) and :func:`assemble_routing` turns the records into one array per finished
sequence; :func:`pad_routing` lays those out like the trainer's ``input_ids``.

Shapes: a sequence of L tokens (prompt + response) has routing for its first L - 1 positions
(the engine never runs the last sampled token through the model), each ``(Lm, k)``: Lm MoE
layers in model order, k experts per token. Expert ids are stored compactly (:func:`routing_dtype`),
and :func:`no_expert` marks positions without routing (padding, each sequence's last token),
where the trainer routes for itself.

Images. A vision-language prompt's image placeholders stand for the image's features: two
requests with the same token ids and other images route differently (the colour task's
prompts are one such set). Each request then carries its images' identities (``media``: the
ids the engine was handed for them, in placeholder order), and a sequence matches a request,
or a cached head its donor, only when both the tokens and the images are the same. Token
positions are the engine's: each placeholder repeated once per image token, as the trainer's
expanded prompt holds them, so the routing of every image-token position lines up with the
trainer's rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def routing_dtype(num_experts: int) -> torch.dtype:
    """uint8 up to 255 experts (255 is the no-expert mark), else int16 (-1 marks)."""
    if num_experts < 255:
        return torch.uint8
    if num_experts < 2**15:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit the int16 routing store")


def no_expert(dtype: torch.dtype) -> int:
    """The id stored at positions that carry no routing."""
    return 255 if dtype == torch.uint8 else -1


@dataclass(frozen=True)
class StepRecord:
    """What one engine forward routed.

    ``requests`` (R,) the engine's ids of the requests in the batch, in batch order;
    ``query_start`` (R + 1,) where each request's tokens start in the flat batch; ``positions``
    and ``tokens`` (n,) each token's position in its sequence and its id; ``experts`` (n, Lm, k);
    ``media`` (R,) each request's image ids in placeholder order (empty: none recorded).
    """

    requests: tuple[str, ...]
    query_start: np.ndarray
    positions: np.ndarray
    tokens: np.ndarray
    experts: np.ndarray
    media: tuple[tuple[str, ...], ...] = ()


Media = tuple[str, ...]


@dataclass(frozen=True)
class RecordedRouting:
    """A rollout's routing from a step-by-step engine: one ``(L - 1, Lm, k)`` array per
    finished sequence asked for, and the compact dtype to store it as."""

    sequences: list[np.ndarray]
    store: torch.dtype


class RoutingError(RuntimeError):
    """The records do not cover a finished sequence (a vLLM change this adapter missed)."""


@dataclass
class _Request:
    positions: list[np.ndarray]
    tokens: list[np.ndarray]
    experts: list[np.ndarray]
    media: Media = ()


def _by_request(
    records: Sequence[StepRecord], keep_first: bool = False
) -> dict[str, tuple[np.ndarray, ...]]:
    """Per request: (covered, tokens, experts, size), later records winning over earlier ones
    at the same position (a preempted request is computed again), or earlier ones with
    ``keep_first``."""
    parts: dict[str, _Request] = {}
    for rec in records:
        for i, req in enumerate(rec.requests):
            lo, hi = int(rec.query_start[i]), int(rec.query_start[i + 1])
            if hi <= lo:
                continue
            media = rec.media[i] if rec.media else ()
            part = parts.setdefault(req, _Request([], [], [], media))
            part.positions.append(rec.positions[lo:hi])
            part.tokens.append(rec.tokens[lo:hi])
            part.experts.append(rec.experts[lo:hi])
    out = {}
    for req, part in parts.items():
        pos = np.concatenate(part.positions)
        tok = np.concatenate(part.tokens)
        exp = np.concatenate(part.experts)
        size = int(pos.max()) + 1
        order = np.arange(len(pos))
        if keep_first:
            pos, order = pos[::-1], order[::-1]
        last = np.full(size, -1)
        last[pos] = order  # numpy assigns in order: the last write of a position wins
        covered = last >= 0
        out[req] = (covered, tok[last[covered]], exp[last[covered]], size, part.media)
    return out


def _key(tokens: np.ndarray, media: Media = ()) -> bytes:
    h = hashlib.blake2b(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    for item in media:
        h.update(b"\0" + item.encode())
    return h.digest()


def assemble_routing(
    records: Sequence[StepRecord],
    sequences: Sequence[Sequence[int]],
    fill: int,
    *,
    keep_first: bool = False,
    media: Sequence[Media] | None = None,
) -> list[np.ndarray]:
    """The routing of each finished sequence (prompt + response token ids), (L - 1, Lm, k).

    Requests are matched to sequences by content (the tokens each forward saw), so nothing
    depends on how the engine names requests. A request whose prompt started from the prefix
    cache computed only its tail; its cached head was computed by another request of the same
    records with the same leading tokens (and images), whose routing it takes (the cache must
    hold nothing from before the records: the adapter resets it).

    ``media``: each sequence's image ids, as the records name them (None: no images).

    A position computed more than once (a preempted request computed again) keeps its last
    computation, or with ``keep_first`` its first: a partial rollout's request, computed again
    from its tokens under new weights, keeps at each position the routing of the forward that
    sampled the token after it (docs/async.md, "Router replay").

    Raises RoutingError when a sequence has no matching request or a head no donor.
    """
    requests = _by_request(records, keep_first)
    # (last position, first computed position, tokens from there on) -> request
    index: dict[tuple[int, int, bytes], list[str]] = {}
    for req, (covered, tok, _, size, images) in requests.items():
        first = int(np.argmax(covered))
        if not covered[first:].all():
            raise RoutingError(f"request {req}: positions missing inside the computed range")
        index.setdefault((size - 1, first, _key(tok, images)), []).append(req)
    starts = sorted({k[1] for k in index})
    matched: list[tuple[int, str]] = []  # (first computed position, request) per sequence
    media = media if media is not None else [()] * len(sequences)
    for i, seq in enumerate(sequences):
        ids = np.asarray(seq, dtype=np.int64)
        last = len(ids) - 2
        found = None
        for first in starts:
            if first > last:
                break
            reqs = index.get((last, first, _key(ids[first : last + 1], media[i])))
            if reqs:
                found = (first, reqs.pop())
                break
        if found is None:
            raise RoutingError(f"sequence {i} ({len(ids)} tokens): no engine forward computed it")
        matched.append(found)
    heads: dict[tuple[int, bytes], np.ndarray] = {}  # (length, tokens) -> routing of that head
    heads_needed = sorted({first for first, _ in matched if first > 0})
    out: list[np.ndarray | None] = [None] * len(sequences)
    for i in sorted(range(len(sequences)), key=lambda j: matched[j][0]):
        first, req = matched[i]
        _, _, experts, size, _ = requests[req]
        ids = np.asarray(sequences[i], dtype=np.int64)
        routing = np.full((size, *experts.shape[1:]), fill, dtype=experts.dtype)
        routing[first:] = experts
        if first > 0:
            head = heads.get((first, _key(ids[:first], media[i])))
            if head is None:
                raise RoutingError(
                    f"sequence {i}: its first {first} tokens came from the prefix cache and no "
                    "forward of this rollout computed them"
                )
            routing[:first] = head
        for n in heads_needed:
            if n <= size:
                heads.setdefault((n, _key(ids[:n], media[i])), routing[:n])
        out[i] = routing
    return out  # type: ignore[return-value]


def pad_routing(
    routing: Sequence[np.ndarray],
    prompt_lens: Sequence[int],
    prompt_width: int,
    response_width: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(N, P + T, Lm, k) routing laid out like ``RolloutOutput.sequences()``: prompts
    left-padded to ``prompt_width``, responses right-padded to ``response_width``; padding and
    each row's last token hold :func:`no_expert`."""
    layers, k = routing[0].shape[1:] if routing else (0, 0)
    out = torch.full(
        (len(routing), prompt_width + response_width, layers, k), no_expert(dtype), dtype=dtype
    )
    for i, (r, p) in enumerate(zip(routing, prompt_lens, strict=True)):
        start = prompt_width - p
        out[i, start : start + len(r)] = torch.from_numpy(np.ascontiguousarray(r)).to(dtype)
    return out
