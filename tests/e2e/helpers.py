"""Run the real CLI (directly or under torchrun) from tests.

Both go through the warm launcher by default (fsdp_rlhf/testing/warm_launch.py): the ranks are
forked from a server that has imported torch, transformers and vLLM once, with the environment
torchrun gives them. ``FSDP_RLHF_TEST_LAUNCHER=torchrun`` runs real torchrun (and a fresh
Python process for ``run_cli``) instead; a case the server cannot serve falls back by itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fsdp_rlhf.testing import warm_launch
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
    cmd = [sys.executable, "-m", "fsdp_rlhf.cli", *args]
    return _run(cmd, "single", 1, _env(env, replace_env), timeout)


def torchrun(
    args: list[str], nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m fsdp_rlhf.cli ARGS`` on a free local port."""
    cmd = local_torchrun(nproc, ["-m", "fsdp_rlhf.cli", *args])
    return _run(cmd, "torchrun", nproc, _env(env), timeout)


def torchrun_script(
    script: str | Path, args: list[str], nproc: int = 2, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N SCRIPT ARGS`` (a test's own worker script)."""
    cmd = local_torchrun(nproc, [str(script), *args])
    return _run(cmd, "torchrun", nproc, _env(None), timeout)


def torchrun_logged(
    args: list[str], log: Path, env: dict[str, str], nproc: int = 2, timeout: float = 600
) -> int:
    """``torchrun --nproc_per_node N -m fsdp_rlhf.cli ARGS`` with stdout and stderr into
    ``log`` (one file, as a shell's ``> log 2>&1``); returns the exit code."""
    cmd = local_torchrun(nproc, ["-m", "fsdp_rlhf.cli", *args])
    with open(log, "ab") as out:
        if warm_launch.mode() == "warm":
            try:
                return warm_launch.launch(
                    "torchrun", cmd[_target(cmd) :], env, str(REPO), nproc, timeout,
                    out.fileno(), out.fileno(),
                )  # fmt: skip
            except warm_launch.Fallback as why:
                warm_launch.note_fallback(" ".join(args[:8]), why)
        return subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO
        ).returncode


def python_c(code: str, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` as one process (a check in a process of its own)."""
    return _run([sys.executable, "-c", code, *args], "single", 1, _env(None), timeout)


def _run(
    cmd: list[str], kind: str, nproc: int, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    if warm_launch.mode() == "warm":
        try:
            return _warm(cmd, kind, nproc, env, timeout)
        except warm_launch.Fallback as why:
            warm_launch.note_fallback(" ".join(cmd[-12:]), why)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def _warm(
    cmd: list[str], kind: str, nproc: int, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """The same case on the warm launcher: ``cmd``'s outputs and exit code, as subprocess.run
    would return them."""
    argv = cmd[_target(cmd) :] if kind == "torchrun" else cmd[1:]
    with tempfile.TemporaryFile("a+b") as out, tempfile.TemporaryFile("a+b") as err:
        try:
            code = warm_launch.launch(
                kind, argv, env, str(REPO), nproc, timeout, out.fileno(), err.fileno()
            )
        except subprocess.TimeoutExpired as e:
            raise subprocess.TimeoutExpired(cmd, timeout, _text(out), _text(err)) from e
        return subprocess.CompletedProcess(cmd, code, _text(out), _text(err))


def _target(cmd: list[str]) -> int:
    """Where torchrun's target (``-m module`` or a script) starts in a ``local_torchrun`` line."""
    return cmd.index("--master_port") + 2


def _text(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def read_metrics(save_path: str | Path) -> list[dict]:
    lines = (Path(save_path) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
