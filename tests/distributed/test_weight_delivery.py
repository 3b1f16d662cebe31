"""Weight versions go to each rollout rank of an asynchronous job on its own (the decoupled
engines of issue #49), between three real processes over gloo on a real TCPStore: training
rank 0 publishes four versions, at most three on their way at once, while rollout rank 2
does not receive for 5 s. The first three publications do not wait for it and rollout rank 1
takes them before rollout rank 2 takes the first; the fourth waits for rollout rank 2 to take
the first (the bound on what training rank 0 holds); both rollout ranks get all four, in
order and intact. In lock-step (one delivery that waits for every rollout rank) the first
publication would wait the 5 s."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp_rlhf.distributed.env import free_port

pytestmark = pytest.mark.exclusive  # its assertions read a clock: it runs alone (conftest.py)
REPO = Path(__file__).resolve().parents[2]
SLOW_S = 5.0
RANK = """
import json, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from fsdp_rlhf.distributed.bridge import Bridge, Channel, Patience
from fsdp_rlhf.distributed.weight_broadcast import WeightLink, publish, receive

rank, delay = int(sys.argv[1]), float(sys.argv[2])
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
    timeout=timedelta(seconds=60),
)
names = {0: "training rank 0", 1: "rollout rank 1 (engine 0)", 2: "rollout rank 2 (engine 1)"}
bridge = Bridge.connect(store, rank, 3, Patience(120.0), names.__getitem__)
link = WeightLink.build(bridge, store, [1, 2], torch.device("cpu"), 2, depth=3)
print("connected", flush=True)


def weights(v):
    yield "embed.weight", torch.full((64, 300), float(v))  # several buckets
    yield "norm.weight", torch.full((300,), float(v), dtype=torch.bfloat16)
    yield "head.weight", torch.full((300, 64), -float(v))


if rank == 0:
    for v in range(4):
        t = time.monotonic()
        sent = publish(link, weights(v), sender=True, header={"kind": "weights", "version": v},
                       bucket_bytes=80_000)
        print(json.dumps({"published": v, "seconds": time.monotonic() - t,
                          "waited": sent.waited, "bytes": sent.bytes}), flush=True)
    link.wait_delivered()
    print(json.dumps({"delivered": time.time()}), flush=True)
else:
    time.sleep(delay)
    for _ in range(4):
        header = bridge.recv_object(0, Channel.CONTROL)
        v = header["version"]
        got = {name: t.clone() for name, t in receive(link)}
        want = dict(weights(v))
        ok = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        print(json.dumps({"received": v, "ok": ok, "t": time.time()}), flush=True)
"""


def _run(tmp_path) -> dict[int, list[dict]]:
    port = free_port()
    store = dist.TCPStore(  # the job's store, as torchrun's agent serves it
        "127.0.0.1", port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
    delays = {0: 0.0, 1: 0.0, 2: SLOW_S}
    procs = {
        r: subprocess.Popen(
            [sys.executable, str(script), str(r), str(delays[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in delays
    }
    out = {}
    try:
        for r, p in procs.items():
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            lines = stdout.splitlines()
            assert lines[0] == "connected", stdout
            out[r] = [json.loads(line) for line in lines[1:]]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        del store
    return out


def test_each_rollout_rank_takes_weight_versions_at_its_own_pace(tmp_path):
    out = _run(tmp_path)
    published = [r for r in out[0] if "published" in r]
    assert [r["published"] for r in published] == [0, 1, 2, 3]
    # publishing waits for no rollout rank (rollout rank 2 receives nothing for 5 s) while
    # fewer than 3 versions are on their way
    first = published[:3]
    assert all(r["seconds"] < 0.5 * SLOW_S and r["waited"] < 0.5 for r in first), published
    assert published[3]["waited"] > 1.0, published  # the bound: version 0 is still on its way
    assert all(r["bytes"] == published[0]["bytes"] > 0 for r in published)
    fast, slow = out[1], out[2]
    assert [r["received"] for r in fast] == [0, 1, 2, 3] and all(r["ok"] for r in fast), fast
    assert [r["received"] for r in slow] == [0, 1, 2, 3] and all(r["ok"] for r in slow), slow
    assert fast[2]["t"] < slow[0]["t"], (fast, slow)
    # the sends are kept until every rollout rank took them
    assert out[0][-1]["delivered"] >= slow[-1]["t"] - 1.0
