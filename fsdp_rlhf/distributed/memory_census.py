"""What a device holds, by owner: the bytes of the live tensors on it, attributed to the models,
grads, optimizer states and engine copy that own them, at the end of a phase.

The memory plan (``distributed.memory``) says what each phase should hold; the allocator's peak
says how much it did. This says *whose* it was: a diagnostic for calibrating the plan on a GPU
(``FSDP_RLHF_MEMORY_CENSUS``, below), off by default.

How: every tensor object the garbage collector tracks (``gc.get_objects``) that lives on the
device is reduced to its storage (views and FSDP2's padded shards share one), each storage
counted once. A storage belongs to the first owner whose tensors use it; the rest is
``other``, listed by its largest shapes. Storages no Python object holds (autograd's saved
tensors, library workspaces) are not seen: with ``allocated`` (``torch.cuda.memory_allocated``)
the difference is reported as ``not reachable from python``.

``FSDP_RLHF_MEMORY_CENSUS``: ``1`` (or ``all``) takes a census at the end of every timed phase
but the step's total; a comma-separated list names the phases (``rollout,update``). Each one
walks every Python object: seconds per step on a large process.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_rlhf.metrics import metric_name  # noqa: F401  (re-exported: the census names its metrics)

log = logging.getLogger("fsdp_rlhf")

ENV = "FSDP_RLHF_MEMORY_CENSUS"
OTHER = "other"
UNREACHABLE = "not reachable from python"
GIB = 2**30


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of ``t``'s storage; None for tensors without one (meta, fake, empty)."""
    try:
        s = t.untyped_storage()
        ptr, nbytes = s.data_ptr(), s.nbytes()
    except Exception:  # noqa: BLE001 (meta, fake and functional tensors have none)
        return None
    return (ptr, nbytes) if ptr and nbytes else None


def model_tensors(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    """A model's ``params`` (with its buffers) and, when it has trainable ones, its ``grads``:
    local shards of DTensors."""
    out = {"params": [_local(p) for p in model.parameters()] + list(model.buffers())}
    if any(p.requires_grad for p in model.parameters()):
        out["grads"] = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of an optimizer's state (Adam's moments and step counts)."""
    return [
        _local(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


def owners_of(
    models: Mapping[str, nn.Module | None],
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    extra: Mapping[str, Iterable[torch.Tensor]] | None = None,
) -> dict[str, list[torch.Tensor]]:
    """``{"<model> params": ..., "<model> grads": ..., "<name> optimizer": ..., **extra}``, in
    that order (the first owner of a shared storage counts it); models that are None are left
    out."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, model in models.items():
        if model is not None:
            for kind, tensors in model_tensors(model).items():
                out[f"{name} {kind}"] = tensors
    for name, optimizer in (optimizers or {}).items():
        out[f"{name} optimizer"] = optimizer_tensors(optimizer)
    for name, tensors in (extra or {}).items():
        out[name] = [_local(t) for t in tensors]
    return out


@dataclass
class Census:
    """Bytes by owner (every owner named, zero included), ``other`` and, when the allocator's
    count was given, what no Python object holds; ``largest_other``: the biggest groups of
    ``other`` storages as ``(description, bytes)``."""

    owners: dict[str, int]
    largest_other: list[tuple[str, int]] = field(default_factory=list)

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.owners.items()}

    def line(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.owners.items())
        other = "; ".join(f"{d}: {b / GIB:.2f}" for d, b in self.largest_other)
        return parts + (f" (largest other: {other})" if other else "")


def census(
    device: torch.device,
    owners: Mapping[str, Iterable[torch.Tensor]],
    allocated: int | None = None,
    top: int = 3,
) -> Census:
    """The live tensors on ``device`` by owner (see the module docstring)."""
    owner_of: dict[tuple[int, int], str] = {}
    for name, tensors in owners.items():
        for t in tensors:
            key = _storage(t) if t.device == device else None
            if key is not None:
                owner_of.setdefault(key, name)
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: it reads __class__, which some proxies warn about
        if not issubclass(kind, torch.Tensor) or issubclass(kind, DTensor):
            continue
        try:  # some subclasses (fake, functional) answer neither device nor storage
            if obj.device != device:
                continue
            key = _storage(obj)
            if key is not None and (key not in seen or obj.numel() > seen[key].numel()):
                seen[key] = obj
        except Exception:  # noqa: BLE001
            continue
    bytes_by = dict.fromkeys(owners, 0)
    bytes_by[OTHER] = 0
    groups: dict[str, list[int]] = {}
    for key, t in seen.items():
        name = owner_of.get(key, OTHER)
        bytes_by[name] += key[1]
        if name == OTHER:
            group = groups.setdefault(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}", [])
            group.append(key[1])
    if allocated is not None:
        bytes_by[UNREACHABLE] = allocated - sum(key[1] for key in seen)
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    largest = [(f"{d} x {len(b)}" if len(b) > 1 else d, sum(b)) for d, b in ranked]
    return Census(bytes_by, largest)


class PhaseCensus:
    """A census of ``device`` at the end of the phases it ``wants``, with the owners
    ``owners()`` names then (offload moves tensors: they are looked up each time)."""

    def __init__(
        self,
        device: torch.device,
        owners: Callable[[], Mapping[str, Iterable[torch.Tensor]]],
        phases: frozenset[str] | None = None,
    ) -> None:
        self.device, self.owners, self.phases = device, owners, phases

    def wants(self, phase: str) -> bool:
        if self.phases is None:
            return phase != "all"
        return phase in self.phases

    def __call__(self) -> Census:
        cuda = self.device.type == "cuda"
        allocated = torch.cuda.memory_allocated(self.device) if cuda else None
        return census(self.device, self.owners(), allocated)


def census_from_env(
    device: torch.device, owners: Callable[[], Mapping[str, Iterable[torch.Tensor]]]
) -> PhaseCensus | None:
    """The census ``FSDP_RLHF_MEMORY_CENSUS`` asks for (None: unset, ``0`` or empty)."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0"):
        return None
    phases = None if value in ("1", "all") else frozenset(filter(None, value.split(",")))
    return PhaseCensus(device, owners, phases)
