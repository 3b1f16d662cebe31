"""The step-by-step rollout of asynchronous training against a scripted engine: each token
keeps the weight version that sampled it and its log-prob, over-sampling keeps the first
groups to finish, and the weight buckets unpack to the tensors that were packed."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.distributed.weight_broadcast import buckets, pack, payload_bytes, unpack
from fsdp_rlhf.rollout.engine import SamplingConfig, TokenDelta
from fsdp_rlhf.rollout.streaming import stream_rollout


class ScriptedEngine:
    """Sample j of prompt i gets ``lengths[i][j]`` tokens, one per step, token id
    ``100 * i + step`` with log-prob ``-(weights) / 10`` (the weights being the number of
    versions loaded so far, so the log-prob tells which weights sampled it)."""

    def __init__(self, lengths: list[list[int]], counts: list[int] | None = None) -> None:
        self.lengths = lengths
        self.counts = counts
        self.progress: dict[tuple[int, int], int] = {}
        self.weights = 0
        self.aborted = False

    def submit(self, prompt_token_ids, sampling):
        self.progress = {(i, j): 0 for i in range(len(self.lengths)) for j in range(sampling.n)}
        return self.counts or [len(prompt_token_ids)]

    def step(self):
        out = []
        for (i, j), done in self.progress.items():
            total = self.lengths[i][j]
            if done < total:
                self.progress[(i, j)] = done + 1
                reason = ("stop" if total < 8 else "length") if done + 1 == total else None
                out.append(TokenDelta((i, j), [100 * i + done], [-self.weights / 10], reason))
        return out

    def has_unfinished(self):
        return any(d < self.lengths[i][j] for (i, j), d in self.progress.items())

    def abort_unfinished(self):
        self.aborted = True
        self.progress = {}

    def take_routing(self, sequences, images=None, keys=None):
        return None


def test_tokens_keep_the_version_that_sampled_them():
    engine = ScriptedEngine([[5, 3], [2, 4]])
    polls = []

    def poll() -> int:  # new weights after the second engine step (a partial rollout)
        polls.append(None)
        if len(polls) == 3:
            engine.weights = 1
        return 7 + engine.weights

    sampling = SamplingConfig(max_new_tokens=8, n=2)
    out = stream_rollout(
        engine, [[1, 2], [3]], sampling, rank_in_engine=0, pad_id=0, poll=poll
    ).output
    assert out.response_ids[0].tolist() == [0, 1, 2, 3, 4]
    assert out.token_versions[0].tolist() == [7, 7, 8, 8, 8]
    assert out.token_versions[1].tolist() == [7, 7, 8, -1, -1]  # padded with -1
    assert out.engine_logprobs[0].tolist() == pytest.approx([0.0, 0.0, -0.1, -0.1, -0.1])
    assert out.token_versions[2].tolist()[:2] == [7, 7]
    assert out.finish_reasons == ["stop", "stop", "stop", "stop"]


def test_over_sampling_keeps_the_first_groups_to_finish():
    # prompt 1's samples finish first, then prompt 2's; prompt 0 has a straggler
    engine = ScriptedEngine([[9, 2], [1, 2], [3, 3]])
    sampling = SamplingConfig(max_new_tokens=16, n=2)
    streamed = stream_rollout(
        engine, [[1], [2], [3]], sampling, rank_in_engine=0, pad_id=0, poll=lambda: 0, keep=2
    )
    assert streamed.kept == [1, 2] and engine.aborted
    assert streamed.output.response_ids.shape[0] == 4 and streamed.steps == 3


class ImageEngine(ScriptedEngine):
    """A vision-language model's engine: takes each prompt's images with it."""

    def submit(self, prompt_token_ids, sampling, images=None):
        self.images = images
        return super().submit(prompt_token_ids, sampling)


def test_image_prompts_reach_the_engine_with_their_images():
    """Each prompt's images go to the engine with it (a text engine is never handed any);
    over-sampling's kept prompts name whose images the kept rows carry."""
    engine = ImageEngine([[9, 2], [1, 2], [3, 3]])
    images = ["img0", None, "img2"]  # stands for PromptImages; None: a text prompt
    sampling = SamplingConfig(max_new_tokens=16, n=2)
    streamed = stream_rollout(
        engine,
        [[1], [2], [3]],
        sampling,
        rank_in_engine=0,
        pad_id=0,
        poll=lambda: 0,
        keep=2,
        images=images,
    )
    assert engine.images == images
    assert [images[i] for i in streamed.kept] == [None, "img2"]
    text = ScriptedEngine([[1]])  # its submit takes no images: none are passed
    stream_rollout(
        text, [[1]], SamplingConfig(max_new_tokens=4), rank_in_engine=0, pad_id=0, poll=lambda: 0
    )


def test_over_sampling_waits_for_every_rank_of_the_engine():
    # two ranks of one engine sent 2 prompts each; rank 1's groups finish last
    engine = ScriptedEngine([[1, 1], [1, 1], [2, 2], [6, 6]], counts=[2, 2])
    sampling = SamplingConfig(max_new_tokens=16, n=2)
    mine = stream_rollout(
        engine, [[1], [2]], sampling, rank_in_engine=0, pad_id=0, poll=lambda: 0, keep=1
    )
    theirs = ScriptedEngine([[1, 1], [1, 1], [2, 2], [6, 6]], counts=[2, 2])
    other = stream_rollout(
        theirs, [[3], [4]], sampling, rank_in_engine=1, pad_id=0, poll=lambda: 0, keep=1
    )
    assert mine.steps == other.steps == 2  # both stop when rank 1's first group is done
    assert mine.kept == [0] and other.kept == [0]


def test_weight_buckets_round_trip():
    embed = torch.randn(7, 3)
    stream = [
        ("embed.weight", embed),
        ("head.weight", embed),  # tied: sent once, named twice
        ("layer.bias", torch.randn(5).to(torch.bfloat16)),
        ("layer.weight", torch.randn(3, 5)),
        ("big", torch.randn(64)),
    ]
    seen = []
    for bucket in buckets(stream, bucket_bytes=200):
        manifest, payload = pack(bucket)
        assert payload.numel() == payload_bytes(manifest)
        seen += [(name, t.clone()) for name, t in unpack(manifest, payload.clone())]
    assert [n for n, _ in seen] == [n for n, _ in stream]
    for (_, got), (_, want) in zip(seen, stream, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    first, *_ = buckets(stream, bucket_bytes=200)
    manifest, _ = pack(first)
    assert manifest[1] == ("head.weight", "alias", "embed.weight")
