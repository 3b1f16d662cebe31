"""Peer heartbeats: end the ranks within a bound when a host vanishes, naming it.

A host that drops off the network (power loss, a dead switch port, a kernel panic) sends no
reset. Its peers sit in a collective until the process-group timeout (``--dist_timeout_min``,
60 minutes), holding their GPUs, and the host itself may keep running cut off. A peer process
that dies outright is different: its host's kernel closes its sockets, and gloo fails the
next collective at once; only the message needs naming the host.

Each rank runs two daemon threads beside training, on their own connection to the job's
TCPStore (``MASTER_ADDR:MASTER_PORT``, the one torchrun serves), never in a collective:

- the *beater* adds 1 to ``beat/<rank>`` every ``interval`` and reads the counter of one
  watched peer: the same local rank on the next node, so every node is watched from another
  node and the store sees four small requests per rank per interval;
- the *judge* ends the rank (one line on stderr, exit code :data:`EXIT_CODE`) when the watched
  counter has not moved for ``timeout_s``, or when no store request has completed for that long
  (the store's host is gone: a request to a vanished host blocks, it does not fail), or when
  another rank has published why the job must end (``abort``).

Heartbeats prove that a process and its host's network are alive, not that training moves: a
long vLLM start, checkpoint save or rollout does not stop them. The judge does not blame a
peer for time it could not watch itself (its own thread held off the interpreter for long);
a rank that finished announces it, so that its exit is not taken for a loss.

An asynchronous job's ranks also read each other's counters on demand while they wait for
each other (:class:`PeerBeats`): there every rank beats, on a single node too (without a
judge), so that a waiting rank tells a live but slow peer from a stopped or hung one.

Bound: a peer lost at time t ends the ranks watching it by ``t + timeout_s + 2 * interval``
(:func:`detection_bound_s`), ``interval = clamp(timeout_s / 10, 0.2, 10)``; the other ranks
follow one interval later through the abort key or, when the lost host served the store, by
the same bound.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("fsdp_rlhf")

# Exit status of a rank ended because a peer or its host was lost.
EXIT_CODE = 3
_PREFIX = "fsdp_rlhf/heartbeat"


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two beats (and between two verdicts)."""
    return min(10.0, max(0.2, timeout_s / 10))


def detection_bound_s(timeout_s: float) -> float:
    """Longest time from losing a peer to the verdict on the ranks that watch it."""
    return timeout_s + 2 * heartbeat_interval(timeout_s)


def watched_rank(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The peer ``rank`` watches: the same local rank on the next node (ring over nodes).

    None on a single node (its ranks share a host; the launcher sees a local death). Where
    ranks are not laid out in equal nodes, the next rank.
    """
    if world_size <= 1:
        return None
    if local_world_size <= 0 or world_size % local_world_size:
        return (rank + 1) % world_size
    if world_size == local_world_size:
        return None
    return (rank + local_world_size) % world_size


def _namespace_prefix(namespace: str) -> str:
    return f"{_PREFIX}/{namespace}/"


def _key(prefix: str, kind: str, rank: int | None = None) -> str:
    return prefix + kind + ("" if rank is None else f"/{rank}")


# ---------------------------------------------------------------- the verdict (pure)


@dataclass
class Verdict:
    kind: str  # "peer" (watched counter still), "store" (no request completed), "abort"
    silent_s: float = 0.0
    peer: int | None = None
    detail: str = ""


@dataclass
class Silence:
    """How long each watched signal has been still, on this process's monotonic clock.

    ``tick(now)`` is called every interval by the judge. When the judge itself was held off
    for more than half the timeout (a long GIL hold, a paused process), what happened
    meanwhile was not watched: baselines restart at ``now`` instead of blaming peers.
    """

    timeout_s: float
    start: float
    peers: tuple[int, ...] = ()
    interval: float = 0.0  # between two rounds of store requests (0: from the timeout)
    last_ok: float = 0.0  # last completed round of store requests
    last_tick: float = 0.0
    values: dict[int, int] = field(default_factory=dict)
    changed_at: dict[int, float] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    any_done: bool = False

    def __post_init__(self) -> None:
        self.interval = self.interval or heartbeat_interval(self.timeout_s)
        self.last_ok = self.last_tick = self.start
        for p in self.peers:
            self.changed_at[p] = self.start

    def store_ok(self, now: float) -> None:
        self.last_ok = now

    def observe(self, peer: int, value: int, now: float, done: bool = False) -> None:
        if done:
            self.done.add(peer)
            self.any_done = True
        if self.values.get(peer) != value:
            self.values[peer] = value
            self.changed_at[peer] = now

    def tick(self, now: float) -> Verdict | None:
        gap = now - self.last_tick
        self.last_tick = now
        if gap > self.timeout_s / 2:  # we were not running: restart the clocks
            self.last_ok = now
            for p in self.changed_at:
                self.changed_at[p] = now
            return None
        # Once a rank has finished, the store may go with it (when a rank process serves it).
        if not self.any_done and now - self.last_ok > self.timeout_s:
            return Verdict("store", now - self.last_ok)
        if now - self.last_ok > 2 * self.interval:
            return None  # the store is slow to answer: no news of the peers, not bad news
        for p in self.peers:
            silent = now - self.changed_at[p]
            if p not in self.done and silent > self.timeout_s:
                return Verdict("peer", silent, peer=p)
        return None


# ---------------------------------------------------------------- host facts


def host_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces, loopback excluded (Linux; [] elsewhere)."""
    addrs = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = struct.pack("256s", name[:15].encode())
                raw = fcntl.ioctl(s.fileno(), 0x8915, packed)  # SIOCGIFADDR
                addr = socket.inet_ntoa(raw[20:24])
                if not addr.startswith("127."):
                    addrs.append(addr)
    return addrs


_PEER_ADDR = re.compile(r"\[([0-9]{1,3}(?:\.[0-9]{1,3}){3}|[0-9a-fA-F:]+)\]:(\d+)")
_GLOO_SOURCE = re.compile(r"^\[[^\]]*\.cc:\d+\]\s*")  # gloo's "[.../pair.cc:537] " prefix
_CONNECTION_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "connection refused",
)


def peer_address(message: str) -> str | None:
    """The peer address in a gloo transport error, when the error is a lost connection."""
    low = message.lower()
    if not any(k in low for k in _CONNECTION_LOST):
        return None
    m = _PEER_ADDR.search(message)
    if m is None:
        return None
    addr = m.group(1)
    return addr.removeprefix("::ffff:")


def describe_ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, sorted(ranks)))


# ---------------------------------------------------------------- the threads


class Store(Protocol):
    def add(self, key: str, value: int) -> int: ...
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def tcp_store_client(host: str, port: int, timeout_s: float) -> Store:
    import torch.distributed as dist

    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _exit(line: str) -> None:
    """Print the reason and end this process now (the main thread may be stuck in C++)."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    print(f"error: {line}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(EXIT_CODE)


class Heartbeat:
    """The two threads of one rank; see the module docstring. ``stop()`` ends them."""

    def __init__(
        self,
        connect: Callable[[], Store],
        *,
        rank: int,
        world_size: int,
        local_world_size: int,
        timeout_s: float,
        store_addr: str = "",
        namespace: str = "0",
        clock: Callable[[], float] = time.monotonic,
        on_lost: Callable[[str], None] = _exit,
    ) -> None:
        self.connect = connect
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval = heartbeat_interval(timeout_s)
        self.store_addr = store_addr
        self.prefix = _namespace_prefix(namespace)
        self.clock = clock
        self.on_lost = on_lost
        self.peer = watched_rank(rank, world_size, local_world_size)
        peers = () if self.peer is None else (self.peer,)
        self.silence = Silence(timeout_s, clock(), peers=peers)
        self.me = {"host": socket.gethostname(), "addrs": host_addresses()}
        self.hosts: dict[int, dict[str, Any]] = {}
        self.reported = False  # a line was printed already (by the main thread)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store: Store | None = None
        self._threads: list[threading.Thread] = []

    # -------------------------------------------------------- lifecycle

    def start(self, judge: bool = True) -> Heartbeat:
        """Start the beater, and the judge unless ``judge`` is False (beats for others to read:
        a single-node asynchronous job's bridge, see :class:`PeerBeats`)."""
        loops = [(self._beat_loop, "beater")] + ([(self._judge_loop, "judge")] if judge else [])
        for target, name in loops:
            t = threading.Thread(target=target, name=f"fsdp_rlhf-heartbeat-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, finished: bool = False) -> None:
        """End the threads; ``finished``: tell the peers this rank is done (not lost)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if finished:
            self._briefly(lambda s: s.set(self._key("done", self.rank), "1"))

    # -------------------------------------------------------- beater

    def _key(self, kind: str, rank: int | None = None) -> str:
        return _key(self.prefix, kind, rank)

    def _beat_loop(self) -> None:
        announced = False
        while not self._stop.is_set():
            try:
                if self._store is None:
                    self._store = self.connect()
                store = self._store
                if not announced:
                    store.set(self._key("host", self.rank), json.dumps(self.me))
                    announced = True
                store.add(self._key("beat", self.rank), 1)
                peer_value, peer_done = 0, False
                if self.peer is not None:
                    peer_value = store.add(self._key("beat", self.peer), 0)
                    peer_done = store.check([self._key("done", self.peer)])
                abort = None
                if store.check([self._key("abort")]):
                    abort = json.loads(store.get(self._key("abort")))
                if len(self.hosts) < self.world_size:
                    self._read_hosts(store)
                now = self.clock()
                with self._lock:
                    self.silence.store_ok(now)
                    if self.peer is not None:
                        self.silence.observe(self.peer, peer_value, now, done=peer_done)
                if abort is not None and not self._stop.is_set():
                    cause = f"{abort['cause']} (found by rank {abort['rank']})"
                    self._lost(cause, publish=False)
                    return
            except Exception as e:  # noqa: BLE001 - the judge decides; reconnect next round
                log.debug("heartbeat: store request failed: %s", e)
                self._store = None
            self._stop.wait(self.interval)

    def _read_hosts(self, store: Store) -> None:
        """Everyone's host facts, once all ranks have published them (two requests)."""
        missing = [r for r in range(self.world_size) if r not in self.hosts]
        keys = [self._key("host", r) for r in missing]
        if not store.check(keys):
            return
        values = store.multi_get(keys) if hasattr(store, "multi_get") else map(store.get, keys)
        for r, value in zip(missing, values, strict=True):
            with contextlib.suppress(ValueError):
                self.hosts[r] = json.loads(value)

    # -------------------------------------------------------- judge

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                verdict = self.silence.tick(self.clock())
            if verdict is not None and not self._stop.is_set():
                self._lost(self.describe(verdict), publish=verdict.kind == "peer")
                return

    def describe(self, v: Verdict) -> str:
        """The cause, naming the lost rank or host."""
        flag = f"--heartbeat_timeout_s {self.timeout_s:g}"
        if v.kind == "peer":
            return (
                f"{self._who(v.peer)} sent no heartbeat for {v.silent_s:.0f} s ({flag}): its "
                "host is down, cut off or hung"
            )
        host = self.store_addr.rsplit(":", 1)[0]
        ranks = [r for r, h in self.hosts.items() if host in (h.get("host"), *h.get("addrs", ()))]
        owner = f"host {host}" + (f" ({describe_ranks(ranks)})" if ranks else "")
        return (
            f"no answer for {v.silent_s:.0f} s from the job's store at {self.store_addr} on "
            f"{owner} ({flag}): that host is down or cut off"
        )

    def _who(self, rank: int | None) -> str:
        h = self.hosts.get(rank) if rank is not None else None
        return f"rank {rank}" + (f" on {h['host']}" if h else "")

    def ending(self) -> str:
        return f"ending rank {self.rank} on {self.me['host']}"

    def _lost(self, cause: str, publish: bool) -> None:
        if publish:  # the others end too, naming the same peer
            abort = json.dumps({"rank": self.rank, "cause": cause})
            self._briefly(lambda s: s.set(self._key("abort"), abort))
        self._stop.set()
        self.on_lost(f"{cause}; {self.ending()}")

    def _briefly(self, request: Callable[[Store], Any]) -> None:
        """One request on a fresh connection, in a daemon thread awaited at most two
        intervals (2 s at most); errors ignored. A vanished store host must not hold us."""

        def run() -> None:
            with contextlib.suppress(Exception):
                request(self.connect())

        t = threading.Thread(target=run, name="fsdp_rlhf-heartbeat-request", daemon=True)
        t.start()
        t.join(timeout=min(2.0, 2 * self.interval))

    # -------------------------------------------------------- main-thread errors

    def fail(self, line: str) -> None:
        """End this rank with ``line`` (from the main thread, after :meth:`explain`)."""
        self._stop.set()
        self.on_lost(line)

    def explain(self, exc: BaseException) -> str | None:
        """One line naming the lost host when ``exc`` is a collective that lost its connection
        to a peer on another host (the peer's process ended: its kernel closed the socket);
        None for anything else."""
        addr = peer_address(str(exc))
        if addr is None or addr in self.me["addrs"]:
            return None
        ranks = [r for r, h in self.hosts.items() if addr in h.get("addrs", ())]
        if not ranks:
            return None
        host = self.hosts[ranks[0]]["host"]
        first = _GLOO_SOURCE.sub("", str(exc).strip().splitlines()[0]).split(". ")[0][:160]
        return (
            f"lost the connection to {host} ({describe_ranks(ranks)}) in a collective: its "
            f"processes ended (an error, a kill or a crash: see that host's log); "
            f"{self.ending()} [{first}]"
        )


def _store_address() -> tuple[str, int] | None:
    """The job's store (torchrun's), from ``MASTER_ADDR`` / ``MASTER_PORT``."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, int(port)) if addr and port else None


def _restart_namespace() -> str:
    """A fresh set of keys for each start of the workers by an elastic agent."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def start_heartbeat(
    timeout_s: float,
    rank: int,
    world_size: int,
    local_world_size: int,
    *,
    beat_on_one_node: bool = False,
) -> Heartbeat | None:
    """This rank's heartbeat, started; None when off: ``timeout_s`` 0, a single-node job (its
    ranks share a host, whose launcher sees a local death), or no ``MASTER_ADDR`` /
    ``MASTER_PORT`` to reach the store by.

    ``beat_on_one_node``: on a single node, beat without judging (an asynchronous job's ranks
    read each other's beats while they wait for each other: :class:`PeerBeats`)."""
    where = _store_address()
    one_node = world_size <= local_world_size
    if timeout_s <= 0 or (one_node and not beat_on_one_node) or where is None:
        return None
    addr, port = where
    # Imported here, not by the beater's first connect: importing torch takes seconds, which
    # the judge would count as silence of the store.
    import torch.distributed  # noqa: F401

    interval = heartbeat_interval(timeout_s)
    hb = Heartbeat(
        lambda: tcp_store_client(addr, port, timeout_s=max(1.0, interval)),
        rank=rank,
        world_size=world_size,
        local_world_size=local_world_size,
        timeout_s=timeout_s,
        store_addr=f"{addr}:{port}",
        namespace=_restart_namespace(),
    )
    return hb.start(judge=not one_node)


# ---------------------------------------------------------------- a peer's beats, on demand


class PeerBeats:
    """Other ranks' heartbeats read on demand, for a rank that waits for one of them (an
    asynchronous job's bridge: :mod:`fsdp_rlhf.distributed.bridge`), and what each of them is
    waiting for, when it says.

    A rank that waits long for a peer can then tell a live peer (its counter moves: slow, or
    itself waiting) from one that is stopped, hung or cut off (its counter stands still for
    ``timeout_s``). One store connection of its own, used by one thread at a time; a store
    request that fails is no news (the heartbeat's judge rules on a silent store).
    """

    def __init__(
        self,
        connect: Callable[[], Store],
        timeout_s: float,
        namespace: str = "0",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connect, self.timeout_s, self.clock = connect, timeout_s, clock
        self.interval = heartbeat_interval(timeout_s)
        self.prefix = _namespace_prefix(namespace)
        self._store: Store | None = None
        self._lock = threading.Lock()

    def _request(self, request: Callable[[Store], Any]) -> Any:
        with self._lock:
            try:
                if self._store is None:
                    self._store = self.connect()
                return request(self._store)
            except Exception as e:  # noqa: BLE001 - no news; reconnect next time
                log.debug("heartbeat: store request failed: %s", e)
                self._store = None
                return None

    def beats(self, rank: int) -> int | None:
        """``rank``'s beat counter (None: the store did not answer)."""
        return self._request(lambda s: s.add(_key(self.prefix, "beat", rank), 0))

    def watch(self, rank: int) -> PeerWatch:
        """One wait's view of ``rank``: silent from now on until its counter moves."""
        return PeerWatch(self, rank)

    def note_waiting(self, rank: int, doing: str) -> None:
        """Publish what ``rank`` is waiting for (``""``: nothing any more)."""
        self._request(lambda s: s.set(_key(self.prefix, "waiting", rank), doing))

    def waiting(self, rank: int) -> str:
        """What ``rank`` last published it is waiting for (``""``: nothing, or unknown)."""
        key = _key(self.prefix, "waiting", rank)
        value = self._request(lambda s: s.get(key) if s.check([key]) else b"")
        return value.decode() if value else ""


class PeerWatch:
    """One peer's heartbeat over one wait, judged as the heartbeat's judge does
    (:class:`Silence`: time this process could not watch is not blamed on the peer)."""

    def __init__(self, beats: PeerBeats, rank: int) -> None:
        self.beats, self.rank = beats, rank
        self.silence = Silence(beats.timeout_s, beats.clock(), peers=(rank,))

    def poll(self) -> Verdict | None:
        """Read the peer's counter; a verdict when it has been still for the timeout."""
        value = self.beats.beats(self.rank)
        now = self.beats.clock()
        if value is not None:
            self.silence.store_ok(now)
            self.silence.observe(self.rank, value, now)
        verdict = self.silence.tick(now)
        return verdict if verdict is not None and verdict.kind == "peer" else None

    def silent_s(self) -> float:
        """Seconds since the peer's counter last moved (or since the watch began)."""
        return self.beats.clock() - self.silence.changed_at[self.rank]


def peer_beats(timeout_s: float) -> PeerBeats | None:
    """The job's heartbeats to read on demand; None when heartbeats are off (``timeout_s``
    0) or the store cannot be reached by ``MASTER_ADDR`` / ``MASTER_PORT``."""
    where = _store_address()
    if timeout_s <= 0 or where is None:
        return None
    addr, port = where
    interval = heartbeat_interval(timeout_s)
    return PeerBeats(
        lambda: tcp_store_client(addr, port, timeout_s=max(1.0, interval)),
        timeout_s,
        namespace=_restart_namespace(),
    )
