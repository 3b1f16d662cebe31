"""OpenRLHF launch scripts, v0.10 flat and v0.11 dotted, run with only the entry point swapped.

The scripts in ``openrlhf_scripts/`` are written the way OpenRLHF's examples write them (bash
arrays or one long command, ``set -x``); the test only fills in paths. Each runs a few steps
of the tiny model on 2 CPU ranks with real vLLM rollouts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fsdp_rlhf.distributed.env import free_port
from fsdp_rlhf.testing.synthetic import (
    continuation_rows,
    preference_rows,
    prompt_rows,
    write_jsonl,
)
from tests.e2e.helpers import REPO, _env, read_metrics
from tests.e2e.test_ppo_cli import PARITY_REWARD, SHORT_REWARD_WITH_PREEMPTION

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "openrlhf_scripts"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("openrlhf_data")
    write_jsonl(prompt_rows(64, chat=True), root / "prompts.jsonl")
    write_jsonl(preference_rows(80), root / "pairs.jsonl")
    (root / "reward.py").write_text(SHORT_REWARD_WITH_PREEMPTION)
    (root / "parity_reward.py").write_text(PARITY_REWARD)
    kd = [{"question": r["input"], "response": r["output"]} for r in continuation_rows(48)]
    write_jsonl(kd, root / "kd.jsonl")
    return root


def run_script(
    name: str, model: str, data: Path, save: Path, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    import sys

    env = _env(
        {
            "MODEL": model,
            "DATA": str(data),
            "SAVE": str(save),
            "PORT": str(free_port()),
            "PYTHON": sys.executable,
            **(extra or {}),
        }
    )
    return subprocess.run(
        ["bash", str(SCRIPTS / name)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )


def translated(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("openrlhf flag: ")]


def test_grpo_script_in_openrlhf_v010_flags(tiny_qwen2, data, tmp_path):
    save = tmp_path / "grpo"
    proc = run_script("grpo_v0.10_flat.sh", tiny_qwen2, data, save)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notes = translated(proc.stdout)
    assert "openrlhf flag: --advantage_estimator group_norm -> --advantage_estimator grpo" in (
        " ".join(notes)
    ) or any("group_norm -> --advantage_estimator grpo" in n for n in notes), notes
    assert any("--vllm_sync_backend nccl: accepted" in n for n in notes), notes
    assert any("--max_len 48" in n and "--prompt_max_len 32" in n for n in notes), notes
    assert len(notes) == len(set(notes))  # once each, from rank 0 only
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]  # --max_samples 16 / --rollout_batch_size 8
    assert rows[-1]["response_length/max"] <= 16
    assert "rollout_corr/is_masked_frac" in rows[-1] or "rollout/mismatch_kl" in rows[-1]
    config = (save / "config.yaml").read_text()
    assert "advantage_estimator: grpo" in config and "zero_stage: 3" in config
    assert "is_correction: icepop" in config
    assert (save / "tb").is_dir() and (save / "config.json").is_file()


def test_dapo_script_in_openrlhf_v011_flags(tiny_qwen2, data, tmp_path):
    save = tmp_path / "dapo"
    proc = run_script("dapo_v0.11_dotted.sh", tiny_qwen2, data, save)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notes = translated(proc.stdout)
    assert any(n.startswith("openrlhf flag: --ds.zero_stage 3 -> --zero_stage 3") for n in notes)
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("dynamic_filter/gen_rounds" in r for r in rows)
    # --data.max_len 40 alone: prompt + response <= 40 for every sequence
    for r in rows:
        assert r["response_length/max"] <= 40 - r["prompt_length/min"], r
    config = (save / "config.yaml").read_text()
    for line in (
        "eps_clip_high: 0.27",
        "dynamic_filtering: true",
        "max_len: 40",
        "is_correction: tis",
        "packing_samples: true",
    ):
        assert line in config, line


def test_rm_script_in_openrlhf_v011_flags(tiny_qwen2, data, tmp_path):
    save = tmp_path / "rm"
    proc = run_script("rm_v0.11_dotted.sh", tiny_qwen2, data, save)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notes = translated(proc.stdout)
    assert any("--model.model_name_or_path" in n and "--pretrain" in n for n in notes), notes
    rows = read_metrics(save)
    assert rows and rows[-1]["step"] >= 3
    saved = json.loads((save / "config.json").read_text())
    assert "reward_mean" in saved
    config = (save / "config.yaml").read_text()
    assert "bf16: true" in config and "packing_samples: true" in config


def test_scripts_are_bash_and_name_no_flag_of_ours_only(tmp_path):
    """The scripts use OpenRLHF's spellings, so a rename on our side cannot make them pass
    by accident: every flag they pass is one of OpenRLHF's parsers' flags."""
    from fsdp_rlhf.compat.migration import VERSIONS, openrlhf_flags

    theirs = {
        f["names"][0]
        for parser in ("ppo", "rm")
        for version in VERSIONS
        for f in openrlhf_flags(parser, version)
    }
    for path in (REPO / "fsdp_rlhf" / "compat" / "data").glob("openrlhf-*-kd.json"):
        theirs |= {f["names"][0] for f in json.loads(path.read_text())["flags"]}
    for script in SCRIPTS.glob("*.sh"):
        text = script.read_text()
        flags = {
            tok
            for line in text.splitlines()
            if not line.lstrip().startswith("#")
            and "torch.distributed.run" not in line
            and "--master_addr" not in line
            for tok in line.split()
            if tok.startswith("--") and len(tok) > 2
        }
        assert flags and flags <= theirs, (script.name, sorted(flags - theirs))
    assert os.access(SCRIPTS / "grpo_v0.10_flat.sh", os.R_OK)


@pytest.fixture(scope="module")
def long_context_gqa(tmp_path_factory) -> str:
    """A 2-layer Qwen2, 4 query / 2 KV heads of 64, with a 40k context (32k responses fit)."""
    from fsdp_rlhf.testing.tiny import build_model

    root = tmp_path_factory.mktemp("long_context_gqa")
    shape = dict(hidden_size=256, num_heads=4, num_kv_heads=2, max_position_embeddings=40960)
    return str(build_model(root, "qwen2", seed=3, **shape))


@pytest.mark.sp
def test_reinforce_baseline_script_with_ring_attention_and_32k_responses(
    long_context_gqa, data, tmp_path
):
    """OpenRLHF's long-reasoning recipe: --ds.ring_attn_size 2 becomes Ulysses sequence
    parallelism over both ranks, and --rollout.max_new_tokens 32768 reaches vLLM whole."""
    save = tmp_path / "reinforce"
    proc = run_script("reinforce_baseline_v0.11_dotted.sh", long_context_gqa, data, save)
    assert proc.returncode == 0, proc.stderr[-4000:]
    notes = translated(proc.stdout)
    assert any(n.startswith("openrlhf flag: --ds.ring_attn_size 2 -> --sequence_parallel_size 2")
               for n in notes), notes  # fmt: skip
    assert any(n.startswith("openrlhf flag: --ds.ring_attn_head_stride 2: accepted") for n in notes)
    log = " ".join((proc.stdout + proc.stderr).split())
    assert "vLLM engine: max_model_len 33000 (prompts up to 232 + responses up to 32768" in log
    assert "1 data-parallel x 2 sequence-parallel" in log
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]  # --data.max_samples 8 / --rollout.batch_size 4
    for r in rows:
        assert r["response_length/max"] > 0 and 0 <= r["response_length/clip_ratio"] <= 1
        assert r["rollout_corr/is_masked_frac"] < 0.05  # engine and split trainer agree
    config = (save / "config.yaml").read_text()
    for line in ("sequence_parallel_size: 2", "generate_max_len: 32768", "zero_stage: 3"):
        assert line in config, line


@pytest.fixture(scope="module")
def kd_teacher(tmp_path_factory) -> str:
    """A teacher for OpenRLHF's KD scripts: the tiny Qwen2's shape and tokenizer, other weights."""
    from fsdp_rlhf.testing.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("kd_teacher"), "qwen2", seed=5))


def _kd_run(script: str, model: str, teacher: str, data: Path, save: Path) -> list[str]:
    """Runs one of OpenRLHF's KD scripts; returns its translation notes after checking the run:
    three optimizer steps (48 samples / 16), the loss (1 - 0.4) NLL + 0.4 KL of its parts, the
    teacher offloaded, the student exported."""
    proc = run_script(script, model, data, save, extra={"TEACHER": teacher})
    assert proc.returncode == 0, proc.stderr[-4000:]
    notes = translated(proc.stdout)
    assert any("--teacher_model" in n and "--teacher_pretrain" in n for n in notes), notes
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["forward_kl"] > 0 and r["nll"] > 0
        assert r["loss"] == pytest.approx(0.6 * r["nll"] + 0.4 * r["forward_kl"], rel=1e-3)
    assert rows[-1]["nll"] < rows[0]["nll"]
    config = (save / "config.yaml").read_text()
    for line in ("kd_coef: 0.4", "teacher_offload: true", "bf16: true"):
        assert line in config, line
    assert (save / "config.json").is_file() and (save / "model.safetensors").is_file()
    return notes


def test_kd_script_in_openrlhf_fsdp2_branch_flags(tiny_qwen2, kd_teacher, data, tmp_path):
    notes = _kd_run("kd_fsdp2_branch.sh", tiny_qwen2, kd_teacher, data, tmp_path / "kd")
    for theirs, ours in (
        ("--model_name_or_path", "--pretrain"),
        ("--ckpt_save_path", "--save_path"),
        ("--param_dtype bf16", "--bf16"),
    ):
        assert any(theirs in n and ours in n for n in notes), (theirs, notes)


@pytest.mark.long
def test_kd_script_in_openrlhf_release_flags(tiny_qwen2, kd_teacher, data, tmp_path):
    _kd_run("kd_v0.9_flat.sh", tiny_qwen2, kd_teacher, data, tmp_path / "kd")
    assert "zero_stage: 3" in (tmp_path / "kd" / "config.yaml").read_text()
