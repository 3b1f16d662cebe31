"""Point-to-point messages between the two sides of an asynchronous job (the *bridge*).

A gloo backend over every rank of the job, built from the job's TCPStore beside each rank's
default group (:mod:`fsdp_rlhf.distributed.split_world`) and used through its own ``send`` /
``recv``. Messages are tensors or small objects (``torch.save`` bytes behind a length) on
numbered *channels* (gloo tags): between two ranks, messages on one channel arrive in the
order they were sent.

gloo's receive work reports completion only once waited on, so :class:`Expected` waits in a
daemon thread and the caller polls a flag: that is how a rollout rank checks for new weights
between two engine steps without blocking.

A peer that died closes its sockets and the operation fails at once; the error becomes a
:class:`PeerLost` line naming the peer by role (``rollout rank 2 (engine 1)``).
"""

from __future__ import annotations

import collections
import datetime
import io
import threading
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from fsdp_rlhf.errors import Fault


class Channel(IntEnum):
    CONTROL = 1  # training rank 0 -> rollout ranks: start, weight versions, end
    WEIGHTS = 2  # training rank 0 -> rollout ranks: weight buckets (gloo)
    EXPERIENCE = 3  # rollout ranks -> training ranks: one message per batch and route


class PeerLost(Fault):
    """The other side of the bridge is gone (its process ended, or its host)."""


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
    """

    def __init__(self, backend, rank: int, describe: Callable[[int], str]) -> None:
        self.backend, self.rank, self.describe = backend, rank, describe
        # isend work and its buffers, kept alive until waited on (oldest first)
        self._sends: collections.deque = collections.deque()

    @classmethod
    def connect(
        cls, store: dist.Store, rank: int, world_size: int, timeout_min: int, describe
    ) -> Bridge:
        """Collective over the whole job: every rank builds its end at start-up."""
        backend = dist.ProcessGroupGloo(
            dist.PrefixStore("fsdp_rlhf/bridge", store),
            rank,
            world_size,
            datetime.timedelta(minutes=timeout_min),
        )
        return cls(backend, rank, describe)

    def _lost(self, peer: int, what: str, e: BaseException) -> PeerLost:
        return PeerLost(
            f"{self.describe(peer)} is gone: the connection to it broke while {what} "
            f"({_first_line(e)}); its own log or the launcher's says why"
        )

    # ------------------------------------------------------------ tensors

    def send(self, tensor: torch.Tensor, dst: int, channel: Channel, what: str = "sending") -> None:
        try:
            self.backend.send([tensor], dst, int(channel)).wait()
        except RuntimeError as e:
            raise self._lost(dst, what, e) from e

    def recv(self, tensor: torch.Tensor, src: int, channel: Channel, what: str = "receiving"):
        try:
            self.backend.recv([tensor], src, int(channel)).wait()
        except RuntimeError as e:
            raise self._lost(src, what, e) from e
        return tensor

    def isend(
        self, tensors: list[torch.Tensor], dst: int, channel: Channel, what: str = "sending"
    ) -> None:
        """Send without waiting; the tensors stay alive until :meth:`flush` (gloo's transport
        moves them meanwhile)."""
        for t in tensors:
            try:
                work = self.backend.send([t], dst, int(channel))
            except RuntimeError as e:
                raise self._lost(dst, what, e) from e
            self._sends.append((work, t, dst))

    def flush(self, keep: int = 0, what: str = "sending") -> None:
        """Wait for the oldest sends until at most ``keep`` are outstanding."""
        while len(self._sends) > keep:
            work, _, dst = self._sends.popleft()
            try:
                work.wait()
            except RuntimeError as e:
                raise self._lost(dst, what, e) from e

    # ------------------------------------------------------------ objects

    def send_object(
        self, obj: Any, dst: int, channel: Channel, wait: bool = True, what: str = "sending"
    ) -> None:
        data = to_bytes(obj)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        if wait:
            self.send(size, dst, channel, what)
            self.send(data, dst, channel, what)
        else:
            self.isend([size, data], dst, channel, what)

    def recv_object(self, src: int, channel: Channel, what: str = "receiving") -> Any:
        size = self.recv(torch.zeros(1, dtype=torch.int64), src, channel, what)
        return from_bytes(self.recv(torch.empty(int(size), dtype=torch.uint8), src, channel, what))

    def expect_object(self, src: int, channel: Channel, what: str = "receiving") -> Expected:
        """Start receiving the next object from ``src`` on ``channel`` in the background."""
        return Expected(lambda: self.recv_object(src, channel, what))


class Expected:
    """A message being received by a daemon thread; :meth:`ready` polls, :meth:`result`
    waits (and re-raises the receive's error)."""

    def __init__(self, receive: Callable[[], Any]) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

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

    def result(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError("no message yet")
        if self._error is not None:
            raise self._error
        return self._value
