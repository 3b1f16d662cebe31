"""Fixtures of the VLM runs: a tiny Qwen2.5-VL (random weights, the real processor) and
colour-naming data (one solid-colour image per row), built locally."""

from __future__ import annotations

from pathlib import Path

import pytest

COLOUR_REWARD = '''
def reward_func(queries, prompts, labels):
    """1 when the answer's first word is the image's colour, else 0."""
    out = []
    for q, p, label in zip(queries, prompts, labels):
        words = q[len(p):].split()
        out.append(float(bool(words) and words[0] == label))
    return out
'''


@pytest.fixture(scope="session")
def tiny_vl(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    return str(build_vl_model(tmp_path_factory.mktemp("tiny_vl")))


@pytest.fixture(scope="session")
def vl_colour_data(tmp_path_factory) -> Path:
    """``prompts.jsonl`` (paths), ``prompts_b64.jsonl`` (base64), ``eval.jsonl`` (data URIs,
    other draws) and ``reward.py``."""
    from fsdp_rlhf.testing.tiny_vlm import colour_rows, write_rows

    root = tmp_path_factory.mktemp("vl_colour_data")
    write_rows(colour_rows(64, root / "images", seed=0), root / "prompts.jsonl")
    write_rows(colour_rows(64, root / "b64", seed=0, encoding="base64"), root / "prompts_b64.jsonl")
    held_out = colour_rows(48, root / "eval", seed=1, encoding="data_uri")
    write_rows(held_out, root / "eval.jsonl")
    (root / "reward.py").write_text(COLOUR_REWARD)
    return root


# the colour task of the GRPO runs (test_vlm_grpo, test_vlm_async): a word-level vocabulary
COLOUR_WORDS = [
    *("what", "colour", "is", "it", "the", "a"),
    *("red", "green", "blue", "user", "assistant"),
]


@pytest.fixture(scope="session")
def colour_vl(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    return str(build_vl_model(tmp_path_factory.mktemp("colour_vl"), words=COLOUR_WORDS, seed=3))


@pytest.fixture(scope="session")
def colour_data(tmp_path_factory) -> Path:
    """``prompts.jsonl`` (96 colour rows), ``blank.jsonl`` (the same labels, grey images) and
    ``reward.py``."""
    from fsdp_rlhf.testing.tiny_vlm import colour_rows, write_rows

    root = tmp_path_factory.mktemp("colour_data")
    write_rows(colour_rows(96, root / "images", seed=0), root / "prompts.jsonl")
    write_rows(colour_rows(96, root / "blank", seed=0, blank=True), root / "blank.jsonl")
    (root / "reward.py").write_text(COLOUR_REWARD)
    return root
