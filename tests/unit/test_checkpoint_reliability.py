"""Checkpoint folder handling on one process: write-order pruning and resume, stale temp
folders, fallback past an unreadable newest checkpoint, tensor-only RNG files, resume checks,
and torn metrics rows. The two-rank case (a failed save ends every rank at once) is at the end.
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

from fsdp_rlhf.distributed.checkpoint import (
    check_resumable,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from fsdp_rlhf.errors import UserError, WriteFault
from fsdp_rlhf.metrics import truncate_metrics
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
