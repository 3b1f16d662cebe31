import math

import pytest
import torch

from fsdp_rlhf.algorithms import (
    binary_kl,
    gating_statistic,
    policy_loss,
    rollout_correction,
    rollout_mismatch_metrics,
    total_variation,
)
from tests.unit.algorithms.helpers import SEEDS, make_gen, ragged_mask, randn, valid_positions

B, T = 8, 10


def _inputs(seed, spread=0.6):
    gen = make_gen(seed)
    mask = ragged_mask(B, T, gen)
    rollout = -randn(B, T, gen=gen).abs() * 2
    old = rollout + randn(B, T, gen=gen) * spread
    return old, rollout, mask


def _ref_weights(old, rollout, mask, mode, low, high):
    """Per-token loops: the definitions, written out."""
    weights = [[0.0] * T for _ in range(B)]
    n_clipped = n_masked = n_valid = 0
    rows_rejected = rows = 0
    for b in range(B):
        pos = valid_positions(mask, b)
        lrs = [(old[b, t] - rollout[b, t]).item() for t in pos]
        seq_ok = True
        if pos:
            rows += 1
            geo = math.exp(sum(lrs) / len(lrs))
            seq_ok = low <= geo <= high
            rows_rejected += mode in ("seq_mask", "seq_mask_tis") and not seq_ok
        for t, lr in zip(pos, lrs, strict=True):
            n_valid += 1
            r = math.exp(lr)
            inside = low <= r <= high
            if mode == "tis":
                w = min(max(r, low), high)
                n_clipped += not inside
            elif mode == "icepop":
                w = r if inside else 0.0
                n_masked += not inside
            elif mode == "seq_mask":
                w = r if seq_ok else 0.0
                n_masked += not seq_ok
            else:  # seq_mask_tis
                w = min(max(r, low), high) if seq_ok else 0.0
                n_clipped += seq_ok and not inside
                n_masked += not seq_ok
            weights[b][t] = w
    return weights, n_clipped / n_valid, n_masked / n_valid, rows_rejected / max(rows, 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["tis", "icepop", "seq_mask", "seq_mask_tis"])
@pytest.mark.parametrize(("low", "high"), [(0.5, 5.0), (0.0, 2.0), (0.8, 1.25)])
def test_correction_weights_match_reference(seed, mode, low, high):
    old, rollout, mask = _inputs(seed)
    old = old.requires_grad_(True)
    weights, stats = rollout_correction(old, rollout, mask, mode, low, high)
    assert not weights.requires_grad
    ref, clipfrac, maskedfrac, seqfrac = _ref_weights(old, rollout, mask, mode, low, high)
    torch.testing.assert_close(weights, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=0)
    assert stats["is_clipfrac"].item() == pytest.approx(clipfrac, abs=1e-12)
    assert stats["is_masked_frac"].item() == pytest.approx(maskedfrac, abs=1e-12)
    valid = [weights[b, t].item() for b in range(B) for t in valid_positions(mask, b)]
    assert stats["is_weight_mean"].item() == pytest.approx(sum(valid) / len(valid), rel=1e-12)
    if mode in ("seq_mask", "seq_mask_tis"):
        assert stats["is_seq_masked_frac"].item() == pytest.approx(seqfrac, abs=1e-12)
    assert (weights[~mask] == 0).all()


def test_seq_mask_tis_rejects_whole_rows_on_the_geometric_mean():
    # Row 0: one very off token among agreeing ones; geometric mean exp(log 4 / 4) ~ 1.41 is
    # inside [0.5, 2], so the row is kept and the token is truncated to 2.
    # Row 1: every token off by 3x: geometric mean 3, rejected whole.
    rollout = torch.zeros(2, 4, dtype=torch.float64)
    old = torch.tensor([[math.log(4.0), 0, 0, 0], [math.log(3.0)] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    w, stats = rollout_correction(old, rollout, mask, "seq_mask_tis", 0.5, 2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float64))
    assert stats["is_seq_masked_frac"].item() == 0.5
    assert stats["is_masked_frac"].item() == pytest.approx(3 / 7)
    # icepop drops only the off tokens
    w, _ = rollout_correction(old, rollout, mask, "icepop", 0.5, 2.0)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float64))


@pytest.mark.parametrize("seed", SEEDS)
def test_mismatch_metrics_match_reference(seed):
    old, rollout, mask = _inputs(seed)
    stats = rollout_mismatch_metrics(old, rollout, mask)
    diffs = [(old[b, t] - rollout[b, t]).item() for b in range(B) for t in valid_positions(mask, b)]
    n = len(diffs)
    assert stats["mismatch_k1"].item() == pytest.approx(-sum(diffs) / n, rel=1e-10, abs=1e-12)
    assert stats["mismatch_abs_diff"].item() == pytest.approx(sum(map(abs, diffs)) / n)
    assert stats["mismatch_abs_diff_max"].item() == pytest.approx(max(map(abs, diffs)))
    k3 = [math.exp(d) - 1 - d for d in diffs]  # KL(rollout || trainer), sampled from rollout
    assert stats["mismatch_kl"].item() == pytest.approx(sum(k3) / n, rel=1e-10)
    _, with_weights = rollout_correction(old, rollout, mask, "tis")
    none, only_metrics = rollout_correction(old, rollout, mask, "none")
    assert none is None and set(only_metrics) == set(stats)
    assert set(stats) < set(with_weights)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_weights_scale_the_policy_gradient(seed):
    old, rollout, mask = _inputs(seed)
    w, _ = rollout_correction(old, rollout, mask, "icepop", 0.7, 1.4)
    assert (w[mask] == 0).any() and (w[mask] != 0).any()
    logprobs = old.clone().requires_grad_(True)
    adv = randn(B, T, gen=make_gen(seed + 3))
    loss, _ = policy_loss(logprobs, old, adv, mask, is_weights=w)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv * w / mask.sum())  # ratio 1: no clipping


def test_bad_thresholds_and_modes():
    old, rollout, mask = _inputs(0)
    for low, high in ((1.0, 1.0), (-0.1, 2.0), (2.0, 1.0)):
        with pytest.raises(ValueError):
            rollout_correction(old, rollout, mask, "tis", low, high)
    with pytest.raises(ValueError):
        rollout_correction(old, rollout, mask, "seq-mask", 0.5, 2.0)


def test_binary_kl_and_tv_against_openrlhf_by_hand():
    """OpenRLHF 0.11.2's gating statistics (PolicyLoss): with p = pi_rollout(y), q = pi_old(y),
    binary_kl = p log(p/q) + (1-p) log((1-p)/(1-q)) and tv = |p - q|. By hand:
    p 0.5, q 0.25: 0.5 ln 2 + 0.5 ln(2/3) = 0.5 ln(4/3); tv 0.25.
    p 0.9, q 0.9: 0 and 0. p 0.2, q 0.6: 0.2 ln(1/3) + 0.8 ln 2; tv 0.4."""
    rollout = torch.tensor([[0.5, 0.9, 0.2]], dtype=torch.float64).log()
    old = torch.tensor([[0.25, 0.9, 0.6]], dtype=torch.float64).log()
    kl = [0.5 * math.log(4 / 3), 0.0, 0.2 * math.log(1 / 3) + 0.8 * math.log(2)]
    torch.testing.assert_close(binary_kl(old, rollout), torch.tensor([kl], dtype=torch.float64))
    torch.testing.assert_close(
        total_variation(old, rollout), torch.tensor([[0.25, 0.0, 0.4]], dtype=torch.float64)
    )
    # probabilities are clamped into [1e-6, 1 - 1e-6] first: a certain token stays finite
    certain = torch.zeros(1, 1, dtype=torch.float64)
    assert torch.isfinite(binary_kl(certain, torch.full_like(certain, -30.0))).all()


def test_seq_mask_is_openrlhfs_seq_mask_tis_by_hand():
    """OpenRLHF's seq-mask-tis (0.11.0) = its seq level with mask mode (0.11.2): rows whose
    geometric-mean ratio is outside [low, high] are dropped, kept rows keep the untruncated
    ratio. Row 0: ratios 4, 1, 1, 1 (geometric mean 4^(1/4) = 1.41, kept: weight 4 on the first
    token, where our seq_mask_tis truncates it to 2). Row 1: ratio 3 everywhere, dropped."""
    rollout = torch.zeros(2, 4, dtype=torch.float64)
    old = torch.tensor([[math.log(4.0), 0, 0, 0], [math.log(3.0)] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    w, stats = rollout_correction(old, rollout, mask, "seq_mask", 0.5, 2.0)
    torch.testing.assert_close(w, torch.tensor([[4.0, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float64))
    assert stats["is_seq_masked_frac"].item() == 0.5 and stats["is_clipfrac"].item() == 0.0
    assert stats["is_masked_frac"].item() == pytest.approx(3 / 7)


def test_divergence_gating_against_openrlhf_by_hand():
    """0.11.2's FlashREINFORCE trust region (seq level, mask, binary_kl, one threshold delta)
    and token-level tv gating. By hand, p = rollout, q = trainer probabilities:
    row 0: (p, q) = (0.5, 0.25), (0.9, 0.9): binary KLs 0.1438 and 0, row mean 0.0719;
    row 1: (0.5, 0.5) on both tokens: mean 0. With delta 0.05 row 0 is dropped, row 1 kept
    (weights = the ratio q / p = 1). Survivors keep the ratio: row 0 with delta 0.1 gets
    0.25 / 0.5 = 0.5 and 1."""
    rollout = torch.tensor([[0.5, 0.9], [0.5, 0.5]], dtype=torch.float64).log()
    old = torch.tensor([[0.25, 0.9], [0.5, 0.5]], dtype=torch.float64).log()
    mask = torch.ones(2, 2, dtype=torch.bool)
    w, stats = rollout_correction(old, rollout, mask, "seq_mask", 0.0, 0.05, gating="binary_kl")
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    assert stats["is_seq_masked_frac"].item() == 0.5
    w, _ = rollout_correction(old, rollout, mask, "seq_mask", 0.0, 0.1, gating="binary_kl")
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0], [1.0, 1.0]], dtype=torch.float64))
    stat = gating_statistic(old, rollout, mask, "binary_kl", per_sequence=True)
    torch.testing.assert_close(
        stat, torch.tensor([0.25 * math.log(4 / 3), 0.0], dtype=torch.float64)
    )
    # token level, tv <= 0.2: the (0.5, 0.25) token (tv 0.25) is dropped, the rest keep ratio 1
    w, stats = rollout_correction(old, rollout, mask, "icepop", 0.0, 0.2, gating="tv")
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=torch.float64))
    assert stats["is_masked_frac"].item() == 0.25


def test_gatings_that_openrlhf_refuses_are_refused():
    old, rollout, mask = _inputs(0)
    # a divergence is bounded from above only; clip (tis) clamps the ratio, not a divergence
    with pytest.raises(ValueError, match="from above only"):
        rollout_correction(old, rollout, mask, "seq_mask", 0.5, 5.0, gating="binary_kl")
    for mode in ("tis", "seq_mask_tis"):
        with pytest.raises(ValueError, match="clamps the ratio"):
            rollout_correction(old, rollout, mask, mode, 0.0, 0.01, gating="tv")
    with pytest.raises(ValueError, match="unknown IS gating"):
        rollout_correction(old, rollout, mask, "icepop", 0.0, 0.01, gating="kl")


def test_binary_kl_of_agreeing_policies_is_never_negative_in_float32():
    """Seen in OpenRLHF's FlashREINFORCE script run here: engine and trainer agree to ~1e-3 in
    log-prob at probabilities ~e^-6, the two terms of the binary KL cancel to ~1e-8, and the
    formula in float32 comes out negative for about a third of the tokens: a one-token row
    then fails ``stat >= 0`` and is rejected though the policies agree. Computed in float64
    and clamped, every statistic is >= 0 and every such row is kept."""
    g = torch.Generator().manual_seed(0)
    rollout = -6 - torch.rand(64, 16, generator=g)
    old = rollout + (torch.rand(64, 16, generator=g) - 0.5) * 0.008
    p, q = rollout.exp(), old.exp()  # the formula as written, in float32
    naive = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    assert (naive < 0).float().mean() > 0.2
    stat = binary_kl(old, rollout)
    assert stat.dtype == torch.float32 and (stat >= 0).all()
    torch.testing.assert_close(stat, binary_kl(old.double(), rollout.double()).float())
    one_token = torch.zeros(64, 16, dtype=torch.bool)
    one_token[:, 0] = True
    w, stats = rollout_correction(old, rollout, one_token, "seq_mask", 0.0, 5e-3, "binary_kl")
    assert stats["is_seq_masked_frac"].item() == 0.0 and (w[:, 0] > 0).all()


def test_behaviour_ratio_stats_by_definition():
    """r = exp(logprobs - behaviour) over valid tokens; a clip around the behaviour policy
    silences a token whose ratio left [1 - eps_low, 1 + eps_high] the way its advantage pushes."""
    from fsdp_rlhf.algorithms import behaviour_ratio_stats

    behaviour = torch.zeros(2, 4)
    logprobs = torch.log(torch.tensor([[1.5, 1.1, 0.5, 9.0], [0.7, 1.0, 1.3, 2.0]]))
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float)  # 9.0 is padding
    st = behaviour_ratio_stats(logprobs, behaviour, advantages, mask, 0.2, 0.28)
    valid = [1.5, 1.1, 0.5, 0.7, 1.0, 1.3, 2.0]
    assert st["behaviour_ratio"] == pytest.approx(sum(valid) / len(valid))
    assert st["behaviour_ratio_max"] == pytest.approx(2.0)
    # silenced: 1.5 (A > 0, above 1.28), 0.7 (A < 0, below 0.8), 1.3 (A > 0, above 1.28);
    # not 0.5 (A > 0 pushes it up: the clip lets it), nor 2.0 (A = 0)
    assert st["behaviour_clipfrac"] == pytest.approx(3 / 7)
    # ratio 1 everywhere: nothing silenced
    same = behaviour_ratio_stats(behaviour, behaviour, advantages, mask)
    assert same["behaviour_ratio"] == 1.0 and same["behaviour_clipfrac"] == 0.0


def test_logprob_gap_by_staleness_sums_each_lag_apart():
    from fsdp_rlhf.algorithms import logprob_gap_by_staleness

    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -0.5, 0.0]])
    behaviour = torch.tensor([[-0.1, -1.5, -2.0], [-0.5, -1.5, -7.0]])
    lag = torch.tensor([[0, 1, 1], [1, 1, 2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float)
    gaps = logprob_gap_by_staleness(old, behaviour, lag, mask, max_lag=2)
    assert set(gaps) == {0, 1, 2}
    assert [float(gaps[0][0]), int(gaps[0][1])] == pytest.approx([0.1, 1])
    assert [float(gaps[1][0]), int(gaps[1][1])] == pytest.approx([0.5 + 0.0 + 0.0 + 1.0, 4])
    assert int(gaps[2][1]) == 0  # the lag-2 token is padding


def test_staleness_clip_compounds_one_trust_region_per_version():
    from fsdp_rlhf.algorithms import staleness_clip

    assert staleness_clip(0.2, 0.28, None) == (0.2, 0.28)
    assert staleness_clip(0.2, None, None) == (0.2, 0.2)
    low, high = staleness_clip(0.2, 0.28, torch.tensor([[0, 1, 2]]))
    assert torch.allclose(1 - low, torch.tensor([[0.8, 0.8**2, 0.8**3]]))
    assert torch.allclose(1 + high, torch.tensor([[1.28, 1.28**2, 1.28**3]]))
    # per token in the PPO loss: a token one version stale clips at 1.28^2, not 1.28
    adv = torch.ones(1, 3)
    logprobs = torch.log(torch.tensor([[1.5, 1.5, 1.5]])).requires_grad_(True)
    loss, st = policy_loss(logprobs, torch.zeros(1, 3), adv, torch.ones(1, 3), low, high)
    loss.backward()
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[0, 1] < 0 and logprobs.grad[0, 2] < 0
    assert st["pg_clipfrac"] == pytest.approx(1 / 3)
