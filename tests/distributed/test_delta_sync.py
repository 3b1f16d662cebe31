"""Delta weight sync on 2 gloo ranks (uneven and empty shards, a tied head): over 20 Adam
steps at an RL learning rate, the delta-synced full tensors equal a full gather bit for bit
after every step, colocated (every rank mirrors; bf16 every step, fp32 the first 4) and as the
asynchronous sender (rank 0's payloads feed a mirror), with and without the gathers running
ahead in a thread."""

from __future__ import annotations

import torch

from fsdp_rlhf.config import BackendConfig, FSDPConfig
from tests.dist_utils import run_distributed

STEPS = 20
FP32_STEPS = 4


def _delta_checks(rank: int, world: int, model_path: str) -> dict:
    from fsdp_rlhf.distributed.delta_sync import DeltaSender, DeltaStats, DeltaSync, Mirror
    from fsdp_rlhf.distributed.fsdp import build_mesh, iter_full_params, shard_model
    from fsdp_rlhf.distributed.prefetch import StageTimes, staged
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.rollout.weight_sync import actor_buckets, hf_param_name
    from tests.dist_utils import current_env

    env = current_env()
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    # 7 rows on 2 ranks (4, 3); 1 row (rank 1 holds nothing)
    model.register_parameter("odd", torch.nn.Parameter(torch.randn(7, 3)))
    model.register_parameter("one", torch.nn.Parameter(torch.randn(1, 5)))
    shard_model(model, build_mesh(env.device, world), FSDPConfig(), bf16=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    colocated = {dtype: DeltaSync(full_every=3, bucket_bytes=64 << 10) for dtype in ("bf16",)}
    colocated["fp32"] = DeltaSync(bucket_bytes=64 << 10)
    sender, mirror = DeltaSender(bucket_bytes=64 << 10), Mirror()
    out = {"exact": [], "async_exact": [], "encodings": [], "changed": [], "wire": []}
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(rank))
    for step in range(STEPS):
        fulls = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            if name == "fp32" and step >= FP32_STEPS:
                continue
            full = dict(iter_full_params(model, dtype))
            full = fulls[name] = {hf_param_name(n): t for n, t in full.items()}
            stats = DeltaStats()
            buckets = actor_buckets(model, dtype, delta=colocated[name], stats=stats)
            got = {}
            for bucket in staged(buckets, StageTimes(), overlap=step % 2 == 1):
                got.update((n, t.clone()) for n, t in bucket)
            same = got.keys() >= full.keys() and all(
                torch.equal(got[n].view(torch.uint8), full[n].view(torch.uint8)) for n in full
            )
            out["exact"].append((step, name, same))
            out["encodings"].append((step, name, dict(stats.encodings)))
            out["changed"].append((step, name, stats.changed_frac if stats.elements else None))
            out["wire"].append((step, name, stats.gathered_bytes, stats.full_bytes))
        # the asynchronous path: every rank encodes, rank 0's payloads feed a mirror
        got = {}
        for i, layout, delta in sender.deltas(model, torch.bfloat16, rename=hf_param_name):
            got.update((n, t.clone()) for n, t in mirror.apply(i, layout, delta))
        full = fulls["bf16"]
        out["async_exact"].append(
            got.keys() == full.keys()
            and all(torch.equal(got[n].view(torch.uint8), full[n].view(torch.uint8)) for n in full)
        )
        extra = (model.odd.full_tensor() ** 2).sum() + (model.one.full_tensor() ** 2).sum()
        loss = model(input_ids=ids).logits.float().pow(2).mean() + extra
        loss.backward()
        opt.step()
        opt.zero_grad()
    return out


def test_delta_sync_matches_full_gathers(tiny_qwen2_tied):
    results = run_distributed(_delta_checks, 2, tiny_qwen2_tied)
    for r in results:
        assert all(same for *_, same in r["exact"]), r["exact"]
        assert all(r["async_exact"]), r["async_exact"]
    r = results[0]
    enc = {(step, name): e for step, name, e in r["encodings"]}
    # the first sync is full; bf16 again every 3rd (full_every=3), fp32 only the first
    full = [s for s in range(STEPS) if s % 3 == 0]
    for step in range(STEPS):
        e = enc[(step, "bf16")]
        assert (e["sparse"] + e["bitmap"] == 0) == (step in full), (step, e)
    assert all(enc[(s, "fp32")]["sparse"] + enc[(s, "fp32")]["bitmap"] > 0 for s in (1, 2, 3))
    assert any(enc[(s, "bf16")]["sparse"] > 0 for s in range(STEPS)), enc  # few changes
    changed = {(step, name): c for step, name, c in r["changed"]}
    assert changed[(0, "bf16")] is None and 0 < changed[(1, "bf16")] < 1, changed
    wire = {(step, name): (g, f) for step, name, g, f in r["wire"]}
    assert wire[(0, "bf16")][0] == wire[(0, "bf16")][1]  # a full sync moves it all
    assert all(wire[(s, "bf16")][0] < wire[(s, "bf16")][1] for s in range(STEPS) if s not in full)
    print(changed, wire)
