"""The pairing audit of asynchronous training (``trainers.ppo.pairing``): marks made from the
rows a rollout rank sends survive every legitimate reshuffle of the batch (route
concatenation, minibatch permutations, trimming) and catch each part of a sample paired with
another sample's."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.models.vision import ImageBatch, ImageInputs
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo.dynamic_filtering import concat_experiences
from fsdp_rlhf.trainers.ppo.pairing import check_groups, check_rows, sample_marks

N_PROMPTS, N, P, T = 3, 4, 5, 6


def _batch(seed: int, prompts: int = N_PROMPTS) -> Experience:
    """Rows of ``prompts`` groups of N samples, every part distinct per sample: ragged
    prompts and responses, scores, behaviour log-probs, versions, experts, one image per
    prompt (shared by its samples, as the rollout ranks build them)."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * N
    prompt_len = torch.randint(2, P + 1, (rows,), generator=g)
    response_len = torch.randint(1, T + 1, (rows,), generator=g)
    attention = torch.cat(
        [
            (torch.arange(P) >= P - prompt_len[:, None]).long(),
            (torch.arange(T) < response_len[:, None]).long(),
        ],
        dim=1,
    )
    images = [
        ImageInputs(torch.randn(4, 8, generator=g), torch.tensor([[1, 2, 2]]))
        for _ in range(prompts)
    ]
    return Experience(
        input_ids=torch.randint(0, 500, (rows, P + T), generator=g) * attention,
        attention_mask=attention,
        response_mask=attention[:, P:].float(),
        engine_logprobs=-torch.rand(rows, T, generator=g) * attention[:, P:],
        token_versions=torch.randint(3, 5, (rows, T), generator=g) * attention[:, P:],
        scores=torch.rand(rows, generator=g),
        routed_experts=torch.randint(0, 8, (rows, P + T, 2, 2), generator=g).to(torch.uint8),
        images=ImageBatch.repeat(images, N),
    )


def _marked(seed: int, first_prompt: int) -> tuple[Experience, list[int]]:
    exp = _batch(seed)
    prompts = list(range(first_prompt, first_prompt + N_PROMPTS))
    exp.sample_marks = sample_marks(exp, prompts, N)
    return exp, prompts


def test_marks_survive_concatenation_permutation_and_trimming():
    a, pa = _marked(0, first_prompt=10)
    b, pb = _marked(1, first_prompt=20)
    exp = concat_experiences([a, b], pad_id=0)  # two routes of different widths
    check_groups(exp, pa + pb, N, batch=1)
    perm = torch.randperm(exp.num_sequences, generator=torch.Generator().manual_seed(2))
    shuffled = exp.rows(perm)  # a minibatch: every field moves with its row
    assert check_rows(shuffled, step=1) == exp.num_sequences
    assert check_rows(shuffled.rows(torch.arange(5)).trimmed(), step=1) == 5
    assert check_rows(_batch(3), step=1) == 0  # no marks: nothing to check


@pytest.mark.parametrize(
    "part", ["score", "image", "tokens", "behaviour", "version_min", "experts"]
)
def test_a_part_paired_with_another_samples_is_named(part):
    exp, _ = _marked(0, first_prompt=10)
    swap = torch.arange(exp.num_sequences)
    swap[[1, 5]] = swap[[5, 1]]  # sample 1 of prompt 10 and sample 1 of prompt 11
    if part == "score":
        exp.scores = exp.scores[swap]
    elif part == "image":
        exp.images = exp.images[swap]
    elif part == "tokens":
        exp.input_ids = exp.input_ids.clone()
        exp.input_ids[1, -T] += 1  # one generated token differs
    elif part == "behaviour":
        exp.engine_logprobs = exp.engine_logprobs[swap]
    elif part == "version_min":
        exp.token_versions = exp.token_versions.clone()
        exp.token_versions[1] -= exp.response_mask[1].long()  # one version older
    else:
        exp.routed_experts = exp.routed_experts[swap]
    with pytest.raises(RuntimeError, match=f"prompt 10 sample 1 holds another {part}"):
        check_rows(exp, step=7)


def test_groups_out_of_place_or_for_another_prompt_are_named():
    exp, prompts = _marked(0, first_prompt=10)
    with pytest.raises(RuntimeError, match="group 1 should hold prompt 99"):
        check_groups(exp, [10, 99, 12], N, batch=3)
    swapped = exp.rows(torch.tensor([0, 1, 2, 4, 3, 5, 6, 7, 8, 9, 10, 11]))
    with pytest.raises(RuntimeError, match="group 0 should hold prompt 10's samples 0-3"):
        check_groups(swapped, prompts, N, batch=3)
    # a group reordered inside keeps each sample's parts: the rows pass, the group does not
    assert check_rows(swapped, step=1) == 12
