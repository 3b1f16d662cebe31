"""FSDP2 (``fully_shard``) wrapping, gradient clipping on DTensors, and full-state-dict gathers."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_rlhf.config import FSDPConfig

log = logging.getLogger(__name__)


def build_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    """A 1-D data-parallel mesh over all ranks (FSDP shards over it)."""
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))


def reshard_after_forward(zero_stage: int) -> bool:
    """ZeRO-3 frees gathered params after forward (re-gathers in backward); lower stages keep
    them until backward ends, trading memory for one all-gather per layer."""
    return zero_stage >= 3


def describe_zero_stage(zero_stage: int) -> str:
    if zero_stage >= 3:
        return "zero_stage=3 -> FSDP2 fully_shard(reshard_after_forward=True)"
    return (
        f"zero_stage={zero_stage} -> FSDP2 fully_shard(reshard_after_forward=False): params stay "
        "gathered from forward until backward ends; grads and optimizer states are sharded"
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model, found by the model's own ``_no_split_modules``."""
    names: set[str] = set()
    for m in model.modules():
        if isinstance(m, nn.Module) and getattr(type(m), "_no_split_modules", None):
            names.update(type(m)._no_split_modules)
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    fsdp: FSDPConfig,
    *,
    bf16: bool,
    grad_reduce: Literal["mean", "sum"] = "mean",
    cpu_offload: bool = False,
) -> nn.Module:
    """Apply ``fully_shard`` to each decoder layer, then to the root.

    Args:
        grad_reduce: ``"mean"`` lets FSDP average gradients over ranks; ``"sum"`` leaves them
            summed, for losses normalised by a global token count computed by the caller.
        cpu_offload: keep sharded params, grads and optimizer states on CPU (GPU only).
    """
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else torch.float32, reduce_dtype=torch.float32
    )
    kwargs = dict(
        mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward(fsdp.zero_stage)
    )
    if cpu_offload and mesh.device_type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard")
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if grad_reduce == "sum":
        set_sum_reduction(model)
    return model


def set_sum_reduction(model: nn.Module) -> None:
    """Make FSDP sum gradients across ranks instead of averaging them.

    NOTE: gloo has no PREMUL_SUM, so a divide factor of 1 alone fails there; forcing plain SUM
    reduction for the collectives is required too.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Total L2 norm of all (sharded) gradients across ranks; scales them to ``max_norm``.

    Works on DTensor shards by summing local squares and all-reducing once, so no full gradient
    is ever gathered. Returns the norm before clipping; ``max_norm <= 0`` only measures.
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if grads:
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    else:
        sq = torch.zeros(())
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = grads[0].device if grads else torch.device("cpu")
        sq = sq.to(device)
        dist.all_reduce(sq)
    total = math.sqrt(float(sq))
    if max_norm > 0 and total > max_norm and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(coef)
    return total


def iter_full_params(
    model: nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` one at a time (each rank gets the full tensor).

    Only one gathered tensor is alive at a time, so peak memory is one parameter, not the model.
    Every rank must consume the whole iterator: each step is a collective.
    """
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        yield name, (full.detach().to(dtype) if dtype is not None else full.detach())


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU state dict on rank 0 (empty dict elsewhere), for HF export."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)
