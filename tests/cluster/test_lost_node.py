"""A lost node under plain torchrun (2 hosts, one rank each, train-rm), three ways:

- ``kill_rank``: node2's rank is SIGKILLed (as by the OOM killer); its torchrun agent lives;
- ``crash_host``: every process of the job on node2 is SIGKILLed, torchrun agent included;
- ``cut_host``: node2's port on the bridge goes down: no packet passes, nobody gets an error.

The rank on node1 must end within seconds in the first two cases (its collective fails at
once) and within the heartbeat bound in the third (``--heartbeat_timeout_s 6``: 7.2 s, plus
the time to exit), each time with one line naming node2 or rank 1. In every case the next
start of the same command (the sbatch's flags include ``--load_checkpoint``) resumes from the
newest complete checkpoint and finishes with every step logged once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from fsdp_rlhf.distributed.heartbeat import EXIT_CODE, detection_bound_s
from tests.cluster import runs

HEARTBEAT_S = 6.0
EPOCHS = 2  # 15 steps an epoch; a checkpoint every 4 (RM_CPU_FLAGS)
STEPS = 15 * EPOCHS
EXIT_SLACK_S = 3.0  # from the verdict to the process gone (logging, torchrun noticing)
BOUNDS = {
    "kill_rank": 10.0,
    "crash_host": 10.0,
    "cut_host": detection_bound_s(HEARTBEAT_S) + EXIT_SLACK_S,
}
PORTS = {"kill_rank": 29411, "crash_host": 29412, "cut_host": 29413}


def children(pid: int) -> list[int]:
    """Running children of ``pid`` (an exited child its stuck parent has not reaped is no
    longer running)."""
    running = []
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    running.append(int(child))
    return running


def complete_checkpoints(ckpt: Path) -> list[int]:
    return sorted(
        int(p.name.split("_")[1]) for p in ckpt.glob("step_*") if (p / "COMPLETE").is_file()
    )


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("how", list(BOUNDS))
def test_lost_node_ends_the_job_then_the_next_start_resumes(setup, logs, how):
    cluster, name = setup.cluster, f"lost_{how}"
    save = setup.save(name)
    flags = setup.rm_flags(name, "--max_epochs", str(EPOCHS), "--heartbeat_timeout_s", "6")
    procs = runs.start_hosts(cluster, "train-rm", flags, logs, port=PORTS[how], tag=name)
    try:
        deadline = time.monotonic() + 120
        while runs.metric_rows(save) < 10:  # a checkpoint (step 8) behind it, 20 steps ahead
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
            time.sleep(0.02)
        agent = procs["node2"].pid  # nsenter exec'd torchrun: same pid
        event = time.monotonic()
        if how == "kill_rank":
            (rank,) = children(agent)
            os.kill(rank, signal.SIGKILL)
        elif how == "crash_host":
            assert cluster.crash("node2")
        else:
            cluster.cut("node2")
        rc = procs["node1"].wait(timeout=BOUNDS[how] + 30)
        took = time.monotonic() - event
        runs.record(logs, f"{how}_node1_end_s", took)
        node1 = (logs / f"{name}-node1.log").read_text()
        assert rc != 0 and took <= BOUNDS[how], (rc, took, runs.tail(node1))
        assert runs.metric_rows(save) < STEPS  # it did end mid-run
        lines = error_lines(node1)
        assert len(lines) == 1, runs.tail(node1)
        assert "node2" in lines[0] and "rank 1" in lines[0] and "ending rank 0 on node1" in lines[0]
        if how == "cut_host":
            assert "sent no heartbeat" in lines[0]
            # the cut-off rank ends too: it hears from neither its peer nor the store on node1
            t_deadline = event + BOUNDS[how] + 5
            while children(agent) and time.monotonic() < t_deadline:
                time.sleep(0.1)
            runs.record(logs, "cut_host_node2_rank_end_s", time.monotonic() - event)
            assert not children(agent), "the cut-off rank is still running"
            node2 = (logs / f"{name}-node2.log").read_text()
            assert any("store at node1:" in ln for ln in error_lines(node2)), runs.tail(node2)
        else:
            assert f"exitcode  : {EXIT_CODE}" in node1  # torchrun's report: our exit, no hang
    finally:
        cluster.crash("node2")  # what is left of the job there (e.g. a cut-off torchrun agent)
        cluster.crash("node1")
        if how == "cut_host":
            cluster.heal("node2")
        for p in procs.values():
            p.wait(timeout=10)

    # the next start: resumes from the newest complete checkpoint, every step logged once
    newest = complete_checkpoints(save / "checkpoints")[-1]
    assert newest >= 8
    run = runs.run_hosts(cluster, "train-rm", flags, logs, tag=f"{name}_resume")
    assert run.returncode == 0, {h: runs.tail(t) for h, t in run.logs.items()}
    text = " ".join(" ".join(run.logs.values()).split())
    assert re.search(rf"resumed from \S+/step_{newest} at step {newest}\b", text), text[-3000:]
    steps = [r["step"] for r in runs.read_metrics(save) if "eval/acc" not in r]
    assert steps == list(range(1, STEPS + 1))
