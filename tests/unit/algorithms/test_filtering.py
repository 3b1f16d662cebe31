import pytest
import torch

from fsdp_rlhf.algorithms import dynamic_filter_groups, expand_group_mask
from tests.unit.algorithms.helpers import SEEDS, make_gen


@pytest.mark.parametrize("seed", SEEDS)
def test_keeps_exactly_the_groups_with_mixed_scores(seed):
    gen = make_gen(seed)
    scores = torch.randint(0, 2, (6 * 4,), generator=gen).to(torch.float64)
    scores[:4] = 1.0  # all right
    scores[4:8] = 0.0  # all wrong
    keep = dynamic_filter_groups(scores, 4)
    groups = scores.reshape(6, 4).tolist()
    assert keep.tolist() == [len(set(g)) > 1 for g in groups]
    assert keep.dtype == torch.bool and keep.shape == (6,)
    assert not keep[0] and not keep[1]
    # OpenRLHF's mean-in-(low, high) rule agrees with it on 0/1 rewards.
    assert dynamic_filter_groups(scores, 4, reward_range=(0.0, 1.0)).tolist() == keep.tolist()
    rows = expand_group_mask(keep, 4)
    assert rows.tolist() == [k for k in keep.tolist() for _ in range(4)]


def test_continuous_scores_tolerance_and_reward_range():
    scores = torch.tensor(
        [0.5, 0.5, 0.5, 0.5, 0.2, 0.2 + 1e-9, 0.2, 0.2, -1.0, 2.0, 0.0, 0.0], dtype=torch.float64
    )
    assert dynamic_filter_groups(scores, 4).tolist() == [False, True, True]
    assert dynamic_filter_groups(scores, 4, atol=1e-6).tolist() == [False, False, True]
    # means: 0.5, ~0.2, 0.25 -> strictly inside (0.21, 1.0): the first and last
    assert dynamic_filter_groups(scores, 4, reward_range=(0.21, 1.0)).tolist() == [
        True,
        False,
        True,
    ]


def test_bad_shapes_and_ranges():
    with pytest.raises(ValueError):
        dynamic_filter_groups(torch.zeros(6), 4)
    with pytest.raises(ValueError):
        dynamic_filter_groups(torch.zeros(4), 1)
    with pytest.raises(ValueError):
        dynamic_filter_groups(torch.zeros(8), 4, reward_range=(1.0, 0.0))
