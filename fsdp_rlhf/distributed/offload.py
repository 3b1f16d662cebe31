"""Move idle models and optimizer states to host memory between phases, and back.

On a CPU-only job everything already lives in host memory, so ``offload_*``/``onload_*`` return
at once: that is by design, not a fallback. The moving logic itself (``move_module_``,
``move_optimizer_``) is device-agnostic and unit-tested with forced copies.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdp_rlhf.distributed.fsdp import is_cpu_offloaded


def _move(
    t: torch.Tensor, device: torch.device, pin: bool, copy: bool, blocking: bool
) -> torch.Tensor:
    """``t`` on ``device``. A ``blocking`` move returns a complete tensor; a non-blocking one
    to the host may still be filling when it returns (a synchronisation must come before
    anything on the host reads it). Copies to a GPU are ordered on its stream either way."""
    non_blocking = not blocking or device.type != "cpu"
    # Pinned host memory makes the later host-to-device copy asynchronous.
    if device.type == "cpu" and pin and t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=non_blocking)
        return out
    return t.to(device, non_blocking=non_blocking, copy=copy)


def placed_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as the local shard of a DTensor placed like ``like`` (same mesh, placements,
    global shape and stride), on whatever device ``local`` is.

    Not ``DTensor.from_local``: it moves a local tensor to its mesh's device type, so a shard
    copied to the host on a CUDA mesh went straight back to the GPU (a second device copy, the
    first one freed): every phase offload kept its bytes on the device. FSDP2 builds the
    host shards of CPUOffloadPolicy the same way (the constructor, with the spec). ``local``
    may have another dtype than ``like`` (an fp32 average of bf16 shards)."""
    spec = like._spec
    if local.dtype != like.dtype:
        meta = TensorMeta(like.shape, like.stride(), local.dtype)
        spec = DTensorSpec(spec.mesh, spec.placements, meta)
    return DTensor(local, spec, requires_grad=local.requires_grad)


def _move_any(
    t: torch.Tensor,
    device: torch.device,
    pin: bool,
    copy: bool,
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    # Tied weights (embed_tokens / lm_head) are one Parameter reached from two modules: move and
    # count it once, and hand the second module the tensor the first one got.
    if id(t) in moved:
        return moved[id(t)][1]
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.device == device and not copy:
        return t
    # Blocking: FSDP2's _apply hook reads the new tensor on the host before _apply returns
    # (reset_sharded_param re-pads a shard shorter than the padded size, e.g. the last rank's
    # when a first dimension does not divide the world size): with a copy still in flight it
    # would keep the pinned buffer's old bytes.
    new = _move(local, device, pin, copy, blocking=True)
    if isinstance(t, DTensor):
        new = placed_like(new, t)
    moved[id(t)] = (t, new)  # holding t keeps its id from being reused during this walk
    return new


def move_module_(
    module: nn.Module, device: torch.device, *, pin: bool = False, copy: bool = False
) -> int:
    """Re-home every parameter, gradient and buffer of ``module`` (local shards for DTensors).

    Goes through ``nn.Module._apply`` (what ``.to()`` uses) because FSDP2 hooks it to re-point
    its sharded-parameter bookkeeping at the new storage. Parameter objects stay the same, so
    optimizers keep their references. Copies to the host are blocking (see ``_move_any``).
    Returns the number of bytes moved.
    """
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    module._apply(lambda t: _move_any(t, device, pin, copy, moved))
    return sum(_local_bytes(new) for _, new in moved.values())


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def move_optimizer_(
    optimizer: torch.optim.Optimizer, device: torch.device, *, pin: bool = False, copy: bool = False
) -> int:
    """Re-home every tensor in the optimizer state (Adam moments). Returns bytes moved."""
    moved = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or key == "step":
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.device == device and not copy:
                continue
            # nothing reads optimizer state before offload_optimizer's synchronisation
            new = _move(local, device, pin, copy, blocking=False)
            state[key] = placed_like(new, value) if isinstance(value, DTensor) else new
            moved += new.numel() * new.element_size()
    return moved


def phase_moves(device: torch.device, fsdp_cpu_offload: bool) -> bool:
    """Whether the trainer's phase offload/onload should move a model (or its optimizer).

    No on a CPU job (already host memory), and no for a model under FSDP2's CPUOffloadPolicy
    (``--adam_offload``): FSDP owns where its params, grads and Adam state live, and moving the
    optimizer state to CUDA while the params stay on CPU would break ``optimizer.step``.
    """
    return device.type != "cpu" and not fsdp_cpu_offload


def _optimizer_cpu_offloaded(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer of a CPUOffloadPolicy model (its params carry the mark from shard_model;
    where they are right now says nothing: phase offload puts any model on CPU)."""
    return any(is_cpu_offloaded(p) for g in optimizer.param_groups for p in g["params"])


def offload_model(module: nn.Module, device: torch.device) -> int:
    """Send an idle model to pinned host memory. No-op on CPU jobs and CPU-offloaded models."""
    if not phase_moves(device, is_cpu_offloaded(module)):
        return 0
    n = move_module_(module, torch.device("cpu"), pin=True)
    torch.cuda.synchronize(device)
    return n


def onload_model(module: nn.Module, device: torch.device) -> int:
    """Bring a model back to its compute device. Same no-op cases as ``offload_model``."""
    if not phase_moves(device, is_cpu_offloaded(module)):
        return 0
    return move_module_(module, device)


def offload_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    if not phase_moves(device, _optimizer_cpu_offloaded(optimizer)):
        return 0
    n = move_optimizer_(optimizer, torch.device("cpu"), pin=True)
    torch.cuda.synchronize(device)
    return n


def onload_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bring Adam state back next to its params: never to CUDA when the params stay on CPU."""
    if not phase_moves(device, _optimizer_cpu_offloaded(optimizer)):
        return 0
    return move_optimizer_(optimizer, device)
