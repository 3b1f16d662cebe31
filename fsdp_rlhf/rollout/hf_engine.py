"""Rollouts with HF ``generate`` on a local, unsharded copy of the actor.

The fallback engine (``--rollout_engine hf``) and the reference the vLLM engine is tested
against. Slow (no paged KV cache, no continuous batching) but needs nothing beyond transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from fsdp_rlhf.models.vision import ImageBatch, VisionTokens
from fsdp_rlhf.rollout.engine import (
    CountingWeights,
    PromptImages,
    RolloutOutput,
    SamplingConfig,
    pad_token_rows,
)
from fsdp_rlhf.rollout.rng import GenerationRng


def generation_config(sampling: SamplingConfig, eos_ids: Sequence[int], pad_id: int):
    """An HF GenerationConfig for ``sampling``; every processor is set explicitly so defaults
    from a checkpoint's generation_config.json (repetition penalty, top-k) do not leak in."""
    from transformers import GenerationConfig

    greedy = sampling.is_greedy
    return GenerationConfig(
        max_new_tokens=sampling.max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else sampling.temperature,
        top_p=None if greedy else sampling.top_p,
        top_k=None if greedy else max(sampling.top_k, 0),  # 0 disables the top-k filter
        repetition_penalty=1.0,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,  # trainer copies are loaded with use_cache=False
        output_scores=True,  # processed scores: what the sampler drew from
        return_dict_in_generate=True,
    )


def trim_at_stop(
    tokens: torch.Tensor, stop_ids: Sequence[int]
) -> tuple[list[list[int]], list[str]]:
    """Cut each row after its first stop token. (N, T) -> token lists and finish reasons.

    Rows without a stop token ran to ``max_new_tokens`` (HF only pads rows that finished).
    """
    is_stop = torch.isin(tokens, torch.as_tensor(list(stop_ids), device=tokens.device))
    responses, reasons = [], []
    for row, stops in zip(tokens.tolist(), is_stop.tolist(), strict=True):
        if True in stops:
            end = stops.index(True) + 1
            responses.append(row[:end])
            reasons.append("stop")
        else:
            responses.append(row)
            reasons.append("length")
    return responses, reasons


def cut_to_budget(
    responses: list[list[int]], reasons: list[str], prompts: Sequence[Sequence[int]], sampling
) -> tuple[list[list[int]], list[str]]:
    """Cut each response to ``sampling.budget(len(prompt))`` tokens ("length" when cut)."""
    out, why = [], []
    for response, reason, prompt in zip(responses, reasons, prompts, strict=True):
        budget = sampling.budget(len(prompt))
        cut = len(response) > budget
        out.append(response[:budget] if cut else response)
        why.append("length" if cut else reason)
    return out, why


def sampled_logprobs(scores: Sequence[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each sampled token under the processed scores.

    Args:
        scores: T tensors (N, V), one per generation step (HF ``output.scores``).
        tokens: (N, T) sampled tokens.
    Returns:
        (N, T) float32.
    """
    steps = [
        torch.log_softmax(s.float(), dim=-1).gather(1, tokens[:, t : t + 1])
        for t, s in enumerate(scores)
    ]
    return torch.cat(steps, dim=1)


class HFEngine:
    """Generation with ``model.generate`` on an unsharded model.

    Args:
        model: a causal LM (its own copy: ``update_weights`` writes into it).
        pad_token_id: pad id of inputs and outputs.
        eos_token_ids: tokens that end a response (the same the vLLM engine stops on).
        seed: seed of this engine's generation RNG (kept apart from the training RNG).
        vision: a vision-language model's tokens (its prompts may come with images).
        unsynced: names of parameters a weight sync never sends (a frozen vision tower): they
            keep the values the copy was loaded with.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_token_id: int,
        eos_token_ids: Sequence[int],
        seed: int,
        vision: VisionTokens | None = None,
        unsynced: Callable[[str], bool] | None = None,
    ) -> None:
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._rng = GenerationRng(seed)
        self.vision = vision
        self.unsynced = unsynced or (lambda name: False)

    def _image_kwargs(
        self, images: Sequence[PromptImages | None] | None, n: int, ids: torch.Tensor
    ) -> dict:
        """The images of the prompt-major rows as ``generate`` kwargs ({} for text)."""
        if images is None:
            return {}
        if self.vision is None:
            raise ValueError("images given to the engine of a text-only model")
        batch = ImageBatch.repeat([im.inputs if im else None for im in images], n)
        mm = batch.model_kwargs(ids.device)
        if not mm:
            return {}
        return {**mm, "mm_token_type_ids": self.vision.token_types(ids)}

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingConfig,
        images: Sequence[PromptImages | None] | None = None,
    ) -> RolloutOutput:
        rows = [p for p in prompt_token_ids for _ in range(sampling.n)]  # prompt-major
        if not rows:
            lps = [] if sampling.return_logprobs else None
            return RolloutOutput.from_lists([], [], [], lps, pad_id=self.pad_token_id, n=sampling.n)
        device = next(self.model.parameters()).device
        ids, mask = pad_token_rows(rows, self.pad_token_id, left=True)
        stop_ids = self.eos_token_ids + tuple(sampling.stop_token_ids)
        cfg = generation_config(sampling, stop_ids, self.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        extra = self._image_kwargs(images, sampling.n, ids)
        with self._rng.active():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=cfg, **extra
            )
        tokens = out.sequences[:, ids.shape[1] :]
        responses, reasons = trim_at_stop(tokens, stop_ids)
        if sampling.max_total_len is not None:  # each prompt's own budget (one generate call)
            responses, reasons = cut_to_budget(responses, reasons, rows, sampling)
        logprobs = None
        if sampling.return_logprobs:
            lp = sampled_logprobs(out.scores, tokens).cpu()
            logprobs = [lp[i, : len(r)].tolist() for i, r in enumerate(responses)]
        return RolloutOutput.from_lists(
            rows, responses, reasons, logprobs, pad_id=self.pad_token_id, n=sampling.n
        )

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy a full set of HF-named weights into the model; returns the bytes received."""
        # tied weights are reachable under both names (the stream sends the LM head alias)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        counted = CountingWeights(weights)
        seen = set()
        for name, tensor in counted:
            if name not in params:
                raise KeyError(f"update_weights: {name} is not a parameter of the HF engine model")
            params[name].copy_(tensor)
            seen.add(name)
        missing = {n for n, _ in self.model.named_parameters() if not self.unsynced(n)} - seen
        if missing:
            raise ValueError(
                f"update_weights: no weights for {sorted(missing)[:5]} "
                f"({len(missing)} parameters); a sync must be complete"
            )
        return counted.nbytes

    def sleep(self) -> None:
        """Nothing to release: the HF copy lives with the trainer."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Nothing to restore (see ``sleep``)."""

    def close(self) -> None:
        """Nothing to shut down."""
