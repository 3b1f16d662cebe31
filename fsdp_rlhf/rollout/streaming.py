"""A rollout driven one engine step at a time (asynchronous training's rollout ranks).

Between two engine steps the caller's ``poll`` runs: it may load new weights into the engine
(partial rollouts) and returns the weight version that samples from then on, so every token
carries the version that sampled it, beside its log-prob under that version. With ``keep``
(over-sampling) the rollout ends as soon as every rank of the engine has ``keep`` prompts
whose samples have all finished, and the stragglers are aborted. An engine that records routed
experts (router replay) hands over the kept samples' routing at the end (``take_routing``).

The ranks of one tensor-parallel engine see the same tokens in the same steps (vLLM's
external launcher schedules identically on each), so each decides alone, and alike, when the
rollout is over. Engine-independent: anything with ``submit`` / ``step`` works (tests use a
scripted engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from fsdp_rlhf.rollout.engine import (
    PromptImages,
    RolloutOutput,
    SamplingConfig,
    TokenDelta,
    pad_token_rows,
)
from fsdp_rlhf.rollout.groups import own_prompt_range
from fsdp_rlhf.rollout.routing import RecordedRouting, pad_routing


class StreamingEngine(Protocol):
    def submit(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[int]:
        """Queue the prompts (collective over the engine's ranks); how many each rank sent.
        An engine of a vision-language model also takes ``images=`` (each prompt's, or
        None), as ``rollout.vllm.engine.VLLMEngine.submit`` does."""
        ...

    def step(self) -> list[TokenDelta]: ...

    def has_unfinished(self) -> bool: ...

    def abort_unfinished(self) -> None: ...

    def take_routing(
        self,
        sequences: list[list[int]],
        images: list[PromptImages | None] | None = None,
        keys: list[tuple[int, int]] | None = None,
    ) -> RecordedRouting | None:
        """The experts the finished ``sequences`` (prompt + response ids) were routed to, one
        ``(L - 1, Lm, k)`` array each (router replay); None when the engine records none.
        ``images``: each sequence's prompt's images (a vision-language model: the same tokens
        with other images routed otherwise); ``keys``: each sequence's sample, as the deltas
        of :meth:`step` key it (an engine that hands routing over per request reads it by
        these). Collective over the engine's ranks, like ``submit``."""
        ...


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None


@dataclass
class StreamedRollout:
    """This rank's result.

    Attributes:
        output: the kept prompts' samples, prompt-major, ``token_versions`` set.
        kept: positions (in this rank's prompt list) of the kept prompts, ascending.
        steps: engine steps taken.
    """

    output: RolloutOutput
    kept: list[int]
    steps: int


def stream_rollout(
    engine: StreamingEngine,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    rank_in_engine: int,
    pad_id: int,
    poll: Callable[[], int],
    keep: int | None = None,
    images: Sequence[PromptImages | None] | None = None,
) -> StreamedRollout:
    """Generate ``sampling.n`` samples of each prompt; see the module docstring.

    Args:
        rank_in_engine: this rank's place in its engine (its prompts' range in the block).
        poll: called before the first step and after every step; returns the weight version
            sampling the next tokens.
        keep: prompts to keep per rank (over-sampling); None keeps all.
        images: each prompt's images (a vision-language model; its ids expanded, as the
            colocated engine takes them); the kept prompts are ``kept``'s.
    """
    ids = [list(p) for p in prompt_ids]
    if images is None:
        counts = engine.submit(ids, sampling)
    else:
        counts = engine.submit(ids, sampling, images=list(images))
    ranges = [own_prompt_range(counts, b) for b in range(len(counts))]
    wanted = [(stop - start) if keep is None else min(keep, stop - start) for start, stop in ranges]
    owner = {i: b for b, (start, stop) in enumerate(ranges) for i in range(start, stop)}
    n = sampling.n
    samples: dict[tuple[int, int], _Sample] = {}
    finished_per_prompt: dict[int, int] = {}
    done = [[] for _ in ranges]  # per block rank: its prompts whose samples all finished
    version, steps = poll(), 0

    def satisfied() -> bool:
        return all(len(d) >= w for d, w in zip(done, wanted, strict=True))

    while not satisfied() and engine.has_unfinished():
        for d in engine.step():
            s = samples.setdefault(d.key, _Sample())
            s.tokens += d.token_ids
            s.logprobs += d.logprobs
            s.versions += [version] * len(d.token_ids)
            if d.finish_reason is not None:
                s.finish = d.finish_reason
                i = d.key[0]
                finished_per_prompt[i] = finished_per_prompt.get(i, 0) + 1
                if finished_per_prompt[i] == n:
                    done[owner[i]].append(i)
        steps += 1
        if not satisfied():
            version = poll()
    engine.abort_unfinished()
    if not satisfied():
        raise RuntimeError(f"the engine stopped with prompts unfinished: {done} of {wanted}")
    start, _ = ranges[rank_in_engine]
    kept = sorted(i - start for i in done[rank_in_engine][: wanted[rank_in_engine]])
    out = _output(samples, prompt_ids, kept, n, pad_id, start)
    keys = [(start + i, j) for i in kept for j in range(n)]
    sequences = [[*prompt_ids[k[0] - start], *samples[k].tokens] for k in keys]
    if images is None:
        routing = engine.take_routing(sequences, keys=keys)
    else:
        kept_images = [images[i] for i in kept for _ in range(n)]
        routing = engine.take_routing(sequences, kept_images, keys=keys)
    if routing is not None:  # router replay: (N, P + T, Lm, k) like out.sequences()
        out.routed_experts = pad_routing(
            routing.sequences,
            [len(prompt_ids[i]) for i in kept for _ in range(n)],
            out.prompt_ids.shape[1],
            out.response_ids.shape[1],
            routing.store,
        )
    return StreamedRollout(out, kept, steps)


def _output(
    samples: dict[tuple[int, int], _Sample],
    prompt_ids: Sequence[Sequence[int]],
    kept: list[int],
    n: int,
    pad_id: int,
    start: int,
) -> RolloutOutput:
    rows = [samples[(start + i, j)] for i in kept for j in range(n)]
    out = RolloutOutput.from_lists(
        [list(prompt_ids[i]) for i in kept for _ in range(n)],
        [s.tokens for s in rows],
        [s.finish for s in rows],
        [s.logprobs for s in rows],
        pad_id=pad_id,
        n=n,
    )
    versions, _ = pad_token_rows([s.versions for s in rows], -1, left=False)
    return replace(out, token_versions=versions.reshape(out.response_ids.shape))
