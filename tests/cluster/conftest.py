"""Fixtures of the multi-host tests: one test cluster (2 hosts, munge, Slurm) for the session,
tiny models and data, and the single-host reference runs the multi-host runs must reproduce.

These tests run only under ``make test-cluster`` (which checks for root and installs Slurm):
``FSDP_RLHF_CLUSTER_TESTS=1``; elsewhere they are skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from fsdp_rlhf.testing.synthetic import preference_rows, prompt_rows, write_jsonl
from tests.cluster import runs
from tests.cluster.cluster import Cluster

ENABLED = os.environ.get("FSDP_RLHF_CLUSTER_TESTS") == "1"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="multi-host tests: `make test-cluster` (root, Slurm) runs them")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


_LOGS: list[Path] = []


def pytest_terminal_summary(terminalreporter):
    for logs in _LOGS:
        if (logs / "timings.json").exists():
            terminalreporter.write_line(
                f"cluster timings (s): {(logs / 'timings.json').read_text()}"
            )


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """ctl + node1 + node2, with Slurm; torn down at the end, failures included (a SIGTERM
    to pytest becomes KeyboardInterrupt so that the teardown runs)."""
    if os.geteuid() != 0:
        pytest.skip("the test cluster needs root")
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    # not under pytest's tmp: munged (as the munge user) must reach its socket folder
    root = Path(tempfile.mkdtemp(prefix="frlc-run-", dir="/tmp"))
    c = Cluster(root, nodes=2, slurm=True)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        keep = tmp_path_factory.mktemp("cluster_logs")
        if (root / "logs").is_dir():
            shutil.copytree(root / "logs", keep, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("run_logs")
    _LOGS.append(path)
    return path


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cluster_data")
    write_jsonl(preference_rows(256), root / "pairs.jsonl")
    write_jsonl(prompt_rows(256, chat=True), root / "prompts.jsonl")  # context_messages key
    return root


def rm_paths(tiny_qwen2: str, data: Path, save: Path) -> dict[str, str]:
    return {
        "SAVE_PATH": str(save),
        "SFT_MODEL_PATH": tiny_qwen2,
        "DATASET_PATH": str(data / "pairs.jsonl"),
        "TENSORBOARD_PATH": str(save / "tb"),
    }


def ppo_paths(tiny_qwen2: str, data: Path, reward_model: str, save: Path) -> dict[str, str]:
    return {
        "SAVE_PATH": str(save),
        "SFT_MODEL_PATH": tiny_qwen2,
        "REWARD_MODEL_PATH": reward_model,
        "DATASET_PATH": str(data / "prompts.jsonl"),
        "TENSORBOARD_PATH": str(save / "tb"),
    }


class Setup:
    """Builds the flags of a run: the shipped sbatch's own, for the paths of that run."""

    def __init__(self, cluster: Cluster, tiny_qwen2: str, data: Path, root: Path) -> None:
        self.cluster, self.model, self.data, self.root = cluster, tiny_qwen2, data, root
        self.reward_model: str | None = None

    def save(self, name: str) -> Path:
        return self.root / name

    def rm_env(self, name: str) -> dict[str, str]:
        return runs.launcher_env(rm_paths(self.model, self.data, self.save(name)))

    def ppo_env(self, name: str) -> dict[str, str]:
        assert self.reward_model is not None
        return runs.launcher_env(
            ppo_paths(self.model, self.data, self.reward_model, self.save(name))
        )

    def rm_flags(self, name: str, *extra: str) -> list[str]:
        extra_flags = [*runs.RM_CPU_FLAGS, *extra]
        return runs.render_flags(self.cluster, "train-rm", self.rm_env(name), extra_flags)

    def ppo_flags(self, name: str, *extra: str) -> list[str]:
        extra_flags = [*runs.PPO_CPU_FLAGS, *extra]
        return runs.render_flags(self.cluster, "ppo", self.ppo_env(name), extra_flags)


# A single-host run of the same world size (2 ranks) takes the 2-node flags of the sbatch
# (--num_nodes 2 --num_gpus_per_node 1) with these in their place.
ONE_HOST = ["--num_nodes", "1", "--num_gpus_per_node", "2"]


@pytest.fixture(scope="session")
def setup(cluster, tiny_qwen2, data, tmp_path_factory) -> Setup:
    s = Setup(cluster, tiny_qwen2, data, tmp_path_factory.mktemp("runs"))
    return s


@pytest.fixture(scope="session")
def rm_reference(setup: Setup, logs: Path) -> dict:
    """train-rm on one host, 2 ranks; its model is the reward model (and critic) of PPO."""
    flags = setup.rm_flags("rm_one_host")
    run = runs.run_local("train-rm", flags, logs / "rm_one_host.log")
    assert run.returncode == 0, runs.tail(run.logs["local"])
    runs.record(logs, "rm_one_host_s", run.seconds)
    setup.reward_model = str(setup.save("rm_one_host"))
    return {"metrics": runs.read_metrics(setup.save("rm_one_host")), "run": run}


def _ppo_reference(setup: Setup, logs: Path, name: str, algo: list[str]) -> dict:
    flags = setup.ppo_flags(name, *algo, *ONE_HOST)
    run = runs.run_local("ppo", flags, logs / f"{name}.log")
    assert run.returncode == 0, runs.tail(run.logs["local"])
    runs.record(logs, f"{name}_s", run.seconds)
    return {"metrics": runs.read_metrics(setup.save(name)), "run": run}


@pytest.fixture(scope="session")
def grpo_reference(setup: Setup, rm_reference, logs: Path) -> dict:
    return _ppo_reference(setup, logs, "grpo_one_host", runs.GRPO_FLAGS)


@pytest.fixture(scope="session")
def gae_reference(setup: Setup, rm_reference, logs: Path) -> dict:
    return _ppo_reference(setup, logs, "gae_one_host", runs.GAE_FLAGS)
