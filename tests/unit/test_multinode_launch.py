"""Multi-node launch settings that need no cluster to check.

The Kubernetes launch scripts (k8s/*-pytorchjob.yaml) and the Slurm ones (slurm/*.sbatch)
read the same environment: the same variables, and, given the same values, the same training
flags and ranks per node. Only where the scheduler states the topology differs (SLURM_* there;
MASTER_ADDR, WORLD_SIZE, RANK and PET_* from the training operator here). Both run for real in
tests/cluster (`make test-cluster`, root only); this keeps them together everywhere. The k8s
launch.sh renders the right torchrun under every environment the operator can inject
(tests/cluster/pytorchjob.py models it), and a vLLM engine's tensor-parallel ranks stay inside
one node.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PAIRS = {
    "train-rm": (REPO / "slurm" / "train_rm.sbatch", REPO / "k8s" / "rm-pytorchjob.yaml"),
    "ppo": (REPO / "slurm" / "ppo.sbatch", REPO / "k8s" / "ppo-pytorchjob.yaml"),
}
# the operator's, not the user's
SCHEDULER_VARS = {"MASTER_ADDR", "WORLD_SIZE", "RANK", "PET_NNODES", "PET_NODE_RANK"}
SCHEDULER_VARS |= {"PET_NPROC_PER_NODE"}
MANIFESTS = sorted((REPO / "k8s").glob("*-pytorchjob.yaml"))
# Read with a default (or a required check): ${VAR:-...}, ${VAR:?...}, ${VAR-...}
_READ = re.compile(r"\$\{([A-Z][A-Z0-9_]*):?[-?]")


def launch_sh(manifest: Path) -> str:
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return cm["data"]["launch.sh"]


def environment_read(script: str) -> set[str]:
    return set(_READ.findall(script))


@pytest.mark.parametrize("cmd", PAIRS)
def test_same_variables(cmd: str):
    sbatch, manifest = PAIRS[cmd]
    slurm = {v for v in environment_read(sbatch.read_text()) if not v.startswith("SLURM_")}
    k8s = environment_read(launch_sh(manifest)) - SCHEDULER_VARS
    assert slurm == k8s, {"only slurm": slurm - k8s, "only k8s": k8s - slurm}
    assert {"SAVE_PATH", "GPUS_PER_NODE", "GLOO_SOCKET_IFNAME", "SAVE_STEPS"} <= k8s


def _render(argv: list[str], env: dict[str, str]) -> list[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    proc = subprocess.run(
        argv, env={**base, **env, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    i = argv.index("fsdp_rlhf.cli")
    return argv[: i - 1], argv[i + 2 :]


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("cmd", PAIRS)
def test_same_values_give_the_same_run(cmd: str, tmp_path: Path):
    sbatch, manifest = PAIRS[cmd]
    user = {  # every variable both read, set to something neither defaults to
        "SAVE_PATH": "/shared/run7",
        "CKPT_PATH": "/shared/ckpt7",
        "SFT_MODEL_PATH": "/shared/sft",
        "REWARD_MODEL_PATH": "/shared/rm",
        "DATASET_PATH": "/shared/data",
        "SAVE_STEPS": "7",
        "TENSORBOARD_PATH": "/shared/tb",
        "GPUS_PER_NODE": "4",
        "VLLM_TENSOR_PARALLEL_SIZE": "2",
        "MASTER_PORT": "31337",
    }
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'n1\\nn2\\n'\n")  # show hostnames
    (fake / "scontrol").chmod(0o755)
    path = f"{fake}{os.pathsep}{os.environ['PATH']}"
    slurm = _render(
        ["bash", str(sbatch), "--seed", "3"],
        {
            **user,
            "PATH": path,
            "SLURM_JOB_ID": "9",
            "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_NNODES": "2",
        },
    )
    script = tmp_path / "launch.sh"
    script.write_text(launch_sh(manifest))
    k8s = _render(
        ["bash", str(script), "--seed", "3"],
        {**user, "MASTER_ADDR": "job-master-0", "WORLD_SIZE": "2", "RANK": "1"},
    )
    (s_launch, s_flags), (k_launch, k_flags) = _split(slurm), _split(k8s)
    assert s_flags == k_flags
    assert "/shared/ckpt7" in s_flags and "--seed" in s_flags
    for name in ("--nproc_per_node", "--nnodes"):
        assert _opt(s_launch, name) == _opt(k_launch, name)
    assert _opt(s_launch, "--rdzv_endpoint") == "n1:31337"
    assert _opt(k_launch, "--master_port") == "31337"


@pytest.mark.parametrize(
    ("local", "tp", "ok"), [(8, 2, True), (8, 8, True), (4, 8, True), (6, 4, False), (1, 1, True)]
)
def test_tp_engines_stay_inside_a_node(monkeypatch, local: int, tp: int, ok: bool):
    """torchrun gives each node a contiguous block of ranks and vLLM makes contiguous TP
    blocks: a TP size that neither divides nor is a multiple of the ranks per node would put
    one engine on parts of two nodes."""
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.errors import UserError
    from fsdp_rlhf.trainers.ppo.setup import _check_world

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    cfg, _ = build_config(PPOConfig, ["--vllm_tensor_parallel_size", str(tp)])
    if ok:
        _check_world(cfg, 2 * max(local, tp))
    else:
        with pytest.raises(UserError, match="span parts of two nodes"):
            _check_world(cfg, 24)


# ---------------------------------------------------------------- the operator's environment


def _operator_dry_run(
    manifest: Path, tmp_path: Path, spec: dict, env: dict[str, str] | None = None
):
    """launch.sh of ``manifest`` (DRY_RUN) in the Worker pod's environment as the training
    operator sets it for the job with ``spec`` merged into its spec."""
    from tests.cluster import pytorchjob

    job, _ = pytorchjob.load(manifest)
    job["spec"].update(spec)
    job = pytorchjob.with_defaults(job)
    injected = dict(pytorchjob.operator_env(job, "Worker", 0))
    script = tmp_path / "launch.sh"
    script.write_text(launch_sh(manifest))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    proc = subprocess.run(
        ["bash", str(script)],
        env={**base, **injected, **(env or {}), "DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=10,
    )
    return job, injected, proc


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.stem)
@pytest.mark.parametrize("nproc", [None, "8"], ids=["as-shipped", "nprocPerNode-8"])
def test_launch_sh_under_the_operators_environment(manifest: Path, tmp_path: Path, nproc):
    """As shipped (no nprocPerNode: the operator defaults it to "auto", WORLD_SIZE counts pods)
    and with nprocPerNode "8" (WORLD_SIZE then counts processes, 16): 2 nodes either way."""
    spec = {} if nproc is None else {"nprocPerNode": nproc}
    job, injected, proc = _operator_dry_run(manifest, tmp_path, spec)
    assert injected["WORLD_SIZE"] == ("2" if nproc is None else "16")
    assert injected["PET_NPROC_PER_NODE"] == (nproc or "auto")
    assert injected["PET_NNODES"] == "2" and injected["RANK"] == injected["PET_NODE_RANK"] == "1"
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    launcher, _ = _split(argv)
    name = job["metadata"]["name"]
    assert _opt(launcher, "--nnodes") == "2" and _opt(launcher, "--node_rank") == "1"
    assert _opt(launcher, "--master_addr") == f"{name}-master-0"
    assert _opt(launcher, "--master_port") == "23456"
    assert _opt(launcher, "--nproc_per_node") == "8"


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.stem)
def test_launch_sh_refuses_what_it_cannot_run(manifest: Path, tmp_path: Path):
    _, _, proc = _operator_dry_run(manifest, tmp_path, {"nprocPerNode": "4"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "launch.sh: the PyTorchJob's nprocPerNode (4) is not GPUS_PER_NODE (8): set them equal, "
        "or leave nprocPerNode out"
    )
    # an elasticPolicy makes PET_NNODES a range (and asks for c10d rendezvous via PET_RDZV_*)
    _, _, proc = _operator_dry_run(manifest, tmp_path, {}, {"PET_NNODES": "1:2"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("launch.sh: PET_NNODES=1:2 is a range (an elasticPolicy)")
    assert len(proc.stderr.strip().splitlines()) == 1
