"""DPO, IPO, cDPO and the NLL term against their published closed forms, in float64 on fixed
log-probs (computed here with math, not with the torch ops the implementation uses)."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_rlhf.algorithms import dpo_loss, ipo_loss, nll_loss, preference_logits, preference_loss

# (policy chosen, policy rejected, ref chosen, ref rejected, chosen response tokens)
PAIRS = [
    (-12.5, -15.0, -13.0, -14.0, 5),
    (-30.25, -22.0, -29.0, -25.5, 9),
    (-4.0, -4.0, -4.0, -4.0, 1),
    (-101.0, -140.5, -120.0, -120.0, 40),
    (-0.75, -60.0, -2.0, -3.0, 2),
]
BETAS = [0.05, 0.1, 0.5, 2.0]


def _cols():
    cols = list(zip(*PAIRS, strict=True))
    return [torch.tensor(c, dtype=torch.float64) for c in cols]


def _h(pc, pr, rc, rr):
    return (pc - pr) - (rc - rr)


def _log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


@pytest.mark.parametrize("beta", BETAS)
def test_dpo_matches_rafailov_eq7(beta):
    pc, pr, rc, rr, _ = _cols()
    got = dpo_loss(preference_logits(pc, pr, rc, rr), beta)
    assert got.dtype == torch.float64
    want = [-_log_sigmoid(beta * _h(*p[:4])) for p in PAIRS]
    assert got.tolist() == pytest.approx(want, abs=1e-6, rel=0)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_cdpo_matches_mitchell_eq3(beta, eps):
    pc, pr, rc, rr, _ = _cols()
    got = dpo_loss(preference_logits(pc, pr, rc, rr), beta, label_smoothing=eps)
    want = [
        -(1 - eps) * _log_sigmoid(beta * _h(*p[:4])) - eps * _log_sigmoid(-beta * _h(*p[:4]))
        for p in PAIRS
    ]
    assert got.tolist() == pytest.approx(want, abs=1e-6, rel=0)


@pytest.mark.parametrize("beta", BETAS)
def test_ipo_matches_azar_eq17(beta):
    pc, pr, rc, rr, _ = _cols()
    got = ipo_loss(preference_logits(pc, pr, rc, rr), beta)
    want = [(_h(*p[:4]) - 1 / (2 * beta)) ** 2 for p in PAIRS]
    assert got.tolist() == pytest.approx(want, abs=1e-6, rel=0)


def test_nll_is_mean_token_nll_of_chosen():
    pc, _, _, _, n = _cols()
    got = nll_loss(pc, n)
    assert got.tolist() == pytest.approx([-p[0] / p[4] for p in PAIRS], abs=1e-6, rel=0)


@pytest.mark.parametrize("ipo", [False, True])
def test_preference_loss_combines_terms_and_rewards(ipo):
    pc, pr, rc, rr, n = _cols()
    beta, coef = 0.1, 0.7
    out = preference_loss(pc, pr, rc, rr, n, beta=beta, ipo=ipo, nll_loss_coef=coef)
    for i, (a, b, c, d, k) in enumerate(PAIRS):
        h = _h(a, b, c, d)
        core = (h - 1 / (2 * beta)) ** 2 if ipo else -_log_sigmoid(beta * h)
        assert out.loss[i].item() == pytest.approx(core + coef * (-a / k), abs=1e-6, rel=0)
        assert out.chosen_rewards[i].item() == pytest.approx(beta * (a - c), abs=1e-12)
        assert out.rejected_rewards[i].item() == pytest.approx(beta * (b - d), abs=1e-12)
        assert out.nll[i].item() == pytest.approx(-a / k, abs=1e-12)


def test_identical_policy_and_reference_give_log2():
    # policy == reference: h = 0, the DPO loss is log 2 and both rewards 0 for every beta
    x = torch.tensor([-3.0, -7.5], dtype=torch.float64)
    out = preference_loss(x, x - 1, x, x - 1, torch.tensor([2, 3]), beta=0.3)
    assert out.loss.tolist() == pytest.approx([math.log(2)] * 2, abs=1e-12)
    assert out.chosen_rewards.abs().max().item() == 0.0


def test_gradient_pushes_margin_up():
    pc = torch.tensor([-10.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-10.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-10.0], dtype=torch.float64)
    preference_loss(pc, pr, ref, ref, torch.tensor([4]), beta=0.5).loss.sum().backward()
    # d/dpc -log sigmoid(beta h) at h = 0 is -beta / 2
    assert pc.grad.item() == pytest.approx(-0.25, abs=1e-12)
    assert pr.grad.item() == pytest.approx(0.25, abs=1e-12)
