"""The memory census (distributed.memory_census): live tensor bytes on a device by owner, and
the phase timer that takes it. Host tensors stand in for a GPU's: the walk is device-agnostic."""

from __future__ import annotations

import torch

from fsdp_rlhf.distributed.memory_census import (
    OTHER,
    UNREACHABLE,
    PhaseCensus,
    census,
    census_from_env,
    metric_name,
    owners_of,
)
from fsdp_rlhf.metrics import PhaseTimer

CPU = torch.device("cpu")


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_bytes_by_owner_count_each_storage_once_and_name_the_rest():
    model, opt = _trained()
    frozen = torch.nn.Linear(16, 16).requires_grad_(False)
    params = sum(p.numel() * 4 for p in model.parameters())
    # a view and its base share one storage; a distinctive tensor nobody owns
    view = model[0].weight.detach()[:2]
    scores = [torch.zeros(3, 1, 4099) for _ in range(2)]
    c = census(CPU, owners_of({"actor": model, "ref": frozen}, {"actor": opt}))
    assert c.owners["actor params"] == params
    assert c.owners["actor grads"] == params
    # exp_avg + exp_avg_sq per param, and a 4-byte step count each
    assert c.owners["actor optimizer"] == 2 * params + 4 * 4
    assert c.owners["ref params"] == (16 * 16 + 16) * 4 and "ref grads" not in c.owners
    assert c.owners[OTHER] >= 2 * 3 * 4099 * 4 and UNREACHABLE not in c.owners
    assert c.largest_other[0] == ("(3, 1, 4099) float32 x 2", 2 * 3 * 4099 * 4), c.largest_other
    assert view.untyped_storage().data_ptr() == model[0].weight.untyped_storage().data_ptr()
    assert len(scores) == 2  # alive through the census


def test_tensors_elsewhere_are_not_counted_and_the_allocator_remainder_is():
    model, opt = _trained()
    meta = torch.nn.Linear(8, 8, device="meta")  # stands in for a model offloaded elsewhere
    owners = owners_of({"actor": model, "critic": meta}, {"actor": opt})
    c = census(CPU, owners, allocated=10**15)
    assert c.owners["critic params"] == 0 and c.owners["critic grads"] == 0
    seen = sum(v for k, v in c.owners.items() if k != UNREACHABLE)
    assert c.owners[UNREACHABLE] == 10**15 - seen
    assert census(torch.device("meta"), owners).owners["actor params"] == 0


def test_the_phase_timer_takes_the_census_at_the_phases_it_wants(monkeypatch):
    model, opt = _trained()
    calls = []

    def owners():
        calls.append(1)
        return owners_of({"actor": model}, {"actor": opt})

    monkeypatch.setenv("FSDP_RLHF_MEMORY_CENSUS", "rollout,update")
    timer = PhaseTimer(CPU, census_from_env(CPU, owners))
    with timer("all"):
        with timer("rollout"):
            pass
        with timer("adv"):
            pass
    metrics = timer.pop()
    assert len(calls) == 1  # rollout only
    params = sum(p.numel() * 4 for p in model.parameters())
    assert metrics[metric_name("rollout", "actor params")] * 2**30 == params
    assert metric_name("rollout", "actor optimizer") == "memory_owner/rollout/actor_optimizer_gib"
    assert not any(k.startswith("memory_owner/adv/") for k in metrics)
    assert timer.pop() == {}  # reset with the rest
    monkeypatch.setenv("FSDP_RLHF_MEMORY_CENSUS", "1")
    every = census_from_env(CPU, owners)
    assert every.wants("rollout") and every.wants("critic_model") and not every.wants("all")
    monkeypatch.setenv("FSDP_RLHF_MEMORY_CENSUS", "0")
    assert census_from_env(CPU, owners) is None


def test_a_failing_census_does_not_end_the_phase():
    def broken():
        raise RuntimeError("no")

    timer = PhaseTimer(CPU, PhaseCensus(CPU, broken))
    with timer("rollout"):
        pass
    assert "timing/rollout" in timer.pop()
