"""Step statistics stay on the device until the step ends (issue #30): on a GPU every
``float(tensor)`` / ``.item()`` is a host synchronisation, so the per-micro-batch and per-batch
accumulators must not call them; one host copy per reduce."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.distributed.stats import to_host
from fsdp_rlhf.trainers.ppo.metrics import RunningAverages, StatCollector


@pytest.fixture
def no_host_sync(monkeypatch):
    """Fail on any tensor -> Python number conversion while active."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("host synchronisation inside an accumulator")

    with monkeypatch.context() as m:
        for name in ("item", "__float__", "tolist", "__bool__", "__int__"):
            m.setattr(torch.Tensor, name, refuse)
        yield


def test_running_averages_add_without_a_host_sync(no_host_sync):
    avg = RunningAverages()
    for i in range(3):
        avg.add({"actor/pg_loss": torch.tensor(float(i)), "x_max": torch.tensor(float(5 - i))})


def test_stat_collector_add_without_a_host_sync(no_host_sync):
    stats = StatCollector()
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, -1.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    stats.add("critic/values", values, mask)
    stats.add_mean("rollout/generated_length", torch.tensor([3.0, 5.0]))
    stats.add_weighted_mean("rollout/mismatch_kl", torch.tensor(0.5), mask.sum())


def test_accumulated_statistics_reduce_to_the_same_numbers():
    avg = RunningAverages()
    for i in range(3):
        avg.add({"actor/pg_loss": torch.tensor(float(i)), "x_max": torch.tensor(float(5 - i))})
    assert avg.reduce() == {"actor/pg_loss": 1.0, "x_max": 5.0}
    stats = StatCollector()
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, -1.0, 4.0]])
    stats.add("critic/values", values, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    stats.add("empty", torch.zeros(2), torch.zeros(2))
    out = stats.reduce()
    assert out["critic/values/mean"] == pytest.approx(9 / 5)
    assert (out["critic/values/max"], out["critic/values/min"]) == (4.0, -1.0)
    assert (out["empty/mean"], out["empty/max"], out["empty/min"]) == (
        0.0,
        -float("inf"),
        float("inf"),
    )


def test_to_host_copies_tensors_once(monkeypatch):
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: calls.append(1) or real(t, *a, **k))
    out = to_host({"a": torch.tensor(1.5), "b": 2.0, "c": torch.tensor(3)})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0} and len(calls) == 1
