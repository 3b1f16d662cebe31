import statistics

import pytest
import torch

from fsdp_rlhf.algorithms import (
    dr_grpo,
    estimate_advantages,
    flash_reinforce,
    gae,
    grpo,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    shape_rewards,
)
from fsdp_rlhf.algorithms.advantages import discounted_returns
from tests.unit.algorithms.helpers import SEEDS, make_gen, ragged_mask, randn, valid_positions

B, T = 6, 12


def _ref_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros(B, T, dtype=torch.float64)
    for row in range(B):
        positions = valid_positions(mask, row)
        running, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[row, t].item() + gamma * next_value - values[row, t].item()
            running = delta + gamma * lam * running
            adv[row, t] = running
            next_value = values[row, t].item()
    return adv


def _ref_returns(rewards, mask, gamma):
    out = torch.zeros(B, T, dtype=torch.float64)
    for row in range(B):
        running = 0.0
        for t in reversed(valid_positions(mask, row)):
            running = rewards[row, t].item() + gamma * running
            out[row, t] = running
    return out


def _inputs(seed):
    gen = make_gen(seed)
    return ragged_mask(B, T, gen), randn(B, T, gen=gen), randn(B, T, gen=gen)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_reference(seed, gamma, lam):
    mask, rewards, values = _inputs(seed)
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    expected = _ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, (expected + values) * mask)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_ignores_masked_values_and_rewards(seed):
    mask, rewards, values = _inputs(seed)
    advantages, returns = gae(rewards, values, mask, 0.97, 0.9)
    noise = randn(B, T, gen=make_gen(seed + 1000)) * 100
    dirty_values = torch.where(mask, values, noise)
    dirty_rewards = torch.where(mask, rewards, -noise)
    dirty_adv, dirty_ret = gae(dirty_rewards, dirty_values, mask, 0.97, 0.9)
    torch.testing.assert_close(dirty_adv, advantages)
    torch.testing.assert_close(dirty_ret, returns)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()
    # Valid values do matter, so the comparison above is not vacuous.
    changed_adv, _ = gae(rewards, values + mask * noise, mask, 0.97, 0.9)
    assert not torch.allclose(changed_adv, advantages)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_lambda_one_is_monte_carlo(seed):
    mask, rewards, values = _inputs(seed)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = _ref_returns(rewards, mask, 1.0)
    torch.testing.assert_close(advantages, (reward_to_go - values) * mask)
    torch.testing.assert_close(returns, reward_to_go)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus(seed):
    mask, rewards, _ = _inputs(seed)
    advantages, returns = reinforce_plus_plus(rewards, mask, gamma=0.9)
    expected_returns = _ref_returns(rewards, mask, 0.9)
    torch.testing.assert_close(returns, expected_returns)
    xs = [expected_returns[b, t].item() for b in range(B) for t in valid_positions(mask, b)]
    mean, std = statistics.fmean(xs), statistics.stdev(xs)
    torch.testing.assert_close(advantages, (expected_returns - mean) / std * mask)
    assert masked_mean(advantages, mask).item() == pytest.approx(0.0, abs=1e-10)
    assert masked_var(advantages, mask).item() == pytest.approx(1.0, rel=1e-6)


def test_reinforce_plus_plus_uses_given_whiten_fn():
    mask, rewards, _ = _inputs(0)
    calls = []

    def scale_by_two(values, m):
        calls.append(values.shape)
        return values * 2

    advantages, returns = reinforce_plus_plus(rewards, mask, 1.0, whiten_fn=scale_by_two)
    assert calls == [(B, T)]
    torch.testing.assert_close(advantages, returns * 2)


def _group_reference(scores, n, kind, eps=1e-6):
    out = []
    for i, s in enumerate(scores.tolist()):
        group = scores.tolist()[(i // n) * n : (i // n + 1) * n]
        others = [g for j, g in enumerate(group) if j != i % n]
        if kind == "rloo":
            out.append(s - sum(others) / len(others))
        elif kind == "grpo":
            out.append((s - statistics.fmean(group)) / (statistics.stdev(group) + eps))
        else:
            out.append(s - statistics.fmean(group))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["rloo", "grpo", "dr_grpo"])
def test_group_estimators_match_reference(seed, n, kind):
    gen = make_gen(seed)
    mask = ragged_mask(B, T, gen)
    scores = randn(B, gen=gen)
    if kind == "rloo":
        out = rloo(scores, mask, n)
    elif kind == "grpo":
        out = grpo(scores, mask, n, eps=1e-6)
    else:
        out = dr_grpo(scores, mask, n)
    expected = _group_reference(scores, n, kind)
    torch.testing.assert_close(out, expected.unsqueeze(1) * mask)


def test_grpo_uniform_group_gets_zero():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0])
    mask = torch.ones(4, 3)
    out = grpo(scores, mask, 2)
    assert (out[:2] == 0).all() and (out[2:] != 0).all()


@pytest.mark.parametrize("fn", [rloo, grpo, dr_grpo])
def test_group_estimators_reject_bad_group_sizes(fn):
    scores, mask = torch.randn(6), torch.ones(6, 4)
    for n in (0, 1):
        with pytest.raises(ValueError):
            fn(scores, mask, n)
    with pytest.raises(ValueError):
        fn(scores, mask, 4)
    assert fn(scores, mask, 3).shape == (6, 4)


@pytest.mark.parametrize(
    "estimator", ["gae", "reinforce++", "rloo", "grpo", "dr_grpo", "flash_reinforce"]
)
def test_estimate_advantages_one_entry_one_shape(estimator):
    g = make_gen(0)
    mask = ragged_mask(B, T, g).double()
    scores = randn(B, gen=g)
    kl = randn(B, T, gen=g).abs() * mask
    values = randn(B, T, gen=g) * mask
    out = estimate_advantages(
        estimator, scores, kl, 0.1, mask, values=values, gamma=0.9, lam=0.95,
        n_samples_per_prompt=3,
    )  # fmt: skip
    rewards = shape_rewards(scores, kl, 0.1, mask)
    torch.testing.assert_close(out.rewards, rewards)
    for t in out:
        assert t.shape == (B, T) and (t[mask == 0] == 0).all()
    if estimator == "gae":
        adv, ret = gae(rewards, values, mask, 0.9, 0.95)
        torch.testing.assert_close(out.returns, ret)
        torch.testing.assert_close(out.advantages, masked_whiten(adv, mask) * mask)
    elif estimator in ("rloo", "grpo", "dr_grpo"):
        group = {"rloo": rloo, "grpo": grpo, "dr_grpo": dr_grpo}[estimator](scores, mask, 3)
        # the per-token KL penalty's reward-to-go rides on top of the group advantage
        kl_to_go = discounted_returns(-0.1 * kl, mask, 0.9)
        torch.testing.assert_close(out.advantages, (group + kl_to_go) * mask)
    elif estimator == "flash_reinforce":
        kl_to_go = discounted_returns(-0.1 * kl, mask, 0.9)
        centred = (scores - scores.mean()).unsqueeze(1) * mask
        torch.testing.assert_close(out.advantages, (centred + kl_to_go) * mask)


def test_estimate_advantages_rejects_unknown_and_missing_values():
    mask = torch.ones(2, 3, dtype=torch.float64)
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        estimate_advantages("ppo2", torch.zeros(2, dtype=torch.float64), zeros, 0.0, mask)
    with pytest.raises(ValueError, match="critic values"):
        estimate_advantages("gae", torch.zeros(2, dtype=torch.float64), zeros, 0.0, mask)


def _ref_rpp_baseline(scores, token_rewards, mask, n, gamma):
    rows = scores.shape[0]
    scores = scores.tolist()
    centred = []
    for g in range(rows // n):
        group = scores[g * n : (g + 1) * n]
        centred += [s - sum(group) / n for s in group]
    returns = [[0.0] * T for _ in range(rows)]
    for b in range(rows):
        pos = valid_positions(mask, b)
        running = 0.0
        for i, t in enumerate(reversed(pos)):
            r = token_rewards[b][t].item() if token_rewards is not None else 0.0
            r += centred[b] if i == 0 else 0.0
            running = r + gamma * running
            returns[b][t] = running
    flat = [returns[b][t] for b in range(rows) for t in valid_positions(mask, b)]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    adv = [
        [(returns[b][t] - mean) / (var + 1e-8) ** 0.5 if mask[b, t] else 0.0 for t in range(T)]
        for b in range(rows)
    ]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("with_kl", [False, True])
def test_reinforce_plus_plus_baseline_matches_reference(seed, gamma, with_kl):
    gen = make_gen(seed)
    mask = ragged_mask(8, T, gen)  # two groups of 4, holes and an empty row
    scores = randn(8, gen=gen)
    token_rewards = randn(8, T, gen=gen) * 0.1 if with_kl else None
    adv, ret = reinforce_plus_plus_baseline(scores, mask, 4, token_rewards, gamma)
    ref_adv, ref_ret = _ref_rpp_baseline(scores, token_rewards, mask, 4, gamma)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-10, atol=1e-12)


def test_reinforce_plus_plus_baseline_ignores_group_offsets_and_checks_groups():
    mask = torch.ones(8, 3, dtype=torch.bool)
    scores = torch.arange(8, dtype=torch.float64)
    shifted = scores + torch.tensor([10.0] * 4 + [-7.0] * 4)  # a per-prompt offset
    a, _ = reinforce_plus_plus_baseline(scores, mask, 4)
    b, _ = reinforce_plus_plus_baseline(shifted, mask, 4)
    torch.testing.assert_close(a, b)
    seen = []
    reinforce_plus_plus_baseline(scores, mask, 4, whiten_fn=lambda v, m: seen.append(1) or v)
    assert seen == [1]
    with pytest.raises(ValueError):
        reinforce_plus_plus_baseline(scores, mask, 3)
    with pytest.raises(ValueError):
        reinforce_plus_plus_baseline(scores, mask, 1)


def test_flash_reinforce_against_openrlhf_by_hand():
    """OpenRLHF 0.11.2's flash_reinforce (experience_maker): each reward minus the mean of
    all rewards of the rollout batch, then (gamma 1) the reward-to-go of the per-token reward
    (score at the last token, -kl_coef x kl on every token) as the advantage, not whitened.
    Expected values worked out by hand."""
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5], dtype=torch.float64)  # mean 0.5
    mask = torch.tensor(
        [[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float64
    )
    adv = flash_reinforce(scores, mask)
    expected = torch.tensor(
        [[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [-0.5, 0, 0], [0, 0, 0], [0, 0, 0]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(adv, expected)
    # with a KL penalty of 0.1 x kl in the reward: row 0 has kl 1, 2 on its two tokens, so
    # its token rewards are -0.1, -0.2 + 0.5 and its advantages 0.2, 0.3; rows whose kl is 0
    # keep the centred score on every token
    kl = torch.zeros(5, 3, dtype=torch.float64)
    kl[0, :2] = torch.tensor([1.0, 2.0])
    out = estimate_advantages("flash_reinforce", scores, kl, 0.1, mask, n_samples_per_prompt=1)
    expected[0, :2] = torch.tensor([0.2, 0.3], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expected)
    # the shaped rewards keep the raw score (as for the group estimators)
    torch.testing.assert_close(out.rewards[0, :2], torch.tensor([-0.1, 0.8], dtype=torch.float64))


def test_flash_reinforce_subtracts_the_batch_mean_it_is_given():
    """Under data parallelism the baseline is the whole batch's mean (``mean_fn``), not the
    rank's: another rank's scores move this rank's advantages."""
    scores = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    other_rank = torch.tensor([1.0, 1.0], dtype=torch.float64)

    def mean_fn(s):
        return torch.cat([s, other_rank]).mean()  # 0.75

    out = estimate_advantages(
        "flash_reinforce", scores, torch.zeros_like(mask), 0.0, mask, mean_fn=mean_fn
    )
    torch.testing.assert_close(
        out.advantages[:, 0], torch.tensor([0.25, -0.75], dtype=torch.float64)
    )
    # no groups needed: n_samples_per_prompt 1 works, and several samples use the batch mean
    assert (
        flash_reinforce(torch.ones(3, dtype=torch.float64), mask[:1].expand(3, 2)).abs().sum() == 0
    )
    with pytest.raises(ValueError, match=r"\(B,\)"):
        flash_reinforce(torch.ones(2, 1, dtype=torch.float64), mask)
