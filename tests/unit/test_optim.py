"""``optim.py``: the AdamW parameter groups and the lr schedules, and their state in checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_rlhf.config import OptimConfig
from fsdp_rlhf.optim import build_optimizer, build_scheduler, lr_factor


def test_lr_schedules():
    cfg = OptimConfig(lr=1.0, lr_warmup_ratio=0.2, min_lr_ratio=0.1)  # 2 warmup steps of 10
    factors = [lr_factor(s, cfg, 10) for s in range(11)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # warmup starts above 0: no wasted step
    assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[10] == pytest.approx(0.1) and min(factors) >= 0.1
    linear = OptimConfig(lr_warmup_ratio=0.0, lr_scheduler="linear")
    assert [lr_factor(s, linear, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    const = OptimConfig(lr_warmup_ratio=0.5, lr_scheduler="constant_with_warmup")
    assert [lr_factor(s, const, 4) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_optimizer_groups_and_scheduler_state_round_trip():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = OptimConfig(lr=1e-3, l2=0.1, lr_warmup_ratio=0.25)
    opt = build_optimizer(model, cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]  # only the matrix decays
    sched = build_scheduler(opt, cfg, total_steps=8)
    lrs = []
    for _ in range(3):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    state = sched.state_dict()
    assert state["lr_lambdas"] == [None, None]  # only counters go into checkpoints
    again = build_scheduler(build_optimizer(model, cfg), cfg, total_steps=8)
    again.load_state_dict(state)
    assert again.get_last_lr() == sched.get_last_lr()
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3)
