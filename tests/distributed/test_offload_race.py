"""Phase offload of a model whose first dimensions do not divide the world size (issue #36).

FSDP2 hooks ``nn.Module._apply``: after the move it re-pads every shard shorter than the padded
shard size (the last ranks' when rows do not divide the world size) by copying it, on the host,
into a new tensor, before ``_apply`` returns. A non-blocking GPU-to-pinned copy may still be in
flight then, so on a GPU that re-pad read the pinned buffer's old bytes: wrong weights in the
critic, the reference and the reward model after their first offload.

On CPU every copy completes before it returns, so wrong values cannot show here. What is checked
is the order of operations that decides it on a GPU, recorded with a dispatch mode: a tensor
written by a non-blocking copy to the host counts as in flight, and any later operation reading
it before the move returns is the race. The values are checked too (the re-pad path runs).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist_utils import run_distributed

aten = torch.ops.aten
# operations that only look at a tensor's metadata (shape, dtype, device), never its bytes
METADATA_ONLY = {
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_like.default,
    aten.narrow.default,
    aten.slice.Tensor,
    aten.view.default,
    aten._unsafe_view.default,
    aten.alias.default,
    aten.detach.default,
    aten.as_strided.default,
    aten.t.default,
    aten.is_pinned.default,
    aten.sym_size.default,
    aten.sym_stride.default,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
}


def _storage(t) -> int | None:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


class InFlightReads(TorchDispatchMode):
    """Records reads of tensors that a non-blocking copy to the host wrote (see the module
    docstring): what would race on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: set[int] = set()
        self.races: list[str] = []
        self.non_blocking_to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = [] if func in METADATA_ONLY else list(args) + list(kwargs.values())
        if func is aten.copy_.default:
            read = [args[1]]  # copy_(dst, src): the destination is written, not read
        for t in read:
            if _storage(t) in self.in_flight:
                self.races.append(str(func))
        out = func(*args, **kwargs)
        non_blocking = kwargs.get("non_blocking", False)
        if func is aten.copy_.default:
            non_blocking = non_blocking or (len(args) > 2 and args[2])
            written = args[0]
        elif func is aten._to_copy.default:
            written = out
        else:
            return out
        if non_blocking and written.device.type == "cpu" and _storage(written) is not None:
            self.in_flight.add(_storage(written))
            self.non_blocking_to_host += 1
        return out


def _offload_uneven(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_rlhf.distributed.offload import move_module_

    torch.manual_seed(0)  # the same full weights on every rank
    # first dimensions 7 and 5: shards of 3+3+1 and 2+2+1 rows on 3 ranks
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 5))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def expected(name: str, p) -> torch.Tensor:
        rows = -(-p.shape[0] // world)
        return full[name][rank * rows : (rank + 1) * rows]

    before = {n: p.to_local().untyped_storage().data_ptr() for n, p in model.named_parameters()}
    recorder = InFlightReads()
    with recorder:
        # a forced copy stands in for the GPU-to-host move (pinning needs a GPU)
        move_module_(model, torch.device("cpu"), copy=True)
    repadded = [
        n
        for n, p in model.named_parameters()
        if p.to_local().untyped_storage().nbytes() > p.to_local().numel() * 4
        and p.to_local().untyped_storage().data_ptr() != before[n]
    ]
    move_module_(model, torch.device("cpu"), copy=True)  # and back (onload)
    wrong = [
        n for n, p in model.named_parameters() if not torch.equal(p.to_local(), expected(n, p))
    ]
    x = torch.randn(3, 6)
    ref = torch.nn.functional.linear(
        torch.nn.functional.linear(x, full["0.weight"], full["0.bias"]),
        full["1.weight"],
        full["1.bias"],
    )
    with torch.no_grad():
        out_ok = torch.allclose(model(x), ref, atol=1e-6)
    return dict(
        races=recorder.races,
        non_blocking_to_host=recorder.non_blocking_to_host,
        repadded=repadded,
        wrong=wrong,
        forward_ok=out_ok,
    )


def test_offload_leaves_no_copy_in_flight_when_fsdp_repads_uneven_shards():
    out = run_distributed(_offload_uneven, 3)
    # the last rank holds the short shards: FSDP re-padded them during the move
    assert out[-1]["repadded"], out[-1]
    for rank, r in enumerate(out):
        assert not r["races"], (rank, r)
        assert not r["wrong"] and r["forward_ok"], (rank, r)
