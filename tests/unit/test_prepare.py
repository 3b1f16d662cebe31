"""The ``prepare`` step of every command (before the process group and any model): checks that
used to fail only at the end of training (or never): where the final model goes,
--normalize_reward without statistics, a missing chat template, the reward token; recovery after
a crash inside the export; prompt truncation counts."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from fsdp_rlhf.config import PPOConfig, PromptDataConfig, RMConfig
from fsdp_rlhf.config_base import build_config
from fsdp_rlhf.data.prompts import check_chat_template, tokenize_prompts
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.save import check_save_path, recover_interrupted_export
from fsdp_rlhf.trainers.offline.data import check_paths
from fsdp_rlhf.trainers.ppo.setup import prepare


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer-only model folders: with and without a chat template, and a reward model
    folder whose config.json has no reward_mean/reward_std."""
    from fsdp_rlhf.testing.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, template in (("chat", True), ("plain", False), ("rm", True)):
        d = root / name
        tok = build_tokenizer(d, vocab_size=300)
        if not template:
            tok.chat_template = None
            for f in d.glob("chat_template*"):
                f.unlink()
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg.pop("chat_template", None)
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        (d / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        out[name] = d
    rows = [{"input": f"question {i} " + "word " * (i % 7)} for i in range(8)]
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["data"] = data
    return out


def ppo_cfg(models, save: Path, *extra: str) -> PPOConfig:
    flags = ["--pretrain", str(models["chat"]), "--reward_pretrain", str(models["rm"])]
    flags += ["--prompt_data", str(models["data"]), "--rollout_batch_size", "4"]
    flags += ["--train_batch_size", "4", "--micro_train_batch_size", "1"]
    flags += ["--micro_rollout_batch_size", "1", "--advantage_estimator", "reinforce++"]
    flags += ["--save_path", str(save), "--ckpt_path", str(save / "ckpt"), *extra]
    return build_config(PPOConfig, flags)[0]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_prepare_accepts_a_good_config(models, tmp_path):
    plan, rows, kinds = prepare(ppo_cfg(models, tmp_path / "out", "--apply_chat_template"), 1)
    assert len(rows) == 8 and not (tmp_path / "out").exists()
    assert kinds["--pretrain"].label == "dense"  # read once here, carried to the trainer


def test_normalize_reward_without_statistics_is_an_error(models, tmp_path):
    with pytest.raises(UserError, match=r"--normalize_reward: .*rm/config.json has no reward_mean"):
        prepare(ppo_cfg(models, tmp_path / "out", "--normalize_reward"), 1)


def test_missing_chat_template_is_one_line(models, tmp_path):
    cfg = ppo_cfg(
        models, tmp_path / "out", "--apply_chat_template", "--pretrain", str(models["plain"])
    )
    with pytest.raises(UserError, match="has no chat template"):
        prepare(cfg, 1)
    from fsdp_rlhf.models.load import load_tokenizer

    with pytest.raises(UserError, match="--apply_chat_template"):
        check_chat_template(load_tokenizer(str(models["plain"])), "plain")


def test_auth_env_is_checked_in_prepare(models, tmp_path, monkeypatch):
    monkeypatch.delenv("RM_TOKEN_FOR_TEST", raising=False)
    extra = ["--remote_rm_url", "http://127.0.0.1:9/", "--remote_rm_auth_env", "RM_TOKEN_FOR_TEST"]
    with pytest.raises(UserError, match="RM_TOKEN_FOR_TEST"):
        prepare(ppo_cfg(models, tmp_path / "out", *extra), 1)


@pytest.mark.parametrize("where", ["dot", "cwd_parent", "pretrain", "foreign", "file"])
def test_bad_save_path_fails_in_prepare(models, tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    save = {"dot": Path("."), "cwd_parent": Path(".."), "pretrain": models["chat"]}.get(where)
    if where == "foreign":
        save = tmp_path / "photos"
        save.mkdir()
        (save / "holiday.jpg").write_text("x")
    if where == "file":
        save = tmp_path / "f"
        save.write_text("x")
    with pytest.raises(UserError, match="--save_path"):
        prepare(ppo_cfg(models, save), 1)
    rm = build_config(RMConfig, ["--pretrain", str(models["chat"]), "--save_path", str(save)])[0]
    with pytest.raises(UserError, match="--save_path"):
        check_paths(rm)


def test_save_path_of_an_earlier_run_is_accepted(tmp_path):
    save = tmp_path / "run"
    save.mkdir()
    (save / "model.safetensors").write_text("x")
    (save / "config.yaml").write_text("seed: 1\n")
    check_save_path(str(save), other_paths={})
    check_save_path(str(tmp_path / "new" / "deeper"), other_paths={})


def test_recover_after_crash_between_the_renames(tmp_path):
    """Crash after the old folder moved aside and before the new one moved in: the run's
    checkpoints (carried into the new folder) must come back to save_path."""
    final = tmp_path / "out"
    old = tmp_path / "out.old-123"
    tmp = tmp_path / "out.tmp-123"
    old.mkdir()
    (old / "model.safetensors").write_text("old weights")
    (old / "config.yaml").write_text("seed: 1\n")
    (tmp / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp / "model.safetensors").write_text("new weights")
    handled = recover_interrupted_export(final)
    assert sorted(p.name for p in handled) == ["out.old-123", "out.tmp-123"]
    assert (final / "model.safetensors").read_text() == "old weights"
    assert (final / "checkpoints" / "step_4").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_recover_removes_a_partial_temp_folder(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "metrics.jsonl").write_text("")
    (tmp_path / "out.tmp-77").mkdir()
    (tmp_path / "out.tmp-77" / "model-00001.safetensors").write_text("half")
    recover_interrupted_export(final)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert os.listdir(final) == ["metrics.jsonl"]


def test_tokenize_prompts_counts_truncated_and_dropped(models, caplog):
    from fsdp_rlhf.models.load import load_tokenizer

    tok = load_tokenizer(str(models["chat"]))
    short = len(tok("the cat", add_special_tokens=False)["input_ids"])
    cfg = PromptDataConfig(input_template=None, prompt_max_len=short)
    rows = [{"input": "the cat"}, {"input": ""}, {"input": "the cat runs over the big red dog"}]
    with caplog.at_level(logging.INFO, logger="fsdp_rlhf"):
        out = tokenize_prompts(rows, tok, cfg)
    assert len(out) == 2 and len(out[1].ids) == short
    assert "2 kept, 1 truncated" in caplog.text and "1 empty dropped" in caplog.text


def test_save_path_being_recovered_is_accepted(tmp_path):
    save = tmp_path / "run"
    (save / "checkpoints").mkdir(parents=True)  # carried back first, config.yaml not yet
    (tmp_path / "run.tmp-5").mkdir()
    check_save_path(str(save), other_paths={})


def test_no_colocate_all_is_refused_not_ignored(models, tmp_path):
    with pytest.raises(UserError, match="--no_colocate_all: every rank holds every model"):
        prepare(ppo_cfg(models, tmp_path / "out", "--no_colocate_all"), 1)


def test_lora_with_the_hf_engine_is_refused(models, tmp_path):
    cfg = ppo_cfg(models, tmp_path / "out", "--lora_rank", "8", "--rollout_engine", "hf")
    with pytest.raises(UserError, match="--lora_rank with --rollout_engine hf: .* full weights"):
        prepare(cfg, 1)
