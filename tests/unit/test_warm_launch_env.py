"""The warm launcher's environment rules (fsdp_rlhf/testing/warm_launch.py), as pure functions."""

from __future__ import annotations

import os

from fsdp_rlhf.testing.warm_launch import cli_env, import_time_differences, torchrun_env


def test_only_variables_read_at_import_decide_and_the_servers_own_imports_do_not():
    server = {"PATH": "/bin", "HF_HUB_OFFLINE": "1"}
    added = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/x", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    # run-time variables and torchrun's own never matter
    case = {**server, "FSDP_RLHF_KILL_AT": "1:training:2", "OMP_NUM_THREADS": "1", "RANK": "0"}
    assert import_time_differences(server, case, added) == []
    # a test process that imported vLLM passes on what vLLM set: no difference
    assert import_time_differences(server, {**case, **added}, added) == []
    # another value of a variable read at import is one
    moved = {**case, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere", "VLLM_LOGGING_LEVEL": "DEBUG"}
    assert import_time_differences(server, moved, added) == [
        "TORCHINDUCTOR_CACHE_DIR",
        "VLLM_LOGGING_LEVEL",
    ]
    # and so is one the server has that the case does not
    assert import_time_differences({**server, "PYTHONPATH": "/repo"}, case, added) == ["PYTHONPATH"]


def test_torchrun_environment_of_each_rank():
    envs = torchrun_env({"A": "1"}, 3, 29500, "/run")
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] == [e["LOCAL_RANK"] for e in envs]
    for e in envs:
        assert e["A"] == "1" and e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "3"
        assert e["MASTER_PORT"] == "29500" and e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert e["OMP_NUM_THREADS"] == "1"  # torchrun's default with several ranks
    assert torchrun_env({"OMP_NUM_THREADS": "4"}, 2, 1, "/r")[0]["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in torchrun_env({}, 1, 1, "/r")[0]


def test_the_cli_settings_come_first_and_user_values_win(monkeypatch):
    from fsdp_rlhf import cli

    env = cli_env({"TRANSFORMERS_VERBOSITY": "info"})
    assert env["TRANSFORMERS_VERBOSITY"] == "info"
    # the same defaults as the CLI's quiet_libraries: each variable it sets, cli_env sets alike
    for key in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    before = dict(os.environ)
    cli.quiet_libraries()
    quiet = {k: v for k, v in os.environ.items() if before.get(k) != v}
    assert quiet
    fresh = cli_env({})
    for key, value in quiet.items():
        assert fresh[key] == value, key
