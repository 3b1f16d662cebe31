"""The shipped k8s/*-pytorchjob.yaml, started as Kubeflow's training operator starts them
(tests/cluster/pytorchjob.py): the Master pod on node1 and the Worker pod on node2, each running
the manifest's own container command (bash /workspace/launch.sh from the ConfigMap) with the
operator's environment (MASTER_ADDR=<job>-master-0 resolving to node1, MASTER_PORT=23456,
WORLD_SIZE, RANK, PET_*). The test changes only what a user of these manifests would: container
env entries (GPUS_PER_NODE=1, the paths on the shared volume, one thread per rank, no hub
access) and the container's args (the CPU flags the other cluster tests append). Each job must
train across both hosts (rank 0 on node1, rank 1 on node2, found in /proc while it runs) and
reproduce the single-host run with the same flags and seed."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from tests.cluster import pytorchjob, runs

MANIFEST = {
    "train-rm": runs.REPO / "k8s" / "rm-pytorchjob.yaml",
    "ppo": runs.REPO / "k8s" / "ppo-pytorchjob.yaml",
}
PVC = "/mnt/cluster"  # the manifests' data volume
# What base_env gives the reference runs, as container env entries.
RUNTIME_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "COLUMNS": "400",
}


def _environ(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
    return {}


class RankWatch:
    """Which training ranks run on which host, seen in /proc while a job runs: a process of
    the host's network namespace that torchrun started (TORCHELASTIC_RUN_ID and LOCAL_RANK in
    its environment)."""

    def __init__(self, cluster, hosts: list[str]) -> None:
        self.cluster, self.hosts = cluster, hosts
        self.seen: dict[str, dict[int, dict[str, str]]] = {h: {} for h in hosts}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RankWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for h in self.hosts:
                for pid in self.cluster.hosts[h].pids():
                    env = _environ(pid)
                    if "TORCHELASTIC_RUN_ID" in env and "LOCAL_RANK" in env:
                        self.seen[h].setdefault(int(env["RANK"]), env)
            time.sleep(0.5)


def _pvc(setup, name: str) -> Path:
    """The shared volume: the tiny models and data linked in, outputs written under it."""
    pvc = setup.root / f"{name}_pvc"
    (pvc / "models").mkdir(parents=True, exist_ok=True)
    links = {"models/sft": setup.model, "data": setup.data}
    if setup.reward_model:
        links["models/rm"] = setup.reward_model
    for rel, target in links.items():
        if not (pvc / rel).exists():
            os.symlink(target, pvc / rel)
    return pvc


def run_job(setup, logs: Path, cmd: str, name: str, env: dict[str, str], args: list[str]):
    """Start the manifest's pods, wait for both; returns (exit codes, pod logs, ranks seen,
    the pods, the shared volume)."""
    cluster = setup.cluster
    pvc = _pvc(setup, name)
    container_env = {"GPUS_PER_NODE": "1", **RUNTIME_ENV, **env}
    pods = pytorchjob.make_pods(
        cluster, MANIFEST[cmd], setup.root / f"{name}_pods", pvc, container_env, args
    )
    t0 = time.monotonic()
    with RankWatch(cluster, [p.host for p in pods]) as watch:
        procs = pytorchjob.start(cluster, pods, logs)
        codes = {n: p.wait(timeout=600) for n, p in procs.items()}
    runs.record(logs, f"{name}_s", time.monotonic() - t0)
    texts = {p.name: (logs / f"{p.name}.log").read_text() for p in pods}
    return codes, texts, watch.seen, pods, pvc


def _check_both_hosts(job: str, codes, texts, seen, pods) -> None:
    master, worker = (p.name for p in pods)
    assert (master, worker) == (f"{job}-master-0", f"{job}-worker-0")
    assert codes == {master: 0, worker: 0}, {n: runs.tail(t) for n, t in texts.items()}
    # the operator's contract reached launch.sh: node rank, node count, the Service name
    assert f"launch.sh: node 0 of 2, master {master}:23456" in texts[master]
    assert f"launch.sh: node 1 of 2, master {master}:23456" in texts[worker]
    # one rank per host, started by torchrun from the operator's master name
    assert set(seen) == {"node1", "node2"}
    assert sorted(seen["node1"]) == [0] and sorted(seen["node2"]) == [1], seen.keys()
    for env in (seen["node1"][0], seen["node2"][1]):
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "1"
        assert env["MASTER_ADDR"] == master and env["PET_MASTER_ADDR"] == master


def test_rm_pytorchjob_on_two_hosts_matches_one_host(setup, rm_reference, logs):
    name = "rm_k8s"
    env = {
        "SAVE_PATH": f"{PVC}/{name}",
        "SFT_MODEL_PATH": f"{PVC}/models/sft",
        "DATASET_PATH": f"{PVC}/data/pairs.jsonl",
        "TENSORBOARD_PATH": f"{PVC}/{name}/tb",
    }
    codes, texts, seen, pods, pvc = run_job(setup, logs, "train-rm", name, env, runs.RM_CPU_FLAGS)
    _check_both_hosts("fsdp-rlhf-rm", codes, texts, seen, pods)
    got = runs.read_metrics(pvc / name)
    assert got and not runs.compare_metrics(got, rm_reference["metrics"])


def test_ppo_pytorchjob_on_two_hosts_matches_one_host(setup, gae_reference, logs):
    name = "gae_k8s"
    env = {
        "SAVE_PATH": f"{PVC}/{name}",
        "SFT_MODEL_PATH": f"{PVC}/models/sft",
        "REWARD_MODEL_PATH": f"{PVC}/models/rm",
        "DATASET_PATH": f"{PVC}/data/prompts.jsonl",
        "TENSORBOARD_PATH": f"{PVC}/{name}/tb",
    }
    args = [*runs.PPO_CPU_FLAGS, *runs.GAE_FLAGS]
    codes, texts, seen, pods, pvc = run_job(setup, logs, "ppo", name, env, args)
    _check_both_hosts("fsdp-rlhf-ppo", codes, texts, seen, pods)
    got = runs.read_metrics(pvc / name)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert all("critic/vf_loss" in r for r in got)
    assert not runs.compare_metrics(got, gae_reference["metrics"])
