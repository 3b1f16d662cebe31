"""The per-rank batch of one PPO step: built from the rollout, filled by no-grad forwards.

Shapes: N sequences on this rank, P prompt tokens (left-padded), T response tokens
(right-padded). ``input_ids = [prompt | response]`` is (N, P + T).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from fsdp_rlhf.models.forward import response_logprobs, sequence_scores, token_values
from fsdp_rlhf.rollout.engine import RolloutOutput


@dataclass
class Experience:
    input_ids: torch.Tensor  # (N, P+T)
    attention_mask: torch.Tensor  # (N, P+T)
    response_mask: torch.Tensor  # (N, T) float, 1 on generated tokens
    engine_logprobs: torch.Tensor  # (N, T) log-probs reported by the rollout engine
    truncated: torch.Tensor | None = None  # (N,) bool: the response hit generate_max_len
    old_logprobs: torch.Tensor | None = None  # (N, T) actor before this step's updates
    ref_logprobs: torch.Tensor | None = None  # (N, T) reference model
    values: torch.Tensor | None = None  # (N, T) critic before this step's updates
    scores: torch.Tensor | None = None  # (N,) raw reward
    rewards: torch.Tensor | None = None  # (N, T) shaped, KL included
    advantages: torch.Tensor | None = None  # (N, T)
    returns: torch.Tensor | None = None  # (N, T)

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    def rows(self, index: torch.Tensor) -> Experience:
        """The sub-batch at ``index`` (every tensor field sliced along dim 0)."""
        picked = {
            f.name: getattr(self, f.name)[index]
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
        return replace(self, **picked)


def chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.no_grad()
def batched_logprobs(
    model: nn.Module,
    exp: Experience,
    micro: int,
    temperature: float,
    packed: bool = False,
    group_size: int = 1,
) -> torch.Tensor:
    """(N, T) log-probs of the response tokens, computed ``micro`` sequences at a time
    (``group_size``: rows sharing one pass of their prompt, a divisor of ``micro``)."""
    out = []
    for sl in chunks(exp.num_sequences, micro):
        lp, _ = response_logprobs(
            model,
            exp.input_ids[sl],
            exp.attention_mask[sl],
            exp.response_len,
            temperature=temperature,
            packed=packed,
            group_size=group_size,
        )
        out.append(lp)
    return torch.cat(out) * exp.response_mask


@torch.no_grad()
def batched_values(
    model: nn.Module, exp: Experience, micro: int, packed: bool = False
) -> torch.Tensor:
    """(N, T) critic values at the positions that predict each response token."""
    out = []
    T = exp.response_len
    for sl in chunks(exp.num_sequences, micro):
        v = token_values(model, exp.input_ids[sl], exp.attention_mask[sl], packed)
        out.append(v[:, -T - 1 : -1])
    return torch.cat(out) * exp.response_mask


@torch.no_grad()
def batched_scores(
    model: nn.Module, exp: Experience, micro: int, packed: bool = False
) -> torch.Tensor:
    """(N,) reward-model scores of prompt + response, read at the last real token."""
    out = [
        sequence_scores(model, exp.input_ids[sl], exp.attention_mask[sl], packed)
        for sl in chunks(exp.num_sequences, micro)
    ]
    return torch.cat(out)


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
    return Experience(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_mask=out.response_mask.float().to(device),
        engine_logprobs=out.engine_logprobs.float().to(device),
        truncated=truncated(out.finish_reasons).bool().to(device),
    )


def truncated(finish_reasons: list[str]) -> torch.Tensor:
    """(N,) 1.0 for each response cut by ``generate_max_len`` rather than ending on EOS; its
    global mean is ``response_length/clip_ratio``."""
    return torch.tensor([float(r == "length") for r in finish_reasons])
