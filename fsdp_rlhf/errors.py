"""Errors the CLI reports as one line (no traceback through fsdp_rlhf unless ``--debug``).

* :class:`UserError` (exit 2): the user's input is wrong: flags, files, data, sizes, or the
  user's own code (a reward function or environment that raises).
* :class:`Fault` (exit 1): something the run depends on failed while it ran: a full disk, an
  unreachable reward server.

Helpers here turn the exceptions raised at those boundaries into such lines: a user file's
``path:line`` and its own frames (:func:`user_code_error`), the operating system's refusal of a
write (:func:`write_fault`, :func:`writing`), a library failing on the user's model or config
files (:func:`reading`).
"""

from __future__ import annotations

import errno
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input: flags, files, data, sizes, their reward code.

    ``detail`` (optional) is printed under the one line: the user's own stack frames.
    """

    exit_code = 2

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class Fault(Exception):
    """Something outside fsdp-rlhf failed mid-run (disk, network); reported as one line."""

    exit_code = 1


class WriteFault(Fault):
    """The filesystem refused a write of ``path`` (full disk, quota, read-only, permissions).

    ``removed_partial``: the half-written copy was deleted, nothing of it is left on disk.
    """

    def __init__(self, reason: str, path: str | Path, *, removed_partial: bool = False) -> None:
        self.reason, self.path, self.removed_partial = reason, str(path), removed_partial
        self.checkpoint_note = ""
        super().__init__(self._line())

    def _line(self) -> str:
        partial = " (the partial copy was removed)" if self.removed_partial else ""
        return f"{self.reason} while writing {self.path}{partial}{self.checkpoint_note}"

    def naming_checkpoint(self, newest: Path | None) -> WriteFault:
        """End the line with the newest complete checkpoint (or that there is none)."""
        self.checkpoint_note = (
            f"; the newest complete checkpoint is {newest}, intact"
            if newest is not None
            else "; there is no complete checkpoint to resume from"
        )
        self.args = (self._line(),)
        return self


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e``, what it was raised from or during, and what a DCP CheckpointException wraps."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        cur = todo.pop(0)
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        todo += [cur.__cause__, cur.__context__]
        failures = getattr(cur, "failures", None)  # torch.distributed.checkpoint: rank -> error
        if isinstance(failures, dict):
            for f in failures.values():
                # DCP ships failures between ranks as (exception, traceback summary) tuples
                todo.append(f[0] if isinstance(f, tuple) and f else f)


# Rust IO errors in safetensors' SafetensorError text, by kind.
_RUST_KINDS = {"StorageFull": 28, "QuotaExceeded": 122, "ReadOnlyFilesystem": 30}


def os_errno(e: BaseException) -> int | None:
    """The errno of the operating-system error behind ``e``, if there is one."""
    for cur in _chain(e):
        if isinstance(cur, OSError) and cur.errno:
            return cur.errno
        text = str(cur)
        for kind, number in _RUST_KINDS.items():
            if f"kind: {kind}" in text or f"os error {number})" in text:
                return number
    return None


# Free space under which a failed write is taken for a full disk: some writers lose the errno
# (torch.save's zip writer reports "unexpected pos"), and what a failed write leaves free is
# less than its buffer.
FULL_DISK_BYTES = 64 * 2**20


def free_bytes(path: str | Path) -> int | None:
    """Bytes this process may still write on the filesystem of ``path`` (or of its nearest
    existing parent); None when that cannot be told."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use reserved blocks
    return blocks * st.f_frsize


def write_fault(
    e: BaseException, path: str | Path, *, removed_partial: bool = False
) -> WriteFault | None:
    """A :class:`WriteFault` when ``e`` is the filesystem refusing to write ``path``
    ("no space left on device while writing PATH"); None when ``e`` is something else.

    Call it before deleting what the failed write left: a full disk is also recognised by the
    space left on it when the writer lost the errno.
    """
    number = os_errno(e)
    if number is None:
        free = free_bytes(path)
        if free is None or free >= FULL_DISK_BYTES:
            return None
        number = errno.ENOSPC
    return WriteFault(os.strerror(number).lower(), path, removed_partial=removed_partial)


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Inside: an OSError writing ``path`` (full disk, quota, permissions) becomes a one-line
    :class:`WriteFault` naming it."""
    try:
        yield
    except OSError as e:
        fault = write_fault(e, path)
        if fault is None:
            raise
        raise fault from e


@contextmanager
def reading(what: str, path: str | Path) -> Iterator[None]:
    """Inside: any failure loading the user's ``what`` from ``path`` (a model, a tokenizer, a
    config file) becomes one :class:`UserError` line naming both; ours stay UserErrors."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a library's error about the user's files
        raise UserError(f"{path}: cannot load the {what}: {exception_line(e)}") from e


def _user_frames(e: BaseException, path: Path) -> list[traceback.FrameSummary]:
    frames = traceback.extract_tb(e.__traceback__)
    return [f for f in frames if Path(f.filename).resolve() == path]


def user_code_where(path: str | Path, e: BaseException) -> str:
    """``path:line`` of the line in the user's file where ``e`` was raised (``path`` alone when
    it was raised elsewhere, e.g. by our checks of what the file returned)."""
    p = Path(path).resolve()
    frames = _user_frames(e, p)
    line = frames[-1].lineno if frames else None
    if isinstance(e, SyntaxError) and e.lineno and Path(e.filename or "").resolve() == p:
        line = e.lineno
    return f"{path}:{line}" if line else str(path)


def exception_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def user_code_error(what: str, path: str | Path, e: BaseException, doing: str = "") -> UserError:
    """The user's file raised ``e``: one line ``WHAT PATH:LINE: DOING Type: message`` (the
    line in their file where it raised), and only their own frames as detail.

    e.g. ``user_code_error("rule reward file", p, e, "reward_func raised")``.
    """
    frames = _user_frames(e, Path(path).resolve())
    detail = "".join(traceback.format_list(frames)).rstrip() if frames else ""
    doing = f"{doing} " if doing else ""
    return UserError(
        f"{what} {user_code_where(path, e)}: {doing}{exception_line(e)}", detail=detail
    )
