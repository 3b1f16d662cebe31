"""`fsdp-rlhf kd` without launching it: every flag of OpenRLHF's train_kd parsers (releases
0.3.6 to 0.9.5 and the FSDP2 branch) has an outcome; both spellings of its example script
build the config they mean; the distillation settings of ``ppo`` check their values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_rlhf.compat import translate
from fsdp_rlhf.compat.migration import describe
from fsdp_rlhf.config import KDConfig, PPOConfig
from fsdp_rlhf.config_base import ConfigError, build_config

DATA = Path(__file__).resolve().parents[2] / "fsdp_rlhf" / "compat" / "data"
PARSERS = sorted(DATA.glob("openrlhf-*-kd.json"))
FLAGS = sorted({f["names"][0] for p in PARSERS for f in json.loads(p.read_text())["flags"]})


def test_the_stored_parsers_span_every_spelling():
    releases = [json.loads(p.read_text())["openrlhf"] for p in PARSERS]
    assert "v0.3.6" in releases and "v0.9.5" in releases, releases
    assert any("branch" in r for r in releases), releases
    for flag in ("--pretrain", "--model_name_or_path", "--bf16", "--param_dtype", "--save_path"):
        assert flag in FLAGS, flag
    assert "--ckpt_save_path" in FLAGS and "--teacher_model" in FLAGS


@pytest.mark.parametrize("flag", FLAGS)
def test_every_train_kd_flag_has_an_outcome(flag):
    outcome, detail = describe("kd", KDConfig, flag)
    assert outcome in ("takes effect", "accepted", "refused"), (flag, outcome)


# OpenRLHF's examples/scripts/train_knowledge_distillation.sh: the 2024 release spelling (0.4 to
# 0.9.1: --pretrain / --save_path / --bf16 / --flash_attn) and the FSDP2 branch's
# (--model_name_or_path / --ckpt_save_path / --param_dtype / --attn_implementation)
SCRIPT_2024 = (
    "--max_len 2048 --dataset d.jsonl --input_key question --output_key response "
    "--train_batch_size 256 --micro_train_batch_size 2 --max_samples 500000 --pretrain student "
    "--teacher_model teacher --save_path ./checkpoint/llama3-8b-kd --save_steps -1 "
    "--logging_steps 1 --eval_steps -1 --zero_stage 3 --max_epochs 1 --bf16 --flash_attn "
    "--kd_coef 0.4 --learning_rate 5e-6 --teacher_offload --gradient_checkpointing"
).split()
SCRIPT_FSDP2 = (
    "--max_len 2048 --dataset d.jsonl --input_key question --output_key response "
    "--train_batch_size 256 --micro_train_batch_size 2 --max_samples 500000 "
    "--model_name_or_path student --teacher_model teacher --ckpt_save_path ./checkpoint/kd "
    "--save_steps -1 --logging_steps 1 --eval_steps -1 --max_epochs 1 --param_dtype bf16 "
    "--attn_implementation flash_attention_2 --kd_coef 0.4 --learning_rate 5e-6 "
    "--teacher_offload --gradient_checkpointing"
).split()


@pytest.mark.parametrize("argv", [SCRIPT_2024, SCRIPT_FSDP2], ids=["2024", "fsdp2-branch"])
def test_both_spellings_of_the_example_script_build_the_same_run(argv):
    cfg, _ = build_config(KDConfig, translate("kd", argv).argv)
    assert cfg.model.pretrain == "student" and cfg.model.teacher_pretrain == "teacher"
    assert cfg.model.teacher_offload and cfg.loss.kd_coef == 0.4
    assert cfg.backend.bf16 and cfg.backend.flash_attn and cfg.backend.gradient_checkpointing
    assert cfg.ckpt.save_path.startswith("./checkpoint/")
    assert (cfg.data.input_key, cfg.data.output_key) == ("question", "response")
    assert cfg.optim.lr == 5e-6 and cfg.batch.max_epochs == 1


def test_the_fsdp2_branchs_own_flags():
    with pytest.raises(ConfigError, match="--dcp_checkpoint_from_path.*--load_checkpoint"):
        translate("kd", ["--dcp_checkpoint_from_path", "/ckpt/global_step_3"])
    assert translate("kd", ["--fsdp2_reshard_after_forward"]).argv == ["--zero_stage", "3"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--kd_coef", "1.5"], "kd_coef must be in [0, 1]"),
    ],
)
def test_kd_values_are_checked(argv, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        build_config(KDConfig, argv)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--teacher_pretrain", "t", "--teacher_url", "http://x"], "both name a teacher"),
        (["--distill_coef", "-1"], "distill_coef must be >= 0"),
        (["--distill_topk", "8"], "--distill_topk applies to --distill_loss"),
        (["--distill_loss", "forward_kl_topk", "--distill_topk", "0"], "distill_topk must be"),
        (["--teacher_timeout_s", "0"], "teacher_timeout_s must be > 0"),
    ],
)
def test_distill_values_are_checked(argv, words):
    with pytest.raises(ConfigError, match=words):
        build_config(PPOConfig, argv)


def test_top_k_losses_default_to_32_teacher_tokens():
    cfg, _ = build_config(PPOConfig, ["--teacher_url", "http://t", "--distill_loss", "k3"])
    assert cfg.distill.distill_topk is None and not cfg.distill.topk
    cfg, _ = build_config(
        PPOConfig, ["--teacher_pretrain", "t", "--distill_loss", "reverse_kl_topk"]
    )
    assert cfg.distill.distill_topk == 32 and cfg.distill.topk
