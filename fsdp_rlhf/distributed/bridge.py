"""Point-to-point messages between the two sides of an asynchronous job (the *bridge*).

A gloo backend over every rank of the job, built from the job's TCPStore beside each rank's
default group (:mod:`fsdp_rlhf.distributed.split_world`) and used through its own ``send`` /
``recv``. Messages are tensors or small objects (``torch.save`` bytes behind a length) on
numbered *channels* (gloo tags): between two ranks, messages on one channel arrive in the
order they were sent.

gloo's receive work reports completion only once waited on, so :class:`Expected` waits in a
daemon thread and the caller polls a flag: that is how a rollout rank checks for new weights
between two engine steps without blocking. Every blocking operation runs that way, and the
caller waits for it (:meth:`Bridge.wait_for`) looking at the peer every few seconds:

* a peer that died closes its sockets and the operation fails at once: a :class:`PeerLost`
  line naming the peer by role (``rollout rank 2 (engine 1)``);
* a peer whose heartbeat stands still for ``--heartbeat_timeout_s`` (stopped, hung, its host
  cut off) is gone too: :class:`PeerLost`, saying so;
* a live peer is waited for up to ``Patience.wait_s`` (``--dist_timeout_min``), then
  :class:`PeerSlow` says which side waited for what, that the other is alive, and what that
  one was waiting for itself, if anything (both sides publish their long waits in the job's
  store).

Each gloo wait gets a timeout far beyond that bound: a receive posted in the background (the
next weights, while a rollout rank generates) lasts a training step, however long, and gloo
fails every operation of the bridge once one of them times out.
"""

from __future__ import annotations

import collections
import datetime
import io
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from fsdp_rlhf.distributed.heartbeat import PeerBeats, PeerWatch
from fsdp_rlhf.errors import Fault

log = logging.getLogger("fsdp_rlhf")

# the timeout of each gloo wait: beyond any bound here (Patience.wait_s is the real one)
BACKGROUND_TIMEOUT = datetime.timedelta(days=7)


class Channel(IntEnum):
    CONTROL = 1  # training rank 0 -> rollout ranks: start, weight versions, end
    WEIGHTS = 2  # training rank 0 -> rollout ranks: weight buckets (gloo)
    EXPERIENCE = 3  # rollout ranks -> training ranks: one message per batch and route
    EVAL = 4  # rollout ranks -> training rank 0: each evaluation's sums


class PeerLost(Fault):
    """The other side of the bridge is gone (its process ended, or its host)."""


class PeerSlow(Fault):
    """The other side of the bridge is alive but did not answer within the wait bound."""


@dataclass(frozen=True)
class Patience:
    """How long a rank waits for a peer of the bridge, and how it tells a live one.

    Attributes:
        wait_s: the longest wait for a live peer (``--dist_timeout_min``).
        beats: the job's heartbeats (None: off, ``--heartbeat_timeout_s 0``; a wait then
            cannot tell a hung peer from a slow one).
    """

    wait_s: float
    beats: PeerBeats | None = None

    @property
    def poll_s(self) -> float:
        """Between two looks at the peer during a wait."""
        every = 5.0 if self.beats is None else min(5.0, self.beats.interval)
        return max(0.05, min(every, self.wait_s / 10))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def to_bytes(obj: Any) -> torch.Tensor:
    """``obj`` (tensors, numbers, strings, lists and dicts of them) as a uint8 tensor."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


class Bridge:
    """Messages to and from any rank of the job.

    Args:
        backend: a gloo backend over all ranks (``dist.ProcessGroupGloo``).
        rank: this rank (global).
        describe: names a global rank for messages (``SplitWorld.describe``).
        patience: how long to wait for a peer, and how to tell a live one.
    """

    def __init__(
        self,
        backend,
        rank: int,
        describe: Callable[[int], str],
        patience: Patience,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend, self.rank, self.describe = backend, rank, describe
        self.patience, self.clock = patience, clock
        # every gloo wait's own timeout: beyond any bound here (module docstring)
        self._gloo_wait = max(BACKGROUND_TIMEOUT, datetime.timedelta(seconds=3 * patience.wait_s))
        # isend work and its buffers, kept alive until waited on (oldest first)
        self._sends = Outbox()
        self._abandoned: list = []

    @classmethod
    def connect(
        cls, store: dist.Store, rank: int, world_size: int, patience: Patience, describe
    ) -> Bridge:
        """Collective over the whole job: every rank builds its end at start-up (within
        ``patience.wait_s``)."""
        backend = dist.ProcessGroupGloo(
            dist.PrefixStore("fsdp_rlhf/bridge", store),
            rank,
            world_size,
            datetime.timedelta(seconds=patience.wait_s),
        )
        return cls(backend, rank, describe, patience)

    def _lost(self, peer: int, what: str, e: BaseException) -> PeerLost:
        return PeerLost(
            f"{self.describe(peer)} is gone: the connection to it broke while {what} "
            f"({_first_line(e)}); its own log or the launcher's says why"
        )

    # ------------------------------------------------------------ waiting

    def wait_for(self, pending: Expected, peer: int, what: str, wait_s: float | None = None) -> Any:
        """``pending``'s result, waiting as the module docstring says (``what``: what this
        rank is doing, for the lines: ``receiving batch 3``; ``wait_s``: a bound of its own
        instead of ``patience.wait_s``)."""
        if pending.wait(self.patience.poll_s):
            return pending.result()
        watch = self.patience.beats.watch(peer) if self.patience.beats is not None else None
        self._note_waiting(peer, what)
        bound = self.patience.wait_s if wait_s is None else wait_s
        value = self._wait_long(pending, peer, what, watch, bound)
        self._note_waiting(None, "")  # kept when the wait fails: the other side reads it
        return value

    def _wait_long(
        self, pending: Expected, peer: int, what: str, watch: PeerWatch | None, bound: float
    ) -> Any:
        start = self.clock() - self.patience.poll_s
        warned = False
        while not pending.wait(self.patience.poll_s):
            verdict = watch.poll() if watch is not None else None
            if verdict is not None:
                raise self._silent(peer, what, verdict.silent_s)
            waited = self.clock() - start
            if waited > bound:
                raise PeerSlow(self._slow_line(peer, what, waited, watch))
            if not warned and waited > bound / 2 and bound >= 60:
                warned = True
                log.warning("%s", self._slow_line(peer, what, waited, watch, still=True))
        return pending.result()

    def _note_waiting(self, peer: int | None, what: str) -> None:
        """Tell the job's store what this rank waits for (a peer's slow line reads it)."""
        if self.patience.beats is not None:
            doing = "" if peer is None else json.dumps({"peer": peer, "what": what})
            self.patience.beats.note_waiting(self.rank, doing)

    def _silent(self, peer: int, what: str, silent_s: float) -> PeerLost:
        timeout = self.patience.beats.timeout_s if self.patience.beats is not None else 0
        return PeerLost(
            f"{self.describe(peer)} is gone: it sent no heartbeat for {silent_s:.0f} s "
            f"(--heartbeat_timeout_s {timeout:g}) while {self.describe(self.rank)} waited for "
            f"it, {what}: its process is stopped or hung, or its host is down or cut off"
        )

    def _slow_line(
        self, peer: int, what: str, waited: float, watch: PeerWatch | None, still: bool = False
    ) -> str:
        me, them = self.describe(self.rank), self.describe(peer)
        bound = f"--dist_timeout_min {self.patience.wait_s / 60:g}"
        if watch is None:
            state = (
                f"with --heartbeat_timeout_s 0 there is no telling whether {them} is alive or "
                "hung; its own log says"
            )
        else:
            state = (
                f"{them} is alive (its heartbeat moved {watch.silent_s():.0f} s ago), so it is "
                f"slow, not gone: {self._peer_doing(peer)}"
            )
        if still:
            return (
                f"{me} has waited {_duration(waited)} for {them}, {what}; {state}. "
                f"{bound} ends the job at {_duration(self.patience.wait_s)}"
            )
        return (
            f"{me} waited {_duration(waited)} for {them}, {what}, and gave up ({bound}); "
            f"{state}. Raise {bound.split()[0]} if that side's work can take this long"
        )

    def _peer_doing(self, peer: int) -> str:
        """What ``peer`` said it is waiting for, if it is waiting."""
        raw = self.patience.beats.waiting(peer) if self.patience.beats is not None else ""
        try:
            doing = json.loads(raw) if raw else None
        except ValueError:
            doing = None
        if not doing:
            return "it is not waiting for this job's other side (generating, scoring or training)"
        whom = "this rank" if doing["peer"] == self.rank else self.describe(doing["peer"])
        line = f"it is itself waiting for {whom}, {doing['what']}"
        if doing["peer"] == self.rank:
            line += " (each side waits for the other: a bug in the schedule, please report it)"
        return line

    def _blocking(
        self, run: Callable[[], Any], peer: int, what: str, wait_s: float | None = None
    ) -> Any:
        """``run()`` (gloo operations with ``peer``) in a thread, waited for here."""
        return self.wait_for(Expected(run), peer, what, wait_s)

    # ------------------------------------------------------------ tensors

    def _send_now(self, tensor: torch.Tensor, dst: int, channel: Channel, what: str) -> None:
        try:
            self.backend.send([tensor], dst, int(channel)).wait(self._gloo_wait)
        except RuntimeError as e:
            raise self._lost(dst, what, e) from e

    def _recv_now(self, tensor: torch.Tensor, src: int, channel: Channel, what: str):
        try:
            self.backend.recv([tensor], src, int(channel)).wait(self._gloo_wait)
        except RuntimeError as e:
            raise self._lost(src, what, e) from e
        return tensor

    def send(self, tensor: torch.Tensor, dst: int, channel: Channel, what: str = "sending") -> None:
        self._blocking(lambda: self._send_now(tensor, dst, channel, what), dst, what)

    def recv(self, tensor: torch.Tensor, src: int, channel: Channel, what: str = "receiving"):
        return self._blocking(lambda: self._recv_now(tensor, src, channel, what), src, what)

    def isend(
        self,
        tensors: list[torch.Tensor],
        dst: int,
        channel: Channel,
        what: str = "sending",
        outbox: Outbox | None = None,
    ) -> None:
        """Send without waiting; the tensors stay alive in ``outbox`` (default: the bridge's
        own) until :meth:`flush` (gloo's transport moves them meanwhile)."""
        outbox = self._sends if outbox is None else outbox
        for t in tensors:
            try:
                work = self.backend.send([t], dst, int(channel))
            except RuntimeError as e:
                raise self._lost(dst, what, e) from e
            outbox.append((work, t, dst))

    def flush(
        self,
        keep: int = 0,
        what: str = "sending",
        wait_s: float | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        """Wait for the oldest sends of ``outbox`` (default: the bridge's own) until at most
        ``keep`` are outstanding (``wait_s``: the bound of each wait, instead of
        ``patience.wait_s``)."""
        outbox = self._sends if outbox is None else outbox
        while len(outbox) > keep:
            work, _, dst = outbox.popleft()
            self._blocking(lambda w=work, d=dst: self._finish(w, d, what), dst, what, wait_s)

    def abandon_sends(self, outbox: Outbox | None = None) -> None:
        """Stop waiting for the outstanding sends of ``outbox`` (default: the bridge's own; a
        failed step's, before a last message): their buffers stay alive, gloo may still be
        reading them."""
        outbox = self._sends if outbox is None else outbox
        self._abandoned.extend(outbox)
        outbox.clear()

    def _finish(self, work, dst: int, what: str) -> None:
        try:
            work.wait(self._gloo_wait)
        except RuntimeError as e:
            raise self._lost(dst, what, e) from e

    # ------------------------------------------------------------ objects

    def send_object(
        self,
        obj: Any,
        dst: int,
        channel: Channel,
        wait: bool = True,
        what: str = "sending",
        outbox: Outbox | None = None,
    ) -> None:
        data = to_bytes(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        if wait:
            self.send(size, dst, channel, what)
            self.send(data, dst, channel, what)
        else:
            self.isend([size, data], dst, channel, what, outbox)

    def _recv_object_now(self, src: int, channel: Channel, what: str) -> Any:
        size = self._recv_now(torch.zeros(1, dtype=torch.int64), src, channel, what)
        data = self._recv_now(torch.empty(int(size), dtype=torch.uint8), src, channel, what)
        return from_bytes(data)

    def recv_object(self, src: int, channel: Channel, what: str = "receiving") -> Any:
        return self._blocking(lambda: self._recv_object_now(src, channel, what), src, what)

    def expect_object(self, src: int, channel: Channel, what: str = "receiving") -> Expected:
        """Start receiving the next object from ``src`` on ``channel`` in the background; its
        ``result()`` waits as :meth:`wait_for` does."""
        return Expected(
            lambda: self._recv_object_now(src, channel, what),
            waiter=lambda pending: self.wait_for(pending, src, what),
        )


class Outbox(collections.deque):
    """Sends posted without waiting, ``(work, tensor, destination)`` oldest first, kept (and
    their tensors alive) until waited on (:meth:`Bridge.flush`): gloo's work tells that it
    finished only once waited on."""


class Expected:
    """An operation running in a daemon thread; :meth:`ready` polls, :meth:`wait` waits at
    most a while, :meth:`result` waits (through ``waiter`` when given) and re-raises the
    operation's error."""

    def __init__(
        self, receive: Callable[[], Any], waiter: Callable[[Expected], Any] | None = None
    ) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiter = waiter

        def run() -> None:
            try:
                self._value = receive()
            except BaseException as e:  # noqa: BLE001 - handed to the caller in result()
                self._error = e
            finally:
                self._done.set()

        threading.Thread(target=run, name="fsdp_rlhf-bridge-recv", daemon=True).start()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        """Whether it finished within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def result(self) -> Any:
        if not self._done.is_set() and self._waiter is not None:
            return self._waiter(self)
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value
