import math

import pytest
import torch

from fsdp_rlhf.algorithms import (
    aggregate_loss,
    entropy_bonus,
    gspo_loss,
    pairwise_loss,
    policy_loss,
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
        ("seq-mean-token-sum", None, 20): sum(sum(r) for r in rows) / 20,
        ("seq-mean-token-sum-norm", None, None): sum(sum(r) / 64 for r in rows) / B,
        ("seq-mean-token-sum-norm", None, 20): sum(sum(r) / 64 for r in rows) / 20,
    }
    for (mode, num_tokens, num_seqs), expected in cases.items():
        got = aggregate_loss(
            loss, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=64
        )
        assert got.item() == pytest.approx(expected, rel=1e-10), mode
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "sum")
    for bad in (None, 0):
        with pytest.raises(ValueError, match="norm_len"):
            aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=bad)


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


@pytest.mark.parametrize("seed", SEEDS[:6])
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_every_mode_is_exact_over_ranks_and_micro_batches(seed, mode):
    """2 ranks x 2 micro-batches of 3 rows with global normalisers: the summed pieces equal
    the loss of the whole batch, value and gradient, for every mode."""
    gen = make_gen(seed)
    mask = ragged_mask(12, T, gen)
    mask[9:] = True  # uneven token counts per piece
    per_token = randn(12, T, gen=gen).requires_grad_(True)
    whole = aggregate_loss(per_token, mask, mode, norm_len=16)
    (grad_whole,) = torch.autograd.grad(whole, per_token)
    kw = dict(num_tokens=int(mask.sum()), num_seqs=12, norm_len=16)
    pieces = [
        aggregate_loss(per_token[i : i + 3], mask[i : i + 3], mode, **kw) for i in range(0, 12, 3)
    ]
    total = sum(pieces)
    (grad_pieces,) = torch.autograd.grad(total, per_token)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_pieces, grad_whole, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_loss_functions_forward_norm_len(seed):
    logprobs, old, adv, mask = _ppo_inputs(seed)
    agg = dict(loss_agg="seq-mean-token-sum-norm", norm_len=32)
    loss, _ = policy_loss(logprobs, old, adv, mask, **agg)
    sums = loss.new_zeros(())
    for b in range(B):
        for t in valid_positions(mask, b):
            lp, o, a = logprobs[b, t].item(), old[b, t].item(), adv[b, t].item()
            sums += _ref_ppo_token(lp, o, a, 0.2, 0.2, None)
    assert loss.item() == pytest.approx(sums.item() / 32 / B, rel=1e-10)
    ent = entropy_bonus(adv.abs(), mask, 0.1, **agg)
    assert ent.item() == pytest.approx(
        -0.1
        * sum(adv[b, t].abs().item() for b in range(B) for t in valid_positions(mask, b))
        / 32
        / B,
        rel=1e-10,
    )
    vloss, _ = value_loss(logprobs, old, adv, mask, **agg)
    assert torch.isfinite(vloss)


def _ref_gspo(logprobs, old, adv, mask, low, high):
    """Sequence loop of GSPO's objective, -1/B sum_i 1/|y_i| sum_t min(s_i A_it, clip(s_i) A_it)."""
    total = 0.0
    for b in range(B):
        pos = valid_positions(mask, b)
        if not pos:
            continue
        s = math.exp(sum(logprobs[b, t].item() - old[b, t].item() for t in pos) / len(pos))
        cs = min(max(s, 1 - low), 1 + high)
        total += sum(max(-adv[b, t].item() * s, -adv[b, t].item() * cs) for t in pos) / len(pos)
    return total / B


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("low", "high"), [(3e-4, 4e-4), (0.05, 0.1)])
def test_gspo_matches_sequence_reference_and_gradient(seed, low, high):
    gen = make_gen(seed)
    mask = ragged_mask(B, T, gen)
    old = -randn(B, T, gen=gen).abs()
    logprobs = (old + randn(B, T, gen=gen) * 0.05).requires_grad_(True)
    seq_adv = randn(B, gen=gen)
    adv = seq_adv[:, None].expand(B, T).contiguous()
    loss, stats = gspo_loss(logprobs, old, adv, mask, low, high)
    assert loss.item() == pytest.approx(_ref_gspo(logprobs, old, adv, mask, low, high), rel=1e-10)
    loss.backward()
    # The gradient of the sequence objective -A_i * s_i / B when s_i is not clipped (or clipped
    # on the side that does not bind), 0 otherwise: d s_i / d logprobs_t = s_i / |y_i|.
    n_clipped_rows = 0
    for b in range(B):
        pos = valid_positions(mask, b)
        if not pos:
            assert (logprobs.grad[b] == 0).all()
            continue
        s = math.exp(sum(logprobs[b, t].item() - old[b, t].item() for t in pos) / len(pos))
        a = seq_adv[b].item()
        clipped = (a > 0 and s > 1 + high) or (a < 0 and s < 1 - low)
        n_clipped_rows += clipped
        for t in range(T):
            expected = 0.0 if (clipped or t not in pos) else -a * s / len(pos) / B
            assert logprobs.grad[b, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-15)
    nonempty = sum(1 for b in range(B) if valid_positions(mask, b))
    assert stats["seq_clipfrac"].item() == pytest.approx(n_clipped_rows / nonempty)


def test_gspo_equals_ppo_on_single_token_rows_and_weights_apply():
    old = torch.zeros(4, 1, dtype=torch.float64)
    lp = torch.tensor([[0.3], [-0.3], [0.05], [-0.05]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0], [-1.0], [1.0]], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    g, _ = gspo_loss(lp, old, adv, mask, 0.2, 0.2)
    p, _ = policy_loss(lp, old, adv, mask, 0.2, 0.2, loss_agg="seq-mean-token-mean")
    torch.testing.assert_close(g, p)
    _, stats = gspo_loss(lp, old, adv, mask, 0.2, 0.2)
    assert stats["seq_clipfrac"].item() == 0.5  # rows 0 and 1 leave [0.8, 1.2] on the binding side
    w = torch.tensor([[0.0], [1.0], [2.0], [1.0]], dtype=torch.float64)
    gw, _ = gspo_loss(lp, old, adv, mask, 0.2, 0.2, is_weights=w)
    pw, _ = policy_loss(lp, old, adv, mask, 0.2, 0.2, loss_agg="seq-mean-token-mean", is_weights=w)
    torch.testing.assert_close(gw, pw)
