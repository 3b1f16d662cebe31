#!/usr/bin/env bash
# What `make install` decides before it installs, kept here so that tests can run it with fake
# tools on PATH (tests/unit/test_install_env.py). Each mode prints its answer on stdout, or one
# line on stderr saying what is wrong and exits 1.
#
#   scripts/install_env.sh python
#       a Python the package supports (pyproject.toml: >=3.11,<3.14), trying python3.11,
#       python3.12, python3.13 and python3 in that order
#   scripts/install_env.sh flash-attn [PYTHON]
#       for the GPU install's flash-attn build: checks that nvcc is there (and, given the venv's
#       PYTHON with torch installed, that nvcc's CUDA major version is torch's), then prints
#       FLASH_ATTN_CUDA_ARCHS=... and TORCH_CUDA_ARCH_LIST=... for the GPUs nvidia-smi lists
#
# flash-attn compiles every kernel once per architecture, by default for sm_80, sm_90, sm_100 and
# sm_120: four times the compile a host with one kind of GPU needs. Set FLASH_ATTN_CUDA_ARCHS
# (flash-attn's names: 80, 90, 100, 120) and/or TORCH_CUDA_ARCH_LIST (8.0, 9.0, ...) to build
# for other GPUs; a value set is kept as it is.
set -euo pipefail

MIN=(3 11)  # pyproject.toml's requires-python, checked by tests/unit/test_install_env.py
MAX=(3 14)  # exclusive

die() {
    echo "make install: $*" >&2
    exit 1
}

find_python() {
    local p
    for p in python3.11 python3.12 python3.13 python3; do
        command -v "$p" >/dev/null 2>&1 || continue
        if "$p" -c "import sys; sys.exit(not (${MIN[0]}, ${MIN[1]}) <= sys.version_info[:2] < (${MAX[0]}, ${MAX[1]}))" 2>/dev/null; then
            echo "$p"
            return
        fi
    done
    die "no Python ${MIN[0]}.${MIN[1]}-${MAX[0]}.$((MAX[1] - 1)) found (tried python3.11, python3.12, python3.13, python3); install one or pass PY=/path/to/python"
}

# The nvcc torch's extension builder uses: $CUDA_HOME, $CUDA_PATH, nvcc on PATH, /usr/local/cuda
# (tests point INSTALL_ENV_CUDA_FALLBACK elsewhere).
CUDA_FALLBACK=${INSTALL_ENV_CUDA_FALLBACK:-/usr/local/cuda}
find_nvcc() {
    local home=${CUDA_HOME:-${CUDA_PATH:-}}
    if [[ -n $home ]]; then
        [[ -x $home/bin/nvcc ]] || die "no nvcc at $home/bin/nvcc (CUDA_HOME/CUDA_PATH): flash-attn is compiled with it; install the CUDA toolkit (or a -devel image) or fix CUDA_HOME"
        echo "$home/bin/nvcc"
    elif command -v nvcc >/dev/null 2>&1; then
        command -v nvcc
    elif [[ -x $CUDA_FALLBACK/bin/nvcc ]]; then
        echo "$CUDA_FALLBACK/bin/nvcc"
    else
        die "nvcc not found (not on PATH, no CUDA_HOME, no $CUDA_FALLBACK): flash-attn is compiled on install; install the CUDA toolkit matching torch's CUDA (or use a -devel image), or set CUDA_HOME"
    fi
}

# flash-attn's architecture for a compute capability: sm_80 kernels run on every 8.x GPU.
fa_arch() {
    local major=${1%%.*}
    case $major in
        8) echo 80 ;;
        9) echo 90 ;;
        10) echo 100 ;;
        12) echo 120 ;;
        *) return 1 ;;
    esac
}

flash_attn_env() {
    local python=${1:-} nvcc release torch_cuda caps cap fa torch_list="" fa_list="" names
    nvcc=$(find_nvcc)
    release=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1)
    [[ -n $release ]] || die "$nvcc --version names no CUDA release: cannot check it against torch's CUDA"
    if [[ -n $python ]]; then
        torch_cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null) \
            || die "$python cannot import torch: install vLLM (which pins torch) first"
        [[ -n $torch_cuda ]] || die "the installed torch is a CPU build: the GPU install needs vLLM's CUDA torch"
        if [[ ${release%%.*} != "${torch_cuda%%.*}" ]]; then
            die "nvcc is CUDA $release ($nvcc) but torch was built with CUDA $torch_cuda: flash-attn would not build; install CUDA ${torch_cuda%%.*}.x's toolkit or point CUDA_HOME at it"
        fi
    fi
    if [[ -z ${FLASH_ATTN_CUDA_ARCHS:-} || -z ${TORCH_CUDA_ARCH_LIST:-} ]]; then
        caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' ' | sort -u) || true
        [[ -n $caps ]] || die "nvidia-smi lists no GPU compute capability: set FLASH_ATTN_CUDA_ARCHS (e.g. 90) and TORCH_CUDA_ARCH_LIST (e.g. 9.0) for the GPUs to build for"
        for cap in $caps; do
            if ! fa=$(fa_arch "$cap"); then
                names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort -u | paste -sd, -)
                die "flash-attn 2 needs compute capability 8.0 or newer; found $cap ($names): set FLASH_ATTN_CUDA_ARCHS to build anyway, or install without flash-attn (pip install -e .[dev] vllm) and run without --flash_attn"
            fi
            [[ ";$fa_list;" == *";$fa;"* ]] || fa_list=${fa_list:+$fa_list;}$fa
            torch_list=${torch_list:+$torch_list;}$cap
        done
    fi
    echo "FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS:-$fa_list}"
    echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$torch_list}"
}

case ${1:-} in
    python) find_python ;;
    flash-attn) flash_attn_env "${2:-}" ;;
    *)
        echo "usage: $0 python | flash-attn [PYTHON]" >&2
        exit 2
        ;;
esac
