"""Checkpoints (``distributed/checkpoint.py``, ``trainers/common.save``) on one process:
write-order pruning and resume, stale temp folders, fallback past an unreadable newest
checkpoint, tensor-only RNG files, resume checks, torn metrics rows; ``--max_ckpt_mem`` rotation
by size, files written into a checkpoint before it is complete (``--save_hf_ckpt``), and an EMA
of the weights saved and restored with the model. The two-rank case (a failed save ends every
rank at once) is at the end.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_rlhf.config import CheckpointConfig
from fsdp_rlhf.config_base import ConfigError
from fsdp_rlhf.distributed.checkpoint import (
    check_resumable,
    folder_bytes,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from fsdp_rlhf.distributed.ema import ShardedEMA
from fsdp_rlhf.errors import UserError, WriteFault
from fsdp_rlhf.metrics import truncate_metrics
from fsdp_rlhf.trainers import common
from tests.dist_utils import run_distributed


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"m": model}, {"m": opt}


def _save(root: Path, step: int, keep: int = 3, **state) -> Path:
    models, opts = _trained()
    return save_checkpoint(
        root, step, models=models, optimizers=opts, schedulers={}, trainer_state=state, keep=keep
    )


def test_fresh_run_into_old_folder_keeps_and_resumes_its_own_checkpoint(tmp_path):
    _save(tmp_path, 100, keep=2)
    _save(tmp_path, 200, keep=2)
    time.sleep(0.01)
    new = _save(tmp_path, 5, keep=2)  # a new run, lower step numbers
    assert new.is_dir()  # pruning by step number deleted exactly this one
    assert [s for s, _ in list_checkpoints(tmp_path)] == [200, 5]  # oldest written pruned
    assert latest_checkpoint(tmp_path) == new
    assert resolve_resume(tmp_path, True) == new


def test_stale_tmp_folders_are_removed(tmp_path):
    (tmp_path / "step_7.tmp" / "models").mkdir(parents=True)
    _save(tmp_path, 1)
    assert not (tmp_path / "step_7.tmp").exists()
    (tmp_path / "step_9.tmp").mkdir()
    assert resolve_resume(tmp_path, True) == tmp_path / "step_1"
    assert not (tmp_path / "step_9.tmp").exists()


@pytest.mark.parametrize("damage", ["truncated_shard", "bad_metadata", "bad_trainer_json"])
def test_unreadable_newest_falls_back_to_previous(tmp_path, caplog, damage):
    _save(tmp_path, 1, pos=1)
    newest = _save(tmp_path, 2, pos=2)
    if damage == "truncated_shard":
        shard = next((newest / "models").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:10])
    elif damage == "bad_metadata":
        (newest / "models" / ".metadata").write_bytes(b"\x00garbage")
    else:
        (newest / "trainer.json").write_text('{"step": 2, "pos"')
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"):
        found = resolve_resume(tmp_path, True)
    assert found == tmp_path / "step_1"
    assert "step_2 is unreadable" in caplog.text
    models, opts = _trained()
    assert load_checkpoint(found, models=models, optimizers=opts, schedulers={})["pos"] == 1


def test_rng_files_load_with_weights_only_and_restore_streams(tmp_path):
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    path = _save(tmp_path, 1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.load(path / "rng_rank0.pt", weights_only=True)  # raises on numpy/pickled objects
    random.seed(99)
    np.random.seed(99)
    models, opts = _trained()  # reseeds torch
    load_checkpoint(path, models=models, optimizers=opts, schedulers={})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    marker = json.loads((path / "COMPLETE").read_text())
    assert marker["step"] == 1 and marker["written_at"] > 0


def test_check_resumable(tmp_path):
    path = _save(tmp_path, 3, train_pairs=100, seed=1)
    check_resumable(
        path, {"train_pairs": 100, "seed": 1, "new_key": 5}, ["train_pairs", "seed", "new_key"]
    )
    with pytest.raises(UserError, match=r"--load_checkpoint .*train_pairs 100 -> 90"):
        check_resumable(path, {"train_pairs": 90, "seed": 1}, ["train_pairs", "seed"])


def test_truncate_metrics_tolerates_a_torn_last_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a": 3}\n{"step": 4, "a"')
    truncate_metrics(f, after_step=2)
    assert [json.loads(x)["step"] for x in f.read_text().splitlines()] == [1, 2]


def _model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))


def _save_model(root: Path, step: int, model=None, **kw) -> Path:
    model = model or _model(step)
    return save_checkpoint(
        root, step, models={"m": model}, optimizers={}, schedulers={}, trainer_state={}, **kw
    )


def test_max_ckpt_mem_removes_oldest_until_under_the_limit_and_logs_it(tmp_path, caplog):
    one = folder_bytes(_save_model(tmp_path, 1))
    time.sleep(0.01)
    _save_model(tmp_path, 2)
    time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="fsdp_rlhf"):
        # room for two checkpoints and a half: the oldest goes, the other two stay
        _save_model(tmp_path, 3, keep=10, max_bytes=2.5 * one)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    removed = [r.getMessage() for r in caplog.records if "removed checkpoint" in r.getMessage()]
    assert len(removed) == 1 and "step_1" in removed[0] and "--max_ckpt_mem" in removed[0]


def test_max_ckpt_mem_never_removes_the_newest(tmp_path):
    _save_model(tmp_path, 1)
    time.sleep(0.01)
    new = _save_model(tmp_path, 2, keep=10, max_bytes=1.0)  # smaller than any checkpoint
    assert [d for _, d in list_checkpoints(tmp_path)] == [new]


def test_max_ckpt_num_removals_are_logged(tmp_path, caplog):
    _save_model(tmp_path, 1)
    time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="fsdp_rlhf"):
        _save_model(tmp_path, 2, keep=1)
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


def _save_fails_on_rank0(rank: int, world: int, root: str) -> str:
    from fsdp_rlhf.distributed.env import PeerFailure

    started = time.monotonic()
    try:
        _save(Path(root), 1)
    except PeerFailure as e:
        return f"peer {time.monotonic() - started:.1f} {e}"
    except WriteFault as e:
        return f"own {e}"
    return "no error"


def test_failed_save_on_rank0_ends_the_other_ranks_at_once(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")  # rank 0 cannot create a checkpoint folder under a file
    out = run_distributed(_save_fails_on_rank0, 2, str(blocker), timeout=120)
    # the rank that failed says what and where, in one line
    assert (
        out[0] == f"own not a directory while writing {blocker}/step_1 (the partial copy "
        "was removed)"
    ), out[0]
    kind, seconds, *msg = out[1].split()
    assert kind == "peer" and float(seconds) < 30, out[1]
    assert "failed on rank 0" in " ".join(msg)
