"""Delta weight sync of an expert-parallel actor (tiny Qwen3-MoE, EP=2 on 2 gloo ranks): the
expert shards live on the 2-D expert mesh and are compared whole, the rest by rows; after every
Adam step the delta-synced tensors equal a full gather bit for bit, and the steps after the
first send deltas, not the whole model. Runs under ``make test-ep``."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.ep]

STEPS = 4


def _delta_under_ep(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    from fsdp_rlhf.config import BackendConfig, FSDPConfig
    from fsdp_rlhf.distributed.delta_sync import DeltaStats, DeltaSync
    from fsdp_rlhf.distributed.expert_parallel import new_expert_parallel_groups
    from fsdp_rlhf.distributed.fsdp import build_mesh, iter_full_params, shard_model
    from fsdp_rlhf.distributed.rank0_load import fill_from_rank0
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.rollout.weight_sync import actor_buckets, hf_param_name

    cpu = torch.device("cpu")
    ep = new_expert_parallel_groups(world, "cpu")
    full = load_causal_lm(path, BackendConfig(), cpu) if dist.get_rank() == 0 else None
    model = load_causal_lm(path, BackendConfig(), cpu, weights=False)
    shard_model(model, build_mesh(cpu, world), FSDPConfig(), bf16=False, ep=ep)
    fill_from_rank0(model, full, cpu)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    delta = DeltaSync(bucket_bytes=64 << 10)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(rank))
    out = {"exact": [], "wire": [], "expert_params": 0}
    out["expert_params"] = sum(
        1 for _, p in model.named_parameters() if getattr(p, "device_mesh", None) is not None
        and p.device_mesh.ndim == 2
    )  # fmt: skip
    for _ in range(STEPS):
        want = {hf_param_name(n): t for n, t in iter_full_params(model, torch.bfloat16)}
        stats = DeltaStats()
        got = {}
        for bucket in actor_buckets(model, torch.bfloat16, delta=delta, stats=stats):
            got.update((n, t.clone()) for n, t in bucket)
        same = got.keys() >= want.keys() and all(
            torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want
        )
        out["exact"].append(same)
        out["wire"].append((stats.gathered_bytes, stats.full_bytes))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out


def test_delta_sync_of_an_expert_parallel_actor_equals_a_full_gather(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path / "m", "qwen3_moe", seed=3))
    for r in run_distributed(_delta_under_ep, 2, path):
        assert r["expert_params"] > 0, r  # the experts really sit on the expert mesh
        assert all(r["exact"]), r
        first, *later = r["wire"]
        assert first[0] >= first[1], r  # the first sync is a full one
        assert all(0 < g < f for g, f in later), r  # then deltas, smaller than the model
