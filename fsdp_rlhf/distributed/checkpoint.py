"""Resumable checkpoints: sharded models and optimizers (DCP), per-rank RNG, trainer state.

Layout of ``<ckpt_path>/step_<N>/``::

    models/          DCP shards of every model + optimizer + scheduler named in ``stateful``
    rng_rank<r>.pt   python / numpy / torch (CPU and CUDA) generator states of rank r
    trainer.json     step, data position and other plain values (rank 0 writes it)
    COMPLETE         written last: {"step", "written_at"}; a folder without it is ignored

A checkpoint is first written as ``step_<N>.tmp`` and renamed once every rank has finished, so
a crash mid-save never leaves something that looks complete; leftover ``.tmp`` folders are
removed by rank 0 at the next save or resume (a save that fails, e.g. on a full disk, removes
its own at once). The small files and the rename are fsynced.

"Newest" means most recently written (``written_at``), not the highest step number: a fresh run
into a folder that still holds higher-numbered checkpoints of an older run must neither resume
from those nor prune away the checkpoint it has just written. On resume, a newest checkpoint
that cannot be read (truncated shard, corrupt metadata or trainer.json) is skipped with a
warning in favour of the previous complete one.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_rlhf.distributed.env import PeerFailure, broadcast_object, run_and_agree
from fsdp_rlhf.errors import UserError, write_fault

log = logging.getLogger("fsdp_rlhf")

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")


def rng_state() -> dict[str, Any]:
    """Generator states as tensors, ints and lists only, so they load with
    ``torch.load(weights_only=True)`` (no arbitrary unpickling of checkpoint files)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    """Write and fsync: a power loss after the rename must not leave an empty trainer.json."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_rng(path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(rng_state(), f)
        f.flush()
        os.fsync(f.fileno())


# Frozen parameters (a LoRA model's base) are the run's input model, not its state: a checkpoint
# holds only what training changes. With every parameter trainable this is the full model.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def _load_trained(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a trained-only model state; every trainable parameter must be in it."""
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    result = set_model_state_dict(model, state, options=options)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    missing = sorted(set(result.missing_keys) - frozen)
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint does not match the model: missing {missing[:3]}, unexpected "
            f"{sorted(result.unexpected_keys)[:3]}"
        )


def _app_state(
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Any],
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, model in models.items():
        state[f"model.{name}"] = get_model_state_dict(model, options=_TRAINED_ONLY)
    for name, opt in optimizers.items():
        state[f"optim.{name}"] = get_optimizer_state_dict(models[name], opt)
    for name, sched in schedulers.items():
        state[f"sched.{name}"] = sched.state_dict()
    return state


def _written_at(d: Path) -> float:
    """When a checkpoint was completed: from COMPLETE (survives copies), else its mtime."""
    marker = d / "COMPLETE"
    try:
        return float(json.loads(marker.read_text())["written_at"])
    except (ValueError, KeyError, TypeError, OSError):
        # Older checkpoints hold only the step number in COMPLETE.
        return marker.stat().st_mtime


def list_checkpoints(ckpt_path: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, folder), oldest written first."""
    root = Path(ckpt_path)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / "COMPLETE").is_file():
            found.append((_written_at(d), int(m.group(1)), d))
    return [(step, d) for _, step, d in sorted(found)]


def latest_checkpoint(ckpt_path: str | Path) -> Path | None:
    """The most recently written complete checkpoint (not checked for readability)."""
    found = list_checkpoints(ckpt_path)
    return found[-1][1] if found else None


def remove_stale_tmp(ckpt_path: str | Path) -> list[Path]:
    """Rank 0: delete ``step_<N>.tmp`` folders left by saves that crashed. Returns them."""
    root = Path(ckpt_path)
    stale = [d for d in root.iterdir() if _TMP_DIR.match(d.name)] if root.is_dir() else []
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return stale


def folder_bytes(path: Path) -> int:
    """Total size of the files under ``path`` (links not followed)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _prune(root: Path, keep: int, just_written: Path, max_bytes: float | None = None) -> None:
    """Keep the ``keep`` most recently written checkpoints, then delete the oldest until the
    complete checkpoints total at most ``max_bytes``; never the one just written. Each
    removal is logged with its reason."""
    found = [d for _, d in list_checkpoints(root)]
    if keep > 0:
        for old in found[:-keep]:
            if old != just_written:
                shutil.rmtree(old, ignore_errors=True)
                log.info("removed checkpoint %s (--max_ckpt_num %d)", old, keep)
        found = [d for d in found if d.exists()]
    if max_bytes is None:
        return
    sizes = {d: folder_bytes(d) for d in found}
    for old in found:
        total = sum(sizes.values())
        if total <= max_bytes or old == just_written:
            break
        shutil.rmtree(old, ignore_errors=True)
        log.info(
            "removed checkpoint %s (%.2f GiB): the checkpoints took %.2f GiB, over "
            "--max_ckpt_mem %g GiB",
            old,
            sizes.pop(old) / 2**30,
            total / 2**30,
            max_bytes / 2**30,
        )


def save_checkpoint(
    ckpt_path: str | Path,
    step: int,
    *,
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    schedulers: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int = 3,
    max_bytes: float | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank must call it. Optimizer keys must match model keys.

    ``max_bytes``: after the save, older checkpoints are deleted until the complete ones
    total at most this (the new one always stays). ``write_extra(folder)``, a collective
    called on every rank after the shards are written and before the checkpoint is marked
    complete, adds files that belong to it (a HF export), so they appear, rotate and
    disappear with it.

    A failure on one rank (disk full, permissions) is agreed on by all ranks right away, so
    none is left waiting at a barrier for the process-group timeout; the partial folder is
    deleted and a refused write raises :class:`~fsdp_rlhf.errors.WriteFault` ("no space left
    on device while writing PATH"), the ranks that did not fail :class:`PeerFailure`.
    """
    root = Path(ckpt_path)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0

    def prepare() -> None:
        remove_stale_tmp(root)
        tmp.mkdir(parents=True)

    def finalize() -> None:
        state = json.dumps({"step": step, **trainer_state}, indent=1).encode()
        _write_durable(tmp / "trainer.json", state)
        marker = json.dumps({"step": step, "written_at": time.time()}).encode()
        _write_durable(tmp / "COMPLETE", marker)
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
        _prune(root, keep, final, max_bytes)

    try:
        run_and_agree(prepare, f"creating {tmp}", only_rank0=True)
        dcp.save(_app_state(models, optimizers, schedulers), checkpoint_id=str(tmp / "models"))
        run_and_agree(lambda: _save_rng(tmp / f"rng_rank{rank}.pt"), f"writing RNG state to {tmp}")
        if write_extra is not None:
            write_extra(tmp)
        run_and_agree(finalize, f"completing checkpoint {final}", only_rank0=True)
    except (Exception, CheckpointException) as e:
        # Every rank gets here together (each step above is agreed on, DCP's save raises on
        # all ranks), so rank 0 may delete the partial folder: nothing half-written stays.
        failure = _save_failure(e, final)  # before the delete: it may look at the free space
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is e:
            raise
        raise failure from e
    return final


def _save_failure(e: BaseException, final: Path) -> BaseException:
    """What a failed save raises: a one-line WriteFault for a full disk or another refused
    write; else the error itself (DCP's CheckpointException, a BaseException, as an Exception
    so the CLI reports it)."""
    if isinstance(e, PeerFailure):
        return e  # the rank that failed reports it
    fault = write_fault(e, final, removed_partial=True)
    if fault is not None:
        return fault
    if isinstance(e, CheckpointException):
        return RuntimeError(f"writing checkpoint {final} failed: {e}")
    return e


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
        _load_trained(model, state[f"model.{name}"])
    for name, opt in optimizers.items():
        set_optimizer_state_dict(models[name], opt, state[f"optim.{name}"])
    for name, sched in schedulers.items():
        sched.load_state_dict(state[f"sched.{name}"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():  # a resume on a different world size keeps fresh RNG for new ranks
        try:
            set_rng_state(torch.load(rng_file, weights_only=True))
        except pickle.UnpicklingError:
            # Checkpoints from before the tensor-only format hold numpy arrays; they are not
            # unpickled (that could run code), at the cost of fresh random streams.
            log.warning("%s: RNG state in an old format, not restored", rng_file)
    return json.loads((path / "trainer.json").read_text())


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from, or None. Reads metadata only, not the shards:
    trainer.json must parse, the DCP metadata must load and every shard file it names must
    exist and be long enough (a torn write or a full disk leaves files short)."""
    try:
        json.loads((path / "trainer.json").read_text())
        meta = dcp.FileSystemReader(str(path / "models")).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure means "unreadable"; say which
        return f"{type(e).__name__}: {e}"
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = str(info.relative_path)
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, size in need.items():
        f = path / "models" / rel
        if not f.is_file() or f.stat().st_size < size:
            return f"shard {rel} is missing or shorter than its metadata says"
    return None


def _newest_readable(ckpt_path: str | Path) -> Path | None:
    """Rank 0: clean up, then the most recently written checkpoint that passes the checks."""
    remove_stale_tmp(ckpt_path)
    for _, d in reversed(list_checkpoints(ckpt_path)):
        problem = checkpoint_problem(d)
        if problem is None:
            return d
        log.warning("checkpoint %s is unreadable (%s); trying the previous one", d, problem)
    return None


def resolve_resume(ckpt_path: str | Path, load: bool) -> Path | None:
    """The checkpoint to resume from, agreed on by all ranks (rank 0 decides)."""
    if not load:
        return None
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    found = _newest_readable(ckpt_path) if rank0 else None
    found = broadcast_object(found)
    return Path(found) if found else None


def check_resumable(
    path: str | Path, current: dict[str, Any], keys: list[str], flag: str = "--load_checkpoint"
) -> None:
    """UserError when ``path`` was written with other values of ``keys`` than ``current``.

    Keys a checkpoint does not record (written by an older version) are not compared.
    """
    path = Path(path)
    saved = json.loads((path / "trainer.json").read_text())
    diff = [k for k in keys if k in saved and saved[k] != current[k]]
    if diff:
        got = ", ".join(f"{k} {saved[k]} -> {current[k]}" for k in diff)
        raise UserError(
            f"{flag} {path}: written with different data or batch settings ({got}); "
            "the data order could not continue. Restore them or start with a new --ckpt_path"
        )
