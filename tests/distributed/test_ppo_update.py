"""The actor update on 2 gloo ranks: taking ``old_logprobs`` from the update's own forward
(``reuse_update_logprobs``), packing the micro-batches, running each shared prompt once
(``--share_prompt_prefix``) and token-budget micro-batches (``--use_dynamic_batch``, with a
different number of micro-batches on each rank) all give the same step as the plain path. The
update runs on its explicit arguments: no trainer is built."""

from __future__ import annotations

import torch

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.models.load import load_causal_lm
from tests.dist_utils import run_distributed
from tests.ppo_batches import ppo_layout_batch

ARGV = (
    "--advantage_estimator grpo --use_kl_loss --init_kl_coef 0.05 --kl_estimator k3 "
    "--rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 8 "
    "--micro_train_batch_size 2 --micro_rollout_batch_size 2 "
    "--pretrain unused"
)


# rank 1's responses are shorter: under a token budget it needs fewer micro-batches
RESPONSE_LENGTHS = {0: [5, 1, 3, 4], 1: [2, 1, 1, 2]}
# --use_dynamic_batch budgets: a few rows per micro-batch at these lengths
DYNAMIC = ["--use_dynamic_batch", "--train_max_tokens_per_gpu", "20"]
DYNAMIC += ["--rollout_max_tokens_per_gpu", "24"]


def _experience(vocab: int, rank: int, P: int = 6, T: int = 5):
    """4 sequences per rank in the PPO layout (left-padded prompt, right-padded response):
    2 prompts with 2 samples each, as ``--n_samples_per_prompt 2`` rolls them out."""
    from fsdp_rlhf.trainers.experience import Experience

    g = torch.Generator().manual_seed(100 + rank)
    responses = RESPONSE_LENGTHS[rank]
    ids, mask, rmask = ppo_layout_batch(g, vocab, [6, 6, 3, 3], responses, P, T)
    ids[1, :P], ids[3, :P] = ids[0, :P], ids[2, :P]
    return Experience(
        input_ids=ids,
        attention_mask=mask,
        response_mask=rmask,
        engine_logprobs=-torch.rand(4, T, generator=g) * rmask,
        ref_logprobs=-torch.rand(4, T, generator=g) * rmask - 2.0 * rmask,
        advantages=torch.randn(4, T, generator=g) * rmask,
    )


def _one_update(
    rank: int,
    world: int,
    model_path: str,
    reuse: bool,
    packed: bool,
    shared: bool,
    dynamic: bool = False,
):
    from fsdp_rlhf.config import PPOConfig, plan_ppo_batches
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.inputs import InputSpec, row_layout
    from fsdp_rlhf.trainers.experience import batched_logprobs
    from fsdp_rlhf.trainers.guards import BadStepGuard
    from fsdp_rlhf.trainers.ppo.setup import prompt_group_size
    from fsdp_rlhf.trainers.ppo.update import (
        TrainedModel,
        UpdatePlan,
        reuse_update_logprobs,
        update_actor,
        update_generator,
    )
    from tests.dist_utils import current_env

    argv = ARGV.split() + (["--packing_samples"] if packed else []) + (DYNAMIC if dynamic else [])
    cfg, _ = build_config(PPOConfig, argv)
    plan = plan_ppo_batches(cfg, world)
    env = current_env()
    actor = load_causal_lm(model_path, cfg.backend, env.device)
    if packed:
        use_varlen_attention(actor)
    group = prompt_group_size(cfg, plan, actor) if shared else 1
    assert group == (2 if shared else 1)
    shard_model(actor, build_mesh(env.device, world), cfg.fsdp, bf16=False, grad_reduce="sum")
    actor.train()
    # SGD, not the configured AdamW: Adam's first step is about lr * sign(grad), which turns
    # rounding-level gradient differences into lr-sized ones; SGD keeps them proportional.
    opt = torch.optim.SGD(actor.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    exp = _experience(actor.config.vocab_size, rank)
    assert reuse_update_logprobs(cfg.algo, plan.optimizer_steps_per_epoch, actor_updates=True)
    update_plan = UpdatePlan.from_config(cfg, plan, group)
    spec = InputSpec(row_layout(packed, group), group)
    assert (update_plan.max_tokens is not None) == dynamic
    if not reuse:
        micro = update_plan.batching if dynamic else 2
        exp.old_logprobs = batched_logprobs(actor, exp, micro, 1.0, spec)
    metrics, reused = update_actor(
        TrainedModel(actor, opt, sched, cfg.actor_optim.max_norm, BadStepGuard(0, "actor"), 1),
        exp,
        cfg.algo,
        update_plan,
        update_generator(cfg.seed, 1, env.rank),
        spec=spec,
        kl_coef=cfg.algo.init_kl_coef,
        temperature=1.0,
        reuse_logprobs=reuse,
    )
    assert (reused is not None) == reuse
    params = {n: p.detach().full_tensor().clone() for n, p in actor.named_parameters()}
    return reused if reuse else exp.old_logprobs, metrics, params


def _all_updates(rank: int, world: int, model_path: str, variants: list[tuple]) -> dict:
    """Every variant in one pair of processes (one process group): a fresh model each."""
    return {key: _one_update(rank, world, model_path, *key) for key in variants}


def test_reused_packed_and_shared_prompt_updates_match_the_plain_update(tiny_qwen2):
    variants = [(False, False, False), (True, False, False), (True, True, False)]
    variants += [(False, False, True), (True, False, True)]
    # token budgets: padded, packed, shared prompts (whole groups per micro-batch), reused
    variants += [(False, False, False, True), (False, True, False, True)]
    variants += [(False, False, True, True), (True, False, True, True)]
    per_rank = run_distributed(_all_updates, 2, tiny_qwen2, variants)
    runs = {key: [per_rank[rank][key] for rank in range(2)] for key in variants}
    plain = runs[variants[0]]
    for key in variants[1:]:
        for rank in range(2):
            old, metrics, params = runs[key][rank]
            ref_old, ref_metrics, ref_params = plain[rank]
            assert (ref_old != 0).any()
            torch.testing.assert_close(old, ref_old, rtol=1e-5, atol=1e-5)
            for name in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "grad_norm"):
                assert metrics["actor/grad_norm"] == metrics["grad_norm"]
                assert abs(metrics[name] - ref_metrics[name]) < 1e-4, (key, name)
            for name, p in params.items():
                torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
    # the step really moved the weights: equal results are not "nothing happened"
    initial = load_causal_lm(tiny_qwen2, BackendConfig(), torch.device("cpu")).state_dict()
    delta = max((p - initial[n]).abs().max().item() for n, p in plain[0][2].items())
    assert delta > 1e-4


def test_the_dynamic_budget_gives_the_ranks_different_micro_batch_counts():
    """The equality above covers the padding micro-batches: at the test's budget, rank 0 needs
    more micro-batches per step than rank 1 (4 rows per rank in one minibatch)."""
    from fsdp_rlhf.trainers.micro_batches import token_bins

    budget = int(DYNAMIC[2])
    counts = []
    for rank in (0, 1):
        lengths = [p + r for p, r in zip([6, 6, 3, 3], RESPONSE_LENGTHS[rank], strict=True)]
        counts.append(len(token_bins(lengths, budget, packed=False)))
    assert counts[0] > counts[1] > 1, counts
