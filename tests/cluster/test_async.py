"""`ppo --async_train` across the test cluster's hosts: torchrun on node1 and node2 (one rank
each), the training rank on node1 and the rollout rank (a vLLM engine) on node2, the bridge
between them over eth0. The shipped sbatch's PPO flags (GAE from the reward model on the
training side) with the rollout rank overriding the placement: 1 training node of 1 rank,
1 engine. Stopped by SIGTERM to both ranks (what a scheduler does) and started again with
the same flags (they include --load_checkpoint), every step is trained once.

Lossless resume across the hosts: 2 ranks a host, 2 training ranks on node1 and 2 engines on
node2, one epoch of tests/e2e/test_ppo_async_resume.py's quick run (16 prompts, 4 steps)
SIGKILLed on node2 while a rollout rank receives weights, then on node1 while a training rank
trains, then finished: its ledger trains every step on its scheduled prompts, every prompt of
the epoch once."""

from __future__ import annotations

import os
import signal
import time

from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl
from fsdp_rlhf.trainers.ppo.async_ledger import trained
from tests.cluster import runs
from tests.cluster.test_lost_node import children, complete_checkpoints
from tests.e2e import test_ppo_async_resume as lossless

STEPS = 8
ASYNC_FLAGS = [
    *("--async_train", "--vllm_num_engines", "1", "--num_nodes", "1"),
    *("--num_gpus_per_node", "1", "--max_steps", str(STEPS), "--save_steps", "-1"),
]


def test_async_rollout_host_and_training_host_stop_and_resume(setup, rm_reference, logs):
    cluster, name = setup.cluster, "async_two_hosts"
    save = setup.save(name)
    flags = setup.ppo_flags(name, *runs.GAE_FLAGS, *ASYNC_FLAGS)
    procs = runs.start_hosts(cluster, "ppo", flags, logs, port=29421, tag=name)
    try:
        deadline = time.monotonic() + 300
        while runs.metric_rows(save) < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
            time.sleep(0.05)
        for p in procs.values():  # nsenter exec'd torchrun: its child is the rank
            for rank in children(p.pid):
                os.kill(rank, signal.SIGTERM)
        stopped = runs.wait_hosts(procs, logs, name, timeout=120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    node1, node2 = stopped.logs["node1"], stopped.logs["node2"]
    assert stopped.returncode == 0, {h: runs.tail(t) for h, t in stopped.logs.items()}
    text = " ".join(node1.split())
    # the placement: rank 0 trains on node1, rank 1 generates on node2
    assert "asynchronous: ranks 0-0 train, 1-1 generate (1 engines x TP 1)" in text
    assert "vLLM" in node2 and "Loading safetensors checkpoint shards" in node2
    assert "stop signal:" in text
    done = complete_checkpoints(save / "checkpoints")
    assert done and done[-1] < STEPS, done
    rows = runs.read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, done[-1] + 1))
    assert all(r["async/staleness_max"] <= 1 for r in rows)

    resumed = runs.run_hosts(cluster, "ppo", flags, logs, tag=f"{name}_resume")
    assert resumed.returncode == 0, {h: runs.tail(t) for h, t in resumed.logs.items()}
    assert f"resumed from {save / 'checkpoints'}/step_{done[-1]}" in " ".join(
        resumed.logs["node1"].split()
    )
    rows = runs.read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once
    assert rows[done[-1]]["async/staleness_max"] == 0  # refilled from the checkpoint
    assert all(r["async/staleness_max"] <= 1 and "critic/vf_loss" in r for r in rows)
    runs.record(logs, "async_two_hosts_resume_s", resumed.seconds)


def test_async_sigkill_on_either_host_then_resume_trains_every_prompt_once(
    setup, tiny_qwen2, logs, tmp_path
):
    cluster, name = setup.cluster, "async_lossless"
    data = tmp_path / "data"
    prompts = lossless.QUICK_PROMPTS
    write_jsonl(prompt_rows(prompts, chat=True), data / "prompts.jsonl")
    (data / "reward.py").write_text(lossless.REWARD)
    save = setup.save(name)
    flags = [*lossless.flags(tiny_qwen2, data, save, prompts), "--num_nodes", "1"]
    flags += ["--num_gpus_per_node", "2", "--no_bf16", "--enforce_eager"]
    # ranks 0, 1 train on node1; rollout ranks 2, 3 (engines 0, 1) on node2: rank 3 dies
    # receiving the weights of step 2, the next start's rank 1 in step 4 (of 4)
    kills = {"node2": "3:syncing:2", "node1": "1:training:4"}
    for i, (host, kill) in enumerate(kills.items()):
        tag = f"{name}_{i}"
        cut = runs.run_hosts(
            cluster, "ppo", flags, logs, tag, nproc=2, env={"FSDP_RLHF_KILL_AT": kill}
        )
        assert cut.returncode != 0, {h: runs.tail(t) for h, t in cut.logs.items()}
        assert "SIGKILL" in cut.logs[host], runs.tail(cut.logs[host])  # torchrun's report
    done = runs.run_hosts(cluster, "ppo", flags, logs, f"{name}_done", nproc=2)
    assert done.returncode == 0, {h: runs.tail(t) for h, t in done.logs.items()}
    text = " ".join(done.logs["node1"].split())
    assert "ranks 0-1 train, 2-3 generate (2 engines x TP 1)" in text
    assert "asynchronous resume at step" in text
    assert trained(save / "ledger") == lossless.schedule(prompts)
    steps = prompts // lossless.BATCH
    assert [r["step"] for r in runs.read_metrics(save)] == list(range(1, steps + 1))
    runs.record(logs, "async_lossless_done_s", done.seconds)
