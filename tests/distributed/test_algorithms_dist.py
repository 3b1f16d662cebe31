"""Global masked statistics on 2 gloo ranks agree with one process holding the whole batch."""

import torch

from fsdp_rlhf.algorithms import aggregate_loss
from fsdp_rlhf.algorithms.masked import masked_whiten
from fsdp_rlhf.distributed.stats import global_masked_whiten, global_token_count
from tests.dist_utils import run_distributed


def _global_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(7, 10, generator=gen, dtype=torch.float64) * 3 + 1
    loss = torch.randn(7, 10, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([10, 3, 0, 7, 1, 9, 5])
    mask = torch.arange(10) < lengths.unsqueeze(1)
    # Rank 1's rows are longer and shifted in value, so per-rank statistics differ from the
    # global ones and a purely local computation would fail the comparison.
    values[4:] += 5.0
    return values, loss, mask


def _rank_slice(rank: int) -> slice:
    return slice(0, 4) if rank == 0 else slice(4, 7)  # uneven shards on purpose


def _whiten_and_loss(rank: int, world_size: int, seed: int) -> dict[str, torch.Tensor]:
    values, loss, mask = _global_batch(seed)
    rows = _rank_slice(rank)
    local_mask = mask[rows]
    # Two micro-batches per rank: the token count must cover both and both ranks.
    micro = [slice(0, 2), slice(2, None)]
    num_tokens = global_token_count([local_mask[m] for m in micro])
    micro_losses = [
        aggregate_loss(loss[rows][m], local_mask[m], "token-mean", num_tokens=num_tokens)
        for m in micro
    ]
    return {
        "whitened": global_masked_whiten(values[rows], local_mask),
        "local_whitened": masked_whiten(values[rows], local_mask),
        "loss": sum(micro_losses),
        "num_tokens": num_tokens,
    }


def test_global_whiten_and_token_mean_match_single_process():
    results = run_distributed(_whiten_and_loss, 2, 0)
    values, loss, mask = _global_batch(0)
    expected = masked_whiten(values, mask)
    whitened = torch.cat([r["whitened"] for r in results])
    torch.testing.assert_close(whitened, expected)
    local = torch.cat([r["local_whitened"] for r in results])
    assert not torch.allclose(local, expected)

    assert [r["num_tokens"] for r in results] == [int(mask.sum())] * 2
    summed_over_ranks = sum(r["loss"] for r in results)
    torch.testing.assert_close(summed_over_ranks, aggregate_loss(loss, mask, "token-mean"))
