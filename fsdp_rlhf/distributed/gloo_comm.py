"""Collectives on gloo (CPU) done with point-to-point sends: FSDP2's gradient reduce-scatter
and the weight-sync all-gather.

gloo's ``reduce_scatter_tensor`` first clones its whole input, which makes it slower than
sending each peer its chunk and adding what arrives; inside a PPO update, where freshly
allocated memory is slow to touch, that clone costs the most. The chunks arrive in one receive
buffer per input size that is kept and reused, so its pages stay mapped; it has a row per peer
only (a rank's own chunk is added from its input): (W - 1) / W of the largest unit's gradient
(the root's: embeddings and output layer, vocabulary-sized), not all of it. gloo's all-gather is
slow the same way: sending each peer the shard directly is faster. Timings:
benchmarks/grpo_rm_vs_trl_intel-xeon-amx-2core_2026-11-22.md. NCCL's collectives need none of
this and are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class P2PReduceScatter(ReduceScatter):
    """``output`` = sum (or mean) over ranks of their input's chunk ``rank``; input (W * n,),
    output (n,)."""

    def __init__(self) -> None:
        self._recv: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"P2PReduceScatter sums or averages; FSDP asked for {op}")
        world, rank = group.size(), group.rank()
        chunks = input_tensor.view(world, -1)
        key = (input_tensor.numel(), input_tensor.dtype)
        if key not in self._recv:  # a row per peer, in rank order
            self._recv[key] = chunks.new_empty(world - 1, chunks.shape[1])
        recv = self._recv[key]
        _exchange(group, chunks, recv)
        torch.sum(recv, dim=0, out=output_tensor)
        output_tensor.add_(chunks[rank])
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None  # done: FSDP waits only on returned work


def use_p2p_reduce_scatter(model: torch.nn.Module) -> None:
    """Give every FSDP2 module of ``model`` one shared :class:`P2PReduceScatter`: the modules
    reduce one after another, so layers of equal size share a receive buffer."""
    comm = P2PReduceScatter()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(comm)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` (W * n,) = every rank's ``shard`` (n,) in rank order, sent peer to peer."""
    world = group.size()
    slots = output.view(world, -1)
    _exchange(group, shard.expand(world, -1), slots)
    slots[group.rank()].copy_(shard)


def _exchange(group: dist.ProcessGroup, send: torch.Tensor, recv: torch.Tensor) -> None:
    """Send ``send[peer]`` to every other rank of ``group`` and receive its piece into
    ``recv``, all at once. ``send`` has a row per group rank; ``recv`` too (``recv[rank]`` is
    untouched) or a row per peer only (W - 1 rows, in rank order without this rank)."""
    rank, world, ops = group.rank(), group.size(), []
    per_peer = world > 1 and recv.shape[0] == world - 1
    for peer in range(world):
        if peer != rank:
            global_peer = dist.get_global_rank(group, peer)
            row = peer - 1 if per_peer and peer > rank else peer
            ops.append(dist.P2POp(dist.isend, send[peer], global_peer, group))
            ops.append(dist.P2POp(dist.irecv, recv[row], global_peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
