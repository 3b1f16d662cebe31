"""Fixtures shared by the end-to-end tests: a reward model trained by `fsdp-rlhf train-rm`."""

from __future__ import annotations

import pytest

from fsdp_rlhf.testing.synthetic import preference_rows, write_jsonl
from tests.e2e.helpers import torchrun


@pytest.fixture(scope="session")
def trained_rm(tiny_qwen2, tmp_path_factory) -> str:
    """A tiny reward model trained for a few steps on synthetic pairs (2 ranks, real CLI)."""
    root = tmp_path_factory.mktemp("trained_rm")
    write_jsonl(preference_rows(256), root / "pairs.jsonl")
    save = root / "rm"
    proc = torchrun(
        [
            "train-rm",
            "--pretrain",
            tiny_qwen2,
            "--dataset",
            str(root / "pairs.jsonl"),
            "--save_path",
            str(save),
            "--train_batch_size",
            "16",
            "--micro_train_batch_size",
            "8",
            "--max_len",
            "64",
            "--learning_rate",
            "1e-3",
            "--max_epochs",
            "1",
            "--logging_steps",
            "4",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(save)
