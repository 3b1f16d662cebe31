"""Shared fixtures: tiny local models (no downloads), seeded RNG, CUDA skip marker."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.testing import warm_launch

REPO = Path(__file__).resolve().parents[1]
# folders whose tests launch ranks (torchrun, gloo): a session holding any starts the warm
# launcher's server at once, so that its imports overlap the first tests
_LAUNCHING = ("e2e", "distributed", "vlm", "models")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Arrow caches of the many small files tests load go to /tmp, not the user's ~/.cache.
os.environ.setdefault(
    "HF_DATASETS_CACHE", os.path.join(tempfile.gettempdir(), "fsdp_rlhf_tests_hf_datasets")
)


def pytest_collection_finish(session):
    if warm_launch.mode() != "warm":
        return
    tests = REPO / "tests"
    for item in session.items:
        parts = Path(str(item.fspath)).relative_to(tests).parts
        if parts and parts[0] in _LAUNCHING:
            warm_launch.start_server(REPO)
            return


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # the marker, not a keyword: keywords also hold folder names (a checkout named "gpu")
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """A 2-layer Qwen2 (hidden 128, 2 heads of 64) with a trained BPE tokenizer, saved locally;
    like Qwen2/2.5 checkpoints its config.json has no head_dim."""
    from fsdp_rlhf.testing.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer Llama shaped like SmolLM: 9 query / 3 KV heads of 64, tied embeddings."""
    from fsdp_rlhf.testing.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen2_tied(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny import build_model

    path = tmp_path_factory.mktemp("tiny_qwen2_tied")
    return str(build_model(path, "qwen2", tie_word_embeddings=True, seed=2))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
