"""W&B logging without a network (CI never has one): an offline run writes its files with the
metrics under their own names and the redacted config; a key with an unreachable server, or a
server that never answers, falls back to offline in bounded time with one warning; the key is
never written anywhere."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from fsdp_rlhf.config import LoggingConfig, PPOConfig
from fsdp_rlhf.config_base import build_config, dump_yaml, redacted_dict
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.metrics import MetricLogger

wandb = pytest.importorskip("wandb", reason="the dev install includes wandb (pyproject [dev])")

from fsdp_rlhf import metrics_wandb  # noqa: E402
from fsdp_rlhf.testing.wandb_file import history, run_config  # noqa: E402

KEY = "k" * 40  # shaped like a W&B key


@pytest.fixture(autouse=True)
def no_ambient_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))


def _run_file(root: Path) -> Path:
    (found,) = root.glob("wandb/offline-run-*/run-*.wandb")
    return found


def _no_key_anywhere(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file():
            assert KEY.encode() not in f.read_bytes(), f


def test_offline_run_holds_the_metrics_and_the_redacted_config(tmp_path, caplog):
    cfg, _ = build_config(
        PPOConfig,
        ["--use_wandb", "True", "--wandb_group", "g", "--remote_rm_url", "http://u:pw@rm/x?t=1"],
    )
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"):
        run = metrics_wandb.open_wandb(cfg.logging, "ppo", redacted_dict(cfg), tmp_path)
    assert run.run.project == "openrlhf_train_ppo" and run.run.name.startswith("ppo_")
    logger = MetricLogger(0, str(tmp_path / "save"), None, wandb=run)
    logger.log(1, {"critic/score/mean": 0.5, "actor/pg_loss": -0.25}, console=False)
    logger.log(2, {"critic/score/mean": 0.75, "actor/pg_loss": float("nan")}, console=False)
    logger.table("samples", [{"prompt": "p", "response": "r", "score": 1.0}], 2)
    logger.close()
    (line,) = [r.getMessage() for r in caplog.records if "W&B: logging" in r.getMessage()]
    assert "offline" in line and "no API key" in line
    offline = run.offline_dir
    assert str(offline) in line and f"wandb sync {offline}" in line
    rows = history(_run_file(tmp_path))
    assert [r["_step"] for r in rows] == [1, 2]
    assert rows[0]["critic/score/mean"] == 0.5 and rows[1]["critic/score/mean"] == 0.75
    assert rows[1]["samples/nrows"] == 1  # the samples table, a file under the run
    assert list(offline.glob("files/media/table/samples_2_*.table.json"))
    config = run_config(_run_file(tmp_path))
    assert config["logging"]["use_wandb"] == "True" and config["logging"]["wandb_group"] == "g"
    assert config["models"]["remote_rm_url"] == "http://***@rm/x?t=***"


def test_a_key_with_an_unreachable_server_goes_offline_fast(tmp_path, monkeypatch, caplog):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connection refused
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    cfg = LoggingConfig(use_wandb=KEY, wandb_project="p", wandb_run_name="r")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"):
        run = metrics_wandb.open_wandb(cfg, "rm", {"logging": {"use_wandb": "***"}}, tmp_path)
    assert time.monotonic() - started < 30
    run.log({"loss": 1.0}, 1)
    run.close()
    (line,) = [r.getMessage() for r in caplog.records if "W&B: logging" in r.getMessage()]
    assert "unreachable" in line and KEY not in line
    assert run.run.name == "r" and [r["loss"] for r in history(_run_file(tmp_path))] == [1.0]
    _no_key_anywhere(tmp_path)


def test_a_server_that_never_answers_bounds_the_online_start(tmp_path, monkeypatch, caplog):
    hole = socket.socket()  # accepts connections, never replies
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    conns = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the socket closes at the end of the test
            while True:
                conns.append(hole.accept())

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{hole.getsockname()[1]}")
    monkeypatch.setattr(metrics_wandb, "INIT_TIMEOUT_S", 2.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"):
        run = metrics_wandb.open_wandb(LoggingConfig(use_wandb=KEY), "ppo", {}, tmp_path)
    assert time.monotonic() - started < 40
    run.close()
    (line,) = [r.getMessage() for r in caplog.records if "W&B: logging" in r.getMessage()]
    assert "online start failed" in line and run.offline_dir is not None
    _no_key_anywhere(tmp_path)
    hole.close()


def test_wandb_disabled_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert metrics_wandb.open_wandb(LoggingConfig(use_wandb="True"), "ppo", {}, tmp_path) is None


def test_key_is_masked_in_config_yaml_and_repr():
    cfg, _ = build_config(PPOConfig, ["--use_wandb", KEY, "--wandb_project", "proj"])
    text = dump_yaml(cfg)
    assert KEY not in text and "use_wandb: '***'" in text and "wandb_project: proj" in text
    assert KEY not in repr(cfg)
    assert "use_wandb: 'True'" in dump_yaml(build_config(PPOConfig, ["--use_wandb", "True"])[0])


def test_use_wandb_switch_words_and_missing_package(monkeypatch):
    assert not LoggingConfig(use_wandb="False").wandb_enabled
    assert not LoggingConfig().wandb_enabled
    assert LoggingConfig(use_wandb="True").wandb_enabled
    assert metrics_wandb.explicit_key("True") is None and metrics_wandb.explicit_key(KEY) == KEY
    monkeypatch.setattr(metrics_wandb.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"--use_wandb: the wandb package is not installed"):
        metrics_wandb.check_wandb(LoggingConfig(use_wandb="True"))
    metrics_wandb.check_wandb(LoggingConfig())  # off: nothing to check
