"""The rollout session's wake-up: what it moves off the device and what it leaves there."""

from __future__ import annotations

import torch

from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.trainers.ppo import rollout
from fsdp_rlhf.trainers.ppo.rollout import RolloutSession


class SleepyEngine:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake {tags[0]}")

    def sleep(self) -> None:
        self.calls.append("sleep")

    def generate(self, prompt_ids, sampling):
        self.calls.append("generate")
        return "out"


def test_the_actor_adam_state_stays_on_the_host_after_the_rollout(monkeypatch):
    """It leaves the device when the engine wakes and comes back for the actor's update only
    (PPOTrainer.update): the scoring passes and the critic's update run without it, as the
    memory plan (distributed.memory) counts them. It used to come back as the engine slept:
    8 bytes per actor parameter per rank through scoring and the critic update."""
    calls: list[str] = []
    monkeypatch.setattr(rollout, "offload_optimizer", lambda opt, dev: calls.append("off"))
    monkeypatch.setattr(
        rollout, "onload_optimizer", lambda opt, dev: calls.append("on"), raising=False
    )
    actor = torch.nn.Linear(2, 2)
    session = RolloutSession(
        SleepyEngine(calls),
        actor,
        torch.optim.AdamW(actor.parameters()),
        PhaseTimer(torch.device("cpu")),
        device=torch.device("cpu"),
        dtype=torch.float32,
        sleep_drops_weights=False,
    )
    session.engine_version = session.actor_version  # the engine holds the actor's weights
    assert session.generate([[1, 2]], sampling=None) == "out"
    assert calls == ["off", "wake weights", "wake kv_cache", "generate", "sleep"], calls
