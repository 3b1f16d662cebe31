"""Host syncs made to fail: the test mode behind "no host sync between the first layer and the
loss".

On a GPU every read of a device value by the host (``.item()``, ``.tolist()``, ``bool(t)``,
``int(t)``, an op whose output size depends on the data: ``nonzero``, boolean indexing,
``masked_select``, ``unique``) waits for the queue to drain, so the host stops running ahead
and the GPU then waits on the host's launches. On CPU nothing waits, so nothing shows; under
:func:`no_host_syncs` each of them raises instead, on any device, naming the op. The ops a
dispatched op runs inside itself (a reference kernel reading its offsets) are not counted: on
the GPU they would be the kernel's own business.

``torch.cuda.set_sync_debug_mode`` is the GPU's own check of the same (the GPU ladder reports
its count).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result the host must read (or whose output size is data-dependent)
SYNC_OPS = (
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique",
    "aten.unique",
    "aten.equal",
    "aten.is_nonzero",
    "aten.item",
    "aten.repeat_interleave.Tensor",  # without output_size
)
_TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__")


class HostSyncError(RuntimeError):
    pass


class _SyncMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 while an op runs: what it does inside is its own business

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        full = str(func)
        if self.depth == 0:
            if any(full.startswith(op) or name == op for op in SYNC_OPS):
                if not (name == "aten.repeat_interleave" and kwargs.get("output_size")):
                    raise HostSyncError(f"host sync inside the model: {full}")
            if name in ("aten.index", "aten.index_put", "aten.index_put_"):
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                    raise HostSyncError(f"host sync inside the model: boolean indexing ({full})")
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1


@contextmanager
def no_host_syncs() -> Iterator[None]:
    """Raise :class:`HostSyncError` at any host read of a tensor's values in this block."""
    mode = _SyncMode()
    saved = {m: getattr(torch.Tensor, m) for m in _TENSOR_METHODS}

    def guard(method: str):
        real = saved[method]

        def wrapped(self, *args, **kwargs):
            if mode.depth == 0 and not isinstance(self, torch.nn.Parameter):
                raise HostSyncError(f"host sync inside the model: Tensor.{method}")
            return real(self, *args, **kwargs)

        return wrapped

    for m in _TENSOR_METHODS:
        setattr(torch.Tensor, m, guard(m))
    try:
        with mode:
            yield
    finally:
        for m, real in saved.items():
            setattr(torch.Tensor, m, real)
