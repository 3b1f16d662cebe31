"""cmd/gpu_smoke.py as the GPU box runs it, rehearsed on CPU (issue #30): vLLM hidden from every
import (a meta-path finder that refuses it, in this process's children through
``sitecustomize``), so its checks must SKIP, PPO and doctor must run with the HF engine, and
no check may FAIL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

HIDE_VLLM = """
import sys


class _HideVLLM:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, _HideVLLM())
"""


def test_smoke_rehearsal_without_vllm_ends_in_skip_and_pass_lines(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE_VLLM)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "cmd" / "gpu_smoke.py"), "--cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,  # the smoke finds the package from its own path, not the cwd
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    lines = [x for x in out.splitlines() if x.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]
    assert lines and not [x for x in lines if x.startswith("FAIL")], out
    skips = [x for x in lines if x.startswith("SKIP")]
    assert sum("needs vLLM" in x for x in skips) == 4, skips
    assert "vllm -" in out  # the versions line saw no vLLM
    ppo = [x for x in lines if "PPO steps" in x]
    assert len(ppo) == 2 and all(x.startswith("PASS") and "(hf engine)" in x for x in ppo), ppo
    assert any(x.startswith("PASS doctor") and "READY" in x for x in lines), lines
    assert any(x.startswith("PASS packed (SDPA varlen)") for x in lines), lines
    assert out.strip().splitlines()[-1].endswith(", 0 failed")
