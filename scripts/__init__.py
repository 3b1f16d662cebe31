"""Maintainer tools, run as modules from the repository root (so they use this tree's code):

    python -m scripts.bench [--smoke]       the bench against TRL (`make bench`; harness: benchkit/)
    python -m scripts.gen_docs [--check]    the generated pages of docs/
    python -m scripts.openrlhf_flags ...    OpenRLHF's parser flags as data (compat/data/)
    bash scripts/vllm_compat.sh             rollout tests on the oldest vLLM (make test-vllm-compat)

Users' launchers are in examples/, slurm/ and k8s/.
"""
