"""Where a collective's tensor must live: the one place that decides it, from the process group.

A process group reduces only on the device types it has a backend for. NCCL registers CUDA
alone: a host tensor handed to it fails with "No backend type associated with device type cpu",
at world size 1 too. gloo registers the host (and CUDA). Trainers hold some statistics on the
host (token counts from host masks, metric sums after one device-to-host copy), so every tensor
collective of the package that may see a host tensor goes through :func:`all_reduce`: the
tensor is reduced where it lives when the group can, else copied to the group's device and the
result copied back.

Not routed here: object collectives (``all_gather_object``, ``broadcast_object_list``) and
``barrier``, whose device torch picks from the group itself; FSDP2's own collectives (on the
mesh device); the heartbeat and the exit report, which use their own TCP store.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_device_types(group: dist.ProcessGroup | None = None) -> list[str]:
    """Device types ``group`` (default: WORLD) has a backend for, e.g. ``["cuda"]`` for NCCL."""
    group = group if group is not None else dist.group.WORLD
    return [d.type for d in group._device_types]


def collective_device(
    group: dist.ProcessGroup | None = None, prefer: torch.device | None = None
) -> torch.device:
    """The device a tensor must be on to take part in a collective of ``group``.

    ``prefer`` (where the tensor lives) wins when the group can reduce there: no copy. Otherwise
    the host when the group has a host backend (gloo), else CUDA (NCCL: this rank's current
    device). Without a process group: ``prefer`` or the host.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return prefer if prefer is not None else torch.device("cpu")
    types = group_device_types(group)
    if prefer is not None and prefer.type in types:
        return prefer
    if "cpu" in types or not types:
        return torch.device("cpu")
    if "cuda" in types:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cuda")  # a CUDA-only group on a host without CUDA cannot reduce
    return torch.device(types[0])


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``dist.all_reduce`` on the group's device; returns the result on ``tensor``'s device.

    In place when the group reduces where ``tensor`` lives (the result is ``tensor``); otherwise
    ``tensor`` is left as it was and a new tensor is returned. Without a process group, returns
    ``tensor`` unchanged.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    device = collective_device(group, tensor.device)
    work = tensor if device == tensor.device else tensor.to(device)
    dist.all_reduce(work, op=op, group=group)
    return work if work is tensor else work.to(tensor.device)
