"""An MoE actor under FSDP2 on 3 gloo ranks (16 experts do not divide by 3): each rank holds a
slice of every layer's experts, the weight-sync stream carries every expert whole, and a replayed
forward and backward trains the router."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.config import BackendConfig, FSDPConfig
from tests.dist_utils import run_distributed

pytestmark = pytest.mark.models


def _checks(rank: int, world: int, model_path: str) -> dict[str, bool]:
    from torch.distributed.tensor import DTensor, Shard

    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.moe import MoEHooks, expert_parameter_names, routing_scope
    from fsdp_rlhf.rollout.weight_sync import stream_actor_weights
    from tests.dist_utils import current_env

    env = current_env()
    ref = load_causal_lm(model_path, BackendConfig(), env.device)
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    experts = set(expert_parameter_names(model))
    shard_model(model, build_mesh(env.device, world), FSDPConfig(zero_stage=3), bf16=False)
    params = dict(model.named_parameters())
    E = model.config.num_experts
    rows = -(-E // world)
    local = [params[n].to_local().shape[0] for n in sorted(experts)]
    out = {
        "experts sharded on the expert dim": all(
            isinstance(params[n], DTensor) and tuple(params[n].placements) == (Shard(0),)
            for n in experts
        ),
        "each rank a slice of the experts": set(local) == {min(rows, max(0, E - rank * rows))},
    }
    streamed = dict(stream_actor_weights(model, torch.float32))
    expect = dict(ref.named_parameters())
    out["the sync carries every expert whole"] = all(
        streamed[n].shape == expect[n].shape and torch.equal(streamed[n], expect[n].detach())
        for n in experts
    )
    hooks = MoEHooks.attach(model)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(5, 400, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    routing = torch.randint(0, E, (2, 12, hooks.num_layers, 1), generator=g).to(torch.uint8)
    routing = torch.cat([routing, (routing + 1) % E, (routing + 2) % E, (routing + 3) % E], -1)
    inputs = forward_inputs(ids, mask)
    with routing_scope(hooks, routing, inputs):
        lp, _ = response_logprobs(model, inputs, 6)
        (lp.sum() + 0.1 * hooks.aux_loss()).backward()
    gate = params["model.layers.0.mlp.gate.weight"]
    out["the router is trained"] = bool(
        gate.grad is not None and gate.grad.to_local().abs().sum() > 0
    )
    metrics = hooks.pop_metrics()  # collective
    out["metrics over all ranks"] = metrics["moe/router_replay_agreement"] < 0.5
    return out


def test_moe_actor_under_fsdp2(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path, "qwen3_moe"))
    for result in run_distributed(_checks, 3, path):
        assert all(result.values()), result
