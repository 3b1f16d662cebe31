"""Errors reach the user from whichever rank finds them, as one line, under torchrun: a failure
on rank 1 only (before and after the models load), the same failure on every rank, and a full
disk (a real tmpfs) while writing a checkpoint and while exporting the model."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fsdp_rlhf.distributed.checkpoint import checkpoint_problem, list_checkpoints
from fsdp_rlhf.testing.synthetic import preference_rows, prompt_rows, write_jsonl
from tests.e2e.helpers import REPO, torchrun

# fault injection: `make test-faults` (not `make test`)
pytestmark = [pytest.mark.slow, pytest.mark.faults]

# An environment file that cannot start on one node (rank 1 here): the import raises there.
ENV_FAILING_ON = """
import os

if os.environ["RANK"] in {ranks!r}:
    raise RuntimeError("the tool server is not reachable from this node")


def reset(prompt, label):
    return None


def step(history, action):
    return None, 0.0, True
"""

# A reward function that meets rows without the field it expects on rank 1 only.
REWARD_FAILING_ON_RANK1 = """
import os


def score(row):
    return float(len(row["text"]) % 3)


def reward_func(queries, prompts, labels):
    rows = [{} if os.environ["RANK"] == "1" else {"text": q} for q in queries]
    return [score(row) for row in rows]
"""


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


def _no_traceback_through_us(stderr: str) -> None:
    # torchrun prints its own ChildFailedError traceback; none may pass through fsdp_rlhf
    frames = [line for line in stderr.splitlines() if line.strip().startswith('File "')]
    assert not [f for f in frames if "fsdp_rlhf" in f], frames


def _multiturn_flags(model: str, env_file: Path, save: Path) -> list[str]:
    return [
        *("--pretrain", model, "--env_file", str(env_file), "--max_turns", "2"),
        *("--max_total_len", "256", "--prompt_max_len", "96", "--generate_max_len", "16"),
        *("--prompt_data", str(REPO / "configs/calculator_prompts.jsonl")),
        *("--input_key", "input", "--label_key", "label"),
        *("--rollout_batch_size", "16", "--n_samples_per_prompt", "4"),
        *("--advantage_estimator", "grpo", "--train_batch_size", "64"),
        *("--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16"),
        *("--max_steps", "1", "--save_path", str(save)),
    ]


def test_a_failure_on_rank1_only_is_reported_every_time(tiny_qwen2, tmp_path):
    """Before the fix rank 1 exited silently and torchrun stopped rank 0 before it printed."""
    env_file = tmp_path / "env.py"
    env_file.write_text(ENV_FAILING_ON.format(ranks=["1"]))
    expected = (
        f"error [rank 1]: --env_file {env_file}:5: import failed: RuntimeError: the tool server "
        "is not reachable from this node"
    )
    for attempt in range(10):
        proc = torchrun(["ppo", *_multiturn_flags(tiny_qwen2, env_file, tmp_path / "run")])
        assert proc.returncode != 0
        assert _error_lines(proc.stderr) == [expected], (attempt, proc.stderr[-3000:])
        _no_traceback_through_us(proc.stderr)
        # the user's own frame follows the line
        assert f'File "{env_file}", line 5, in <module>' in proc.stderr
    assert not (tmp_path / "run").exists()  # failed before anything was written


def test_the_same_failure_on_every_rank_is_one_line(tiny_qwen2, tmp_path):
    env_file = tmp_path / "env.py"
    env_file.write_text(ENV_FAILING_ON.format(ranks=["0", "1"]))
    proc = torchrun(["ppo", *_multiturn_flags(tiny_qwen2, env_file, tmp_path / "run")])
    assert proc.returncode != 0
    assert _error_lines(proc.stderr) == [
        f"error: --env_file {env_file}:5: import failed: RuntimeError: the tool server is not "
        "reachable from this node"
    ], proc.stderr[-3000:]


def test_reward_function_raising_on_rank1_after_the_models_load(tiny_qwen2, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FAILING_ON_RANK1)
    write_jsonl(prompt_rows(64, chat=True), tmp_path / "prompts.jsonl")
    flags = [
        *("--pretrain", tiny_qwen2, "--remote_rm_url", str(reward)),
        *("--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "input"),
        *("--rollout_batch_size", "4", "--n_samples_per_prompt", "2"),
        *("--advantage_estimator", "grpo", "--train_batch_size", "8"),
        *("--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4"),
        *("--generate_max_len", "8", "--prompt_max_len", "32", "--max_steps", "1"),
        *("--save_path", str(tmp_path / "run")),
    ]
    proc = torchrun(["ppo", *flags])
    assert proc.returncode != 0
    assert _error_lines(proc.stderr) == [
        f"error [rank 1]: rule reward file {reward}:6: reward_func raised KeyError: 'text'"
    ], proc.stderr[-3000:]
    # then the user's frames, innermost last; none of ours
    at = proc.stderr.index("error [rank 1]")
    assert f'File "{reward}", line 11, in reward_func' in proc.stderr[at:]
    assert f'File "{reward}", line 6, in score' in proc.stderr[at:]
    _no_traceback_through_us(proc.stderr)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(name, size)``: a tmpfs of ``size`` (e.g. "12m") mounted at tmp_path/name."""
    mounted = []

    def mount(name: str, size: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def _rm_flags(model: str, data: Path, save: Path, ckpt: Path) -> list[str]:
    return [
        *("--pretrain", model, "--dataset", str(data), "--max_len", "64"),
        *("--train_batch_size", "16", "--micro_train_batch_size", "8"),
        *("--max_epochs", "1", "--save_path", str(save), "--ckpt_path", str(ckpt)),
    ]


def test_full_disk_while_checkpointing_and_exporting(tiny_qwen2, tmp_path, small_disk):
    data = tmp_path / "pairs.jsonl"
    write_jsonl(preference_rows(64), data)  # 4 steps

    # Checkpoints: one (model + AdamW state, ~8 MB) fits on 12 MB, the second does not.
    ckpt = small_disk("ckpt_disk", "12m") / "ckpt"
    flags = _rm_flags(tiny_qwen2, data, tmp_path / "rm", ckpt)
    proc = torchrun(["train-rm", *flags, "--save_steps", "1"])
    assert proc.returncode != 0
    assert _error_lines(proc.stderr) == [
        f"error: no space left on device while writing {ckpt}/step_2 (the partial copy was "
        f"removed); the newest complete checkpoint is {ckpt}/step_1, intact"
    ], proc.stderr[-3000:]
    _no_traceback_through_us(proc.stderr)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1"]  # nothing half-written
    assert checkpoint_problem(ckpt / "step_1") is None  # and the one named is readable

    # The export: the checkpoints land elsewhere, the model's 2.6 MB not on 1 MB.
    save = small_disk("model_disk", "1m") / "rm"
    ckpt = tmp_path / "ckpt"
    proc = torchrun(["train-rm", *_rm_flags(tiny_qwen2, data, save, ckpt), "--save_steps", "1"])
    assert proc.returncode != 0
    last = max(list_checkpoints(ckpt))[1]  # the final step's
    assert _error_lines(proc.stderr) == [
        f"error [rank 0]: no space left on device while writing {save} (the partial copy was "
        f"removed); the newest complete checkpoint is {last}, intact"
    ], proc.stderr[-3000:]
    _no_traceback_through_us(proc.stderr)
    leftovers = sorted(p.name for p in save.parent.iterdir())
    assert leftovers == ["rm"], leftovers  # no rm.tmp-<pid>
    assert not list(save.glob("*.safetensors"))  # the run's logs are there, no half a model
