"""The rollout engine beside the actor: one ``generate`` that wakes the engine, brings the
actor's current weights into it when they changed, samples, and puts it back to sleep.

The engine and the trainer share the device, so the engine sleeps whenever the trainer works
and the actor's Adam state leaves the device when the engine wakes. It comes back only for the
actor's update (``PPOTrainer.update``): the scoring passes and the critic's update run without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.distributed.delta_sync import DeltaSync
from fsdp_rlhf.distributed.env import job_hosts
from fsdp_rlhf.distributed.offload import offload_optimizer
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.rollout import (
    AdapterSpec,
    RolloutEngine,
    RolloutOutput,
    SamplingConfig,
    sync_adapter,
    sync_weights,
)
from fsdp_rlhf.rollout.engine import PromptImages


class RolloutSession:
    """Owns the engine and knows whether it holds the actor's current weights.

    ``actor_updated()`` after each optimizer update marks the engine stale; the next
    ``generate`` syncs before sampling. At sleep level 2 on CUDA the engine drops its weights
    when it sleeps, so every wake-up syncs. With ``adapter`` (LoRA) a sync moves only the
    adapters; the engine keeps the base it loaded. With ``lora_scaling`` (LoRA synced merged)
    it moves every weight, the adapted ones with their adapters merged in. ``unsynced``
    names the parameters no sync sends (a frozen vision tower). ``delta``: sync by delta
    (``--weight_sync delta``; its mirror is built by the first sync, so a resumed run's first
    sync is full); ``overlap``: gather the next bucket while the engine loads this one.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        actor: nn.Module,
        actor_optimizer: torch.optim.Optimizer,
        timer: PhaseTimer,
        *,
        device: torch.device,
        dtype: torch.dtype,
        sleep_drops_weights: bool,
        adapter: AdapterSpec | None = None,
        lora_scaling: float | None = None,
        unsynced: Callable[[str], bool] | None = None,
        delta: DeltaSync | None = None,
        overlap: bool = False,
    ) -> None:
        self.engine, self.actor, self.actor_optimizer = engine, actor, actor_optimizer
        self.timer, self.device, self.dtype = timer, device, dtype
        self.sleep_drops_weights = sleep_drops_weights
        self.adapter = adapter
        self.lora_scaling = lora_scaling  # LoRA synced merged into the base weights
        self.unsynced = unsynced
        self.delta, self.overlap = delta, overlap
        # the engine loaded the checkpoint the run started from; after a resume (or a first
        # sleep that dropped them) its weights are not the actor's: sync at the first rollout
        self.actor_version, self.engine_version = 0, -1

    def actor_updated(self) -> None:
        self.actor_version += 1

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        metrics: dict[str, float] | None = None,
        phase: str = "rollout",
        images: Sequence[PromptImages | None] | None = None,
    ) -> RolloutOutput:
        """Sample ``sampling.n`` responses per prompt with the actor's current weights.

        ``phase`` names the generation timer (``rollout``, or ``eval``); a weight sync adds
        ``rollout/weight_sync_gbps`` to ``metrics``. ``images``: each prompt's (a VLM).
        """
        with self.awake(metrics):
            with self.timer(phase):
                if images is None:
                    return self.engine.generate(prompt_ids, sampling)
                return self.engine.generate(prompt_ids, sampling, images)

    @contextmanager
    def awake(self, metrics: dict[str, float] | None = None) -> Iterator[RolloutEngine]:
        """The engine awake with the actor's weights for several ``generate`` calls (one per
        turn of a multi-turn rollout): one wake-up and at most one sync around all of them.
        The actor's Adam state goes to the host first and stays there: whoever updates the
        actor brings it back (``onload_optimizer``)."""
        offload_optimizer(self.actor_optimizer, self.device)
        with self.timer("resharding_to_infer"):
            self.engine.wake_up(["weights"])
            if self.engine_version != self.actor_version or self.sleep_drops_weights:
                sync = self._sync()
                self.engine_version = self.actor_version
                if metrics is not None:
                    metrics.update(sync.metrics("rollout"))
            self.engine.wake_up(["kv_cache"])
        yield self.engine
        with self.timer("resharding_to_train"):
            self.engine.sleep()

    def _sync(self):
        if self.adapter is not None:
            return sync_adapter(self.actor, self.engine, self.dtype, self.adapter)
        return sync_weights(
            self.actor,
            self.engine,
            self.dtype,
            self.lora_scaling,
            skip=self.unsynced,
            delta=self.delta,
            overlap=self.overlap,
        )

    def close(self) -> None:
        self.engine.close()


def sleep_drops_weights(cfg: PPOConfig, device: torch.device) -> bool:
    """Sleep level 2 (CUDA) discards the engine's weights: every rollout needs a full sync.
    With LoRA the engine sleeps at level 1 (its base weights are never synced again)."""
    r = cfg.rollout
    level2 = r.vllm_enable_sleep and r.vllm_sleep_level == 2 and not adapter_sync(cfg)
    return device.type == "cuda" and level2


def delta_state(cfg: PPOConfig, device: torch.device) -> DeltaSync | None:
    """A colocated rank's delta-sync state, or None for a full sync."""
    if cfg.weight_sync_mode(device.type, job_hosts()) != "delta":
        return None
    return DeltaSync(full_every=cfg.rollout.weight_sync_full_every)


def adapter_sync(cfg: PPOConfig) -> bool:
    """LoRA synced as adapters that vLLM serves (``--lora_sync adapter``)."""
    return cfg.lora.enabled and cfg.rollout.lora_sync == "adapter"


def sampling_config(cfg: PPOConfig, step: int, round_: int = 0) -> SamplingConfig:
    """The sampling of one step's rollout (``round_``: the dynamic-sampling round).

    A fresh seed per step and round, so a resumed run samples what the uninterrupted one did;
    the engine derives per-request seeds from it, identical inside a TP group.
    """
    seed = cfg.seed * 100_003 + step + round_ * 1_000_003
    return SamplingConfig.from_rollout_config(
        cfg.rollout, n=cfg.batch.n_samples_per_prompt, seed=seed
    )
