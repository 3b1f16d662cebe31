"""Distillation signals and the KD loss (algorithms.distill) against hand computations, direct
full-vocabulary computations and TRL 1.16's DistillationTrainer loss."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_rlhf.algorithms import (
    distill_advantages,
    distill_kl,
    forward_kl_from_logits,
    kd_forward_kl,
    kd_loss,
    picked_logprobs,
    topk_kl,
    topk_logprobs,
    topk_mass,
)
from tests.unit.algorithms.helpers import make_gen, randn


def test_advantage_is_minus_coef_times_the_sampled_token_gap():
    s = torch.tensor([[-1.0, -2.0, -0.25], [-0.5, -4.0, -1.0]])
    t = torch.tensor([[-0.5, -3.0, -9.0], [-0.5, -1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = distill_advantages(s, t, mask, coef=0.5)
    # -0.5 * (s - t): (-1 + 0.5) -> 0.25, (-2 + 3) -> -0.5, masked -> 0; ...
    expected = torch.tensor([[0.25, -0.5, 0.0], [0.0, 1.5, -0.5]])
    assert torch.equal(out, expected)


def test_kl_estimators_by_hand_and_their_gradients():
    s = torch.tensor([-1.0, -2.0], requires_grad=True)
    t = torch.tensor([-1.5, -0.5])
    gap = [0.5, -1.5]  # s - t
    k1 = distill_kl(s, t, "k1")
    k2 = distill_kl(s, t, "k2")
    k3 = distill_kl(s, t, "k3")
    assert k1.tolist() == pytest.approx(gap)
    assert k2.tolist() == pytest.approx([g * g / 2 for g in gap])
    assert k3.tolist() == pytest.approx([math.exp(-g) - 1 + g for g in gap])
    (grad,) = torch.autograd.grad(k3.sum(), s)
    assert grad.tolist() == pytest.approx([1 - math.exp(-g) for g in gap])
    # off-policy: the importance-weighted gradient w * (s - t), w = pi / pi_old (capped at 10)
    old = torch.tensor([-1.0, -2.5])
    (grad,) = torch.autograd.grad(distill_kl(s, t, "k3", old_logprobs=old).sum(), s)
    weights = [1.0, math.exp(0.5)]
    assert grad.tolist() == pytest.approx([w * g for w, g in zip(weights, gap, strict=True)])
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        distill_kl(s, t, "k3+")


def test_topk_kl_by_hand_with_a_tail_bucket():
    # V = 4, teacher top-2 = tokens 0 and 1
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    t_top, s_top = p[:2].log(), q[:2].log()
    p_tail, q_tail = 0.2, 0.5
    forward = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25)
    forward += p_tail * math.log(p_tail / q_tail)
    reverse = 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.3)
    reverse += q_tail * math.log(q_tail / p_tail)
    assert float(topk_kl(s_top, t_top, "forward")) == pytest.approx(forward, rel=1e-6)
    assert float(topk_kl(s_top, t_top, "reverse")) == pytest.approx(reverse, rel=1e-6)
    assert float(topk_mass(t_top)) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="forward or reverse"):
        topk_kl(s_top, t_top, "both")


@pytest.mark.parametrize("seed", range(4))
def test_topk_kl_with_k_equal_to_the_vocabulary_is_the_full_kl(seed):
    gen = make_gen(seed)
    V = 11
    logits = (randn(3, 5, V, gen=gen) * 2).float()
    teacher_logits = (randn(3, 5, V, gen=gen) * 2).float()
    t_lp, ids = topk_logprobs(teacher_logits.reshape(-1, V), None, V)
    s_lp = torch.log_softmax(logits.reshape(-1, V), -1).gather(-1, ids)
    full_forward = forward_kl_from_logits(logits, teacher_logits).reshape(-1)
    full_reverse = forward_kl_from_logits(teacher_logits, logits).reshape(-1)
    torch.testing.assert_close(topk_kl(s_lp, t_lp, "forward"), full_forward, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(topk_kl(s_lp, t_lp, "reverse"), full_reverse, rtol=1e-5, atol=1e-6)
    # fewer tokens: the tail bucket merges outcomes, so the KL can only shrink (data processing)
    t3, ids3 = topk_logprobs(teacher_logits.reshape(-1, V), None, 3)
    s3 = torch.log_softmax(logits.reshape(-1, V), -1).gather(-1, ids3)
    assert bool((topk_kl(s3, t3, "forward") <= full_forward + 1e-6).all())


def test_topk_logprobs_from_hidden_states_in_chunks():
    gen = make_gen(3)
    hidden, weight = randn(7, 6, gen=gen), randn(13, 6, gen=gen)
    values, ids = topk_logprobs(hidden, weight, 4, chunk_size=2)
    direct = torch.log_softmax(hidden @ weight.T, -1).topk(4, -1)
    torch.testing.assert_close(values, direct.values.float())
    assert torch.equal(ids, direct.indices)
    with pytest.raises(ValueError, match="1 <= k <= V"):
        topk_logprobs(hidden, weight, 14)


@pytest.mark.parametrize("weighted", [True, False])
def test_picked_logprobs_and_gradients_match_autograd(weighted):
    gen = make_gen(5)
    n, H, V, k = 9, 5, 17, 3
    hidden = randn(n, H if weighted else V, gen=gen).float().requires_grad_()
    weight = randn(V, H, gen=gen).float().requires_grad_() if weighted else None
    ids = torch.randint(0, V, (n, k), generator=gen)
    upstream = randn(n, k, gen=gen).float()
    out = picked_logprobs(hidden, weight, ids, chunk_size=4)
    logits = hidden @ weight.T if weighted else hidden
    direct = torch.log_softmax(logits, -1).gather(-1, ids)
    torch.testing.assert_close(out, direct)
    inputs = [hidden] + ([weight] if weighted else [])
    got = torch.autograd.grad((out * upstream).sum(), inputs)
    want = torch.autograd.grad((direct * upstream).sum(), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _kd_inputs(seed: int, *, hs: int = 6, ht: int = 10, v: int = 23, n: int = 11):
    gen = make_gen(seed)
    hidden = randn(n, hs, gen=gen).float().requires_grad_()
    weight = randn(v, hs, gen=gen).float().requires_grad_()
    teacher_hidden, teacher_weight = randn(n, ht, gen=gen).float(), randn(v, ht, gen=gen).float()
    labels = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, teacher_hidden, teacher_weight, labels


@pytest.mark.parametrize("seed", range(3))
def test_kd_forward_kl_matches_the_direct_computation_and_its_gradients(seed):
    """Different hidden sizes, chunks smaller than the positions; values and gradients of
    (1 - c) NLL + c KL equal autograd through full (n, V) log-softmaxes."""
    hidden, weight, th, tw, labels = _kd_inputs(seed)
    logp, kl = kd_forward_kl(hidden, weight, th, tw, labels, chunk_size=3)
    ls = torch.log_softmax(hidden @ weight.T, -1)
    lt = torch.log_softmax(th @ tw.T, -1)
    direct_logp = ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    direct_kl = (lt.exp() * (lt - ls)).sum(-1)
    torch.testing.assert_close(logp, direct_logp)
    torch.testing.assert_close(kl, direct_kl)
    c, n_global = 0.4, 20
    loss = kd_loss(logp, kl, c, n_global)
    direct = ((1 - c) * -direct_logp.sum() + c * direct_kl.sum()) / n_global
    torch.testing.assert_close(loss, direct)
    got = torch.autograd.grad(loss, [hidden, weight])
    want = torch.autograd.grad(direct, [hidden, weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_kd_forward_kl_on_logits_and_refusals():
    gen = make_gen(9)
    logits = randn(4, 7, gen=gen).float().requires_grad_()
    teacher = randn(4, 7, gen=gen).float()
    labels = torch.tensor([0, 6, 3, 3])
    logp, kl = kd_forward_kl(logits, None, teacher, None, labels, chunk_size=1)
    torch.testing.assert_close(kl, forward_kl_from_logits(logits, teacher))
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    want = torch.softmax(logits, -1) - torch.softmax(teacher, -1)  # d KL(T || S) / dz_S
    torch.testing.assert_close(grad, want.detach())
    with pytest.raises(ValueError, match="vocabulary"):
        kd_forward_kl(logits, None, teacher[:, :6], None, labels)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_against_trl_distillation_trainer_loss(beta):
    """TRL 1.16's DistillationTrainer loss (``_chunked_divergence_loss``: beta 0 the forward
    KL(teacher || student), 1 the reverse KL, temperature 1, token mean) on the same hidden
    states and heads: beta 0 equals our KD term, beta 1 our reverse top-k KL at k = V."""
    trl = pytest.importorskip("trl")
    if trl.__version__ != "1.16.0":
        pytest.skip(f"compared with TRL 1.16.0, found {trl.__version__}")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    B, K, hs, ht, V = 2, 5, 6, 10, 23
    hidden, weight, th, tw, _ = _kd_inputs(4, hs=hs, ht=ht, v=V, n=B * K)
    mask = torch.ones(B, K)
    mask[1, 3:] = 0
    theirs, _, count = _chunked_divergence_loss(
        hidden.detach().view(B, K, hs), th.view(B, K, ht), weight.detach(), tw, mask, beta=beta
    )
    valid = mask.reshape(-1).bool()
    assert int(count) == int(valid.sum())
    if beta == 0.0:
        labels = torch.zeros(B * K, dtype=torch.long)
        _, kl = kd_forward_kl(hidden, weight, th, tw, labels)
        ours = kl[valid].mean()
    else:
        t_lp, ids = topk_logprobs(th[valid], tw, V)
        s_lp = picked_logprobs(hidden[valid], weight, ids)
        ours = topk_kl(s_lp, t_lp, "reverse").mean()
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)


def test_top_k_and_picked_log_probs_at_repeated_row_indices():
    """``index`` picks (and may repeat) rows of the hidden states, as a head's output rows are
    read for the positions some label needs; gradients land on the picked rows."""
    gen = make_gen(11)
    hidden = randn(5, 4, gen=gen).float().requires_grad_()
    weight = randn(9, 4, gen=gen).float().requires_grad_()
    index = torch.tensor([3, 0, 3, 4])
    values, ids = topk_logprobs(hidden.detach(), weight.detach(), 2, index, chunk_size=3)
    direct = torch.log_softmax(hidden[index] @ weight.T, -1)
    torch.testing.assert_close(values, direct.topk(2, -1).values)
    out = picked_logprobs(hidden, weight, ids, index, chunk_size=3)
    torch.testing.assert_close(out, direct.gather(-1, ids))
    got = torch.autograd.grad(out.sum(), [hidden, weight])
    want = torch.autograd.grad(direct.gather(-1, ids).sum(), [hidden, weight])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert float(got[0][1].abs().sum()) == 0.0  # row 1 is never read
