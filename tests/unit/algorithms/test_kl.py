import math

import pytest
import torch

from fsdp_rlhf.algorithms import AdaptiveKLController, FixedKLController, kl_estimate
from fsdp_rlhf.algorithms.kl import kl_mean_parts
from tests.unit.algorithms.helpers import SEEDS, make_gen, ragged_mask, randn, valid_positions


def _ref_kl(lp: float, ref_lp: float, kind: str) -> float:
    log_ratio = lp - ref_lp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return math.exp(-log_ratio) - 1 + log_ratio


def _logprob_pair(seed: int):
    gen = make_gen(seed)
    logprobs = -randn(4, 9, gen=gen).abs() * 2
    ref_logprobs = -randn(4, 9, gen=gen).abs() * 2
    return logprobs, ref_logprobs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_kl_matches_reference(seed, kind):
    logprobs, ref_logprobs = _logprob_pair(seed)
    out = kl_estimate(logprobs, ref_logprobs, kind, clamp=None)
    ref_kind = "k3" if kind == "k3+" else kind
    for lp, rlp, got in zip(
        logprobs.flatten().tolist(),
        ref_logprobs.flatten().tolist(),
        out.flatten().tolist(),
        strict=True,
    ):
        assert got == pytest.approx(_ref_kl(lp, rlp, ref_kind), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_k3_nonnegative_and_k1_can_be_negative(seed):
    logprobs, ref_logprobs = _logprob_pair(seed)
    logprobs = logprobs * 5  # wide ratios in both directions
    assert (kl_estimate(logprobs, ref_logprobs, "k3") >= 0).all()
    assert (kl_estimate(logprobs, ref_logprobs, "k2") >= 0).all()
    assert (kl_estimate(logprobs, ref_logprobs, "k1") < 0).any()


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_k3_plus_has_k3_value_and_k2_gradient(seed):
    logprobs, ref_logprobs = _logprob_pair(seed)
    weights = randn(4, 9, gen=make_gen(seed + 50))
    grads = {}
    values = {}
    for kind in ("k2", "k3", "k3+"):
        lp = logprobs.clone().requires_grad_(True)
        values[kind] = kl_estimate(lp, ref_logprobs, kind, clamp=None)
        (values[kind] * weights).sum().backward()
        grads[kind] = lp.grad
    torch.testing.assert_close(values["k3+"], values["k3"])
    torch.testing.assert_close(grads["k3+"], grads["k2"])
    torch.testing.assert_close(grads["k2"], (logprobs - ref_logprobs) * weights)
    assert not torch.allclose(grads["k3"], grads["k2"])


def test_clamps_keep_extreme_ratios_finite():
    logprobs = torch.tensor([[0.0, -200.0, 0.0]], dtype=torch.float64)
    ref_logprobs = torch.tensor([[-200.0, 0.0, 0.0]], dtype=torch.float64)
    for kind in ("k1", "k2", "k3", "k3+"):
        out = kl_estimate(logprobs, ref_logprobs, kind, clamp=10.0)
        assert torch.isfinite(out).all()
        assert out.abs().max().item() == pytest.approx(10.0)
    unclamped = kl_estimate(logprobs, ref_logprobs, "k3", clamp=None)
    assert unclamped[0, 1].item() == pytest.approx(math.exp(20.0) - 21.0)
    with pytest.raises(ValueError):
        kl_estimate(logprobs, ref_logprobs, "k4")


def test_adaptive_controller_moves_toward_target():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=256)  # too much KL: penalty grows, capped at +20%
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    high = ctl.value
    ctl.update(current_kl=3.0, n_steps=256)  # too little KL: error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(high * (1 - 0.2 * 256 / 10000))
    before = ctl.value
    ctl.update(current_kl=6.3, n_steps=256)  # within the clip: proportional
    assert ctl.value == pytest.approx(before * (1 + 0.05 * 256 / 10000))


def test_controller_state_dicts_round_trip():
    ctl = AdaptiveKLController(0.05, target=1.0, horizon=100)
    for _ in range(5):
        ctl.update(3.0, 10)
    state = ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    restored = AdaptiveKLController(0.05, target=1.0, horizon=100)
    restored.load_state_dict(state)
    assert restored.value == ctl.value != 0.05
    fixed = FixedKLController(0.02)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.02
    other = FixedKLController(0.5)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.02


@pytest.mark.parametrize("log_ratio", [6.0, 12.0, -6.0, -12.0])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_clamp_bounds_the_value_but_keeps_the_gradient(kind, log_ratio):
    # Past |log_ratio| ~ 4.47 (k2) or 10 (k1) a plain clamp would zero the gradient.
    lp = torch.tensor([[log_ratio - 1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0]], dtype=torch.float64)
    out = kl_estimate(lp, ref, kind, clamp=10.0)
    out.sum().backward()
    raw = _ref_kl(log_ratio - 1.0, -1.0, "k3" if kind == "k3+" else kind)
    assert out.item() == pytest.approx(max(min(raw, 10.0), -10.0), rel=1e-12)
    expected_grad = {
        "k1": 1.0,
        "k2": log_ratio,
        "k3": 1.0 - math.exp(-log_ratio),
        "k3+": log_ratio,  # the k2 gradient, consistent with k2
    }[kind]
    assert lp.grad.item() == pytest.approx(expected_grad, rel=1e-12)
    assert lp.grad.item() != 0


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_clamped_and_unclamped_gradients_agree(seed):
    logprobs, ref_logprobs = _logprob_pair(seed)
    logprobs = logprobs * 8  # many log-ratios beyond the clamp
    for kind in ("k1", "k2", "k3+"):
        grads = []
        for clamp in (10.0, None):
            lp = logprobs.clone().requires_grad_(True)
            kl_estimate(lp, ref_logprobs, kind, clamp=clamp).sum().backward()
            grads.append(lp.grad)
        torch.testing.assert_close(grads[0], grads[1])


def test_log_ratio_guard_is_the_only_hard_clamp():
    lp = torch.tensor([[30.0]], dtype=torch.float64, requires_grad=True)
    kl_estimate(lp, torch.zeros(1, 1, dtype=torch.float64), "k2").sum().backward()
    assert lp.grad.item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_means_match_reference(seed):
    gen = make_gen(seed)
    mask = ragged_mask(6, 9, gen)
    kl = randn(6, 9, gen=gen)
    rows = [[kl[b, t].item() for t in valid_positions(mask, b)] for b in range(6)]
    flat = [x for r in rows for x in r]
    seq_means = [sum(r) / len(r) for r in rows if r]
    num, den = kl_mean_parts(kl, mask, "seq-mean-token-mean")
    assert den.item() == len(seq_means)  # the empty row does not count
    assert (num / den).item() == pytest.approx(sum(seq_means) / len(seq_means), rel=1e-12)
    num, den = kl_mean_parts(kl, mask, "token-mean")
    assert (num.item(), den.item()) == (pytest.approx(sum(flat), rel=1e-12), len(flat))
    # Summing the parts of shards (what an all-reduce does) gives the global mean exactly.
    parts = [kl_mean_parts(kl[i : i + 2], mask[i : i + 2]) for i in (0, 2, 4)]
    total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert total.item() == pytest.approx(sum(seq_means) / len(seq_means), rel=1e-12)
    with pytest.raises(ValueError):
        kl_mean_parts(kl, mask, "sum")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_unbiased_gradient_against_openrlhf_by_hand(kind):
    """OpenRLHF 0.11.1's compute_approx_kl(unbiased_gradient=True): the estimator's value, the
    gradient w * log_ratio with w = min(pi / pi_old, 10) detached. Worked by hand:
    log_ratio 0.2 (w = e^0.1), -0.5 (w = e^-0.3), 1.0 (pi / pi_old = e^3 = 20.1, capped at 10)."""
    logprobs = torch.tensor([[0.3, -1.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[0.1, -0.5, -1.5]], dtype=torch.float64)
    old = torch.tensor([[0.2, -0.7, -3.5]], dtype=torch.float64)
    kl = kl_estimate(logprobs, ref, kind, unbiased_gradient=True, old_logprobs=old)
    values = {
        "k1": [0.2, -0.5, 1.0],
        "k2": [0.02, 0.125, 0.5],
        "k3": [math.exp(-0.2) - 0.8, math.exp(0.5) - 1.5, math.exp(-1.0)],
        "k3+": [math.exp(-0.2) - 0.8, math.exp(0.5) - 1.5, math.exp(-1.0)],
    }[kind]
    torch.testing.assert_close(kl.detach(), torch.tensor([values], dtype=torch.float64))
    kl.sum().backward()
    grad = [math.exp(0.1) * 0.2, math.exp(-0.3) * -0.5, 10.0 * 1.0]
    torch.testing.assert_close(logprobs.grad, torch.tensor([grad], dtype=torch.float64))
    # no old log-probs: weight 1, the gradient of k2 (on-policy)
    lp = logprobs.detach().clone().requires_grad_(True)
    kl_estimate(lp, ref, kind, unbiased_gradient=True).sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.2, -0.5, 1.0]], dtype=torch.float64))
