"""Run the real CLI (directly or under torchrun) from tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fsdp_rlhf.testing.launch import local_torchrun

REPO = Path(__file__).resolve().parents[2]


def _env(extra: dict[str, str] | None, replace_env: bool = False) -> dict[str, str]:
    env = dict(extra or {}) if replace_env else {**os.environ, **(extra or {})}
    env.setdefault("PYTHONPATH", str(REPO))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_cli(
    args: list[str],
    env: dict[str, str] | None = None,
    replace_env: bool = False,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``python -m fsdp_rlhf.cli ARGS`` as one process."""
    return subprocess.run(
        [sys.executable, "-m", "fsdp_rlhf.cli", *args],
        capture_output=True,
        text=True,
        env=_env(env, replace_env),
        timeout=timeout,
        cwd=REPO,
    )


def torchrun(
    args: list[str], nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m fsdp_rlhf.cli ARGS`` on a free local port."""
    cmd = local_torchrun(nproc, ["-m", "fsdp_rlhf.cli", *args])
    return subprocess.run(
        cmd, capture_output=True, text=True, env=_env(env), timeout=timeout, cwd=REPO
    )


def read_metrics(save_path: str | Path) -> list[dict]:
    lines = (Path(save_path) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
