"""`fsdp-rlhf train-rm` through the real command line: AIAK-RLHF's RM flags (its guide's
section 1.3) under torchrun and under ``python -m torch.distributed.launch``, and one-line errors
on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fsdp_rlhf.allocator import find_tcmalloc, gpu_visible
from fsdp_rlhf.cli import app
from fsdp_rlhf.distributed.env import free_port
from tests.rm_utils import synthetic_pairs, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def _aiak_flags(model: str, dataset: Path, out: Path) -> list[str]:
    """The launch line of AIAK-RLHF's RM example, with paths and sizes made tiny."""
    return [
        "--save_path", str(out / "model"),
        "--save_steps", "-1",
        "--logging_steps", "1",
        "--eval_steps", "-1",
        "--train_batch_size", "8",
        "--micro_train_batch_size", "1",
        "--pretrain", model,
        "--bf16",
        "--max_epochs", "1",
        "--max_len", "64",
        "--zero_stage", "3",
        "--learning_rate", "9e-6",
        "--dataset", str(dataset),
        "--dataset_probs", "1",
        "--flash_attn",
        "--tensorboard", str(out / "tb"),
        "--gradient_checkpointing",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    # COLUMNS: rich wraps log lines at 80 columns when not on a terminal.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "300"}


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    # AIAK-RLHF's own launcher: passes --local-rank=N before our subcommand (no --use-env).
    "launch": [sys.executable, "-m", "torch.distributed.launch"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_aiak_launch_line_trains_and_saves(launcher, tiny_qwen2, tmp_path):
    dataset = write_jsonl(tmp_path / "pairs.jsonl", synthetic_pairs(40, seed=0))
    # OpenRLHF's train_rm flags on one of the two runs: W&B (offline: no key here), a HF
    # export in each checkpoint, one checkpoint kept
    openrlhf = [
        "--use_wandb", "True", "--save_steps", "2", "--ckpt_path", str(tmp_path / "ckpt"),
        "--save_hf_ckpt", "--max_ckpt_num", "1", "--max_ckpt_mem", "1e8",
    ] if launcher == "torchrun" else []  # fmt: skip
    cmd = [
        *LAUNCHERS[launcher], "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), "-m", "fsdp_rlhf.cli", "train-rm",
        *_aiak_flags(tiny_qwen2, dataset, tmp_path), *openrlhf,
    ]  # fmt: skip
    env = {**_env(), "WANDB_API_KEY": "", "NETRC": str(tmp_path / "no_netrc"), "COLUMNS": "1000"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model = tmp_path / "model"
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["reward_std"] > 0 and "reward_mean" in cfg
    rows = [json.loads(line) for line in (model / "metrics.jsonl").read_text().splitlines()]
    # 40 pairs - 8 held out = 32 = 4 steps of 8; one row per step, then the final eval
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert {"eval/loss", "eval/acc", "eval/reward_mean", "eval/reward_std"} <= set(rows[-1])
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    run_cfg = (model / "config.yaml").read_text()
    for line in ("bf16: true", "flash_attn: true", "gradient_checkpointing: true", "zero_stage: 3"):
        assert line in run_cfg
    assert "zero_stage=3 -> FSDP2 fully_shard(reshard_after_forward=True)" in proc.stdout
    if find_tcmalloc() and not gpu_visible() and "LD_PRELOAD" not in os.environ:
        # the ranks restarted themselves with tcmalloc (same PIDs: the launcher saw nothing)
        assert "host allocator: libtcmalloc preloaded by fsdp-rlhf" in proc.stdout
    assert "eta" in proc.stdout
    if openrlhf:
        _check_openrlhf_flags(tmp_path, model, rows, proc.stdout)


def _check_openrlhf_flags(tmp_path: Path, model: Path, rows: list[dict], log: str) -> None:
    from fsdp_rlhf.testing.wandb_file import history, run_config

    (run_file,) = model.glob("wandb/offline-run-*/run-*.wandb")
    assert f"wandb sync {run_file.parent}" in log
    logged = {r["_step"]: r for r in history(run_file)}
    for row in rows:  # every metrics.jsonl row, train steps and the final eval
        for key, value in row.items():
            if key != "step":
                assert logged[row["step"]][key] == pytest.approx(value), (row["step"], key)
    config = run_config(run_file)
    assert config["logging"]["use_wandb"] == "True" and config["model"]["pretrain"]
    # 4 steps, saved at 2 and 4, one kept: step_4 with its HF reward model
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_4"]
    hf = tmp_path / "ckpt" / "step_4" / "hf"
    assert json.loads((hf / "config.json").read_text())["value_head_prefix"] == "score"
    assert (hf / "model.safetensors").is_file()


# ---------------------------------------------------------------- bad input


@pytest.fixture
def bad_inputs(tiny_qwen2, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", synthetic_pairs(40, seed=0))
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(good.read_text().splitlines()[0] + "\n{not json\n")
    base = _aiak_flags(tiny_qwen2, good, tmp_path)

    def flags(**over: str) -> list[str]:
        out = list(base)
        for name, value in over.items():
            out[out.index(f"--{name}") + 1] = value
        return out

    return {
        "missing dataset": (flags(dataset=str(tmp_path / "nope.jsonl")),
                            r"--dataset .*nope\.jsonl: no such file or folder"),
        "malformed line": (flags(dataset=str(malformed)), r"malformed\.jsonl:2: malformed JSON"),
        "missing key": (flags() + ["--chosen_key", "answer"],
                        r"--chosen_key 'answer': no such key .*available keys: chosen, rejected"),
        "probs count": (flags(dataset=f"{good},{good}"), r"--dataset_probs has 1 value"),
        "batch divisibility": (flags(train_batch_size="3", micro_train_batch_size="2"),
                               r"train_batch_size \(3\) must be divisible by world size \(1\)"),
        "missing model": (flags(pretrain=str(tmp_path / "no_model")),
                          r"--pretrain .*no_model: does not exist"),
    }  # fmt: skip


def test_bad_input_is_one_line_and_writes_nothing(bad_inputs, tmp_path):
    import re

    runner = CliRunner()
    for name, (flags, pattern) in bad_inputs.items():
        result = runner.invoke(app, ["train-rm", *flags])
        assert result.exit_code == 2, (name, result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, result.stderr)
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert "Traceback" not in result.output
        assert not (tmp_path / "model").exists(), name


def test_bad_input_exit_code_from_a_real_process(bad_inputs, tmp_path):
    flags, pattern = bad_inputs["malformed line"]
    cmd = [sys.executable, "-m", "fsdp_rlhf.cli", "train-rm", *flags]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "model").exists()
