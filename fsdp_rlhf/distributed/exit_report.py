"""How a failing multi-rank job tells the user why, whichever rank found the problem.

torchrun stops every rank (SIGTERM) as soon as one exits with a non-zero code. A line printed
by rank 0 alone is then lost whenever another rank fails first, and a report rank 0 is still
printing (``doctor``'s verdict) is cut off. So before a rank exits with a failure it meets the
others in torchrun's key-value store (the agent's TCPStore, there before the process group
exists and after it is destroyed):

* each failing rank records its message; ranks that failed the same way print it once, as
  ``error: ...`` when every rank did, else with their ranks (``error [rank 1]: ...``,
  ``error [ranks 0,2-3]: ...``); a rank whose only news is that another rank failed
  (``PeerFailure``) stays silent unless no rank with a reason has shown up;
* no rank exits until every rank that arrived has printed, so no line or report is cut off;
* an unexpected error on a rank after another rank noted its failure (:func:`note_failing`) is
  a consequence (a broken collective): reported without a traceback, unless no rank says more;
* the meeting is bounded: a rank that never arrives (it is well and blocked in a collective, or
  hung) costs at most :data:`WAIT_S` seconds, and ranks that already passed the validation
  phase (:func:`note_prepared`) are not waited for at all; a SIGTERM (another rank exited)
  ends the wait at once, this rank's own line printed first.

Without torchrun's store (a single process, or ranks started by hand) every failing rank prints
its own line with its rank, at once.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TextIO

WAIT_S = 5.0  # for the other ranks to arrive with their failure
PRINTED_WAIT_S = 5.0  # for the ranks that arrived to print, before this one exits
_CONNECT_S = 5.0
_POLL_S = 0.05


@dataclass(frozen=True)
class Failure:
    """What one rank reports: its exit code and message (None: nothing to say, e.g. a report
    already printed). ``secondary``: the message only says that another rank failed."""

    code: int
    message: str | None = None
    secondary: bool = False


def format_ranks(ranks: Iterable[int]) -> str:
    """``[1]`` -> ``rank 1``; ``[0, 2, 3, 4]`` -> ``ranks 0,2-4``."""
    rs = sorted(set(ranks))
    spans, start, prev = [], rs[0], rs[0]
    for r in rs[1:]:
        if r != prev + 1:
            spans.append((start, prev))
            start = r
        prev = r
    spans.append((start, prev))
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(rs) == 1 else "ranks ") + text


def lines_to_print(rank: int, world: int, failures: dict[int, Failure]) -> list[str]:
    """The lines ``rank`` prints, given the failures it knows of (its own included).

    Each distinct message is printed by the lowest rank that has it; secondary messages only
    when no rank brought a primary one.
    """
    said = {r: f for r, f in failures.items() if f.message and not f.secondary}
    if not said:
        said = {r: f for r, f in failures.items() if f.message}
    groups: dict[str, list[int]] = {}
    for r in sorted(said):
        groups.setdefault(said[r].message, []).append(r)
    out = []
    for message, ranks in groups.items():
        if ranks[0] != rank:
            continue
        who = "" if world == 1 or len(ranks) == world else f" [{format_ranks(ranks)}]"
        out.append(f"error{who}: {message}")
    return out


_connected = None


def _store():
    """A client of torchrun's store, namespaced to this run and restart; None without one."""
    global _connected
    if _connected is not None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return _connected
    try:
        from torch.distributed import PrefixStore, TCPStore

        store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=_CONNECT_S),
        )
    except Exception:  # noqa: BLE001 - no store: each rank speaks for itself
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _connected = PrefixStore(f"fsdp_rlhf/exit/{run}/{attempt}", store)
    return _connected


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_passed_prepare = False


def note_prepared() -> None:
    """This rank passed the validation phase (before the process group). A rank that failed
    in that phase need not wait for this one: it will not fail there any more, and it cannot
    get past the process group's start, where it waits for the failed rank."""
    global _passed_prepare
    _passed_prepare = True
    if _rank_world()[1] > 1 and (store := _store()) is not None:
        try:
            store.add("prepared", 1)
        except Exception:  # noqa: BLE001 - an optimisation only; the wait stays bounded
            pass


_failed_as: int | None = None  # this rank's place among the ranks that failed after validation


def note_failing() -> None:
    """This rank failed after the process group started. Called before its teardown, which
    breaks the collectives the other ranks wait in: their errors ("Connection closed by
    peer") come after this note, so :func:`first_to_fail` tells them they are consequences."""
    global _failed_as
    if _failed_as is not None or _rank_world()[1] == 1 or (store := _store()) is None:
        return
    try:
        _failed_as = store.add("failing", 1)
    except Exception:  # noqa: BLE001 - without the note an error is reported as unexpected
        pass


def first_to_fail() -> bool:
    """Whether no other rank noted a failure before this one (True when unknown)."""
    return _failed_as is None or _failed_as == 1


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


_held_sigterm = False


def hold_termination() -> None:
    """This rank is failing: a SIGTERM from now on (torchrun stopping every rank because
    another one ended first) must not kill it before :func:`report` has printed its line, so
    it is only noted; ``report`` then prints at once instead of waiting for the others, and
    says nothing when its news is only that another rank failed first (that one speaks)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _note_sigterm)


def _note_sigterm(signum, frame) -> None:
    global _held_sigterm
    _held_sigterm = True


def _wait(store, until, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not until(store) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


def _records(store) -> dict[int, Failure]:
    out = {}
    for line in store.get("failures").decode().splitlines():
        rank, code, message, secondary = json.loads(line)
        out[rank] = Failure(code, message, secondary)
    return out


def _print(lines: list[str], file: TextIO) -> None:
    if lines:
        file.write("".join(line + "\n" for line in lines))  # one write per rank
        file.flush()


def report(failure: Failure, *, file: TextIO | None = None, wait_s: float = WAIT_S) -> None:
    """Print this rank's part of the job's error report; return when it may exit.

    Every rank that is about to exit with a failure calls it (see the module docstring).
    """
    file = file or sys.stderr
    sys.stdout.flush()  # a report already written to stdout goes out first
    rank, world = _rank_world()
    alone = {rank: failure}
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    printed = False
    try:
        if _held_sigterm:  # torchrun is stopping the job: no time to meet the others
            if not (failure.secondary and not first_to_fail()):  # else the first one speaks
                _print(lines_to_print(rank, world, alone), file)
            printed = True
            return
        store = _store() if world > 1 else None
        if store is None:
            _print(lines_to_print(rank, world, alone), file)
            return
        record = [rank, failure.code, failure.message, failure.secondary]
        store.append("failures", json.dumps(record) + "\n")
        store.add("arrived", 1)

        def everyone_known(s) -> bool:
            # failed before the process group: the ranks that passed validation will not come
            done = 0 if _passed_prepare else s.add("prepared", 0)
            return s.add("arrived", 0) + done >= world

        _wait(store, everyone_known, wait_s)
        _print(lines_to_print(rank, world, _records(store)), file)
        printed = True
        store.add("printed", 1)
        # the ranks that arrived by now print before anyone leaves (torchrun would cut them off)
        _wait(store, lambda s: s.add("printed", 0) >= s.add("arrived", 0), PRINTED_WAIT_S)
    except Exception:  # noqa: BLE001 - the store failed, or SIGTERM: speak for oneself
        if not printed:
            _print(lines_to_print(rank, world, alone), file)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
