"""``trainers/ppo/dynamic_filtering.py`` (DAPO's dynamic filtering) on one process: the group
pool, the re-padding of batches of different widths, the round loop and its cap."""

from __future__ import annotations

import torch

from fsdp_rlhf.config import PPOAlgoConfig
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo.dynamic_filtering import (
    MAX_ROUNDS_WHEN_UNLIMITED,
    GroupPool,
    concat_experiences,
    dynamic_sample,
    round_cap,
)

PAD = 9


def _batch(scores: list[float], P: int, T: int, tag: int) -> Experience:
    """Rows with prompt width P and response width T; every real token is ``tag``."""
    N = len(scores)
    return Experience(
        input_ids=torch.full((N, P + T), tag),
        attention_mask=torch.ones(N, P + T, dtype=torch.long),
        response_mask=torch.ones(N, T),
        engine_logprobs=torch.full((N, T), -float(tag)),
        scores=torch.tensor(scores),
    )


def _prompts(tag: int, k: int) -> list[Prompt]:
    return [Prompt(ids=[tag], text=f"{tag}-{i}", label=None) for i in range(k)]


def test_concat_pads_prompts_left_and_responses_right():
    a, b = _batch([1.0], P=2, T=3, tag=1), _batch([2.0, 3.0], P=4, T=1, tag=2)
    out = concat_experiences([a, b], pad_id=PAD)
    assert out.input_ids.shape == (3, 4 + 3) and out.response_len == 3
    assert out.input_ids[0].tolist() == [PAD, PAD, 1, 1, 1, 1, 1]
    assert out.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert out.input_ids[1].tolist() == [2, 2, 2, 2, 2, PAD, PAD]
    assert out.response_mask[1].tolist() == [1, 0, 0]
    assert out.engine_logprobs[2].tolist() == [-2.0, 0.0, 0.0]
    assert out.scores.tolist() == [1.0, 2.0, 3.0]


def test_pool_keeps_groups_in_drawing_order_and_fills_from_dropped():
    pool = GroupPool(n=2, target=3)
    # groups: (0, 1) kept, (1, 1) dropped
    pool.add(_batch([0, 1, 1, 1], 1, 2, tag=1), _prompts(1, 2), torch.tensor([True, False]))
    assert pool.short and pool.kept_groups == 1 and pool.seen_groups == 2
    pool.add(_batch([0, 1, 0, 1], 1, 3, tag=2), _prompts(2, 2), torch.tensor([True, True]))
    assert not pool.short
    exp, prompts, filled = pool.take(PAD)
    assert filled == 0 and [p.text for p in prompts] == ["1-0", "2-0", "2-1"]
    assert exp.num_sequences == 6 and exp.scores.tolist() == [0, 1, 0, 1, 0, 1]

    short = GroupPool(n=2, target=2)
    short.add(_batch([1, 1, 0, 1], 1, 2, tag=3), _prompts(3, 2), torch.tensor([False, True]))
    exp, prompts, filled = short.take(PAD)
    # the kept group first, then the dropped one tops the batch up
    assert filled == 1 and [p.text for p in prompts] == ["3-1", "3-0"]
    assert exp.scores.tolist() == [0, 1, 1, 1]


def _fake_rollouts(score_rounds: list[list[float]]):
    calls = []

    def generate_and_score(prompts, round_):
        calls.append(round_)
        scores = score_rounds[min(round_, len(score_rounds) - 1)]
        return _batch(scores, 1, 2, tag=round_ + 1), {"rollout/x": float(round_)}

    return generate_and_score, calls


def test_dynamic_sample_draws_until_full():
    # round 0 keeps 1 of 2 groups, round 1 keeps 2 more: two rounds, batch of 2 groups
    gen, calls = _fake_rollouts([[1, 1, 0, 1], [0, 1, 1, 0]])
    drawn = []

    def draw():
        drawn.append(1)
        return _prompts(len(drawn) + 1, 2)

    algo = PPOAlgoConfig(advantage_estimator="grpo", dynamic_filtering=True)
    exp, prompts, m = dynamic_sample(_prompts(1, 2), draw, gen, algo, n=2, pad_id=PAD)
    assert calls == [0, 1] and len(drawn) == 1
    assert [p.text for p in prompts] == ["1-1", "2-0"]
    assert m["dynamic_filter/gen_rounds"] == 2 and m["dynamic_filter/prompts_drawn"] == 4
    assert m["dynamic_filter/kept_frac"] == 0.75 and m["dynamic_filter/filled_groups"] == 0
    assert exp.num_sequences == 4 and m["rollout/x"] == 1.0


def test_dynamic_sample_stops_at_the_cap_and_fills(caplog):
    gen, calls = _fake_rollouts([[1, 1, 0, 0]])  # every group uniform, forever
    algo = PPOAlgoConfig(advantage_estimator="grpo", dynamic_filtering=True, max_num_gen_batches=3)
    exp, prompts, m = dynamic_sample(
        _prompts(1, 2), lambda: _prompts(5, 2), gen, algo, n=2, pad_id=PAD
    )
    assert calls == [0, 1, 2] and m["dynamic_filter/filled_groups"] == 2
    assert exp.num_sequences == 4 and m["dynamic_filter/kept_frac"] == 0.0
    assert "filled" in caplog.text
    assert round_cap(0) == MAX_ROUNDS_WHEN_UNLIMITED and round_cap(5) == 5


def test_reward_range_rule_is_used_when_given():
    gen, calls = _fake_rollouts([[0.2, 0.4, 0.9, 0.9]])
    algo = PPOAlgoConfig(
        advantage_estimator="grpo",
        dynamic_filtering=True,
        dynamic_filtering_reward_range=(0.0, 0.5),
        max_num_gen_batches=1,
    )
    _, prompts, m = dynamic_sample(_prompts(1, 2), lambda: [], gen, algo, n=2, pad_id=PAD)
    # group 0 (mean 0.3) is inside (0, 0.5), group 1 (mean 0.9) is not, though not uniform
    assert m["dynamic_filter/kept_frac"] == 0.5 and prompts[0].text == "1-0"
