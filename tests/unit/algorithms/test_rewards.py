import pytest
import torch

from fsdp_rlhf.algorithms import (
    clip_scores,
    overlong_penalty,
    shape_rewards,
    stop_properly_penalty,
)
from tests.unit.algorithms.helpers import SEEDS, make_gen, ragged_mask, randn, valid_positions


@pytest.mark.parametrize("seed", SEEDS)
def test_shape_rewards_matches_reference(seed):
    gen = make_gen(seed)
    batch, length = 7, 10
    mask = ragged_mask(batch, length, gen)
    scores = randn(batch, gen=gen)
    kl = randn(batch, length, gen=gen)
    kl_coef = 0.05 * (seed + 1)
    out = shape_rewards(scores, kl, kl_coef, mask)
    for row in range(batch):
        positions = valid_positions(mask, row)
        expected = [0.0] * length
        for t in positions:
            expected[t] = -kl_coef * kl[row, t].item()
        if positions:
            expected[positions[-1]] += scores[row].item()
        assert out[row].tolist() == pytest.approx(expected, abs=1e-12)


def test_shape_rewards_empty_row_gets_nothing_and_tensor_coef():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    scores = torch.tensor([1.0, 5.0, -2.0])
    kl = torch.zeros(3, 3)
    out = shape_rewards(scores, kl, torch.tensor(0.1), mask)
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -2.0]])
    torch.testing.assert_close(out, expected)


def test_clip_scores():
    scores = torch.tensor([-7.0, -1.0, 0.5, 9.0])
    torch.testing.assert_close(clip_scores(scores, 2.0), torch.tensor([-2.0, -1.0, 0.5, 2.0]))
    assert clip_scores(scores, None) is scores
    with pytest.raises(ValueError):
        clip_scores(scores, 0.0)


def _ref_overlong(length, max_len, buffer, factor):
    expected = max_len - buffer
    if length <= expected:
        return 0.0
    return -min(length - expected, buffer) / buffer * factor


@pytest.mark.parametrize(
    ("max_len", "buffer", "factor"), [(20, 8, 1.0), (16, 16, 0.5), (10, 3, 2.0)]
)
def test_overlong_penalty_matches_reference(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 4, dtype=torch.float64)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    as_int = overlong_penalty(lengths.long(), max_len, buffer, factor)  # default float dtype
    torch.testing.assert_close(as_int, got.to(as_int.dtype))
    for length, value in zip(lengths.tolist(), got.tolist(), strict=True):
        assert value == pytest.approx(_ref_overlong(length, max_len, buffer, factor), abs=1e-12)
    assert got[max_len].item() == pytest.approx(-factor)  # full penalty at the budget
    assert got[max_len - buffer].item() == 0.0  # none up to the expected length


def test_overlong_penalty_from_a_ragged_mask_and_validation():
    gen = make_gen(3)
    mask = ragged_mask(6, 12, gen)
    lengths = mask.sum(-1)
    got = overlong_penalty(lengths.double(), 12, 4)
    assert got.dtype == torch.float64
    for b in range(6):
        assert got[b].item() == pytest.approx(_ref_overlong(int(lengths[b]), 12, 4, 1.0))
    for bad in ((12, 0), (12, 13)):
        with pytest.raises(ValueError):
            overlong_penalty(lengths, *bad)
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 12, 4, -1.0)


@pytest.mark.parametrize(
    "coef,expected",
    [
        (0.0, [0.0, 0.9, 0.0, 0.0]),  # ProRL's script: truncated responses score 0
        (0.5, [0.5, 0.9, 0.0, -0.15]),  # a factor in [0, 1] scales them
        (1.0, [1.0, 0.9, 0.0, -0.3]),  # 1: no penalty
        (-0.5, [-0.5, 0.9, -0.5, -0.5]),  # below 0: a fixed score, whatever they earned
    ],
)
def test_stop_properly_penalty_matches_openrlhfs_rule(coef, expected):
    scores = torch.tensor([1.0, 0.9, 0.0, -0.3], dtype=torch.float64)
    truncated = torch.tensor([True, False, True, True])
    out = stop_properly_penalty(scores, truncated, coef)
    assert out.dtype == torch.float64 and out.tolist() == pytest.approx(expected)
    # 0/1 flags work as well, and the input is not modified
    assert stop_properly_penalty(scores, truncated.float(), coef).tolist() == out.tolist()
    assert scores.tolist() == [1.0, 0.9, 0.0, -0.3]


def test_stop_properly_penalty_rejects_a_reward_for_truncation():
    with pytest.raises(ValueError, match="coef"):
        stop_properly_penalty(torch.zeros(2), torch.ones(2), 1.5)
