"""The shipped slurm/*.sbatch on a real 2-node Slurm (22.05), unchanged: CPU differences only
through environment variables (GPUS_PER_NODE, paths), sbatch options (--gpus-per-node=0,
--cpus-per-task=1) and extra training flags after the script name.

Preemption is what ``--signal=B:USR1@N`` does at a time limit: USR1 to the batch shell
(``scancel --signal=USR1 --batch``). The script forwards it through srun, the ranks checkpoint
and exit 0, the script requeues the job, and the next start resumes from the checkpoint.
Slurm holds a requeued job until its launch credential expires; the test cluster's slurm.conf
sets ``AuthInfo=...,cred_expire=10`` (default 120 s) so the hold is 11 s."""

from __future__ import annotations

import re
import time
from pathlib import Path

from tests.cluster import runs

CPU_OPTIONS = ["--gpus-per-node=0", "--cpus-per-task=1"]


def sbatch(setup, script: Path, env: dict[str, str], workdir: Path, extra: list[str]) -> str:
    (workdir / "logs").mkdir(parents=True, exist_ok=True)  # the scripts' --output folder
    cluster = setup.cluster
    cluster.wait_nodes_idle(timeout=30)  # both slurmd up (earlier tests must leave them)
    argv = ["sbatch", "--parsable", f"--chdir={workdir}", *CPU_OPTIONS, str(script), *extra]
    out = cluster.ctl.run(argv, env=cluster.slurm_env(runs.base_env(**env))).stdout
    return out.strip().split(";")[0]


def wait_job(cluster, job: str, done, timeout: float = 300) -> dict[str, str]:
    """Poll ``scontrol show job`` until ``done(fields)``."""
    deadline = time.monotonic() + timeout
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = cluster.job_state(job)
        if done(fields):
            return fields
        if fields.get("JobState") in (
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
        ):
            break
        time.sleep(0.25)
    raise AssertionError(f"job {job}: {fields}")


def job_logs(workdir: Path, name: str, job: str) -> str:
    out = workdir / "logs" / f"{name}-{job}.out"
    err = workdir / "logs" / f"{name}-{job}.err"
    return "".join(p.read_text() for p in (out, err) if p.exists())


def stop_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "stop signal:" in ln and ln.startswith("[rank")]


def completed(f: dict[str, str]) -> bool:
    return f.get("JobState") == "COMPLETED"


def test_train_rm_sbatch_on_two_nodes_matches_one_host(setup, rm_reference, logs):
    name, workdir = "rm_slurm", setup.save("rm_slurm_submit")
    t0 = time.monotonic()
    job = sbatch(setup, runs.SBATCH["train-rm"], setup.rm_env(name), workdir, runs.RM_CPU_FLAGS)
    fields = wait_job(setup.cluster, job, completed)
    runs.record(logs, "rm_sbatch_s", time.monotonic() - t0)
    text = job_logs(workdir, "fsdp-rlhf-rm", job)
    assert fields["ExitCode"] == "0:0", text[-3000:]
    assert fields["NodeList"] == "node[1-2]" and fields["Restarts"] == "0"
    assert "rendezvous node1:" in text and "--nnodes 2 --nproc_per_node 1" in text
    got = runs.read_metrics(setup.save(name))
    assert not runs.compare_metrics(got, rm_reference["metrics"])


def test_ppo_sbatch_preempted_requeued_resumes_like_an_uninterrupted_run(
    setup, grpo_reference, logs
):
    name, workdir = "grpo_slurm", setup.save("grpo_slurm_submit")
    cluster = setup.cluster
    extra = [*runs.PPO_CPU_FLAGS, *runs.GRPO_FLAGS]
    t0 = time.monotonic()
    job = sbatch(setup, runs.SBATCH["ppo"], setup.ppo_env(name), workdir, extra)
    deadline = time.monotonic() + 300
    while runs.metric_rows(setup.save(name)) < 2:  # mid-run: 2 of 8 steps logged
        assert time.monotonic() < deadline, cluster.job_state(job)
        assert cluster.job_state(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")
        time.sleep(0.05)
    cluster.ctl.run(["scancel", "--signal=USR1", "--batch", job], env=cluster.slurm_env())
    signalled = time.monotonic()
    requeued = wait_job(cluster, job, lambda f: f.get("Restarts") == "1", timeout=120)
    runs.record(logs, "ppo_sbatch_usr1_to_requeue_s", time.monotonic() - signalled)
    # the first start's batch step may still be finishing (COMPLETING) when Restarts reads 1
    states = ("COMPLETING", "PENDING", "REQUEUED", "RUNNING", "CONFIGURING")
    assert requeued["JobState"] in states, requeued
    held = time.monotonic()
    wait_job(cluster, job, lambda f: f.get("JobState") in ("RUNNING", "COMPLETED"), timeout=120)
    runs.record(logs, "ppo_sbatch_requeue_hold_s", time.monotonic() - held)
    fields = wait_job(cluster, job, completed)
    runs.record(logs, "ppo_sbatch_total_s", time.monotonic() - t0)
    text = job_logs(workdir, "fsdp-rlhf-ppo", job)
    assert fields["ExitCode"] == "0:0" and fields["Restarts"] == "1", text[-3000:]
    # the first start stopped mid-run on the signal, wrote its checkpoint and requeued
    assert "SIGUSR1 (time limit/preemption near)" in text
    assert f"ranks stopped (exit 0); requeueing job {job}" in text
    assert f"job {job} restart 1 on 2 node(s)" in text
    resumed = re.findall(r"resumed from (\S+)/step_(\d+) at step (\d+)", " ".join(text.split()))
    assert len(resumed) == 1, text[-3000:]
    (ckpt_dir, step, at), stopped = resumed[0], stop_lines(text)
    assert int(step) == int(at) and 1 <= int(step) < 8 and stopped, text[-3000:]
    assert ckpt_dir == str(setup.save(name) / "checkpoints")
    assert f"checkpoint at step {step} on disk" in stopped[0]
    # every step logged once, and the same run as one uninterrupted
    got = runs.read_metrics(setup.save(name))
    assert [r["step"] for r in got] == list(range(1, 9))
    assert not runs.compare_metrics(got, grpo_reference["metrics"])
