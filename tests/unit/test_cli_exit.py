"""The console entry point ends run commands with os._exit (no interpreter teardown), keeping
the exit code; other commands and in-process uses of the typer app exit normally."""

from __future__ import annotations

import pytest

from fsdp_rlhf import cli


class Exited(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


@pytest.fixture
def hard_exit(monkeypatch):
    monkeypatch.setenv("FSDP_RLHF_TCMALLOC", "0")  # no re-exec of the test process

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(cli.os, "_exit", fake_exit)


@pytest.mark.parametrize(
    ("argv", "code"),
    [(["ppo", "--pretrain", "/nope"], 2), (["train-rm", "--help"], None)],
)
def test_run_commands_skip_teardown_with_their_exit_code(hard_exit, monkeypatch, argv, code):
    monkeypatch.setattr(cli.sys, "argv", ["fsdp-rlhf", *argv])
    if code is None:  # --help is not a run: a normal SystemExit
        with pytest.raises(SystemExit) as done:
            cli.main()
        assert done.value.code == 0
        return
    with pytest.raises(Exited) as done:
        cli.main()
    assert done.value.code == code
