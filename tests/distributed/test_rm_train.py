"""`train-rm` on 2 gloo ranks with a tiny Qwen2 and a learnable synthetic preference set.

One spawn runs three trainings: uninterrupted; stopped by SIGTERM at step 5 (checkpoint, exit
0, no model); resumed with --load_checkpoint. Then the saved model is checked from plain HF.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import torch

from fsdp_rlhf.trainers.offline.rm import TRAIN_KEYS
from tests.dist_utils import run_distributed
from tests.rm_utils import synthetic_pairs, write_jsonl

STEPS = 12  # 192 train pairs / 16 per step, 1 epoch
STOP_AT = 5
CRASH_AT = 6  # checkpoint at 4, rows for 5 and 6 written


def _argv(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--pretrain", model,
        "--dataset", str(data / "train.jsonl"),
        "--eval_dataset", str(data / "eval.jsonl"),
        "--save_path", str(out / "model"),
        "--ckpt_path", str(out / "ckpt"),
        "--train_batch_size", "16",
        "--micro_train_batch_size", "4",  # 2 accumulation steps per rank
        "--max_len", "48",
        "--learning_rate", "1e-3",
        "--lr_warmup_ratio", "0.1",
        "--logging_steps", "1",
        "--zero_stage", "3",
        *extra,
    ]  # fmt: skip


def _run_rm(argv: list[str]) -> int:
    from fsdp_rlhf.config import RMConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.trainers.offline.rm import main

    cfg, _ = build_config(RMConfig, argv)
    return main(cfg)


class _Interrupt(Exception):
    pass


def _interrupt_at(step: int, act):
    """Wrap RMTrainer.train_step so that ``act()`` runs after step ``step``."""
    from fsdp_rlhf.trainers.offline.rm import RMTrainer

    original = RMTrainer.train_step

    def wrapped(self, stop_agreed):
        finished = original(self, stop_agreed)
        if self.step == step:
            act()
        return finished

    RMTrainer.train_step = wrapped
    return original


def _run_interrupted(argv: list[str], step: int, act) -> int | str:
    from fsdp_rlhf.trainers.offline.rm import RMTrainer

    original = _interrupt_at(step, act)
    try:
        return _run_rm(argv)
    except _Interrupt:
        return "crashed"
    finally:
        RMTrainer.train_step = original


def _crash():
    raise _Interrupt


def _three_runs(rank: int, world: int, model: str, data: str, root: str) -> dict:
    data_dir, root_dir = Path(data), Path(root)
    codes = {"full": _run_rm(_argv(model, data_dir, root_dir / "full"))}
    sigterm = (lambda: signal.raise_signal(signal.SIGTERM)) if rank == 0 else (lambda: None)
    argv = _argv(model, data_dir, root_dir / "resumed")
    codes["stopped"] = _run_interrupted(argv, STOP_AT, sigterm)
    stopped_model_written = (root_dir / "resumed" / "model" / "model.safetensors").exists()
    codes["resumed"] = _run_rm([*argv, "--load_checkpoint"])
    # A crash (no stop vote) after rows past the last checkpoint were written: the resumed
    # run redoes those steps and must not leave them twice in metrics.jsonl.
    argv = _argv(model, data_dir, root_dir / "crashed", "--save_steps", "4")
    codes["crashed"] = _run_interrupted(argv, CRASH_AT, _crash)
    codes["after_crash"] = _run_rm([*argv, "--load_checkpoint"])
    return {"codes": codes, "stopped_model_written": stopped_model_written}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _hf_scores(model_dir: Path, data_dir: Path):
    """Scores of the eval pairs from AutoModelForSequenceClassification alone, and ours."""
    from datasets import load_dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fsdp_rlhf.config import PreferenceDataConfig
    from fsdp_rlhf.data.preference import collate_pairs, tokenize_pairs
    from fsdp_rlhf.models.forward import sequence_scores
    from fsdp_rlhf.models.inputs import forward_inputs

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    raw = load_dataset("json", data_files=str(data_dir / "eval.jsonl"), split="train")
    pairs, _ = tokenize_pairs(raw, tok, PreferenceDataConfig(max_len=48))
    batch = collate_pairs(pairs[:], tok.pad_token_id)
    with torch.no_grad():
        hf = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]
        ours = sequence_scores(model, forward_inputs(batch.input_ids, batch.attention_mask))
    return hf.double(), ours.double(), batch.num_pairs


def test_rm_learns_saves_and_resumes(tiny_qwen2, tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", synthetic_pairs(192, seed=0))
    write_jsonl(data / "eval.jsonl", synthetic_pairs(64, seed=1))
    out = run_distributed(_three_runs, 2, tiny_qwen2, str(data), str(tmp_path))
    codes = {"full": 0, "stopped": 0, "resumed": 0, "crashed": "crashed", "after_crash": 0}
    assert out[0]["codes"] == out[1]["codes"] == codes
    assert not out[0]["stopped_model_written"]

    full = _rows(tmp_path / "full" / "model" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "model" / "metrics.jsonl")
    train_full = {r["step"]: r for r in full if "loss" in r}
    train_resumed = {r["step"]: r for r in resumed if "loss" in r}
    assert sorted(train_full) == sorted(train_resumed) == list(range(1, STEPS + 1))
    assert set(TRAIN_KEYS) <= set(train_full[1])
    # resuming from the SIGTERM checkpoint continues exactly: same data order, state and RNG
    for step in (STOP_AT + 1, STEPS):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(train_full[step][key] - train_resumed[step][key]) < 1e-6, (step, key)

    crashed = _rows(tmp_path / "crashed" / "model" / "metrics.jsonl")
    assert [r["step"] for r in crashed if "loss" in r] == list(range(1, STEPS + 1))

    final_eval = [r for r in full if "eval/acc" in r][-1]
    assert final_eval["step"] == STEPS
    assert final_eval["eval/acc"] > 0.9, final_eval
    assert train_full[1]["acc"] < 0.9  # it did have to learn

    model_dir = tmp_path / "full" / "model"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert "normalize_reward" not in cfg
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"]
    assert (model_dir / "config.yaml").is_file()
    hf, ours, n = _hf_scores(model_dir, data)
    # HF's last-non-pad rule and our last-attended-token rule read the same position
    torch.testing.assert_close(hf, ours, atol=1e-5, rtol=0)
    # the plain-HF scores reproduce the trainer's final eval rewards
    assert n == 64
    assert abs(hf.mean().item() - cfg["reward_mean"]) < 1e-4
    assert abs(hf.std().item() - cfg["reward_std"]) < 1e-4
    assert abs(cfg["reward_mean"] - final_eval["eval/reward_mean"]) < 1e-9
    acc = (hf[:n] > hf[n:]).double().mean().item()
    assert abs(acc - final_eval["eval/acc"]) < 1e-9

    from fsdp_rlhf.models.load import reward_normalization

    assert reward_normalization(str(model_dir)) == (cfg["reward_mean"], cfg["reward_std"])


def _lora_run(rank: int, world: int, model: str, data: str, root: str) -> int:
    extra = ["--lora_rank", "8", "--lora_alpha", "16", "--merge_lora", "--learning_rate", "5e-3"]
    argv = _argv(model, Path(data), Path(root) / "lora", *extra)
    return _run_rm(argv)


def test_rm_lora_learns_and_exports_adapter_and_merged_model(tiny_qwen2, tmp_path):
    """--lora_rank: the decoder gets adapters, the score head is trained in full; the merged
    export scores like the trainer's final eval, and base + adapter in peft like the merge."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", synthetic_pairs(192, seed=0))
    write_jsonl(data / "eval.jsonl", synthetic_pairs(64, seed=1))
    assert run_distributed(_lora_run, 2, tiny_qwen2, str(data), str(tmp_path)) == [0, 0]
    model_dir = tmp_path / "lora" / "model"
    rows = _rows(model_dir / "metrics.jsonl")
    final_eval = [r for r in rows if "eval/acc" in r][-1]
    assert final_eval["eval/acc"] > 0.8 and rows[0]["acc"] < 0.9, (rows[0], final_eval)
    cfg = json.loads((model_dir / "config.json").read_text())
    hf, _, n = _hf_scores(model_dir, data)
    assert abs(hf.mean().item() - cfg["reward_mean"]) < 1e-4
    adapter = json.loads((model_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["modules_to_save"] == ["score"] and adapter["task_type"] == "SEQ_CLS"
    base = AutoModelForSequenceClassification.from_pretrained(tiny_qwen2, num_labels=1)
    base.config.pad_token_id = cfg["pad_token_id"]
    peft_model = PeftModel.from_pretrained(base, str(model_dir / "adapter")).eval()
    merged = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    ids = torch.tensor([[5, 17, 33, 9, 41, 2, 77]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits)
