"""`fsdp-rlhf sft` and `fsdp-rlhf dpo` through the real command line on 2 ranks: SFT learns a
held-out continuation task, DPO raises chosen-over-rejected on held-out pairs; both exports are
checked with plain transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.testing.synthetic import continuation_rows, write_jsonl
from tests.e2e.helpers import read_metrics, torchrun
from tests.rm_utils import synthetic_pairs

pytestmark = pytest.mark.slow


def _greedy_accuracy(model_dir: str | Path, rows: list[dict]) -> float:
    """Share of rows whose greedy continuation after the prompt is the expected word."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hits = 0
    for row in rows:
        ids = tok(f"User: {row['input']}\nAssistant:", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        hits += (
            tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip() == row["output"]
        )
    return hits / len(rows)


def test_sft_learns_held_out_continuation_and_resumes(tiny_qwen2, tmp_path):
    write_jsonl(continuation_rows(512, seed=0), tmp_path / "train.jsonl")
    held_out = continuation_rows(48, seed=1)
    write_jsonl(held_out, tmp_path / "eval.jsonl")
    out = tmp_path / "sft"
    args = [
        "sft", "--pretrain", tiny_qwen2, "--dataset", str(tmp_path / "train.jsonl"),
        "--eval_dataset", str(tmp_path / "eval.jsonl"), "--input_key", "input",
        "--output_key", "output", "--save_path", str(out), "--ckpt_path", str(out / "ckpt"),
        "--train_batch_size", "16", "--micro_train_batch_size", "4",
        "--learning_rate", "3e-3", "--max_len", "64", "--logging_steps", "8",
        "--eval_steps", "16", "--save_steps", "32", "--max_epochs", "2",
    ]  # fmt: skip
    proc = torchrun(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 4 and evals[-1] < 0.1 < evals[0], evals
    assert [r["step"] for r in rows if "loss" in r] == [8, 16, 24, 32, 40, 48, 56, 64]
    assert _greedy_accuracy(tiny_qwen2, held_out) < 0.2
    assert _greedy_accuracy(out, held_out) >= 0.9
    # resume from the step-64 checkpoint (--save_steps) for a third epoch: steps 65-96 only
    proc = torchrun([*args[: args.index("--max_epochs") + 1], "3", "--load_checkpoint"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in " ".join((proc.stdout + proc.stderr).split())
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == [8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96]
    assert read_metrics(out)[-1]["eval/loss"] < 0.1


def _response_logps(model, tok, prompt: str, reply: str) -> float:
    ids = tok(prompt + reply)["input_ids"] + [tok.eos_token_id]
    n_prompt = len(tok(prompt)["input_ids"])
    x = torch.tensor([ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
    return sum(lp[t - 1, ids[t]].item() for t in range(n_prompt, len(ids)))


def _implicit_accuracy(policy_dir, ref_dir, rows) -> float:
    """Share of pairs whose implicit reward log(pi/ref) is higher for chosen than rejected,
    from plain transformers forwards of the exported model and the base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    ref = AutoModelForCausalLM.from_pretrained(ref_dir).eval()
    hits = 0
    for row in rows:
        margin = 0.0
        for side, sign in (("chosen", 1), ("rejected", -1)):
            for model, s in ((policy, 1), (ref, -1)):
                margin += sign * s * _response_logps(model, tok, row["prompt"], row[side])
        hits += margin > 0
    return hits / len(rows)


def _prompted(rows: list[dict]) -> list[dict]:
    """synthetic_pairs with the shared "Human: ... Assistant:" part as the prompt."""
    out = []
    for r in rows:
        cut = r["chosen"].index("Assistant:") + len("Assistant:")
        out.append({"prompt": r["chosen"][:cut], "chosen": r["chosen"][cut:],
                    "rejected": r["rejected"][cut:]})  # fmt: skip
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_raises_chosen_over_rejected(tiny_qwen2, tmp_path, lora):
    write_jsonl(_prompted(synthetic_pairs(128, seed=0)), tmp_path / "pairs.jsonl")
    held_out = _prompted(synthetic_pairs(24, seed=1))
    write_jsonl(held_out, tmp_path / "eval.jsonl")
    out = tmp_path / "dpo"
    extra = ["--lora_rank", "8", "--lora_alpha", "16", "--merge_lora"] if lora else []
    proc = torchrun([
        "dpo", "--pretrain", tiny_qwen2, "--dataset", str(tmp_path / "pairs.jsonl"),
        "--eval_dataset", str(tmp_path / "eval.jsonl"), "--prompt_key", "prompt",
        "--save_path", str(out), "--train_batch_size", "16", "--micro_train_batch_size", "4",
        "--learning_rate", "1e-2" if lora else "1e-3", "--max_len", "64",
        "--logging_steps", "1", "--beta", "0.1", "--nll_loss_coef", "0.1", *extra,
    ])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = " ".join((proc.stdout + proc.stderr).split())
    assert "shared prompt prefix: each pair's common prefix runs once" in log
    if lora:
        assert "reference: the policy with its LoRA adapters disabled" in log
    rows = read_metrics(out)
    train = [r for r in rows if "loss" in r]
    assert len(train) == 8
    # step 1: policy == reference, so the DPO term is log 2 (plus the NLL term)
    first = train[0]
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert first["loss"] == pytest.approx(math.log(2) + 0.1 * first["nll_loss"], abs=1e-4)
    final = rows[-1]
    assert final["eval/rewards/accuracies"] >= 0.9 and final["eval/rewards/margins"] > 0
    assert final["eval/loss"] - 0.1 * final["eval/nll_loss"] < 0.6  # the DPO term alone
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert _implicit_accuracy(out, tiny_qwen2, held_out) >= 0.9
