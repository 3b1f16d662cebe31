"""Fill an FSDP2-sharded skeleton from rank 0's copy of the model: one full model in host
memory per job instead of one per rank.

Every rank builds the model on the meta device (``models.load``, ``weights=False``) and shards
it; rank 0 alone loads the checkpoint. The shards are then allocated on their device (the GPU,
or the host under ``--adam_offload``) and each parameter and buffer is broadcast from rank 0,
one tensor at a time, each rank keeping its rows. Loading a 32B model in fp32 on every rank took
about 131 GB of host memory per rank (1 TB on an 8-GPU node); now rank 0 holds one copy and the
others their shards plus one tensor in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_rlhf.distributed.collectives import collective_device
from fsdp_rlhf.distributed.env import run_and_agree
from fsdp_rlhf.distributed.fsdp import is_cpu_offloaded


def _layout(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (global shape, dtype) of every parameter and buffer, ties counted once."""
    out = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    out.update({n: (tuple(b.shape), b.dtype) for n, b in model.named_buffers()})
    return out


def _check_same_layout(skeleton: nn.Module, full: nn.Module) -> None:
    want, have = _layout(skeleton), _layout(full)
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:3]
        raise RuntimeError(f"rank 0's model and the sharded skeleton differ: {diff}")


@torch.no_grad()
def _keep_rows(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` (the whole tensor) into ``param``'s local storage."""
    if not isinstance(param, DTensor):
        param.copy_(full)
        return
    shape, offset = compute_local_shape_and_global_offset(
        full.shape, param.device_mesh, param.placements
    )
    local = param.to_local()
    if local.numel():
        index = tuple(slice(o, o + n) for n, o in zip(shape, offset, strict=True))
        local.copy_(full[index])


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer ``name`` of ``model``."""
    module, _, leaf = name.rpartition(".")
    owner = model.get_submodule(module)
    return owner._parameters[leaf] if leaf in owner._parameters else owner._buffers[leaf]


def _broadcast(like: torch.Tensor, source: torch.Tensor | None, device) -> torch.Tensor:
    """Rank 0's ``source`` on every rank, on ``device`` (the group's), shaped like ``like``."""
    if source is not None:
        buf = source.detach().to(device=device, dtype=like.dtype)
    else:
        buf = torch.empty(tuple(like.shape), dtype=like.dtype, device=device)
    dist.broadcast(buf, src=0)
    return buf


@torch.no_grad()
def fill_from_rank0(model: nn.Module, full: nn.Module | None, device: torch.device) -> int:
    """Allocate ``model``'s shards and fill them with rank 0's values (collective).

    Args:
        model: sharded with FSDP2 on every rank, its params and buffers on the meta device.
        full: rank 0's loaded model, same names, shapes and dtypes (None on other ranks).
        device: the compute device (buffers live there; shards too unless the model is under
            CPUOffloadPolicy, whose shards stay on the host).

    Returns the bytes each rank received.
    """
    if dist.get_rank() == 0 and full is None:
        raise ValueError("rank 0 must hold the loaded model")
    run_and_agree(lambda: _check_same_layout(model, full), "rank 0's model", only_rank0=True)
    model.to_empty(device=torch.device("cpu") if is_cpu_offloaded(model) else device)
    group_device = collective_device(prefer=device)
    received = 0
    for name, param in model.named_parameters():
        whole = _broadcast(param, None if full is None else _tensor(full, name), group_device)
        _keep_rows(param, whole)
        received += whole.numel() * whole.element_size()
        del whole
    for name, buffer in list(model.named_buffers()):
        whole = _broadcast(buffer, None if full is None else _tensor(full, name), group_device)
        module, _, leaf = name.rpartition(".")
        model.get_submodule(module)._buffers[leaf] = whole.to(device)
        received += whole.numel() * whole.element_size()
    return received
