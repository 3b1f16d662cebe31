"""Resumable checkpoints: sharded models and optimizers (DCP), per-rank RNG, trainer state.

Layout of ``<ckpt_path>/step_<N>/``::

    models/          DCP shards of every model + optimizer + scheduler named in ``stateful``
    rng_rank<r>.pt   python / numpy / torch (CPU and CUDA) generator states of rank r
    trainer.json     step, data position and other plain values (rank 0 writes it)
    COMPLETE         written last; a folder without it is ignored on resume and cleaned up

A checkpoint is first written as ``step_<N>.tmp`` and renamed once every rank has finished, so
a crash mid-save never leaves something that looks complete.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_rlhf.distributed.env import barrier, broadcast_object

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _app_state(
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Any],
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, model in models.items():
        state[f"model.{name}"] = get_model_state_dict(model)
    for name, opt in optimizers.items():
        state[f"optim.{name}"] = get_optimizer_state_dict(models[name], opt)
    for name, sched in schedulers.items():
        state[f"sched.{name}"] = sched.state_dict()
    return state


def list_checkpoints(ckpt_path: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = Path(ckpt_path)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / "COMPLETE").is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(ckpt_path: str | Path) -> Path | None:
    found = list_checkpoints(ckpt_path)
    return found[-1][1] if found else None


def save_checkpoint(
    ckpt_path: str | Path,
    step: int,
    *,
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int = 3,
) -> Path:
    """Collective: every rank must call it. Optimizer keys must match model keys."""
    root = Path(ckpt_path)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(_app_state(models, optimizers, schedulers), checkpoint_id=str(tmp / "models"))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps({"step": step, **trainer_state}, indent=1))
    barrier()
    if rank == 0:
        (tmp / "COMPLETE").write_text(str(step))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(
    path: str | Path,
    *,
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Any],
) -> dict[str, Any]:
    """Restore in place; returns the trainer state (``step`` and what was saved with it)."""
    path = Path(path)
    state = _app_state(models, optimizers, schedulers)
    dcp.load(state, checkpoint_id=str(path / "models"))
    for name, model in models.items():
        set_model_state_dict(model, state[f"model.{name}"])
    for name, opt in optimizers.items():
        set_optimizer_state_dict(models[name], opt, state[f"optim.{name}"])
    for name, sched in schedulers.items():
        sched.load_state_dict(state[f"sched.{name}"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():  # a resume on a different world size keeps fresh RNG for new ranks
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / "trainer.json").read_text())


def resolve_resume(ckpt_path: str | Path, load: bool) -> Path | None:
    """The checkpoint to resume from, agreed on by all ranks (rank 0 decides)."""
    if not load:
        return None
    found = (
        latest_checkpoint(ckpt_path)
        if (not dist.is_initialized() or dist.get_rank() == 0)
        else None
    )
    found = broadcast_object(found)
    return Path(found) if found else None
