"""The asynchronous job's bridge waiting for a peer, between two real processes on a real
TCPStore (one node, heartbeats on as --async_train runs them): a peer that is alive but slow
is waited for up to the bound and then named as alive, with what each side was waiting for;
a stopped peer (SIGSTOP: hung, or its host cut off) is named as gone by its silent heartbeat,
well before the bound; a message that comes later than the bound while nobody blocks on it
(a long training step while a rollout rank generates) still arrives."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_rlhf.distributed.env import free_port
from fsdp_rlhf.distributed.heartbeat import detection_bound_s

pytestmark = pytest.mark.exclusive  # its assertions read a clock: it runs alone (conftest.py)
REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 2.0
RANK = """
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist
from fsdp_rlhf.distributed.bridge import Bridge, Channel, Patience, PeerLost, PeerSlow
from fsdp_rlhf.distributed.heartbeat import peer_beats, start_heartbeat

case, rank, wait_s, heartbeat_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), {hb}
names = {{0: "training rank 0", 1: "rollout rank 1 (engine 0)"}}
start_heartbeat(heartbeat_s, rank, 2, 2, beat_on_one_node=True)
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
    timeout=timedelta(seconds=30),
)
patience = Patience(wait_s, peer_beats(heartbeat_s))
bridge = Bridge.connect(store, rank, 2, patience, names.__getitem__)
print("connected", flush=True)
t0 = time.monotonic()
try:
    if case == "each other":  # both sides wait for a batch from the other
        bridge.recv_object(1 - rank, Channel.EXPERIENCE, "receiving batch 1")
    elif rank == 1:
        if case == "slow":  # later than the bound, while rank 0 does not block on it
            time.sleep(1.5 * wait_s)
            bridge.send_object("late", 0, Channel.CONTROL)
        time.sleep(120)  # alive (beating), busy, and it never sends batch 1
    else:
        if case == "slow":
            pending = bridge.expect_object(1, Channel.CONTROL, "waiting for new weights")
            while not pending.ready():  # a rollout rank generating meanwhile
                time.sleep(0.05)
            print(json.dumps({{"background": pending.result()}}), flush=True)
            t0 = time.monotonic()
        bridge.recv_object(1, Channel.EXPERIENCE, "receiving batch 1")
except (PeerLost, PeerSlow) as e:
    out = {{"kind": type(e).__name__, "line": str(e), "after_s": time.monotonic() - t0}}
    print(json.dumps(out), flush=True)
    time.sleep(120)  # the test ends it (an exit would break the other's wait)
"""


def _start(tmp_path, case: str, wait_s: float) -> tuple[list[subprocess.Popen], dist.Store]:
    port = free_port()
    store = dist.TCPStore(  # the job's store, as torchrun's agent serves it
        "127.0.0.1", port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(hb=HEARTBEAT_S))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "LOCAL_WORLD_SIZE": "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), case, str(r), str(wait_s)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    for p in procs:
        line = p.stdout.readline().strip()
        assert line == "connected", (line, p.stderr.read() if p.poll() is not None else "")
    return procs, store


def _report(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read() if proc.wait(timeout=30) is not None else ""
    return json.loads(line)


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()


def test_a_live_slow_peer_is_waited_for_to_the_bound_and_named_alive(tmp_path):
    wait_s = 3.0
    procs, _store = _start(tmp_path, "slow", wait_s)
    try:
        assert _report(procs[0]) == {"background": "late"}  # arrived 4.5 s in: not timed out
        r = _report(procs[0])
        assert r["kind"] == "PeerSlow" and wait_s <= r["after_s"] < wait_s + 3, r
        line = r["line"]
        assert line.startswith(
            "training rank 0 waited 3 s for rollout rank 1 (engine 0), receiving batch 1, "
            "and gave up (--dist_timeout_min 0.05); rollout rank 1 (engine 0) is alive (its "
            "heartbeat moved "
        ), line
        assert "so it is slow, not gone: it is not waiting for this job's other side" in line
        assert "is gone" not in line and "\n" not in line
    finally:
        _end(procs)


def test_a_stopped_peer_is_named_gone_by_its_heartbeat_before_the_bound(tmp_path):
    wait_s = 30.0
    procs, _store = _start(tmp_path, "stopped", wait_s)
    try:
        procs[1].send_signal(signal.SIGSTOP)  # hung: its sockets stay open, no beats
        r = _report(procs[0])
        assert r["kind"] == "PeerLost", r
        assert r["after_s"] <= detection_bound_s(HEARTBEAT_S) + 2.0, r  # not the 30 s bound
        assert r["line"].startswith(
            "rollout rank 1 (engine 0) is gone: it sent no heartbeat for 2 s "
            "(--heartbeat_timeout_s 2) while training rank 0 waited for it, receiving batch 1: "
            "its process is stopped or hung"
        ), r["line"]
    finally:
        _end(procs)


def test_two_sides_waiting_for_each_other_say_so(tmp_path):
    procs, _store = _start(tmp_path, "each other", 3.0)
    try:
        for rank, other in ((0, "rollout rank 1 (engine 0)"), (1, "training rank 0")):
            r = _report(procs[rank])
            assert r["kind"] == "PeerSlow", r
            assert f"{other} is alive" in r["line"], r["line"]
            assert (
                "it is itself waiting for this rank, receiving batch 1 (each side waits for "
                "the other" in r["line"]
            ), r["line"]
    finally:
        _end(procs)


if __name__ == "__main__":
    pytest.main([__file__])
