"""Token-budget micro-batches (``--use_dynamic_batch``, issue #28): the bin packing, the cut to
each micro-batch's own longest row, and the no-grad forwards and the critic update giving the
same results as fixed-size micro-batches (one process; the 2-rank actor update with padding
micro-batches is in tests/distributed/test_ppo_update.py). Also, on the same one-process
update: --kl_unbiased_gradient reaching the actor's KL loss."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.config import BackendConfig, PPOConfig
from fsdp_rlhf.config_base import ConfigError, build_config
from fsdp_rlhf.trainers.experience import (
    Experience,
    batched_logprobs,
    batched_scores,
    batched_values,
    micro_batches,
)
from fsdp_rlhf.trainers.micro_batches import MicroBatching, padded_tokens, token_bins
from tests.ppo_batches import ppo_layout_batch

PROMPTS, RESPONSES = [7, 3, 5, 1, 2, 6], [6, 2, 4, 1, 5, 1]


def _experience(vocab: int = 500) -> Experience:
    g = torch.Generator().manual_seed(5)
    ids, mask, rmask = ppo_layout_batch(g, vocab, PROMPTS, RESPONSES, 8, 7)
    return Experience(
        input_ids=ids,
        attention_mask=mask,
        response_mask=rmask,
        engine_logprobs=-torch.rand(6, 7, generator=g) * rmask,
        values=torch.randn(6, 7, generator=g) * rmask,
        returns=torch.randn(6, 7, generator=g) * rmask,
        advantages=torch.randn(6, 7, generator=g) * rmask,
    )


def test_bins_fit_the_budget_and_cover_every_row_once():
    lengths = [13, 5, 9, 2, 7, 7, 30, 1]
    for packed in (False, True):
        bins = token_bins(lengths, 20, packed)
        assert sorted(r for b in bins for r in b) == list(range(8))
        for b in bins:
            cost = sum(lengths[r] for r in b) if packed else len(b) * max(lengths[r] for r in b)
            assert cost <= 20 or len(b) == 1, (packed, b)  # 30 tokens: a micro-batch alone
    assert token_bins([3, 3, 9, 1], 12, False, group=2) == [[2, 3], [0, 1]]  # longest first
    with pytest.raises(ValueError, match="groups of 2"):
        token_bins([1, 2, 3], 10, False, group=2)


def test_fixed_split_is_the_old_chunks_and_dynamic_sorts_by_length():
    lengths = torch.tensor([4, 9, 2, 8, 3])
    assert [t.tolist() for t in MicroBatching(2).split(lengths)] == [[0, 1], [2, 3], [4]]
    dynamic = MicroBatching(2, max_tokens=18).split(lengths)
    assert [t.tolist() for t in dynamic] == [[1, 3], [0, 2, 4]]
    assert padded_tokens(lengths, dynamic, None) == 2 * 9 + 3 * 4
    assert padded_tokens(lengths, MicroBatching(2).split(lengths), 9) == 5 * 9


def test_trimmed_keeps_every_attended_token_and_drops_common_padding():
    exp = _experience()
    sub = exp.rows(torch.tensor([1, 3]))  # prompts 3 and 1, responses 2 and 1
    cut = sub.trimmed()
    assert cut.input_ids.shape == (2, 3 + 2) and cut.response_mask.shape == (2, 2)
    assert cut.attention_mask.sum() == sub.attention_mask.sum()
    assert torch.equal(
        cut.input_ids[cut.attention_mask.bool()], sub.input_ids[sub.attention_mask.bool()]
    )
    assert cut.values.shape == (2, 2) and torch.equal(cut.values, sub.values[:, :2])


@pytest.mark.parametrize("packed", [False, True])
def test_no_grad_forwards_equal_fixed_micro_batches(tiny_qwen2, packed):
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model

    exp = _experience()
    actor = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    critic = load_scalar_model(tiny_qwen2, BackendConfig(), "cpu", value_head_prefix="score")
    critic.config.pad_token_id = 0
    if packed:
        use_varlen_attention(actor)
        use_varlen_attention(critic)
    from fsdp_rlhf.models.inputs import InputSpec, row_layout

    spec = InputSpec(row_layout(packed))
    dynamic = MicroBatching(2, max_tokens=24)
    assert len(dynamic.split(exp.lengths)) > 1  # really several micro-batches
    fixed_lp = batched_logprobs(actor, exp, 2, 0.7, spec)
    dyn_lp = batched_logprobs(actor, exp, dynamic, 0.7, spec)
    torch.testing.assert_close(dyn_lp, fixed_lp, rtol=1e-5, atol=1e-5)
    assert (fixed_lp[exp.response_mask.bool()] < 0).all()
    torch.testing.assert_close(
        batched_values(critic, exp, dynamic, spec),
        batched_values(critic, exp, 2, spec),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        batched_scores(critic, exp, dynamic, spec),
        batched_scores(critic, exp, 2, spec),
        rtol=1e-5,
        atol=1e-5,
    )


def test_critic_update_equals_fixed_micro_batches(tiny_qwen2, monkeypatch):
    """One process: the value loss over token-budget micro-batches, with the same gradient (an
    unsharded model: FSDP's gradient-sync switch is not the subject here)."""
    import copy

    monkeypatch.setattr("fsdp_rlhf.trainers.ppo.update.accumulate", lambda *a: None)

    from fsdp_rlhf.config import PPOAlgoConfig
    from fsdp_rlhf.models.inputs import InputSpec
    from fsdp_rlhf.models.load import load_scalar_model
    from fsdp_rlhf.trainers.guards import BadStepGuard
    from fsdp_rlhf.trainers.ppo.update import TrainedModel, UpdatePlan, update_critic

    exp = _experience()
    results = []
    base = load_scalar_model(tiny_qwen2, BackendConfig(), "cpu", value_head_prefix="score")
    base.config.pad_token_id = 0
    for max_tokens in (None, 24):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        plan = UpdatePlan(1, 6, 6, 2, 1, 2, False, 7, max_tokens=max_tokens)
        metrics = update_critic(
            TrainedModel(model, opt, sched, 1e9, BadStepGuard(0, "critic"), 1),
            exp,
            PPOAlgoConfig(),
            plan,
            torch.Generator().manual_seed(0),
            InputSpec(),
        )
        results.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (fixed, fixed_params), (dyn, dyn_params) = results
    assert abs(fixed["critic/vf_loss"] - dyn["critic/vf_loss"]) < 1e-6
    assert abs(fixed["critic/grad_norm"] - dyn["critic/grad_norm"]) < 1e-5
    for name, p in dyn_params.items():
        torch.testing.assert_close(p, fixed_params[name], rtol=1e-5, atol=1e-6, msg=name)


def test_flags_and_defaults():
    cfg = build_config(PPOConfig, ["--pretrain", "x"])[0]
    assert not cfg.batch.use_dynamic_batch and cfg.batch.scoring_max_tokens is None
    argv = ["--pretrain", "x", "--use_dynamic_batch", "--train_max_tokens_per_gpu", "4096"]
    cfg = build_config(PPOConfig, argv)[0]
    assert cfg.batch.train_max_tokens_per_gpu == 4096 and cfg.batch.scoring_max_tokens == 4096
    cfg = build_config(PPOConfig, [*argv, "--rollout_max_tokens_per_gpu", "8192"])[0]
    assert cfg.batch.scoring_max_tokens == 8192
    assert build_config(PPOConfig, ["--pretrain", "x"])[0].batch.train_max_tokens_per_gpu == 16192
    with pytest.raises(ConfigError, match="train_max_tokens_per_gpu"):
        build_config(PPOConfig, ["--pretrain", "x", "--train_max_tokens_per_gpu", "0"])


def test_a_padding_micro_batch_is_one_row_or_one_group():
    exp = _experience()
    batching = MicroBatching(2, max_tokens=1000, group=2)
    pairs = list(micro_batches(exp, batching))
    assert len(pairs) == 1 and pairs[0][0].tolist() == list(range(6))


def test_unbiased_kl_gradient_reaches_the_actor_update(tiny_qwen2, monkeypatch):
    """--kl_unbiased_gradient in the actor update (one process, SGD, advantages 0 so only the
    KL loss moves the weights): with the update's own log-probs as the old ones the weight
    pi / pi_old is 1, so k1 with the unbiased gradient steps exactly as k2 (gradient
    log_ratio), and unlike plain k1 (gradient 1 per token)."""
    import copy

    monkeypatch.setattr("fsdp_rlhf.trainers.ppo.update.accumulate", lambda *a: None)

    from fsdp_rlhf.config import PPOAlgoConfig
    from fsdp_rlhf.models.inputs import InputSpec
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.trainers.guards import BadStepGuard
    from fsdp_rlhf.trainers.ppo.update import TrainedModel, UpdatePlan, update_actor

    exp = _experience()
    exp.advantages = torch.zeros_like(exp.advantages)
    exp.ref_logprobs = -3.0 - torch.rand(6, 7, generator=torch.Generator().manual_seed(1))
    base = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    params = {}
    for name, kind, unbiased in (("k1", "k1", False), ("k2", "k2", False), ("k1u", "k1", True)):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        algo = PPOAlgoConfig(use_kl_loss=True, kl_estimator=kind, kl_unbiased_gradient=unbiased)
        update_actor(
            TrainedModel(model, opt, sched, 1e9, BadStepGuard(0, "actor"), 1),
            exp,
            algo,
            UpdatePlan(1, 6, 6, 3, 1, 2, False, 7),
            torch.Generator().manual_seed(0),
            spec=InputSpec(),
            kl_coef=0.5,
            temperature=1.0,
            reuse_logprobs=True,
        )
        params[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    before = torch.cat([p.detach().flatten() for p in base.parameters()])
    torch.testing.assert_close(params["k1u"], params["k2"], rtol=1e-5, atol=1e-7)
    assert (params["k1u"] - before).abs().max() > 1e-4
    assert (params["k1u"] - params["k1"]).abs().max() > 1e-4
