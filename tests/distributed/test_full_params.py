"""Bucketed full-parameter gathers (the weight-sync path) on 3 gloo ranks: exact values,
uneven and empty shards, every bucket size, dtype casting, and the tied-head alias."""

from __future__ import annotations

import torch

from fsdp_rlhf.config import BackendConfig, FSDPConfig
from tests.dist_utils import run_distributed


def _gather_checks(rank: int, world: int, model_path: str) -> dict[str, bool]:
    from fsdp_rlhf.distributed.fsdp import build_mesh, iter_full_params, shard_model
    from fsdp_rlhf.models.load import load_causal_lm
    from tests.dist_utils import current_env

    env = current_env()
    ref = load_causal_lm(model_path, BackendConfig(), env.device)
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    # an odd row count: 3 ranks get 3, 3, 1 rows; and a 1-row parameter leaves ranks empty
    model.register_parameter("odd", torch.nn.Parameter(torch.arange(14.0).reshape(7, 2)))
    model.register_parameter("one", torch.nn.Parameter(torch.ones(1, 5)))
    shard_model(model, build_mesh(env.device, world), FSDPConfig(), bf16=False)
    expect = {n: p.detach() for n, p in ref.named_parameters()}
    expect["odd"], expect["one"] = torch.arange(14.0).reshape(7, 2), torch.ones(1, 5)
    out = {}
    for bucket_bytes in (1, 4096, 1 << 30):  # one tensor per gather .. everything in one
        got = dict(iter_full_params(model, bucket_bytes=bucket_bytes))
        out[f"fp32 {bucket_bytes}"] = got.keys() == expect.keys() and all(
            torch.equal(got[n], expect[n]) for n in expect
        )
    got = dict(iter_full_params(model, torch.bfloat16))
    out["bf16"] = all(
        got[n].dtype == torch.bfloat16 and torch.equal(got[n], expect[n].to(torch.bfloat16))
        for n in expect
    )
    return out


def test_bucketed_gather_is_exact(tiny_qwen2):
    for result in run_distributed(_gather_checks, 3, tiny_qwen2):
        assert all(result.values()), result


def _tied_checks(rank: int, world: int, model_path: str) -> bool:
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.rollout.weight_sync import stream_actor_weights
    from tests.dist_utils import current_env

    env = current_env()
    ref = load_causal_lm(model_path, BackendConfig(), env.device)
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    shard_model(model, build_mesh(env.device, world), FSDPConfig(), bf16=False)
    got = dict(stream_actor_weights(model, torch.float32))
    embed = ref.get_input_embeddings().weight
    return torch.equal(got["lm_head.weight"], embed) and torch.equal(
        got["model.embed_tokens.weight"], embed
    )


def test_tied_head_alias_after_bucketed_gather(tiny_qwen2_tied):
    assert all(run_distributed(_tied_checks, 2, tiny_qwen2_tied))
