"""The per-rank batch of one PPO step: built from the rollout, filled by no-grad forwards.

Shapes: N sequences on this rank, P prompt tokens (left-padded), T response tokens
(right-padded). ``input_ids = [prompt | response]`` is (N, P + T). With a vision-language
model each row also carries its images (``images``), picked with the row by every split.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from fsdp_rlhf.models.forward import (
    response_logprobs,
    response_positions,
    sequence_scores,
    token_values,
    topk_at,
)
from fsdp_rlhf.models.inputs import ForwardInputs, InputSpec
from fsdp_rlhf.models.moe import MoEHooks, routing_scope
from fsdp_rlhf.models.vision import ImageBatch
from fsdp_rlhf.rollout.engine import RolloutOutput
from fsdp_rlhf.trainers.micro_batches import MicroBatching


@dataclass
class Experience:
    input_ids: torch.Tensor  # (N, P+T)
    attention_mask: torch.Tensor  # (N, P+T)
    response_mask: torch.Tensor  # (N, T) float, 1 on generated tokens
    engine_logprobs: torch.Tensor  # (N, T) log-probs reported by the rollout engine
    truncated: torch.Tensor | None = None  # (N,) bool: the response hit generate_max_len
    # (N, T) long: the weight version that sampled each token (asynchronous training only)
    token_versions: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None  # (N, T) actor before this step's updates
    ref_logprobs: torch.Tensor | None = None  # (N, T) reference model
    values: torch.Tensor | None = None  # (N, T) critic before this step's updates
    scores: torch.Tensor | None = None  # (N,) raw reward
    rewards: torch.Tensor | None = None  # (N, T) shaped, KL included
    advantages: torch.Tensor | None = None  # (N, T)
    returns: torch.Tensor | None = None  # (N, T)
    # on-policy distillation: the teacher's log-probs of the sampled tokens (N, T), and with a
    # top-k loss its top-k tokens (N, T, k) and their log-probs
    teacher_logprobs: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    # (N, P+T, Lm, k) the engine's experts per token and MoE layer (--router_replay)
    routed_experts: torch.Tensor | None = None
    images: ImageBatch | None = None  # N rows' images (a vision-language model)
    # (N, K) int64: each row's marks from its rollout rank (the pairing audit, ppo.pairing)
    sample_marks: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    def forward_inputs(self, spec: InputSpec) -> ForwardInputs:
        """These rows' forward, built from ``spec``'s parts (``models.inputs``)."""
        return spec.build(
            self.input_ids,
            self.attention_mask,
            response_len=self.response_len,
            images=self.images,
        )

    def rows(self, index: torch.Tensor) -> Experience:
        """The sub-batch at ``index`` (every tensor field sliced along dim 0)."""
        picked = {
            f.name: getattr(self, f.name)[index]
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
        return replace(self, **picked)

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) tokens of each sequence (prompt + response)."""
        return self.attention_mask.sum(-1)

    def trimmed(self) -> Experience:
        """The same rows cut to their own longest prompt and response: the left padding every
        prompt has and the right padding every response has are dropped (the (N, T) fields
        keep their first T' columns)."""
        T = self.response_len
        P = self.input_ids.shape[1] - T
        attended = self.attention_mask.bool().any(0)
        start = int(attended[:P].int().argmax()) if bool(attended[:P].any()) else P
        response = attended[P:].nonzero()
        keep = int(response[-1]) + 1 if len(response) else 1
        cut = {"input_ids": self.input_ids[:, start : P + keep]}
        cut["attention_mask"] = self.attention_mask[:, start : P + keep]
        if self.routed_experts is not None:
            cut["routed_experts"] = self.routed_experts[:, start : P + keep]
        for f in fields(self):
            value = getattr(self, f.name)
            # the (N, T) fields, and the teacher's (N, T, k) top-k; the (N, K) marks are per row
            per_token = f.name != "sample_marks"
            if (
                f.name not in cut
                and isinstance(value, torch.Tensor)
                and value.ndim in (2, 3)
                and per_token
            ):
                cut[f.name] = value[:, :keep]
        return replace(self, **cut)


def chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def micro_batches(
    exp: Experience, batching: MicroBatching
) -> Iterator[tuple[torch.Tensor | None, Experience]]:
    """``(rows, micro-batch)`` pairs covering ``exp``; ``rows`` is None for a padding
    micro-batch (one row, its result to be dropped: see ``trainers.micro_batches``). Dynamic
    micro-batches are cut to their own longest prompt and response."""
    for rows in batching.split(exp.lengths):
        if not batching.dynamic:
            yield rows, exp.rows(rows)
        elif len(rows):
            yield rows, exp.rows(rows).trimmed()
        else:
            shortest = exp.lengths.argmin().reshape(1)
            if batching.group > 1:  # a whole group: its rows share one prompt pass
                first = int(shortest) // batching.group * batching.group
                shortest = torch.arange(first, first + batching.group)
            yield None, exp.rows(shortest).trimmed()


def _batching(micro: int | MicroBatching, spec: InputSpec) -> MicroBatching:
    """How ``spec``'s forwards cut the rows: by token budget counted packed or padded, keeping
    each shared-prompt group whole."""
    packed = spec.rows == "packed"
    if isinstance(micro, MicroBatching):
        return replace(micro, packed=packed, group=spec.group_size)
    return MicroBatching(micro, None, packed, spec.group_size)


@torch.no_grad()
def batched_logprobs(
    model: nn.Module,
    exp: Experience,
    micro: int | MicroBatching,
    temperature: float,
    spec: InputSpec,
    moe: MoEHooks | None = None,
) -> torch.Tensor:
    """(N, T) log-probs of the response tokens, computed ``micro`` sequences at a time or by
    token budget, each micro-batch's forward built by ``spec`` (``models.inputs``; rows
    sharing one pass of their prompt stay together). ``moe``: the model's router hooks, to
    replay ``exp.routed_experts`` (router replay)."""
    out = torch.zeros_like(exp.response_mask)
    for rows, mb in micro_batches(exp, _batching(micro, spec)):
        inputs = mb.forward_inputs(spec)
        with routing_scope(moe, mb.routed_experts, inputs, collect=False):
            lp, _ = response_logprobs(model, inputs, mb.response_len, temperature=temperature)
        if rows is not None:
            out[rows, : mb.response_len] = lp
    return out * exp.response_mask


@torch.no_grad()
def batched_topk(
    model: nn.Module,
    exp: Experience,
    micro: int | MicroBatching,
    k: int,
    spec: InputSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T, k) log-probs (temperature 1) and ids of the k most likely tokens at each
    response position, micro-batched as :func:`batched_logprobs`."""
    N, T = exp.response_mask.shape
    logprobs = torch.zeros(N, T, k, device=exp.response_mask.device)
    ids = torch.zeros(N, T, k, dtype=torch.long, device=exp.response_mask.device)
    for rows, mb in micro_batches(exp, _batching(micro, spec)):
        inputs = mb.forward_inputs(spec)
        lp, top = topk_at(model, inputs, response_positions(inputs, mb.response_len), k)
        if rows is not None:
            logprobs[rows, : mb.response_len], ids[rows, : mb.response_len] = lp, top
    return logprobs, ids


@torch.no_grad()
def batched_values(
    model: nn.Module, exp: Experience, micro: int | MicroBatching, spec: InputSpec
) -> torch.Tensor:
    """(N, T) critic values at the positions that predict each response token (a VLM critic
    sees each row's images)."""
    out = torch.zeros_like(exp.response_mask)
    for rows, mb in micro_batches(exp, _batching(micro, spec)):
        T = mb.response_len
        v = token_values(model, mb.forward_inputs(spec))
        if rows is not None:
            out[rows, :T] = v[:, -T - 1 : -1]
    return out * exp.response_mask


@torch.no_grad()
def batched_scores(
    model: nn.Module, exp: Experience, micro: int | MicroBatching, spec: InputSpec
) -> torch.Tensor:
    """(N,) reward-model scores of prompt + response (with its images), read at the last real
    token."""
    out = torch.zeros(exp.num_sequences, device=exp.input_ids.device)
    for rows, mb in micro_batches(exp, _batching(micro, spec)):
        scores = sequence_scores(model, mb.forward_inputs(spec))
        if rows is not None:
            out[rows] = scores.float()
    return out


def minibatches(
    n: int, size: int, generator: torch.Generator, group: int = 1
) -> list[torch.Tensor]:
    """A shuffled split of ``range(n)`` into index tensors of ``size`` rows; runs of ``group``
    consecutive rows (a shared-prompt group) stay together and in order."""
    perm = torch.randperm(n // group, generator=generator)
    if group > 1:
        perm = (perm.unsqueeze(1) * group + torch.arange(group)).flatten()
    return [perm[i : i + size] for i in range(0, n, size)]


def experience_from_rollout(out: RolloutOutput, device: torch.device) -> Experience:
    input_ids, attention_mask = out.sequences()
    routed = out.routed_experts
    return Experience(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_mask=out.response_mask.float().to(device),
        engine_logprobs=out.engine_logprobs.float().to(device),
        truncated=truncated(out.finish_reasons).bool().to(device),
        token_versions=None if out.token_versions is None else out.token_versions.to(device),
        routed_experts=routed.to(device) if routed is not None else None,
    )


def truncated(finish_reasons: list[str]) -> torch.Tensor:
    """(N,) 1.0 for each response cut by ``generate_max_len`` rather than ending on EOS; its
    global mean is ``response_length/clip_ratio``."""
    return torch.tensor([float(r == "length") for r in finish_reasons])
