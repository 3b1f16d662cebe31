"""The pairing audit of asynchronous training: each sample checked at the update against what
its rollout rank sent.

A sample's parts travel apart on their way to the update: its tokens, score, behaviour
log-probs, weight versions, routed experts and images are fields of the batch that are
concatenated over routes, sliced into minibatches and micro-batches, trimmed and packed; its
group is a block of rows, and its prompt an entry of a list. A slip in any of these pairs a
sample with another's reward or image, or computes its advantage in another group: nothing
fails, the run only learns less. With ``FSDP_RLHF_PAIRING_AUDIT=1`` (a test switch, like the
fault points: docs/testing.md) every rollout rank marks each sample it sends
(:func:`sample_marks`: its prompt and place in the group, and a digest of each part), the
marks ride with the rows (``Experience.sample_marks``), and the training ranks check them:
the groups and prompts of each batch on arrival (:func:`check_groups`), and every row of every
micro-batch of the actor update against its own parts (:func:`check_rows`). A mismatch ends
the run with one line naming the sample and the part.
"""

from __future__ import annotations

import os
import zlib

import torch

from fsdp_rlhf.trainers.experience import Experience

ENV = "FSDP_RLHF_PAIRING_AUDIT"

# the columns of Experience.sample_marks (N, len(MARKS)) int64
MARKS = (
    "prompt",  # the prompt's index in the prompt data
    "sample",  # its place in the prompt's group, 0 .. n-1
    "tokens",  # crc32 of the row's tokens (prompt, response, environment turns) and which
    # of them the model generated
    "score",  # the score's float32 bits (-1: scored on the training ranks)
    "behaviour",  # crc32 of the engine's log-probs of the generated tokens
    "image",  # crc32 of the row's pixel values and image grids (0: no image)
    "version_min",  # the oldest weight version among its generated tokens (-1: none)
    "version_max",  # the newest
    "experts",  # crc32 of the routed experts of its tokens (0: no router replay)
)
_COLUMN = {name: i for i, name in enumerate(MARKS)}


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _crc(*tensors: torch.Tensor) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), crc)
    return crc


def _row_digests(exp: Experience, i: int) -> dict[str, int]:
    """Row ``i``'s parts, digested (everything but its prompt and place)."""
    attended = exp.attention_mask[i].bool()
    generated = exp.response_mask[i].bool()
    by_position = torch.zeros_like(attended)  # which of the row's tokens the model generated
    by_position[-exp.response_len :] = generated
    out = {
        "tokens": _crc(exp.input_ids[i][attended].long(), by_position[attended].to(torch.uint8)),
        "score": -1,
        "behaviour": _crc(exp.engine_logprobs[i][generated].float()),
        "image": 0,
        "version_min": -1,
        "version_max": -1,
        "experts": 0,
    }
    if exp.scores is not None:
        out["score"] = int(exp.scores[i].float().cpu().view(torch.int32))
    images = exp.images.rows[i] if exp.images is not None else None
    if images is not None:
        out["image"] = _crc(images.pixel_values.float(), images.grid_thw.long())
    if exp.token_versions is not None and generated.any():
        versions = exp.token_versions[i][generated]
        out["version_min"], out["version_max"] = int(versions.min()), int(versions.max())
    if exp.routed_experts is not None:
        out["experts"] = _crc(exp.routed_experts[i][attended])
    return out


def sample_marks(exp: Experience, prompts: list[int], n: int) -> torch.Tensor:
    """(N, len(MARKS)) int64 marks of the rows a rollout rank sends: rows ``g*n .. g*n+n-1``
    are the samples of prompt ``prompts[g]``."""
    if exp.num_sequences != len(prompts) * n:
        raise ValueError(f"{exp.num_sequences} rows for {len(prompts)} prompts x {n} samples")
    rows = []
    for i in range(exp.num_sequences):
        digests = _row_digests(exp, i)
        marks = {"prompt": prompts[i // n], "sample": i % n, **digests}
        rows.append([marks[name] for name in MARKS])
    return torch.tensor(rows, dtype=torch.int64)


def check_groups(exp: Experience, prompts: list[int], n: int, batch: int) -> None:
    """The rows of a received batch: block ``g`` of ``n`` rows holds the samples ``0 .. n-1``
    of ``prompts[g]``, the prompt the training rank takes for it (its advantages are computed
    over that block; its rule scores or reward model read that prompt)."""
    marks = exp.sample_marks
    if marks is None:
        return
    if marks.shape[0] != len(prompts) * n:
        raise RuntimeError(
            f"pairing audit, batch {batch}: {marks.shape[0]} marked rows for {len(prompts)} "
            f"prompts x {n} samples; report it"
        )
    for g, prompt in enumerate(prompts):
        block = marks[g * n : (g + 1) * n]
        got = block[:, _COLUMN["prompt"]].tolist()
        places = block[:, _COLUMN["sample"]].tolist()
        if got != [prompt] * n or places != list(range(n)):
            raise RuntimeError(
                f"pairing audit, batch {batch}: group {g} should hold prompt {prompt}'s "
                f"samples 0-{n - 1}, it holds (prompt, sample) "
                f"{list(zip(got, places, strict=True))}; report it"
            )


def check_rows(mb: Experience, step: int) -> int:
    """Every row of an update's micro-batch against its marks; returns the rows checked (0
    without marks). Raises naming the first sample whose parts are not its own."""
    marks = mb.sample_marks
    if marks is None:
        return 0
    for i in range(mb.num_sequences):
        digests = _row_digests(mb, i)
        for name, value in digests.items():
            sent = int(marks[i, _COLUMN[name]])
            if name == "score" and sent == -1:
                continue  # scored here (a reward model): nothing was sent
            if value != sent:
                prompt, sample = int(marks[i, 0]), int(marks[i, 1])
                raise RuntimeError(
                    f"pairing audit, step {step}: the update's row for prompt {prompt} "
                    f"sample {sample} holds another {name} than its rollout rank sent "
                    f"({value} != {sent}); report it"
                )
    return mb.num_sequences
