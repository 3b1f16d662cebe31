"""scripts/install_env.sh, the decisions `make install` takes before installing: which Python, and
for the GPU install whether nvcc can build flash-attn and for which architectures. Run with fake
python/nvcc/nvidia-smi on PATH (no GPU, no CUDA toolkit needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_env.sh"


def _exe(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def fake_python(folder: Path, name: str, version: tuple[int, int], torch_cuda: str | None = None):
    """A `python` that runs the script's version check as ``version`` would answer it, and
    whose torch reports ``torch_cuda`` (None: no torch)."""
    torch = "echo 'No module named torch' >&2; exit 1"
    if torch_cuda is not None:
        torch = f"echo '{torch_cuda}'"
    patch = f"import sys; sys.version_info = {version!r}; exec(sys.argv[1])"
    _exe(
        folder,
        name,
        f"""case "$2" in
  *torch*) {torch} ;;
  *) exec {sys.executable} -c "{patch}" "$2" ;;
esac
""",
    )


def fake_nvcc(folder: Path, release: str) -> None:
    _exe(
        folder,
        "nvcc",
        f'echo "nvcc: NVIDIA (R) Cuda compiler driver"\n'
        f'echo "Cuda compilation tools, release {release}, V{release}.88"\n',
    )


def fake_smi(folder: Path, gpus: list[tuple[str, str]]) -> None:
    """nvidia-smi answering --query-gpu=compute_cap / name for ``gpus`` [(name, cap)]."""
    caps = "\n".join(c for _, c in gpus)
    names = "\n".join(n for n, _ in gpus)
    _exe(
        folder,
        "nvidia-smi",
        f"""case "$1" in
  --query-gpu=compute_cap) printf '%s\\n' "{caps}" ;;
  --query-gpu=name) printf '%s\\n' "{names}" ;;
esac
""",
    )


def run(bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script with only ``bin_dir`` and the system's shell tools on PATH."""
    tools = bin_dir / "tools"
    tools.mkdir(exist_ok=True)
    for tool in ("sed", "head", "tr", "sort", "paste", "cat"):
        target = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        if not (tools / tool).exists():
            os.symlink(target, tools / tool)
    base = {
        "PATH": f"{bin_dir}:{tools}",
        "INSTALL_ENV_CUDA_FALLBACK": str(bin_dir / "no-cuda"),
        **env,
    }
    return subprocess.run(
        ["/bin/bash", str(SCRIPT), *args], env=base, capture_output=True, text=True, timeout=30
    )


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("make install: "), proc.stderr
    return lines[0]


def assignments(proc: subprocess.CompletedProcess) -> dict[str, str]:
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.split())


# ---------------------------------------------------------------- python


def test_script_bounds_are_pyprojects():
    text = SCRIPT.read_text()
    low = re.search(r"^MIN=\((\d+) (\d+)\)", text, re.M)
    high = re.search(r"^MAX=\((\d+) (\d+)\)", text, re.M)
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec == f">={low[1]}.{low[2]},<{high[1]}.{high[2]}"


@pytest.mark.parametrize(
    ("have", "picked"),
    [
        ({"python3.11": (3, 11), "python3.12": (3, 12)}, "python3.11"),
        ({"python3.12": (3, 12), "python3": (3, 12)}, "python3.12"),  # a CUDA 13 image
        ({"python3.13": (3, 13)}, "python3.13"),
        ({"python3": (3, 12)}, "python3"),
        ({"python3.11": (3, 10), "python3": (3, 13)}, "python3"),  # a misnamed one is skipped
    ],
)
def test_picks_a_supported_python(tmp_path: Path, have: dict, picked: str):
    for name, version in have.items():
        fake_python(tmp_path, name, version)
    proc = run(tmp_path, "python")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == picked


def test_no_supported_python_is_one_line(tmp_path: Path):
    fake_python(tmp_path, "python3", (3, 10))
    fake_python(tmp_path, "python3.14", (3, 14))
    line = one_line(run(tmp_path, "python"))
    assert "no Python 3.11-3.13 found" in line and "PY=" in line


# ---------------------------------------------------------------- flash-attn


def test_builds_only_the_gpus_here(tmp_path: Path):
    fake_nvcc(tmp_path, "13.0")
    fake_smi(tmp_path, [("NVIDIA H100 80GB HBM3", "9.0")] * 8)
    fake_python(tmp_path, "venv-python", (3, 12), torch_cuda="13.0")
    got = assignments(run(tmp_path, "flash-attn", str(tmp_path / "venv-python")))
    assert got == {"FLASH_ATTN_CUDA_ARCHS": "90", "TORCH_CUDA_ARCH_LIST": "9.0"}


def test_mixed_gpus_and_ampere_variants(tmp_path: Path):
    """sm_80 kernels serve every 8.x GPU (flash-attn builds no sm_86/sm_89 of its own)."""
    fake_nvcc(tmp_path, "13.0")
    fake_smi(tmp_path, [("NVIDIA A10", "8.6"), ("NVIDIA L40S", "8.9"), ("NVIDIA H200", "9.0")])
    got = assignments(run(tmp_path, "flash-attn"))
    assert got == {"FLASH_ATTN_CUDA_ARCHS": "80;90", "TORCH_CUDA_ARCH_LIST": "8.6;8.9;9.0"}


def test_set_architectures_are_kept(tmp_path: Path):
    fake_nvcc(tmp_path, "13.0")
    fake_smi(tmp_path, [("NVIDIA H100", "9.0")])
    got = assignments(
        run(tmp_path, "flash-attn", FLASH_ATTN_CUDA_ARCHS="80;90", TORCH_CUDA_ARCH_LIST="8.0;9.0")
    )
    assert got == {"FLASH_ATTN_CUDA_ARCHS": "80;90", "TORCH_CUDA_ARCH_LIST": "8.0;9.0"}
    # both set: nvidia-smi is not needed (building an image on a host without a GPU)
    (tmp_path / "nvidia-smi").unlink()
    got = assignments(
        run(tmp_path, "flash-attn", FLASH_ATTN_CUDA_ARCHS="100", TORCH_CUDA_ARCH_LIST="10.0")
    )
    assert got == {"FLASH_ATTN_CUDA_ARCHS": "100", "TORCH_CUDA_ARCH_LIST": "10.0"}


def test_nvcc_missing_is_one_line(tmp_path: Path):
    fake_smi(tmp_path, [("NVIDIA H100", "9.0")])
    line = one_line(run(tmp_path, "flash-attn"))
    assert "nvcc not found" in line and "CUDA_HOME" in line
    line = one_line(run(tmp_path, "flash-attn", CUDA_HOME=str(tmp_path / "cuda-13.0")))
    assert f"no nvcc at {tmp_path}/cuda-13.0/bin/nvcc" in line


def test_nvcc_from_cuda_home_wins(tmp_path: Path):
    fake_nvcc(tmp_path, "12.8")  # on PATH, the wrong one
    home = tmp_path / "cuda" / "bin"
    home.mkdir(parents=True)
    fake_nvcc(home, "13.0")
    fake_smi(tmp_path, [("NVIDIA H100", "9.0")])
    fake_python(tmp_path, "venv-python", (3, 12), torch_cuda="13.0")
    proc = run(tmp_path, "flash-attn", str(tmp_path / "venv-python"), CUDA_HOME=str(home.parent))
    assert assignments(proc)["FLASH_ATTN_CUDA_ARCHS"] == "90"


def test_nvcc_cuda_not_torchs_is_one_line(tmp_path: Path):
    fake_nvcc(tmp_path, "12.8")
    fake_smi(tmp_path, [("NVIDIA H100", "9.0")])
    fake_python(tmp_path, "venv-python", (3, 12), torch_cuda="13.0")
    line = one_line(run(tmp_path, "flash-attn", str(tmp_path / "venv-python")))
    assert "nvcc is CUDA 12.8" in line and "torch was built with CUDA 13.0" in line
    # before the download (no python given) only nvcc's presence is checked
    assert assignments(run(tmp_path, "flash-attn"))["FLASH_ATTN_CUDA_ARCHS"] == "90"


def test_cpu_torch_or_no_torch_is_one_line(tmp_path: Path):
    fake_nvcc(tmp_path, "13.0")
    fake_smi(tmp_path, [("NVIDIA H100", "9.0")])
    fake_python(tmp_path, "cpu-python", (3, 11), torch_cuda="")
    assert "CPU build" in one_line(run(tmp_path, "flash-attn", str(tmp_path / "cpu-python")))
    fake_python(tmp_path, "bare-python", (3, 11))
    assert "cannot import torch" in one_line(
        run(tmp_path, "flash-attn", str(tmp_path / "bare-python"))
    )


def test_pre_ampere_gpu_is_one_line(tmp_path: Path):
    fake_nvcc(tmp_path, "13.0")
    fake_smi(tmp_path, [("Tesla T4", "7.5")])
    line = one_line(run(tmp_path, "flash-attn"))
    assert "compute capability 8.0 or newer; found 7.5 (Tesla T4)" in line


def test_no_gpu_listed_is_one_line(tmp_path: Path):
    fake_nvcc(tmp_path, "13.0")
    _exe(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2; exit 9\n")
    assert "FLASH_ATTN_CUDA_ARCHS" in one_line(run(tmp_path, "flash-attn"))
