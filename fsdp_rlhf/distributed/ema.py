"""An exponential moving average of a sharded model's trainable weights (``--enable_ema``).

Each rank keeps fp32 copies of its own shards of the trainable parameters (FSDP2 local
shards: no communication, ``1 / world`` of the model per rank) and after every optimizer step
moves them toward the new weights: ``ema = beta * ema + (1 - beta) * param`` (OpenRLHF's
update, run after each actor optimizer step). The copies stay on the shards' device unless
``host`` is asked for (offloading runs keep them in host memory instead of doubling the GPU's
share of the weights). Frozen parameters (a LoRA base) are not averaged: they never change.

Its ``state_dict`` holds DTensors shaped and placed like the model's parameters, so a
checkpoint stores it sharded and a resume (also on another world size) restores it exactly.
:meth:`ShardedEMA.applied` puts the averages into the model for an export, then restores the
trained weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_rlhf.distributed.offload import placed_like


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedEMA:
    """fp32 EMA of ``model``'s trainable parameters (local shards); see the module docstring."""

    def __init__(self, model: nn.Module, beta: float, *, host: bool = False) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.model, self.beta = model, beta
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in self.params.items():
                local = _local(p).detach()
                device = torch.device("cpu") if host else local.device
                self.shadow[name] = local.to(device=device, dtype=torch.float32, copy=True)

    def attach(self, optimizer: torch.optim.Optimizer):
        """Update after every ``optimizer.step()`` (a step skipped for a non-finite gradient
        norm never calls it, so the average skips it too). Returns the hook handle."""
        return optimizer.register_step_post_hook(lambda *_: self.update())

    @torch.no_grad()
    def update(self) -> None:
        """``ema = beta * ema + (1 - beta) * param`` on every local shard."""
        for name, p in self.params.items():
            ema = self.shadow[name]
            ema.lerp_(_local(p).detach().to(device=ema.device, dtype=ema.dtype), 1.0 - self.beta)

    @contextmanager
    @torch.no_grad()
    def applied(self, model: nn.Module | None = None) -> Iterator[nn.Module]:
        """The model with the averages in place of its trained weights (for an export); the
        trained weights are back, bit for bit, on exit."""
        model = model or self.model
        params = {n: p for n, p in model.named_parameters() if n in self.shadow}
        saved = {}
        for name, p in params.items():
            local = _local(p)
            saved[name] = local.detach().to("cpu", copy=True)
            local.copy_(self.shadow[name].to(device=local.device, dtype=local.dtype))
        try:
            yield model
        finally:
            for name, p in params.items():
                local = _local(p)
                local.copy_(saved[name].to(device=local.device, dtype=local.dtype))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """DTensors placed like the parameters, viewing the averages (a checkpoint loads into
        them in place); plain tensors for unsharded parameters."""
        out = {}
        for name, p in self.params.items():
            ema = self.shadow[name]
            if isinstance(p, DTensor):  # where the average lives (the host, when offloading)
                ema = placed_like(ema, p)
            out[name] = ema
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(state))
        if missing:
            raise KeyError(f"EMA state lacks {missing[:3]}")
        for name, ema in self.shadow.items():
            value = _local(state[name])
            if value.data_ptr() != ema.data_ptr():
                ema.copy_(value.to(device=ema.device, dtype=ema.dtype))
