"""The actor's EMA (``distributed/ema.py``) on one process: OpenRLHF's update, frozen
parameters left out, the averaged weights swapped in and back. Saved with a checkpoint:
``test_checkpoint.py``; on 2 ranks: ``tests/distributed/test_ema.py``."""

from __future__ import annotations

import torch

from fsdp_rlhf.distributed.ema import ShardedEMA


def _model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))


def test_ema_follows_openrlhfs_update_and_skips_frozen_params():
    model = _model()
    model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = ShardedEMA(model, beta=0.9)
    ema.attach(opt)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        for n, p in model.named_parameters():
            expected[n] = 0.9 * expected[n] + 0.1 * p.detach()
    assert "0.bias" not in ema.shadow
    for name, value in ema.shadow.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-7)


def test_ema_applied_is_restored_bit_for_bit():
    model = _model()
    ema = ShardedEMA(model, beta=0.5)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.data.add_(1.0)
    ema.update()
    with ema.applied() as averaged:
        for n, p in averaged.named_parameters():
            torch.testing.assert_close(p, trained[n] + 0.5)
    for n, p in model.named_parameters():
        assert torch.equal(p, trained[n] + 1.0)
