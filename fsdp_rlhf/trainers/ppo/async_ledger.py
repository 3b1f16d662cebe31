"""The ledger of an asynchronous run: which prompts, and how many samples of each, were
generated, queued and trained, by which attempt (a launch; a resume starts the next one).

JSON lines under ``<save_path>/ledger/``, appended and flushed one event at a time (a SIGKILL
loses at most the line being written; a torn last line is skipped when read)::

    rollout<i>.jsonl  rollout rank i   generated  batch, prompts kept (with their samples),
                                                  prompts dropped (over-sampling, filtering)
                                       queued     batch (sent to the training ranks)
                                       weights    version (taken; loaded or only received)
    train.jsonl       training rank 0  start      the step the attempt starts after, and the
                                                  batches an interrupted attempt had
                                                  generated after it (generated again)
                                       trained    step, every prompt trained and its samples
                                       published  weight version

A ``start`` at step ``s`` voids the ``trained`` events of earlier attempts for steps after
``s``: the checkpoint it resumed from holds the models of step ``s``, so those steps are
trained again. :func:`trained` is what remains: the run's history as its models saw it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRAIN = "train.jsonl"


def ledger_folder(cfg) -> Path:
    """``<save_path>/ledger``."""
    return Path(cfg.ckpt.save_path) / "ledger"


def rollout_file(index: int) -> str:
    return f"rollout{index}.jsonl"


class LedgerWriter:
    """Appends one file's events (one writer per file)."""

    def __init__(self, folder: Path, name: str, attempt: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.attempt = attempt
        self._file = open(folder / name, "a", encoding="utf-8")  # noqa: SIM115 - held open

    def record(self, event: str, **fields: Any) -> None:
        row = {"event": event, "attempt": self.attempt, "t": round(time.time(), 3), **fields}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(path: Path) -> list[dict]:
    """A ledger file's events (none if it is missing; a torn last line is skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # the line a kill cut short
    return rows


def attempts(folder: Path) -> int:
    """How many attempts wrote to this ledger."""
    return sum(1 for r in read(folder / TRAIN) if r["event"] == "start")


def trained(folder: Path) -> dict[int, dict[int, int]]:
    """``{step: {prompt: samples}}``: what the run's models were trained on (module
    docstring: later starts void what earlier attempts trained after the step they resumed)."""
    out: dict[int, dict[int, int]] = {}
    for row in read(folder / TRAIN):
        if row["event"] == "start":
            out = {s: v for s, v in out.items() if s <= row["step"]}
        elif row["event"] == "trained":
            prompts = {int(p): int(n) for p, n in zip(row["prompts"], row["samples"], strict=True)}
            out[int(row["step"])] = prompts
    return out


def rollout_events(folder: Path) -> Iterator[tuple[int, dict]]:
    """``(rollout rank index, event)`` of every rollout rank's file."""
    for path in sorted(folder.glob("rollout*.jsonl")):
        index = int(path.stem.removeprefix("rollout"))
        for row in read(path):
            yield index, row


def generated_after(folder: Path, step: int) -> list[int]:
    """Batches after ``step`` that earlier attempts generated (and did not train for good):
    what a resume from ``step`` generates again."""
    batches = {
        int(row["batch"])
        for _, row in rollout_events(folder)
        if row["event"] == "generated" and int(row["batch"]) > step
    }
    return sorted(batches)
