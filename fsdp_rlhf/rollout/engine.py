"""The rollout contract: sampling settings, the token-level output batch, and the engine protocol.

Everything here is engine-independent, so trainers and tests never import vLLM. Rows of a
:class:`RolloutOutput` are prompt-major: the ``n`` samples of prompt ``i`` are rows
``i * n ... i * n + n - 1``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from fsdp_rlhf.config import RolloutConfig
from fsdp_rlhf.models.vision import ImageInputs

FinishReason = Literal["stop", "length"]
WAKE_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How responses are sampled. ``temperature == 0`` or ``greedy`` means argmax decoding.

    ``top_k <= 0`` and ``top_p == 1`` disable those filters. ``seed`` (optional) makes sampling
    reproducible per request; without it the engine's own generation RNG is used.
    ``stop_token_ids`` stop generation in addition to the tokenizer's EOS; the stop token is
    kept in the response (and in its mask), like EOS. ``max_total_len`` (OpenRLHF's
    ``--max_len``) caps prompt + response: a prompt of P tokens gets at most
    ``max_total_len - P`` new tokens (see :meth:`budget`).
    """

    max_new_tokens: int
    max_total_len: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    return_logprobs: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0

    def budget(self, prompt_len: int) -> int:
        """New tokens a prompt of ``prompt_len`` tokens may get (at least 1)."""
        if self.max_total_len is None:
            return self.max_new_tokens
        return max(1, min(self.max_new_tokens, self.max_total_len - prompt_len))

    @classmethod
    def from_rollout_config(
        cls, cfg: RolloutConfig, *, n: int, seed: int | None = None
    ) -> SamplingConfig:
        """Sampling of PPO rollouts: the rollout section's settings, ``n`` samples per prompt."""
        return cls(
            max_new_tokens=cfg.generate_max_len,
            max_total_len=cfg.max_len,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            n=n,
            seed=seed,
        )


def pad_token_rows(
    rows: Sequence[Sequence[int]], pad_id: int, *, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token lists to a (N, max_len) long tensor and its 0/1 mask."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if not r:
            continue
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


@dataclass
class RolloutOutput:
    """Token-level result of generating ``n`` responses for each of B prompts (N = B * n rows).

    Attributes:
        prompt_ids: (N, P) prompts, left-padded with the pad id.
        prompt_mask: (N, P) 1 on prompt tokens.
        response_ids: (N, T) responses, right-padded with the pad id; T is the longest response.
        response_mask: (N, T) 1 on generated tokens, including a final EOS/stop token.
        finish_reasons: N entries, "stop" (EOS or a stop token) or "length" (max_new_tokens).
        engine_logprobs: (N, T) float32 log-prob of each sampled token under the engine, 0 at
            pads; None when not requested.
        n: samples per prompt.
        response_attention_mask: (N, T) 1 on every response token the model sees, or None
            when that is ``response_mask``. Multi-turn rollouts set it: environment tokens
            inside a response are attended to (1 here) but not trained on (0 in
            ``response_mask``).
        token_versions: (N, T) long, the weight version that sampled each token (-1 at pads
            and environment tokens), or None when one version sampled everything (set by
            asynchronous training's rollouts, where weights may change mid-response).
        routed_experts: (N, P + T, Lm, k) the experts the engine routed each token of
            ``sequences()`` to in each of the Lm MoE layers (router replay), uint8 or int16,
            ``rollout.routing.no_expert`` where it did not route; None when not asked for.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    finish_reasons: list[str]
    engine_logprobs: torch.Tensor | None
    n: int
    response_attention_mask: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @classmethod
    def from_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        finish_reasons: Sequence[str],
        logprobs: Sequence[Sequence[float]] | None,
        *,
        pad_id: int,
        n: int,
    ) -> RolloutOutput:
        """Pad per-row token lists (one entry per row, prompts already repeated n times)."""
        rows = len(responses)
        if len(prompts) != rows or len(finish_reasons) != rows or rows % n:
            raise ValueError(
                f"{len(prompts)} prompts, {rows} responses, {len(finish_reasons)} finish reasons"
                f" do not form rows of {n} samples per prompt"
            )
        bad = set(finish_reasons) - {"stop", "length"}
        if bad:
            raise ValueError(f"unexpected finish reasons {sorted(bad)}")
        prompt_ids, prompt_mask = pad_token_rows(prompts, pad_id, left=True)
        response_ids, response_mask = pad_token_rows(responses, pad_id, left=False)
        engine_logprobs = None
        if logprobs is not None:
            engine_logprobs = torch.zeros(response_ids.shape, dtype=torch.float32)
            for i, (lp, r) in enumerate(zip(logprobs, responses, strict=True)):
                if len(lp) != len(r):
                    raise ValueError(f"row {i}: {len(lp)} logprobs for {len(r)} tokens")
                engine_logprobs[i, : len(lp)] = torch.as_tensor(list(lp), dtype=torch.float32)
        return cls(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            list(finish_reasons),
            engine_logprobs,
            n,
        )

    @property
    def response_lengths(self) -> torch.Tensor:
        """(N,) number of generated tokens per row."""
        return self.response_mask.sum(-1)

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` and ``attention_mask`` (N, P + T) for trainer forwards.

        The prompt stays left-padded and the response right-padded, so the last T columns are
        the response, as ``models.forward.response_logprobs`` expects.
        """
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        attention_mask = torch.cat([self.prompt_mask, self.response_tokens_mask], dim=1)
        return input_ids, attention_mask

    @property
    def response_tokens_mask(self) -> torch.Tensor:
        """(N, T) 1 on every response token, generated or (multi-turn) from the environment."""
        if self.response_attention_mask is None:
            return self.response_mask
        return self.response_attention_mask

    @classmethod
    def concat(cls, parts: Sequence[RolloutOutput], pad_id: int) -> RolloutOutput:
        """The rows of ``parts`` in order, padded to the widest prompt (on the left) and
        response (on the right); every part has the same ``n``."""
        if len({p.n for p in parts}) != 1:
            raise ValueError(
                f"cannot concatenate rollouts of {sorted({p.n for p in parts})} samples"
            )
        if len(parts) == 1:
            return parts[0]
        P = max(p.prompt_ids.shape[1] for p in parts)
        T = max(p.response_ids.shape[1] for p in parts)

        def cat(get, width: int, left: bool, value: float = 0) -> torch.Tensor:
            padded = []
            for part in parts:
                x = get(part)
                pad = width - x.shape[1]
                padded.append(
                    torch.nn.functional.pad(x, (pad, 0) if left else (0, pad), value=value)
                )
            return torch.cat(padded)

        with_logprobs = all(p.engine_logprobs is not None for p in parts)
        attends = any(p.response_attention_mask is not None for p in parts)
        routed = None
        if any(p.routed_experts is not None for p in parts):  # (N, P + T, Lm, k) each
            from fsdp_rlhf.rollout.routing import no_expert

            if any(p.routed_experts is None for p in parts):
                raise ValueError("cannot concatenate rollouts with and without routed experts")
            padded = []
            for part in parts:
                x, p_len = part.routed_experts, part.prompt_ids.shape[1]
                left, right = P - p_len, T - (x.shape[1] - p_len)
                fill = no_expert(x.dtype)  # no routing at the padding
                padded.append(torch.nn.functional.pad(x, (0, 0, 0, 0, left, right), value=fill))
            routed = torch.cat(padded)
        return cls(
            prompt_ids=cat(lambda p: p.prompt_ids, P, True, pad_id),
            prompt_mask=cat(lambda p: p.prompt_mask, P, True),
            response_ids=cat(lambda p: p.response_ids, T, False, pad_id),
            response_mask=cat(lambda p: p.response_mask, T, False),
            finish_reasons=[r for p in parts for r in p.finish_reasons],
            engine_logprobs=cat(lambda p: p.engine_logprobs, T, False) if with_logprobs else None,
            n=parts[0].n,
            response_attention_mask=cat(lambda p: p.response_tokens_mask, T, False)
            if attends
            else None,
            routed_experts=routed,
        )


@dataclass(frozen=True)
class TokenDelta:
    """What one engine step added to one request of a step-by-step rollout.

    Attributes:
        key: ``(prompt index, sample index)`` of the request among those submitted together.
        token_ids: the tokens sampled in this step (possibly none).
        logprobs: their log-probs under the engine, one per token.
        finish_reason: ``"stop"`` / ``"length"`` once the request finished, else None.
    """

    key: tuple[int, int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images, in placeholder order, in the two forms the engines take: decoded
    RGB images (vLLM runs the model's processor on them itself) and the trainer processor's
    tensors (HF generate). The prompt ids handed to an engine are expanded: each image's
    placeholder repeated as many times as the image has tokens (``data.vision``)."""

    images: tuple
    inputs: ImageInputs


class CountingWeights:
    """Wraps a ``(name, tensor)`` stream and counts the bytes that went through it."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self.nbytes = 0
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            self.nbytes += tensor.numel() * tensor.element_size()
            self.count += 1
            yield name, tensor


def check_wake_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """Validate wake-up tags; None means all of them."""
    if tags is None:
        return WAKE_TAGS
    unknown = set(tags) - set(WAKE_TAGS)
    if unknown or not tags:
        raise ValueError(f"wake_up tags must be a non-empty subset of {WAKE_TAGS}, got {tags}")
    return tuple(tags)


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter's settings besides its tensors, as peft's adapter_config.json has them."""

    rank: int
    alpha: int
    target_modules: tuple[str, ...]

    def peft_config(self) -> dict[str, object]:
        targets = list(self.target_modules)
        return {"r": self.rank, "lora_alpha": self.alpha, "target_modules": targets}


class RolloutEngine(Protocol):
    """What trainers need from a generation engine. Every method is called on every rank."""

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        images: Sequence[PromptImages | None] | None = None,
    ) -> RolloutOutput:
        """Generate ``sampling.n`` responses per prompt for this rank's prompts (with a
        vision-language model, ``images``: each prompt's images, or None for a text prompt)."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a full set of HF-named weights in place; returns the bytes received."""
        ...

    def update_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], spec: AdapterSpec) -> int:
        """Serve a new LoRA adapter (peft-named tensors: ``base_model.model.<module>.lora_A.
        weight``) on the unchanged base from now on, replacing the previous one; returns the
        bytes received. Only engines built for LoRA take it."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) until ``wake_up``."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``tags`` (``"weights"``, ``"kv_cache"``; None: both)."""
        ...

    def close(self) -> None:
        """Release the engine at the end of the run (vLLM: also ends torch.distributed)."""
        ...
