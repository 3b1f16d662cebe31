# fsdp-rlhf GPU image: the `gpu` extra (vLLM + flash-attn) on a PyTorch CUDA devel image (devel
# gives nvcc: flash-attn compiles against the installed torch). One consistent stack, pinned below
# and checked against pyproject.toml by tests/unit/test_dockerfile.py:
#   vLLM 0.32.0 pins torch==2.13.0; torch 2.13.0's PyPI wheel is built for CUDA 13.0 (it requires
#   cuda-toolkit==13.0.3); flash-attn 2.8.3.post2 is compiled here with that torch and nvcc 13.0.
# The build fails when torch, its CUDA or nvcc end up anything else. Not built on the dev machines
# (no Docker engine there). No ENTRYPOINT: launchers (k8s/, slurm/, cmd/) pass commands.
#
#   docker build -t fsdp-rlhf:latest .
#   docker build --build-arg MAX_JOBS=4 --build-arg FLASH_ATTN_CUDA_ARCHS="80;90" ...
ARG TORCH_VERSION=2.13.0
ARG CUDA_VERSION=13.0
ARG BASE_IMAGE=pytorch/pytorch:${TORCH_VERSION}-cuda${CUDA_VERSION}-cudnn9-devel
FROM ${BASE_IMAGE}

ARG TORCH_VERSION
ARG CUDA_VERSION
ARG VLLM_VERSION=0.32.0
ARG FLASH_ATTN_VERSION=2.8.3.post2
# flash-attn's CUDA build runs one nvcc per job and each can take several GiB of host memory:
# unbounded (ninja's default is all cores) it is killed by the OOM killer on big build hosts.
ARG MAX_JOBS=8
# Hopper and Ampere only by default (each extra architecture adds to a build of tens of minutes).
ARG FLASH_ATTN_CUDA_ARCHS=80;90

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MAX_JOBS=${MAX_JOBS} \
    NVCC_THREADS=2 \
    FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS}

# procps: pkill/ps for the launchers' signal forwarding; rdma-core user-space libraries so that
# NCCL can use InfiniBand/RoCE (rdma/hca) instead of falling back to TCP sockets.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        procps libibverbs1 ibverbs-providers librdmacm1 \
    && rm -rf /var/lib/apt/lists/*

# pyproject.toml accepts Python 3.11-3.13 (the CUDA 13 PyTorch images ship 3.12); fail here
# rather than at pip time if the base has another.
RUN python -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 14), sys.version'

# flash-attn compiles with this nvcc against torch's CUDA: their versions must agree.
RUN nvcc --version | grep -q "release ${CUDA_VERSION}," \
    || { echo "nvcc is not CUDA ${CUDA_VERSION}: flash-attn would not build" >&2; exit 1; }

# vLLM first with its torch pin stated: pip would otherwise swap the base image's torch for
# whatever vLLM pulls without saying so. Then check the torch flash-attn will be built against.
RUN pip install "setuptools>=68" wheel packaging ninja psutil \
        "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}" \
    && python -c "import sys, torch; \
v, c = torch.__version__.split('+')[0], torch.version.cuda or 'none'; \
print('torch', torch.__version__, 'cuda', c); \
ok = v == '${TORCH_VERSION}' and c.startswith('${CUDA_VERSION}'); \
sys.exit(0 if ok else 'torch %s / CUDA %s, expected ${TORCH_VERSION} / ${CUDA_VERSION}' % (v, c))"

WORKDIR /workspace/fsdp-rlhf
COPY . .

# flash-attn's setup imports torch, so it is built without build isolation against the torch
# checked above; the same check runs again after in case the extra's resolution moved it.
RUN pip install --no-build-isolation -e ".[gpu,wandb]" \
    && python -c "import sys, torch, vllm, flash_attn, fsdp_rlhf; \
got = (torch.__version__.split('+')[0], (torch.version.cuda or '')[:len('${CUDA_VERSION}')], \
vllm.__version__, flash_attn.__version__); \
want = ('${TORCH_VERSION}', '${CUDA_VERSION}', '${VLLM_VERSION}', '${FLASH_ATTN_VERSION}'); \
print('torch/cuda/vllm/flash-attn', got); \
sys.exit(0 if got == want else 'stack %s, expected %s' % (got, want))" \
    && command -v torchrun fsdp-rlhf
