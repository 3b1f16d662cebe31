"""The failure meeting of fsdp_rlhf.distributed.exit_report between real processes over a real
TCPStore (standing in for torchrun's agent store): one line for a shared failure, a lone
failure bounded in time, no wait for ranks past validation, and a SIGTERM cutting the wait."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from fsdp_rlhf.distributed.exit_report import WAIT_S

pytestmark = pytest.mark.exclusive  # its assertions read a clock: it runs alone (conftest.py)
REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys, time
import torch.distributed  # imported by then in a real run
from fsdp_rlhf.distributed import exit_report as er
spec = json.loads(sys.argv[1])
if spec.get("prepared"):
    er.note_prepared()
    sys.exit(0)
time.sleep(spec.get("delay", 0))
print("reporting", flush=True)
start = time.monotonic()
er.report(er.Failure(spec.get("code", 2), spec.get("message"), spec.get("secondary", False)))
print(json.dumps({"seconds": time.monotonic() - start}), flush=True)
"""


@pytest.fixture
def store_env():
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(60)
    )

    def env(rank: int, world: int) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(server.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": "test",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }

    return env


def _start(env: dict[str, str], spec: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> tuple[str, float | None]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return err, json.loads(lines[-1])["seconds"] if lines else None


def test_ranks_that_fail_alike_print_one_line(store_env):
    message = "--input_key 'q': no such key in the dataset"
    procs = [
        _start(store_env(0, 2), {"message": message, "delay": 1.0}),  # arrives a second later
        _start(store_env(1, 2), {"message": message}),
    ]
    results = [_finish(p) for p in procs]
    assert "".join(err for err, _ in results) == f"error: {message}\n"
    assert all(seconds < WAIT_S for _, seconds in results), results  # no one waited it out


def test_different_failures_each_print_their_line_and_peers_stay_quiet(store_env):
    specs = [
        {"message": "no space left on device while writing /ckpt/step_2"},
        {"message": "saving failed on rank 0; its log has the error", "secondary": True},
        {"message": "rule reward file r.py:3: reward_func raised KeyError: 'a'"},
    ]
    procs = [_start(store_env(r, 3), s) for r, s in enumerate(specs)]
    errs = [_finish(p)[0] for p in procs]
    assert errs == [
        "error [rank 0]: no space left on device while writing /ckpt/step_2\n",
        "",
        "error [rank 2]: rule reward file r.py:3: reward_func raised KeyError: 'a'\n",
    ]


def test_a_lone_failure_waits_a_bounded_time_for_ranks_that_never_come(store_env):
    # ranks 0 and 2 are well (blocked in a collective, say): they never report
    err, seconds = _finish(_start(store_env(1, 3), {"message": "boom"}))
    assert err == "error [rank 1]: boom\n"
    assert WAIT_S <= seconds < WAIT_S + 3, seconds


def test_ranks_past_validation_are_not_waited_for(store_env):
    _finish(_start(store_env(0, 2), {"prepared": True}))
    err, seconds = _finish(_start(store_env(1, 2), {"message": "--env_file e.py:3: import failed"}))
    assert err == "error [rank 1]: --env_file e.py:3: import failed\n"
    assert seconds < 2, seconds


def test_sigterm_ends_the_wait_with_the_line_printed(store_env):
    proc = _start(store_env(1, 3), {"message": "boom"})
    assert proc.stdout.readline().strip() == "reporting"
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 2
    assert err == "error [rank 1]: boom\n" and proc.returncode == 0


def _broken_collective(rank: int, world: int) -> str:
    """Rank 1 fails and tears down (as launch does); rank 0 waits in an all-reduce."""
    import contextlib
    import io

    import torch
    import torch.distributed as dist

    from fsdp_rlhf.cli import describe_failure
    from fsdp_rlhf.distributed import exit_report

    # the process group's own store (rank 0 hosts it) stands in for torchrun's
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="t")
    if rank == 1:
        exit_report.note_failing()
        dist.destroy_process_group()  # the collective rank 0 waits in breaks now
        time.sleep(3)  # rank 0's store outlives its check
        return "failed first"
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:  # noqa: BLE001 - the broken collective
        exit_report.note_failing()
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            failure = describe_failure(e, debug=False)
        return f"{failure.secondary} {stderr.getvalue()!r} {failure.message}"
    return "no error"


def test_a_collective_broken_by_the_rank_that_failed_first_is_no_new_error():
    from tests.dist_utils import run_distributed

    out = run_distributed(_broken_collective, 2, timeout=120)
    assert out[1] == "failed first"
    # secondary (printed only if no rank says more), and no traceback
    assert out[0].startswith("True '' stopped after another rank failed (RuntimeError: "), out[0]
