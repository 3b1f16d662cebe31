"""--accumulate_gathered on 2 gloo ranks (issue #58): at ZeRO-3 the collectives per optimizer
step are what the setting says (each FSDP2 unit gathered twice and reduced at every
micro-batch, or gathered once and reduced once per step), and both give the same training."""

from __future__ import annotations

import torch

from tests.dist_utils import run_distributed

MICRO, STEPS = 3, 2


def _both(rank: int, world: int) -> dict:
    return {gathered: _train(rank, world, gathered) for gathered in (False, True)}


def _train(rank: int, world: int, gathered: bool) -> dict:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    counts = {"all_gather": 0, "reduce_scatter": 0}
    real_ag, real_rs = group_mod.foreach_all_gather, group_mod.foreach_reduce

    def all_gather(*args, **kwargs):
        counts["all_gather"] += 1
        return real_ag(*args, **kwargs)

    def reduce_scatter(*args, **kwargs):
        counts["reduce_scatter"] += 1
        return real_rs(*args, **kwargs)

    group_mod.foreach_all_gather, group_mod.foreach_reduce = all_gather, reduce_scatter
    try:
        return _steps(rank, world, gathered, counts)
    finally:
        group_mod.foreach_all_gather, group_mod.foreach_reduce = real_ag, real_rs


def _steps(rank: int, world: int, gathered: bool, counts: dict) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import accumulate, build_mesh, clip_grad_norm_, shard_model
    from fsdp_rlhf.models.attention import PADDED_ATTENTION, register_attention
    from tests.dist_utils import current_env

    env = current_env()
    register_attention()
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=PADDED_ATTENTION)
    shard_model(model, build_mesh(env.device, world), FSDPConfig(zero_stage=3), bf16=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    per_step, norms = [], []
    for _ in range(STEPS):
        before = dict(counts)
        for i in range(MICRO):
            accumulate(model, i == MICRO - 1, 3, gathered)
            ids = torch.randint(0, 96, (2, 10), generator=g)
            logits = model(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
            )
            (loss / MICRO).backward()
        norms.append(clip_grad_norm_(list(model.parameters()), 1.0))
        optim.step()
        optim.zero_grad(set_to_none=True)
        per_step.append({k: counts[k] - before[k] for k in counts})
    full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"per_step": per_step, "norms": norms, "params": full}


def test_collectives_per_step_follow_the_setting():
    units = 3  # 2 decoder layers and the root (embeddings, final norm, head)
    runs = run_distributed(_both, 2)
    resharding, gathered = ([r[setting] for r in runs] for setting in (False, True))
    for rank in range(2):
        for step in resharding[rank]["per_step"]:
            # every micro-batch: each unit gathered in forward, the layers again in backward
            # (the root keeps its params from forward to backward), each unit reduced
            assert step == {"all_gather": MICRO * (units + 2), "reduce_scatter": MICRO * units}
        for step in gathered[rank]["per_step"]:
            assert step == {"all_gather": units, "reduce_scatter": units}
        assert gathered[rank]["norms"] == resharding[rank]["norms"] or all(
            abs(a - b) <= 1e-5 * max(1.0, abs(b))
            for a, b in zip(gathered[rank]["norms"], resharding[rank]["norms"], strict=True)
        )
        for name, p in resharding[rank]["params"].items():
            # the same sums in another order (accumulated before or after the reduction),
            # through two Adam steps
            torch.testing.assert_close(gathered[rank]["params"][name], p, rtol=1e-4, atol=1e-5)
