import math

import pytest
import torch

from fsdp_rlhf.algorithms import AdaptiveKLController, FixedKLController, kl_estimate
from tests.unit.algorithms.helpers import SEEDS, make_gen, randn


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
