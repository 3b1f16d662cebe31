"""Lossless asynchronous resume (issue #49): one epoch of 32 prompts (8 steps of 4 prompts x 2
samples) with 2 engines, each run SIGKILLed (FSDP_RLHF_KILL_AT: a rank kills itself, as the
OOM killer would) at another phase and resumed from its last checkpoint, until one finishes.
The run's ledger (<save_path>/ledger) must then say what an uninterrupted run's says: every
step trained the same prompts with all their samples, so every prompt of the epoch was trained
exactly once, although batches were generated, queued and lost again at every kill.

Ranks: 1 or 2 training ranks first, then 2 rollout ranks (an engine of TP 1 each). The same
across the two namespace hosts is in tests/cluster/test_async.py.

`make test-async` runs one case (marker ``asynchronous``): an epoch of 16 prompts on 1 training
rank, SIGKILLed once while it trains, against the prompt samplers' schedule. The full matrix
(marker ``async_resume_full``, ``make test-async-resume``; ~28 min on 2 loaded cores) kills at
every phase on 1 and 2 training ranks and checks the samplers' schedule against a run never
stopped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fsdp_rlhf.data.prompts import PromptSampler
from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl
from fsdp_rlhf.trainers.ppo.async_ledger import read, trained
from tests.e2e.helpers import read_metrics, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.asynchronous]
full_matrix = pytest.mark.async_resume_full  # make test-async-resume, not make test-async

PROMPTS, BATCH, SAMPLES = 32, 4, 2
STEPS = PROMPTS // BATCH  # one epoch
QUICK_PROMPTS = 16  # the make test-async case's epoch: 4 steps
REWARD = (
    "def reward_func(queries, prompts, labels):\n"
    "    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]\n"
)


def write_data(root: Path, prompts: int) -> Path:
    write_jsonl(prompt_rows(prompts, chat=True), root / "prompts.jsonl")
    (root / "reward.py").write_text(REWARD)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("resume_data"), PROMPTS)


def flags(model: str, data: Path, save: Path, prompts: int = PROMPTS) -> list[str]:
    """One epoch of ``prompts`` (``data`` holds that many)."""
    return [
        *("--pretrain", model, "--remote_rm_url", str(data / "reward.py")),
        *("--prompt_data", str(data / "prompts.jsonl"), "--input_key", "input"),
        *("--rollout_batch_size", str(BATCH), "--n_samples_per_prompt", str(SAMPLES)),
        *("--advantage_estimator", "grpo", "--train_batch_size", str(BATCH * SAMPLES)),
        *("--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2"),
        *("--packing_samples", "--generate_max_len", "8", "--prompt_max_len", "32"),
        *("--max_steps", str(prompts // BATCH), "--actor_learning_rate", "2e-3", "--seed", "7"),
        *("--save_path", str(save), "--ckpt_path", str(save / "ckpt"), "--save_steps", "1"),
        *("--async_train", "--vllm_num_engines", "2", "--load_checkpoint"),
    ]


def schedule(prompts: int = PROMPTS) -> dict[int, dict[int, int]]:
    """What each step trains, from the rollout ranks' prompt samplers: ``{step: {prompt:
    samples}}`` (rollout rank i draws its half of each batch)."""
    samplers = [PromptSampler(prompts, BATCH, i, 2, 7) for i in (0, 1)]
    steps = {}
    for step in range(1, prompts // BATCH + 1):
        steps[step] = {p: SAMPLES for s in samplers for p in s.next_indices()}
    return steps


@pytest.fixture(scope="module")
def uninterrupted(tiny_qwen2, data, tmp_path_factory) -> dict[int, dict[int, int]]:
    """The ledger of the same run, never stopped (1 training rank): the samplers' schedule."""
    save = tmp_path_factory.mktemp("uninterrupted")
    run = torchrun(["ppo", *flags(tiny_qwen2, data, save)], nproc=3)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in read_metrics(save)] == list(range(1, STEPS + 1))
    ledger = trained(save / "ledger")
    assert ledger == schedule()
    return ledger


def kill_and_resume(
    model, data, save: Path, nproc: int, kills: list[str], prompts: int = PROMPTS
) -> None:
    """One run per entry of ``kills`` (``rank:phase:n``), each SIGKILLed there and the next
    resuming it, then one that finishes."""
    for kill in kills:
        cut = torchrun(["ppo", *flags(model, data, save, prompts)], nproc=nproc,
                       env={"FSDP_RLHF_KILL_AT": kill})  # fmt: skip
        assert cut.returncode != 0, (kill, cut.stdout[-2000:])
        # the rank named died of the SIGKILL (torchrun's report of its failed ranks)
        rank = kill.split(":")[0]
        died = rf"rank\s*: {rank} \(local_rank: {rank}\)\s+exitcode\s*: -9 \(pid: \d+\)"
        died += r"\s+\(SIGKILL\)"
        assert re.search(died, cut.stderr), cut.stderr[-3000:]
    done = torchrun(["ppo", *flags(model, data, save, prompts)], nproc=nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "asynchronous resume at step" in done.stdout + done.stderr


def check_ledger(
    save: Path, want: dict[int, dict[int, int]], attempts: int, prompts: int = PROMPTS
) -> None:
    steps = prompts // BATCH
    folder = save / "ledger"
    got = trained(folder)
    assert got == want  # the same prompts each step, with all their samples
    every = sorted(p for step in got.values() for p in step)
    assert every == list(range(prompts))  # each prompt of the epoch, exactly once
    rows = read(folder / "train.jsonl")
    starts = [r for r in rows if r["event"] == "start"]
    assert [r["attempt"] for r in starts] == list(range(1, attempts + 1))
    # each step's prompts are those the rollout ranks generated for that batch in the attempt
    # that trained it for good (batches generated past a checkpoint were generated again)
    final: dict[int, int] = {}
    for r in rows:
        if r["event"] == "start":
            final = {step: a for step, a in final.items() if step <= r["step"]}
        elif r["event"] == "trained":
            final[r["step"]] = r["attempt"]
    generated: dict[tuple[int, int], list[int]] = {}
    for i in (0, 1):
        for r in read(folder / f"rollout{i}.jsonl"):
            if r["event"] == "generated":
                generated.setdefault((r["attempt"], r["batch"]), []).extend(r["prompts"])
    assert {a for a, _ in generated} == set(range(1, attempts + 1))  # every attempt generated
    for step, attempt in final.items():
        assert sorted(generated[attempt, step]) == sorted(got[step]), (step, attempt)
    for start in starts:
        assert all(b > start["step"] for b in start["regenerated"]), start
    assert [r["step"] for r in read_metrics(save)] == list(range(1, steps + 1))
    saved = json.loads((save / "ckpt" / f"step_{steps}" / "trainer.json").read_text())
    assert saved["async"]["regenerated_from_batch"] == steps + 1


def test_sigkill_while_training_then_resume_trains_every_prompt_once(tiny_qwen2, tmp_path):
    """The make test-async case: 1 training rank (rank 0), rollout ranks 1 and 2, an epoch of
    16 prompts (4 steps); killed while training step 3 (the rollout ranks have generated and
    queued batches past the step-2 checkpoint: they are generated again) and resumed."""
    data = write_data(tmp_path / "data", QUICK_PROMPTS)
    save = tmp_path / "run"
    kill_and_resume(tiny_qwen2, data, save, 3, ["0:training:3"], QUICK_PROMPTS)
    check_ledger(save, schedule(QUICK_PROMPTS), 2, QUICK_PROMPTS)


@full_matrix
def test_sigkill_while_generating_queued_and_training_then_resume(
    tiny_qwen2, data, uninterrupted, tmp_path
):
    """1 training rank (rank 0), rollout ranks 1 and 2: killed while rollout rank 2 generates
    batch 3, after rollout rank 1 queued batch 5, while training rank 0 trains step 6."""
    save = tmp_path / "run"
    kills = ["2:generating:3", "1:queued:5", "0:training:6"]
    kill_and_resume(tiny_qwen2, data, save, 3, kills)
    check_ledger(save, uninterrupted, len(kills) + 1)


@full_matrix
def test_sigkill_while_syncing_on_either_side_with_two_training_ranks(
    tiny_qwen2, data, uninterrupted, tmp_path
):
    """2 training ranks (0, 1), rollout ranks 2 and 3: killed while training rank 1 gathers
    weight version 2 for its publication, and while rollout rank 3 receives version 4."""
    save = tmp_path / "run"
    kill_and_resume(tiny_qwen2, data, save, 4, ["1:syncing:2", "3:syncing:4"])
    check_ledger(save, uninterrupted, 3)
