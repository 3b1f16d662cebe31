"""Peer heartbeats between two real processes on a real TCPStore: a rank that stops (SIGSTOP,
as a host that vanishes looks to its peers) ends the other within the bound, with one line
naming it; when it runs again it finds the verdict in the store and ends too. The two
processes pose as two nodes (LOCAL_WORLD_SIZE=1) and keep their main thread busy, as
training does; the multi-host runs are in tests/cluster."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_rlhf.distributed.env import free_port
from fsdp_rlhf.distributed.heartbeat import EXIT_CODE, detection_bound_s

pytestmark = pytest.mark.exclusive  # its assertions read a clock: it runs alone (conftest.py)
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0
RANK = """
import sys, time
from fsdp_rlhf.distributed.heartbeat import start_heartbeat
rank = int(sys.argv[1])
hb = start_heartbeat({timeout}, rank, 2, 1)
assert hb is not None
print("beating", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:  # a busy main thread (training) does not silence the beats
    sum(i * i for i in range(10_000))
"""


def test_a_stopped_rank_ends_its_peer_within_the_bound(tmp_path):
    port = free_port()
    store = dist.TCPStore(  # the job's store, as torchrun's agent serves it
        "127.0.0.1", port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(timeout=TIMEOUT_S))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "LOCAL_WORLD_SIZE": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "beating"
        time.sleep(3 * TIMEOUT_S)  # healthy ranks for longer than the timeout: no verdict
        ended = [(p.poll(), p.stderr.read() if p.poll() is not None else "") for p in procs]
        assert [rc for rc, _ in ended] == [None, None], ended
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=30)
        took = time.monotonic() - t0
        err0 = procs[0].stderr.read()
        assert rc == EXIT_CODE, err0
        assert took <= detection_bound_s(TIMEOUT_S) + 1.0, took
        lines = err0.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: rank 1 on "), err0
        assert "sent no heartbeat" in lines[0] and "ending rank 0 on" in lines[0]
        procs[1].send_signal(signal.SIGCONT)  # it wakes up: the store says it was given up
        assert procs[1].wait(timeout=10) == EXIT_CODE
        assert "(found by rank 0); ending rank 1 on" in procs[1].stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
