"""`train-rm --packing_samples` on 2 ranks trains like padded batches: same first-step loss
(nothing has been updated yet), a loss that keeps falling, and a saved model; with each pair's
shared prefix run once (the default) and without."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import read_metrics, torchrun
from tests.rm_utils import synthetic_pairs, write_jsonl

pytestmark = pytest.mark.slow


def _train(model: str, data, out, *extra: str) -> tuple[list[dict], str]:
    proc = torchrun([
        "train-rm", "--pretrain", model, "--dataset", str(data), "--save_path", str(out),
        "--ckpt_path", str(out / "ckpt"), "--train_batch_size", "8",
        "--micro_train_batch_size", "2", "--max_len", "64", "--learning_rate", "1e-3",
        "--logging_steps", "1", "--seed", "3", *extra,
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r for r in read_metrics(out) if "loss" in r], " ".join(proc.stdout.split())


@pytest.mark.long
def test_packing_matches_padded_first_step_and_learns(tiny_qwen2, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", synthetic_pairs(88, seed=1))
    # hh-rlhf shaped: "Human: ... Assistant: <filler>" is common to both sides of a pair
    padded, _ = _train(tiny_qwen2, data, tmp_path / "padded")
    packed, log = _train(tiny_qwen2, data, tmp_path / "packed", "--packing_samples")
    assert "shared prompt prefix: each pair's common prefix runs once" in log
    unshared, log = _train(
        tiny_qwen2, data, tmp_path / "unshared", "--packing_samples", "--no_share_prompt_prefix"
    )
    assert "shared prompt prefix" not in log
    for run in (packed, unshared):
        assert len(run) == len(padded) == 10
        assert run[0]["loss"] == pytest.approx(padded[0]["loss"], abs=1e-5)
        assert run[0]["grad_norm"] == pytest.approx(padded[0]["grad_norm"], rel=1e-4)
        assert sum(r["loss"] for r in run[-3:]) < sum(r["loss"] for r in run[:3])
    assert (tmp_path / "packed" / "model.safetensors").is_file()
