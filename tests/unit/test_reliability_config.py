"""Failure-handling flags and the redaction of secrets in the saved config."""

from __future__ import annotations

import pytest
import yaml

from fsdp_rlhf.config import PPOConfig, RMConfig
from fsdp_rlhf.config_base import ConfigError, build_config, dump_yaml


@pytest.mark.parametrize("cls", [RMConfig, PPOConfig])
def test_guard_flags(cls):
    cfg, _ = build_config(cls, [])
    assert (cfg.guard.max_bad_steps, cfg.guard.dist_timeout_min) == (5, 60)
    cfg, _ = build_config(cls, ["--max_bad_steps", "0", "--dist_timeout_min", "15"])
    assert (cfg.guard.max_bad_steps, cfg.guard.dist_timeout_min) == (0, 15)
    with pytest.raises(ConfigError, match="max_bad_steps must be >= 0"):
        build_config(cls, ["--max_bad_steps", "-1"])
    with pytest.raises(ConfigError, match="dist_timeout_min must be >= 1"):
        build_config(cls, ["--dist_timeout_min", "0"])


def test_config_yaml_masks_reward_url_secrets():
    url = "https://bob:hunter2@rm.example/score?api_key=K123"
    cfg, _ = build_config(
        PPOConfig, ["--remote_rm_url", url, "--remote_rm_auth_env", "RM_TOKEN", "--pretrain", "m"]
    )
    text = dump_yaml(cfg)
    assert "hunter2" not in text and "K123" not in text and "bob" not in text
    models = yaml.safe_load(text)["models"]
    assert models["remote_rm_url"] == "https://***@rm.example/score?api_key=***"
    assert models["remote_rm_auth_env"] == "RM_TOKEN"  # the name, never the value
    assert models["pretrain"] == "m"
    cfg, _ = build_config(PPOConfig, ["--remote_rm_url", "/data/r.py"])
    assert yaml.safe_load(dump_yaml(cfg))["models"]["remote_rm_url"] == "/data/r.py"
