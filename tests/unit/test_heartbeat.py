"""Peer heartbeats (fsdp_rlhf/distributed/heartbeat.py): who watches whom, the verdict logic
on a fake clock, and the threads on an in-memory store with a short timeout."""

from __future__ import annotations

import threading
import time

import pytest

from fsdp_rlhf.config import GuardConfig
from fsdp_rlhf.config_base import ConfigError
from fsdp_rlhf.distributed.heartbeat import (
    Heartbeat,
    Silence,
    detection_bound_s,
    heartbeat_interval,
    peer_address,
    watched_rank,
)

pytestmark = pytest.mark.exclusive  # its assertions read a clock: it runs alone (conftest.py)

# ---------------------------------------------------------------- pure logic


def test_each_node_is_watched_from_another_node():
    # 3 nodes x 4 ranks: local rank i of node n watches local rank i of node n+1
    world, local = 12, 4
    watched = {r: watched_rank(r, world, local) for r in range(world)}
    assert watched[0] == 4 and watched[5] == 9 and watched[11] == 3
    assert sorted(watched.values()) == list(range(world))  # everyone is watched once
    assert all(w // local != r // local for r, w in watched.items())
    assert watched_rank(0, 8, 8) is None  # one node: nothing to watch across hosts
    assert watched_rank(0, 1, 1) is None
    assert watched_rank(4, 6, 4) == 5  # uneven layout: the next rank


def test_interval_and_bound():
    assert heartbeat_interval(120) == 10.0  # capped
    assert heartbeat_interval(6) == pytest.approx(0.6)
    assert heartbeat_interval(1) == 0.2  # floored
    assert detection_bound_s(120) == 140.0
    assert detection_bound_s(6) == pytest.approx(7.2)


def _silence(timeout=10.0, peers=(1,)):
    return Silence(timeout, start=100.0, peers=peers, interval=1.0)


def _run(s: Silence, until: float, peer_value=None, store=True, start=100.0):
    """Tick every second from ``start`` to ``until``; the store answers when ``store``; the
    peer's counter moves when ``peer_value`` is None (else stays at it)."""
    t, v = start, 0
    while t < until:
        t += 1.0
        if store:
            s.store_ok(t)
            v = v + 1 if peer_value is None else peer_value
            s.observe(1, v, t)
        if verdict := s.tick(t):
            return t, verdict
    return t, None


def test_live_peer_and_store_give_no_verdict():
    assert _run(_silence(), until=200)[1] is None


def test_still_peer_is_named_after_the_timeout():
    s = _silence()
    _run(s, until=150)
    t, v = _run(s, until=200, peer_value=7, start=150)
    assert v.kind == "peer" and v.peer == 1
    assert 150 + 10 < t <= 150 + detection_bound_s(10)


def test_silent_store_is_blamed_not_the_peer():
    s = _silence()
    _run(s, until=150)
    t, v = _run(s, until=200, store=False, start=150)
    assert v.kind == "store" and 160 < t <= 162


def test_finished_peer_is_not_lost():
    s = _silence()
    s.observe(1, 3, 101, done=True)
    _, v = _run(s, until=200, peer_value=3)
    assert v is None
    # and once a rank has finished, a store that went away with it is no loss either
    _, v = _run(s, until=300, store=False, start=200)
    assert v is None


def test_time_the_judge_could_not_watch_is_not_blamed_on_peers():
    s = _silence()
    _run(s, until=150)
    assert s.tick(190.0) is None  # 40 s without a tick: held off, clocks restart
    verdicts = {}
    for t in range(191, 203):  # the peer's counter stays still from here on
        s.store_ok(float(t))
        verdicts[t] = s.tick(float(t))
    assert not any(verdicts[t] for t in range(191, 201))  # silent 10 s since the restart
    v = verdicts[201]
    assert v is not None and v.kind == "peer"


def test_peer_address_from_gloo_errors():
    reset = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[10.77.0.12]:36055: Connection reset by peer. This is typically caused by ..."
    )
    assert peer_address(reset) == "10.77.0.12"
    closed = "[pair.cc:598] Connection closed by peer [10.0.0.7]:4242"
    assert peer_address(closed) == "10.0.0.7"
    assert peer_address("Timed out waiting 1800000ms for recv operation") is None
    assert peer_address("CUDA out of memory") is None


def test_config_leaf():
    assert GuardConfig().heartbeat_timeout_s == 120.0
    assert GuardConfig(heartbeat_timeout_s=0).heartbeat_timeout_s == 0
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        GuardConfig(heartbeat_timeout_s=0.5)


# ---------------------------------------------------------------- the threads


class MemoryStore:
    """The part of a TCPStore the heartbeat uses, shared by the 'ranks' of one test.
    ``hang`` makes every request block, as one to a vanished host does."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.hang = threading.Event()

    def _wait(self) -> None:
        while self.hang.is_set():
            time.sleep(0.01)

    def add(self, key: str, value: int) -> int:
        self._wait()
        with self.lock:
            n = int(self.data.get(key, b"0")) + value
            self.data[key] = str(n).encode()
            return n

    def set(self, key: str, value: str) -> None:
        self._wait()
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        self._wait()
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._wait()
        with self.lock:
            return all(k in self.data for k in keys)


TIMEOUT = 1.0  # interval 0.2 s; a verdict within 1.4 s


def _ranks(store: MemoryStore, world: int, hosts=None) -> tuple[list[Heartbeat], dict]:
    lines: dict[int, str] = {}
    beats = []
    for r in range(world):

        def on_lost(line: str, r=r) -> None:
            lines[r] = line

        hb = Heartbeat(
            lambda: store,
            rank=r,
            world_size=world,
            local_world_size=1,
            timeout_s=TIMEOUT,
            store_addr="node1:29400",
            on_lost=on_lost,
        )
        hb.me = {"host": f"node{r + 1}", "addrs": [f"10.77.0.{11 + r}"]}
        beats.append(hb.start())
    return beats, lines


def _wait_for(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_silent_rank_ends_the_others_naming_it():
    store = MemoryStore()
    beats, lines = _ranks(store, world=4)
    try:
        _wait_for(lambda: all(len(b.hosts) == 4 for b in beats), 3)
        time.sleep(0.5)
        assert not lines
        beats[2].stop()  # rank 2 (node3) goes silent; rank 1 watches it
        took = _wait_for(lambda: len(lines) == 3, detection_bound_s(TIMEOUT) + 1.0)
        assert took <= detection_bound_s(TIMEOUT) + 0.5
        assert lines[1].startswith("rank 2 on node3 sent no heartbeat for 1 s")
        assert lines[1].endswith("ending rank 1 on node2")
        for r in (0, 3):  # the others follow rank 1's verdict through the abort key
            assert "rank 2 on node3" in lines[r] and "(found by rank 1)" in lines[r]
            assert lines[r].endswith(f"ending rank {r} on node{r + 1}")
    finally:
        for b in beats:
            b.stop()


def test_finishing_ranks_do_not_end_the_others():
    store = MemoryStore()
    beats, lines = _ranks(store, world=2)
    try:
        time.sleep(0.5)
        beats[1].stop(finished=True)
        time.sleep(detection_bound_s(TIMEOUT) + 0.5)
        assert lines == {}
    finally:
        for b in beats:
            b.stop()


def test_a_store_that_stops_answering_is_named():
    store = MemoryStore()
    beats, lines = _ranks(store, world=2)
    try:
        _wait_for(lambda: all(len(b.hosts) == 2 for b in beats), 3)
        store.hang.set()
        _wait_for(lambda: len(lines) == 2, detection_bound_s(TIMEOUT) + 1.0)
        assert all("from the job's store at node1:29400 on host node1 (rank 0)" in ln
                   for ln in lines.values())  # fmt: skip
    finally:
        store.hang.clear()
        for b in beats:
            b.stop()


def test_explain_names_the_host_of_a_reset_connection():
    store = MemoryStore()
    beats, _ = _ranks(store, world=2)
    try:
        _wait_for(lambda: all(len(b.hosts) == 2 for b in beats), 3)
    finally:
        for b in beats:
            b.stop()
    err = RuntimeError("[pair.cc:537] Read error [10.77.0.12]:36055: Connection reset by peer.")
    line = beats[0].explain(err)
    assert line.startswith("lost the connection to node2 (rank 1) in a collective")
    assert "ending rank 0 on node1" in line and "Read error [10.77.0.12]:36055" in line
    assert "pair.cc" not in line
    assert beats[1].explain(err) is None  # its own address: not a peer
    assert beats[0].explain(RuntimeError("Connection reset by peer [10.9.9.9]:1")) is None
    assert beats[0].explain(ValueError("bad value")) is None
