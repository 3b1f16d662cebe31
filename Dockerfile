# fsdp-rlhf GPU image: the `gpu` extra (vLLM 0.32.0 + flash-attn 2.8.3.post2) on a PyTorch CUDA
# devel image (devel gives nvcc in case flash-attn has to compile). vLLM 0.32 pins torch 2.13, so
# pip replaces the base image's torch unless BASE_IMAGE already carries 2.13. Not built here (no
# Docker engine on the dev machines). No ENTRYPOINT: launchers (k8s/, slurm/, cmd/) pass commands.
#
#   docker build -t fsdp-rlhf:latest .
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# procps: pkill/ps for the launchers' signal forwarding; rdma-core user-space libraries so that
# NCCL can use InfiniBand/RoCE (rdma/hca) instead of falling back to TCP sockets.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        procps libibverbs1 ibverbs-providers librdmacm1 \
    && rm -rf /var/lib/apt/lists/*

# pyproject.toml requires Python 3.11; fail here rather than at pip time if the base differs.
RUN python -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version'

WORKDIR /workspace/fsdp-rlhf
COPY . .

# flash-attn's setup imports torch, so it is built without build isolation against the torch
# that vLLM pins (installed first).
RUN pip install "setuptools>=68" wheel packaging ninja psutil "vllm==0.32.0" \
    && pip install --no-build-isolation -e ".[gpu]" \
    && python -c 'import fsdp_rlhf, torch; print("torch", torch.__version__)' \
    && command -v torchrun fsdp-rlhf
