"""The point-to-point reduce-scatter and all-gather used on gloo against gloo's own, on 3
ranks (the reduce-scatter's kept receive buffer has a row per peer, not per rank)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed


def _compare(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    from fsdp_rlhf.distributed.gloo_comm import P2PReduceScatter

    comm, diffs = P2PReduceScatter(), []
    group = dist.group.WORLD
    for n, op in ((7, dist.ReduceOp.SUM), (7, dist.ReduceOp.AVG), (5, dist.ReduceOp.SUM)):
        g = torch.Generator().manual_seed(10 * rank + n)
        inp = torch.randn(world * n, generator=g)
        expected = torch.empty(n)
        dist.reduce_scatter_tensor(expected, inp.clone(), op=op)
        out = comm.allocate((n,), dtype=inp.dtype, device=inp.device)
        assert comm(out, inp, group, op) is None
        diffs.append((out - expected).abs().max().item())
    with pytest.raises(ValueError, match="sums or averages"):
        comm(out, inp, group, dist.ReduceOp.MAX)
    # the kept receive buffers hold the peers' chunks only: (W - 1) / W of each input
    assert sorted(tuple(b.shape) for b in comm._recv.values()) == [(world - 1, 5), (world - 1, 7)]
    from fsdp_rlhf.distributed.gloo_comm import all_gather_into

    shard = torch.arange(4.0) + 10 * rank
    full, expected = torch.empty(4 * world), torch.empty(4 * world)
    all_gather_into(full, shard, group)
    dist.all_gather_into_tensor(expected, shard)
    diffs.append((full - expected).abs().max().item())
    return diffs


def test_p2p_collectives_match_gloo():
    for diffs in run_distributed(_compare, 3):
        assert max(diffs) < 1e-6, diffs
