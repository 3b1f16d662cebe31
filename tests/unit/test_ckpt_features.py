"""Checkpoint features of OpenRLHF's flags on one process: ``--max_ckpt_mem`` rotation by size,
files written into a checkpoint before it is complete (``--save_hf_ckpt``), and an EMA of the
weights (``--enable_ema``) saved and restored with the model."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.config import CheckpointConfig
from fsdp_rlhf.config_base import ConfigError
from fsdp_rlhf.distributed.checkpoint import (
    folder_bytes,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from fsdp_rlhf.distributed.ema import ShardedEMA
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.trainers import common


def _model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))


def _save(root: Path, step: int, model=None, **kw) -> Path:
    model = model or _model(step)
    return save_checkpoint(
        root, step, models={"m": model}, optimizers={}, schedulers={}, trainer_state={}, **kw
    )


def test_max_ckpt_mem_removes_oldest_until_under_the_limit_and_logs_it(tmp_path, caplog):
    one = folder_bytes(_save(tmp_path, 1))
    time.sleep(0.01)
    _save(tmp_path, 2)
    time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="fsdp_rlhf"):
        # room for two checkpoints and a half: the oldest goes, the other two stay
        _save(tmp_path, 3, keep=10, max_bytes=2.5 * one)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    removed = [r.getMessage() for r in caplog.records if "removed checkpoint" in r.getMessage()]
    assert len(removed) == 1 and "step_1" in removed[0] and "--max_ckpt_mem" in removed[0]


def test_max_ckpt_mem_never_removes_the_newest(tmp_path):
    _save(tmp_path, 1)
    time.sleep(0.01)
    new = _save(tmp_path, 2, keep=10, max_bytes=1.0)  # smaller than any checkpoint
    assert [d for _, d in list_checkpoints(tmp_path)] == [new]


def test_max_ckpt_num_removals_are_logged(tmp_path, caplog):
    _save(tmp_path, 1)
    time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="fsdp_rlhf"):
        _save(tmp_path, 2, keep=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert any("step_1 (--max_ckpt_num 1)" in r.getMessage() for r in caplog.records)


def test_max_ckpt_mem_config():
    assert CheckpointConfig().max_ckpt_bytes is None  # OpenRLHF's default: no limit
    assert CheckpointConfig(max_ckpt_mem=float("inf")).max_ckpt_bytes is None
    assert CheckpointConfig(max_ckpt_mem=1.5).max_ckpt_bytes == 1.5 * 2**30
    with pytest.raises(ConfigError, match="max_ckpt_mem"):
        CheckpointConfig(max_ckpt_mem=0)


def test_hf_export_is_inside_the_checkpoint_and_rotates_with_it(tmp_path):
    cfg = CheckpointConfig(ckpt_path=str(tmp_path), save_hf_ckpt=True, max_ckpt_num=1)
    seen = []

    def export(folder: Path) -> None:
        # written while the checkpoint is still a temporary folder: it completes with it
        assert folder.parent.name.endswith(".tmp") and not (folder.parent / "COMPLETE").exists()
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        seen.append(folder)

    state = common.TrainedModels(models={"m": _model()})
    first = common.save(cfg, 1, state, {}, hf_export=export)
    assert (first / common.HF_CKPT_DIR / "config.json").is_file()
    time.sleep(0.01)
    second = common.save(cfg, 2, state, {}, hf_export=export)
    assert not first.exists() and (second / "hf" / "config.json").is_file()
    assert [f.name for f in seen] == ["hf", "hf"]
    with pytest.raises(UserError, match="--save_hf_ckpt"):
        common.save(cfg, 3, state, {})  # a command without an exporter must say so


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


def test_ema_is_saved_and_restored_with_the_checkpoint(tmp_path):
    model = _model(0)
    ema = ShardedEMA(model, beta=0.8)
    for p in model.parameters():
        p.data.mul_(2.0)
    ema.update()
    saved = {n: t.clone() for n, t in ema.shadow.items()}
    path = save_checkpoint(
        tmp_path,
        1,
        models={"m": model},
        optimizers={},
        schedulers={"m_ema": ema},
        trainer_state={},
    )
    fresh_model = _model(1)
    fresh = ShardedEMA(fresh_model, beta=0.8)
    load_checkpoint(path, models={"m": fresh_model}, optimizers={}, schedulers={"m_ema": fresh})
    for name, value in saved.items():
        assert torch.equal(fresh.shadow[name], value)
