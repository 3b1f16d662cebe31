"""What the cluster tests run: the shipped launchers' own flags plus CPU overrides, on one host
or across the test cluster's hosts, and how their results are compared."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.cluster import Cluster
from tests.e2e.helpers import torchrun_logged

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # torchrun of the environment running the tests
SBATCH = {"train-rm": REPO / "slurm" / "train_rm.sbatch", "ppo": REPO / "slurm" / "ppo.sbatch"}

# CPU differences, as extra training flags after the launchers' own (the last one wins): fp32
# (no native bf16 here, no flash-attn), eager vLLM (no compile at engine start), tiny sizes.
RM_CPU_FLAGS = (
    "--no_bf16 --no_flash_attn --train_batch_size 16 --micro_train_batch_size 8 --max_len 64"
    " --learning_rate 1e-3 --save_steps 4"
).split()
PPO_CPU_FLAGS = (
    "--no_bf16 --no_flash_attn --enforce_eager --rollout_batch_size 16"
    " --micro_train_batch_size 8 --generate_max_len 16 --prompt_max_len 32"
    " --actor_learning_rate 2e-3 --critic_learning_rate 1e-3 --seed 7"
).split()
# The seed's PPO is GAE with a critic (from the reward model); GRPO adds groups of 4.
GAE_FLAGS = "--train_batch_size 16 --micro_rollout_batch_size 8 --max_steps 4".split()
GRPO_FLAGS = (
    "--advantage_estimator grpo --n_samples_per_prompt 4 --train_batch_size 64"
    " --micro_rollout_batch_size 16 --max_steps 8"
).split()

# Metrics that vary from run to run on the same inputs (wall time, speed, memory).
# timings and per-host memory; and the weight sync's wire accounting, which differs by design
# after a resume (its first sync is full: the mirror starts empty) and between delta and full
NOISY_PREFIXES = (
    "timing/",
    "memory/",
    "memory_",  # memory_reserved/, memory_owner/, ...
    "rollout/weight_sync_changed_frac",
    "rollout/weight_sync_wire_bytes",
)
NOISY_SUFFIXES = ("tps", "gbps", "_s")  # rates and wall times (e.g. rollout/weight_sync_s)


def base_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",  # torchrun's default with several ranks per host; same for all
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "400",  # rank 0's log lines unwrapped, for the tests to read
    }
    env.update(extra)
    return env


def launcher_env(paths: dict[str, str]) -> dict[str, str]:
    """What the sbatch scripts read from the environment, for one run on this CPU cluster."""
    return {"GPUS_PER_NODE": "1", **paths}


def render_flags(cluster: Cluster, cmd: str, env: dict[str, str], extra: list[str]) -> list[str]:
    """The training flags the shipped sbatch script passes for a 2-node job (its DRY_RUN mode),
    followed by ``extra``."""
    dry = cluster.slurm_env(
        base_env(
            DRY_RUN="1", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2", **env
        )
    )
    proc = subprocess.run(
        ["bash", str(SBATCH[cmd]), *extra], env=dry, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    i = argv.index("fsdp_rlhf.cli")
    assert argv[i + 1] == cmd
    return argv[i + 2 :]


@dataclass
class Run:
    returncode: int
    seconds: float
    logs: dict[str, str]  # per host (or "local")


def run_local(cmd: str, flags: list[str], log: Path, nproc: int = 2, timeout=600) -> Run:
    """``cmd`` on this machine's own network namespace: one host, ``nproc`` ranks (the
    single-host reference of a multi-host run: through the tests' warm launcher, which gives
    the ranks torchrun's environment; the multi-host runs use the real launchers)."""
    t0 = time.monotonic()
    log.write_bytes(b"")
    code = torchrun_logged([cmd, *flags], log, base_env(), nproc, timeout)
    return Run(code, time.monotonic() - t0, {"local": log.read_text()})


def torchrun_argv(
    cluster: Cluster, cmd: str, flags: list[str], port: int, run_id: str, nproc: int = 1
):
    """torchrun on every node, ``nproc`` ranks each, c10d rendezvous on node1 (as the sbatch
    does)."""
    return [
        str(VENV_BIN / "torchrun"),
        *("--nnodes", str(cluster.nodes), "--nproc_per_node", str(nproc)),
        *("--rdzv_backend", "c10d", "--rdzv_endpoint", f"node1:{port}"),
        *("--rdzv_id", run_id, "--max_restarts", "0"),
        *("-m", "fsdp_rlhf.cli", cmd, *flags),
    ]


def start_hosts(
    cluster: Cluster,
    cmd: str,
    flags: list[str],
    logs: Path,
    port=29400,
    tag="run",
    nproc: int = 1,
    env: dict[str, str] | None = None,
):
    """Start the 2-host torchrun (``nproc`` ranks per host, ``env`` added to the base one);
    returns {host: Popen} (logs under ``logs/<tag>-<host>.log``)."""
    env = base_env(GLOO_SOCKET_IFNAME="eth0", **(env or {}))
    argv = torchrun_argv(cluster, cmd, flags, port, tag, nproc)
    return {
        name: cluster.hosts[name].popen(argv, env=env, cwd=REPO, log=logs / f"{tag}-{name}.log")
        for name in cluster.node_names
    }


def wait_hosts(procs: dict[str, subprocess.Popen], logs: Path, tag: str, timeout=600) -> Run:
    t0 = time.monotonic()
    codes = [p.wait(timeout=timeout) for p in procs.values()]
    texts = {n: (logs / f"{tag}-{n}.log").read_text() for n in procs}
    return Run(max(codes, key=abs), time.monotonic() - t0, texts)


def run_hosts(cluster: Cluster, cmd: str, flags: list[str], logs: Path, tag: str, **kw) -> Run:
    return wait_hosts(start_hosts(cluster, cmd, flags, logs, tag=tag, **kw), logs, tag)


def read_metrics(save_path: str | Path) -> list[dict]:
    lines = (Path(save_path) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def metric_rows(save_path: str | Path) -> int:
    path = Path(save_path) / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def deterministic(key: str) -> bool:
    return not key.startswith(NOISY_PREFIXES) and not key.endswith(NOISY_SUFFIXES)


def compare_metrics(got: list[dict], want: list[dict], rel=1e-5, abs_=1e-6) -> list[str]:
    """Differences between two metrics.jsonl (same rows, same steps, same values to float
    tolerance, noisy keys aside); [] when they agree."""
    diffs = []
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return [f"steps {[r['step'] for r in got]} != {[r['step'] for r in want]}"]
    for g, w in zip(got, want, strict=True):
        keys = {k for k in w if deterministic(k)}
        if keys != {k for k in g if deterministic(k)}:
            diffs.append(f"step {w['step']}: keys differ")
            continue
        for k in sorted(keys):
            a, b = g[k], w[k]
            if isinstance(b, float | int) and not math.isclose(a, b, rel_tol=rel, abs_tol=abs_):
                diffs.append(f"step {w['step']} {k}: {a!r} != {b!r}")
    return diffs


def record(logs: Path, key: str, value: float) -> None:
    """A measurement of this session (printed at its end, kept in ``timings.json``)."""
    path = logs / "timings.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = round(value, 2)
    path.write_text(json.dumps(data, indent=1))


def tail(text: str, n: int = 3000) -> str:
    return text[-n:]
