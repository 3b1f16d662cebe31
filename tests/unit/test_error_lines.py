"""One line per fault: which rank prints what, the user's file and line, the filesystem's
refusal named with the path, and how the CLI turns each exception into its line and exit code."""

from __future__ import annotations

import errno
import importlib.util
import sys

import pytest

from fsdp_rlhf.cli import describe_failure
from fsdp_rlhf.distributed.env import PeerFailure
from fsdp_rlhf.distributed.exit_report import Failure, format_ranks, lines_to_print
from fsdp_rlhf.errors import Fault, UserError, WriteFault, user_code_error, write_fault
from fsdp_rlhf.trainers.rule_reward import load_python_reward


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([1], "rank 1"),
        ([0, 2], "ranks 0,2"),
        ([3, 0, 1, 2, 5], "ranks 0-3,5"),
        ([4, 5], "ranks 4-5"),
    ],
)
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def _all_lines(world: int, failures: dict[int, Failure]) -> list[str]:
    return [line for r in range(world) for line in lines_to_print(r, world, failures)]


def test_the_same_failure_on_every_rank_is_one_line_from_rank_0():
    failures = {r: Failure(2, "--input_key 'q': no such key") for r in range(4)}
    assert lines_to_print(0, 4, failures) == ["error: --input_key 'q': no such key"]
    assert _all_lines(4, failures) == ["error: --input_key 'q': no such key"]


def test_each_message_once_with_its_ranks():
    failures = {0: Failure(2, "a"), 1: Failure(2, "b"), 2: Failure(2, "a"), 3: Failure(1)}
    assert lines_to_print(0, 4, failures) == ["error [ranks 0,2]: a"]
    assert lines_to_print(1, 4, failures) == ["error [rank 1]: b"]
    assert lines_to_print(2, 4, failures) == [] and lines_to_print(3, 4, failures) == []


def test_a_rank_alone_names_itself_and_one_process_does_not():
    assert lines_to_print(1, 8, {1: Failure(2, "x")}) == ["error [rank 1]: x"]
    assert lines_to_print(0, 1, {0: Failure(2, "x")}) == ["error: x"]


def test_peer_failures_stay_silent_unless_nobody_says_why():
    peer = Failure(1, "saving the model failed on rank 0; its log has the error", secondary=True)
    own = Failure(1, "no space left on device while writing /m")
    assert _all_lines(2, {0: own, 1: peer}) == [
        "error [rank 0]: no space left on device while writing /m"
    ]
    # the rank that failed never showed up (hung): the others still say something
    assert _all_lines(3, {1: peer, 2: peer}) == [f"error [ranks 1-2]: {peer.message}"]


def test_a_report_with_nothing_to_say_prints_nothing():
    assert _all_lines(2, {0: Failure(1), 1: Failure(1)}) == []  # doctor: rank 0 printed it


def _import(path):
    spec = importlib.util.spec_from_file_location("user_reward_mod", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_func_raising_names_its_line_and_shows_only_the_users_frames(tmp_path):
    f = tmp_path / "reward.py"
    f.write_text(
        "def lookup(row):\n"
        "    return row['answer']\n"
        "\n"
        "def reward_func(queries, prompts, labels):\n"
        "    return [float(lookup({})) for _ in queries]\n"
    )
    fn = load_python_reward(str(f))
    with pytest.raises(UserError) as err:
        fn(["q"], ["p"], [None])
    e = err.value
    assert str(e) == f"rule reward file {f}:2: reward_func raised KeyError: 'answer'"
    assert f'File "{f}", line 5, in reward_func' in e.detail
    assert f'File "{f}", line 2, in lookup' in e.detail
    assert "fsdp_rlhf" not in e.detail  # our frames only with --debug
    failure = describe_failure(e, debug=False)
    assert failure.code == 2 and failure.message == f"{e}\n{e.detail}"


def test_a_malformed_reward_result_is_the_users_error(tmp_path):
    f = tmp_path / "reward.py"
    f.write_text("def reward_func(queries, prompts, labels):\n    return [1.0, 2.0]\n")
    with pytest.raises(
        UserError, match=r"rule reward file .*reward\.py: expected 1 rewards, got 2"
    ):
        load_python_reward(str(f))(["q"], ["p"], [None])


def test_syntax_error_in_a_user_file_names_its_line(tmp_path):
    f = tmp_path / "env.py"
    f.write_text("x = 1\ndef reset(:\n")
    with pytest.raises(SyntaxError) as err:
        _import(f)
    e = user_code_error("--env_file", f, err.value, "import failed:")
    assert str(e).startswith(f"--env_file {f}:2: import failed: SyntaxError: ")


def test_write_fault_names_the_errno_and_the_path(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    fault = write_fault(full, "/ckpt/step_4", removed_partial=True)
    assert str(fault) == (
        "no space left on device while writing /ckpt/step_4 (the partial copy was removed)"
    )
    fault.naming_checkpoint(tmp_path / "step_2")
    assert str(fault).endswith(f"; the newest complete checkpoint is {tmp_path / 'step_2'}, intact")
    assert str(WriteFault("x", "/p").naming_checkpoint(None)).endswith(
        "; there is no complete checkpoint to resume from"
    )
    quota = RuntimeError("write failed")
    quota.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert str(write_fault(quota, "/m")) == "disk quota exceeded while writing /m"
    # safetensors reports the Rust error kind in its text, with no errno attribute
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert str(write_fault(rust, "/m")).startswith("no space left on device while writing /m")
    # something else on a disk with room: not a write fault
    assert write_fault(RuntimeError("unexpected pos 704 vs 598"), tmp_path) is None


def test_write_fault_sees_through_dcp_failures():
    from torch.distributed.checkpoint.api import CheckpointException

    e = CheckpointException("save", {1: (OSError(errno.ENOSPC, "No space"), [])})
    assert str(write_fault(e, "/c")).startswith("no space left on device while writing /c")


def test_describe_failure_codes_and_tracebacks(capsys):
    assert describe_failure(UserError("bad flag"), debug=False) == Failure(2, "bad flag")
    assert describe_failure(Fault("server down"), debug=False) == Failure(1, "server down")
    peer = describe_failure(PeerFailure("x failed on rank 0"), debug=False)
    assert peer == Failure(1, "x failed on rank 0", secondary=True)
    assert capsys.readouterr().err == ""  # no traceback without --debug
    try:
        raise UserError("bad flag")
    except UserError as e:
        describe_failure(e, debug=True)
    assert "Traceback" in capsys.readouterr().err
    try:
        {}["k"]
    except KeyError as e:  # a bug of ours: always its traceback
        bug = describe_failure(e, debug=False)
    assert "Traceback" in capsys.readouterr().err
    assert (
        bug.code == 1
        and bug.message == "KeyError: 'k' (unexpected: the traceback above shows where)"
    )


def test_one_process_prints_one_line(monkeypatch, capsys):
    from fsdp_rlhf.distributed.exit_report import report

    monkeypatch.setenv("WORLD_SIZE", "1")
    report(Failure(2, "bad flag"), file=sys.stderr)
    assert capsys.readouterr().err == "error: bad flag\n"


def test_a_broken_model_folder_is_one_line_naming_it(tmp_path, tiny_qwen2):
    import shutil

    import torch

    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer

    broken = tmp_path / "model"
    shutil.copytree(tiny_qwen2, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # a torn download
    with pytest.raises(UserError, match=rf"^{broken}: cannot load the causal LM: \w+"):
        load_causal_lm(str(broken), BackendConfig(), torch.device("cpu"))
    (broken / "tokenizer.json").write_text("{")
    with pytest.raises(UserError, match=rf"^{broken}: cannot load the tokenizer: "):
        load_tokenizer(str(broken))


def test_metrics_that_cannot_be_written_are_one_line(tmp_path):
    from fsdp_rlhf.metrics import MetricLogger

    blocker = tmp_path / "file"
    blocker.write_text("x")  # save_path below a file: the folder cannot be made
    with pytest.raises(WriteFault) as err:
        MetricLogger(0, str(blocker / "run"), None)
    assert str(err.value) == f"not a directory while writing {blocker}/run/metrics.jsonl"


def test_a_lost_peer_is_the_line_unless_the_peer_failed_first(monkeypatch):
    from fsdp_rlhf.distributed import exit_report
    from fsdp_rlhf.distributed.bridge import PeerLost

    lost = PeerLost("rollout rank 1 (engine 0) is gone: ...")
    assert describe_failure(lost, debug=False) == Failure(1, str(lost))
    monkeypatch.setattr(exit_report, "_failed_as", 2)  # another rank noted its failure first
    assert describe_failure(lost, debug=False) == Failure(1, str(lost), secondary=True)


def test_a_sigterm_while_failing_waits_for_the_line(monkeypatch, capsys):
    """torchrun stops every rank once one ended; a rank that is failing at that moment still
    prints its line (at once, without waiting for the others' reports)."""
    import os
    import signal

    from fsdp_rlhf.distributed import exit_report

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(exit_report, "_held_sigterm", False)
    try:
        exit_report.hold_termination()
        os.kill(os.getpid(), signal.SIGTERM)  # noted, not fatal
        assert exit_report._held_sigterm
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        exit_report.report(Failure(1, "rollout rank 1 is gone"), file=sys.stderr, wait_s=30)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err == "error [rank 0]: rollout rank 1 is gone\n"


def test_a_sigterm_while_failing_second_leaves_the_line_to_the_first(monkeypatch, capsys):
    from fsdp_rlhf.distributed import exit_report

    monkeypatch.setattr(exit_report, "_held_sigterm", True)
    monkeypatch.setattr(exit_report, "_failed_as", 2)  # another rank noted its failure first
    monkeypatch.setenv("WORLD_SIZE", "2")
    exit_report.report(Failure(1, "stopped after another rank failed", secondary=True))
    assert capsys.readouterr().err == ""


# A bad flag in a fresh process: the report, then what the process had imported by then.
BAD_FLAG_PROBE = """
import sys
from fsdp_rlhf.cli import _run
from fsdp_rlhf.commands import BY_NAME
try:
    _run(["--bogus_flag"], BY_NAME["sft"])
except BaseException as e:
    print(type(e).__name__, e.exit_code)
print("torch" in sys.modules)
"""


def test_a_bad_flag_is_reported_without_importing_torch():
    """A flag error is found in the config tree, before any model: the line that reports it
    must not cost a torch import (seconds per process; benchmarks/2026-11-27-make-test-startup.md).
    Importing the CLI itself does not import typer either: the tcmalloc re-exec comes first."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", BAD_FLAG_PROBE], env=env, capture_output=True, text=True
    )
    assert proc.stdout.split() == ["Exit", "2", "False"], proc.stderr
    assert "unknown flag --bogus_flag" in proc.stderr
    probe = "import sys, fsdp_rlhf.cli; print(sorted({'typer', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr
