import math

import pytest
import torch

from fsdp_rlhf.algorithms import (
    aggregate_loss,
    entropy_bonus,
    pairwise_loss,
    policy_loss,
    truncated_is_weights,
    value_loss,
)
from tests.unit.algorithms.helpers import SEEDS, make_gen, ragged_mask, randn, valid_positions

B, T = 5, 9


def _ppo_inputs(seed):
    gen = make_gen(seed)
    mask = ragged_mask(B, T, gen)
    old = -randn(B, T, gen=gen).abs()
    logprobs = old + randn(B, T, gen=gen) * 0.3
    advantages = randn(B, T, gen=gen)
    return logprobs, old, advantages, mask


def _ref_ppo_token(lp, old, adv, low, high, dual):
    ratio = math.exp(lp - old)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    if dual is not None and adv < 0:
        loss = min(loss, -adv * dual)
    return loss


def _ref_token_mean(per_token, mask):
    vals = [per_token[b][t] for b in range(B) for t in valid_positions(mask, b)]
    return sum(vals) / len(vals)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("low", "high", "dual"), [(0.2, 0.2, None), (0.1, 0.28, 3.0)])
def test_policy_loss_matches_reference(seed, low, high, dual):
    logprobs, old, adv, mask = _ppo_inputs(seed)
    loss, stats = policy_loss(logprobs, old, adv, mask, low, high, dual_clip=dual)
    per_token = [
        [
            _ref_ppo_token(
                logprobs[b, t].item(), old[b, t].item(), adv[b, t].item(), low, high, dual
            )
            for t in range(T)
        ]
        for b in range(B)
    ]
    assert loss.item() == pytest.approx(_ref_token_mean(per_token, mask), rel=1e-10)
    log_ratio = [
        (logprobs[b, t] - old[b, t]).item() for b in range(B) for t in valid_positions(mask, b)
    ]
    assert stats["ppo_kl"].item() == pytest.approx(-sum(log_ratio) / len(log_ratio), rel=1e-10)
    assert all(not v.requires_grad for v in stats.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_policy_gradient_zero_exactly_where_clipped(seed):
    logprobs, old, adv, mask = _ppo_inputs(seed)
    logprobs = (old + randn(B, T, gen=make_gen(seed + 7)) * 0.5).requires_grad_(True)
    loss, stats = policy_loss(logprobs, old, adv, mask, 0.2, 0.2)
    loss.backward()
    ratio = torch.exp(logprobs.detach() - old)
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    assert (clipped & mask).any() and (~clipped & mask).any()
    assert (logprobs.grad[clipped] == 0).all()
    assert (logprobs.grad[~clipped & mask] != 0).all()
    assert (logprobs.grad[~mask] == 0).all()
    expected_frac = (clipped & mask).sum() / mask.sum()
    assert stats["pg_clipfrac"].item() == pytest.approx(expected_frac.item())


def test_dual_clip_caps_negative_advantages_and_validates():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logprobs = torch.tensor([[3.0, 3.0, 0.1]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(logprobs, old, adv, mask, 0.2, dual_clip=3.0, loss_agg="token-mean")
    loss.backward()
    # Token 0: ratio e^3 ~ 20 on a bad action would cost 20; the dual clip caps it at 3.
    expected = (3.0 + (-1.2) + math.exp(0.1)) / 3
    assert loss.item() == pytest.approx(expected)
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 2] != 0
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError):
            policy_loss(logprobs, old, adv, mask, 0.2, dual_clip=bad)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("value_clip", [None, 0.2])
def test_value_loss_matches_reference(seed, value_clip):
    gen = make_gen(seed)
    mask = ragged_mask(B, T, gen)
    old_values, returns = randn(B, T, gen=gen), randn(B, T, gen=gen)
    values = old_values + randn(B, T, gen=gen) * 0.4
    loss, stats = value_loss(values, old_values, returns, mask, value_clip=value_clip)
    per_token, n_clipped = [[0.0] * T for _ in range(B)], 0
    for b in range(B):
        for t in valid_positions(mask, b):
            v, ov, r = values[b, t].item(), old_values[b, t].item(), returns[b, t].item()
            err = (v - r) ** 2
            if value_clip is not None:
                vc = ov + min(max(v - ov, -value_clip), value_clip)
                n_clipped += (vc - r) ** 2 > err
                err = max(err, (vc - r) ** 2)
            per_token[b][t] = 0.5 * err
    assert loss.item() == pytest.approx(_ref_token_mean(per_token, mask), rel=1e-10)
    assert stats["vf_clipfrac"].item() == pytest.approx(n_clipped / mask.sum().item())


@pytest.mark.parametrize("seed", SEEDS)
def test_aggregate_modes_match_reference(seed):
    gen = make_gen(seed)
    mask = ragged_mask(B, T, gen)
    loss = randn(B, T, gen=gen)
    rows = [[loss[b, t].item() for t in valid_positions(mask, b)] for b in range(B)]
    flat = [x for row in rows for x in row]
    seq_means = [sum(r) / len(r) if r else 0.0 for r in rows]
    cases = {
        ("token-mean", None, None): sum(flat) / len(flat),
        ("token-mean", 100, None): sum(flat) / 100,
        ("seq-mean-token-mean", None, None): sum(seq_means) / B,
        ("seq-mean-token-mean", None, 20): sum(seq_means) / 20,
        ("seq-mean-token-sum", None, None): sum(sum(r) for r in rows) / B,
    }
    for (mode, num_tokens, num_seqs), expected in cases.items():
        got = aggregate_loss(loss, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs)
        assert got.item() == pytest.approx(expected, rel=1e-10), mode
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "sum")


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_token_mean_over_micro_batches_equals_global_mean(seed):
    gen = make_gen(seed)
    mask = ragged_mask(8, T, gen)
    mask[6:] = True  # uneven micro-batch token counts make local averaging wrong
    loss = randn(8, T, gen=gen)
    total = int(mask.sum())
    assert len({int(mask[i : i + 3].sum()) for i in (0, 3, 6)}) > 1
    micro = [aggregate_loss(loss[i : i + 3], mask[i : i + 3], num_tokens=total) for i in (0, 3, 6)]
    torch.testing.assert_close(sum(micro), aggregate_loss(loss, mask))
    local_means = sum(aggregate_loss(loss[i : i + 3], mask[i : i + 3]) for i in (0, 3, 6)) / 3
    assert not torch.allclose(local_means, aggregate_loss(loss, mask))


def test_entropy_bonus_sign_and_scale():
    entropy = torch.tensor([[1.0, 2.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    term = entropy_bonus(entropy, mask, coef=0.01)
    assert term.item() == pytest.approx(-0.015)
    term.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.005, -0.005, 0.0]]))


@pytest.mark.parametrize("seed", SEEDS[:6])
@pytest.mark.parametrize("kind", ["sigmoid", "logexp"])
def test_pairwise_loss_matches_reference(seed, kind):
    gen = make_gen(seed)
    chosen, rejected, margin = randn(7, gen=gen) * 5, randn(7, gen=gen) * 5, randn(7, gen=gen)
    for m in (None, margin):
        got = pairwise_loss(chosen, rejected, m, kind=kind)
        margins = [0.0] * 7 if m is None else m.tolist()
        ref = [
            math.log1p(math.exp(r - c + mm))
            for c, r, mm in zip(chosen.tolist(), rejected.tolist(), margins, strict=True)
        ]
        assert got.item() == pytest.approx(sum(ref) / 7, rel=1e-10)
    big = pairwise_loss(torch.tensor([0.0]), torch.tensor([1000.0]), kind=kind)
    assert big.item() == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        pairwise_loss(chosen, rejected, kind="hinge")


@pytest.mark.parametrize("seed", SEEDS)
def test_truncated_is_weights(seed):
    gen = make_gen(seed)
    mask = ragged_mask(B, T, gen)
    rollout = -randn(B, T, gen=gen).abs()
    old = (rollout + randn(B, T, gen=gen) * 0.5).requires_grad_(True)
    weights, stats = truncated_is_weights(old, rollout, mask, cap=1.5)
    assert not weights.requires_grad
    diffs, kls, n_capped = [], [], 0
    for b in range(B):
        for t in range(T):
            lr = (old[b, t] - rollout[b, t]).item()
            expected = min(math.exp(lr), 1.5) if mask[b, t] else 0.0
            assert weights[b, t].item() == pytest.approx(expected, rel=1e-12)
            if mask[b, t]:
                diffs.append(abs(lr))
                kls.append(math.exp(lr) - 1 - lr)
                n_capped += math.exp(lr) > 1.5
    assert stats["mismatch_abs_diff"].item() == pytest.approx(sum(diffs) / len(diffs))
    assert stats["mismatch_kl"].item() == pytest.approx(sum(kls) / len(kls))
    assert stats["tis_clipfrac"].item() == pytest.approx(n_capped / len(diffs))
    logprobs = old.detach().clone().requires_grad_(True)
    adv = randn(B, T, gen=gen)
    weighted, _ = policy_loss(logprobs, old.detach(), adv, mask, is_weights=weights)
    weighted.backward()
    n = mask.sum()
    torch.testing.assert_close(logprobs.grad, -adv * weights / n)
