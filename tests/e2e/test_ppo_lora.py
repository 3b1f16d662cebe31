"""`fsdp-rlhf ppo --lora_rank` end to end: 2 CPU ranks under torchrun, one vLLM engine over
both (TP 2), actor and critic trained as LoRA adapters on a tiny Qwen2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.e2e.helpers import read_metrics, torchrun
from tests.e2e.test_ppo_cli import grpo_flags, ppo_data  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

RANK = 8


def _adapter_bytes(model_path: str, rank: int) -> int:
    """fp32 bytes of rank-``rank`` adapters on every Linear of the decoder (all-linear)."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    return sum(4 * rank * (m.in_features + m.out_features) for m in linears)


# In a fresh interpreter, as a user would: the merged export loads in transformers and equals
# the base + adapter in peft, which differs from the base; the critic's adapter carries its head.
CHECK_EXPORT = """
import sys, torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM as C, AutoModelForSequenceClassification as S
base, save = sys.argv[1], sys.argv[2]
ids = torch.tensor([[5, 17, 33, 9, 41, 2, 77]])
with torch.no_grad():
    merged = C.from_pretrained(save)(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(C.from_pretrained(base), save + "/adapter")
    assert torch.allclose(adapted(input_ids=ids).logits, merged, atol=1e-4)
    assert not torch.allclose(C.from_pretrained(base)(input_ids=ids).logits, merged, atol=1e-3)
    critic_dir = save + "/critic/adapter"
    critic = PeftModel.from_pretrained(S.from_pretrained(base, num_labels=1), critic_dir)
    head = load_file(critic_dir + "/adapter_model.safetensors")["base_model.model.score.weight"]
    assert torch.equal(critic.base_model.model.score.modules_to_save["default"].weight, head)
"""


def _run_following_the_trainer(flags: list[str], save) -> list[dict]:
    """Run ``ppo`` for 3 steps; the engine's log-probs match the trainer's at every step, and
    the updates moved the policy away from the reference (the base with adapters disabled)."""
    run = torchrun(["ppo", *flags])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/logprob_diff/max"] < 1e-3, r
    assert rows[-1]["actor/kl"] > 1e-3, rows[-1]
    return rows


@pytest.mark.long
def test_lora_gae_tp2_adapter_sync_export_and_resume(tiny_qwen2, ppo_data, tmp_path):  # noqa: F811
    save = tmp_path / "full"
    flags = grpo_flags(tiny_qwen2, ppo_data, save, 3)
    flags[flags.index("--advantage_estimator") + 1] = "gae"
    # a high rate moves the adapters far in 2 updates: a stale engine adapter would show
    flags[flags.index("--actor_learning_rate") + 1] = "1e-2"
    flags[flags.index("--save_steps") + 1] = "2"
    flags += [
        "--critic_pretrain", tiny_qwen2, "--critic_learning_rate", "1e-3",
        "--lora_rank", str(RANK), "--merge_lora", "--vllm_tensor_parallel_size", "2",
    ]  # fmt: skip
    # the engine generates with the trainer's adapters after every sync (TP 2: both slices)
    rows = _run_following_the_trainer(flags, save)
    # only the adapters travel into vLLM
    want = _adapter_bytes(tiny_qwen2, RANK)
    assert all(r["rollout/weight_sync_bytes"] == want for r in rows), (want, rows)
    assert "timing/ref_onload" not in rows[-1]  # no reference model to onload
    config = json.loads((save / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["base_model_name_or_path"] == tiny_qwen2
    critic_config = json.loads((save / "critic" / "adapter" / "adapter_config.json").read_text())
    assert critic_config["modules_to_save"] == ["score"]
    subprocess.run(
        [sys.executable, "-c", CHECK_EXPORT, tiny_qwen2, str(save)], check=True, capture_output=True
    )

    # Resume from the step-2 checkpoint (adapters, head and Adam state only): step 3 again
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(save / "ckpt" / "step_2", resumed / "ckpt" / "step_2")
    shutil.copy(save / "config.yaml", resumed / "config.yaml")
    flags[flags.index("--save_path") + 1] = str(resumed)
    flags[flags.index("--ckpt_path") + 1] = str(resumed / "ckpt")
    again = torchrun(["ppo", *flags, "--load_checkpoint"])
    assert again.returncode == 0, again.stderr[-3000:]
    (last,) = read_metrics(resumed)
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl", "critic/vf_loss"):
        assert last[key] == pytest.approx(rows[-1][key], rel=1e-4, abs=1e-6), key
    from safetensors.torch import load_file

    a = load_file(str(save / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-6 for k in a)


def _model_bytes(model_path: str) -> int:
    """fp32 bytes of every weight vLLM is sent in a full sync (a tied head counted twice)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    tied = model.config.tie_word_embeddings
    extra = model.get_output_embeddings().weight.numel() if tied else 0
    return 4 * (sum(p.numel() for p in model.parameters()) + extra)


def test_lora_synced_merged_matches_the_trainer(tiny_qwen2, ppo_data, tmp_path):  # noqa: F811
    """--lora_sync merged: vLLM runs without LoRA and gets W + (alpha/r) B A at every sync."""
    save = tmp_path / "merged"
    flags = grpo_flags(tiny_qwen2, ppo_data, save, 3)
    flags[flags.index("--actor_learning_rate") + 1] = "1e-2"
    flags += ["--lora_rank", str(RANK), "--lora_sync", "merged"]
    # the engine samples from the merged weights the trainer computes with, after each update
    rows = _run_following_the_trainer(flags, save)
    assert all(r["rollout/weight_sync_bytes"] == _model_bytes(tiny_qwen2) for r in rows), rows
