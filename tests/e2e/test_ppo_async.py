"""`fsdp-rlhf ppo --async_train` end to end: 2 CPU ranks under torchrun (1 training rank, 1
rollout rank with a real vLLM engine), 3 for an engine of TP 2 or two engines. `make
test-async` runs these (marker ``asynchronous``); the two-host runs are in tests/cluster."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.config_base import build_config
from fsdp_rlhf.distributed.env import free_port
from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo import pairing
from fsdp_rlhf.trainers.ppo.update import _correction, ratio_anchor
from tests.e2e.helpers import REPO, _env, read_metrics, torchrun, torchrun_script
from tests.e2e.test_ppo_cli import (
    PARITY_REWARD,
    SHORT_REWARD_WITH_PREEMPTION,
    check_delta_run,
    delta_flags,
    grpo_flags,
)

pytestmark = [pytest.mark.slow, pytest.mark.asynchronous]

ASYNC = ["--async_train", "--vllm_num_engines", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_data")
    write_jsonl(prompt_rows(256, chat=True), root / "prompts.jsonl")
    (root / "reward.py").write_text(SHORT_REWARD_WITH_PREEMPTION)
    return root


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_async_grpo_learns_like_sync_with_bounded_staleness_and_overlap(tiny_qwen2, data, tmp_path):
    """The colocated test task (a rule reward for short answers, 14 steps, same seed) learns
    about as well one step off policy; every batch is exactly one version old after the first
    (the bound, --async_queue_size 1); the training rank waits for batches far less than a
    rollout takes, so a step costs less than rollout + training; and a rollout rank's stop
    signal checkpoints the run, whose resume trains every remaining step once."""
    steps = 14
    sync = torchrun(["ppo", *grpo_flags(tiny_qwen2, data, tmp_path / "sync", steps)])
    assert sync.returncode == 0, sync.stderr[-3000:]
    save = tmp_path / "async"
    run = torchrun(["ppo", *grpo_flags(tiny_qwen2, data, save, steps), *ASYNC])
    assert run.returncode == 0, run.stderr[-3000:]
    rows, base = read_metrics(save), read_metrics(tmp_path / "sync")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    gain = _mean(rows[-4:], "critic/score/mean") - _mean(rows[:4], "critic/score/mean")
    base_gain = _mean(base[-4:], "critic/score/mean") - _mean(base[:4], "critic/score/mean")
    assert gain > 0.05 and gain > 0.5 * base_gain, (gain, base_gain)
    assert rows[0]["async/staleness_max"] == 0  # the first batch: the initial weights
    for r in rows[1:]:
        assert r["async/staleness_max"] == r["async/staleness_mean"] == 1, r["step"]
        assert r["async/off_policy_token_frac"] == 1 and r["async/partial_response_frac"] == 0
    # the overlap: after the first step the training rank hardly waits for batches, so a
    # step (timing/all, waiting included) is shorter than a rollout plus the training phases
    steady = rows[2:]
    step = statistics.median(r["timing/all"] for r in steady)
    training = statistics.median(r["timing/all"] - r["timing/train_wait"] for r in steady)
    rollout = statistics.median(r["timing/rollout"] for r in steady)
    assert step < rollout + training, (step, rollout, training)
    assert statistics.median(r["timing/train_wait"] for r in steady) < 0.5 * rollout
    for key in ("timing/rollout_wait", "timing/weight_sync", "rollout_tps", "e2e_tps"):
        assert key in rows[-2], key


def test_rollout_stop_signal_checkpoints_and_resume_does_no_step_twice(tiny_qwen2, data, tmp_path):
    """SIGTERM on the rollout rank (its reward function sends it at the 6th batch): the
    training rank learns it through the job's store, abandons step 6 before its update and
    checkpoints step 5; the resumed run refills the queue from step 5's weights (batch 6 is
    zero versions old) and trains steps 6-10 once each."""
    steps, kill_at = 10, 6
    save = tmp_path / "stopped"
    flags = [*grpo_flags(tiny_qwen2, data, save, steps), *ASYNC]
    cut = torchrun(["ppo", *flags], env={"TEST_SIGTERM_AT_CALL": str(kill_at)})
    assert cut.returncode == 0, cut.stderr[-3000:]
    log = " ".join((cut.stdout + cut.stderr).split())
    assert "stop signal on rollout rank 1 (engine 0): passed to the training ranks" in log
    assert "checkpoint at step 5 on disk" in log
    assert [r["step"] for r in read_metrics(save)] == list(range(1, kill_at))
    state = json.loads((save / "ckpt" / "step_5" / "trainer.json").read_text())
    assert state["async"] == {
        "samplers": [{"epoch": 0, "index": 5}],
        "weight_version": 5,
        "regenerated_from_batch": 6,
    }
    resumed = torchrun(["ppo", *flags, "--load_checkpoint"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert rows[kill_at - 1]["async/staleness_max"] == 0  # from the checkpointed weights
    assert rows[kill_at]["async/staleness_max"] == 1


def test_partial_rollouts_and_over_sampling_in_one_run(tiny_qwen2, data, tmp_path):
    """--partial_rollout with long responses and a fast update: weights arrive while
    responses are being generated, some responses span two versions, and no token is more
    than --async_queue_size 2 versions old. Over-sampling (20 prompts for 16) drops 4 groups
    a step."""
    save = tmp_path / "partial"
    flags = grpo_flags(tiny_qwen2, data, save, 6)
    for flag, value in (("--generate_max_len", "96"), ("--prompt_max_len", "32")):
        flags[flags.index(flag) + 1] = value
    flags += [*ASYNC, "--partial_rollout", "--async_queue_size", "2"]
    flags += ["--vllm_generate_batch_size", "20", "--max_len", "128"]
    run = torchrun(["ppo", *flags])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["async/staleness_max"] <= 2 for r in rows)
    assert any(r["async/partial_response_frac"] > 0 for r in rows), [
        r["async/partial_response_frac"] for r in rows
    ]
    assert all(r["async/dropped_groups"] == 4 for r in rows)


def test_an_engine_of_two_tensor_parallel_ranks(tiny_qwen2, data, tmp_path):
    """3 ranks: 1 training rank, 1 engine of TP 2 (its own default group of 2 ranks). With
    partial rollouts the engine's two ranks must agree at which engine step new weights load
    (they poll separately), or their TP all-reduces would mix two weight versions."""
    save = tmp_path / "tp2"
    flags = grpo_flags(tiny_qwen2, data, save, 4)
    flags[flags.index("--generate_max_len") + 1] = "48"
    flags += ["--async_train", "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2"]
    flags += ["--partial_rollout", "--max_len", "80"]
    run = torchrun(["ppo", *flags], nproc=3)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ranks 0-0 train, 1-2 generate (1 engines x TP 2)" in " ".join(run.stdout.split())
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # each rank of the engine sent its half of every batch (the training rank checks the
    # prompt count of each part); a batch is never more than one version old
    assert all(r["async/staleness_max"] <= 1 for r in rows)


def _two_engines(tmp_path, data, model, steps: int) -> list[str]:
    flags = grpo_flags(model, data, tmp_path, steps)
    flags[flags.index("--generate_max_len") + 1] = "8"
    return [*flags, "--async_train", "--vllm_num_engines", "2"]


def test_two_engines_beside_one_training_rank(tiny_qwen2, data, tmp_path):
    """3 ranks: 1 training rank, 2 engines of TP 1 (each its own default group of 1 rank).
    Each rollout rank builds an engine of its own world (not the job's 2 engines) that never
    sleeps; each sends its half of every batch to the training rank."""
    run = torchrun(["ppo", *_two_engines(tmp_path, data, tiny_qwen2, 2)], nproc=3)
    assert run.returncode == 0, run.stderr[-3000:]
    log = " ".join(run.stdout.split())
    assert "ranks 0-0 train, 1-2 generate (2 engines x TP 1)" in log
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["async/staleness_max"] <= 1 for r in rows)


EVAL_KEYS = (
    "eval/greedy_pass@1", "eval/greedy_score_mean", "eval/pass@1", "eval/pass@2",
    "eval/score_mean",
)  # fmt: skip


def test_eval_on_the_rollout_ranks_equals_the_colocated_eval(tiny_qwen2, data, tmp_path):
    """--eval_dataset under --async_train: a rollout rank evaluates each evaluated step's
    weights at a batch boundary (with partial rollouts too: never while requests are in
    flight) and the training rank logs the numbers at that step. With the actor frozen
    every version is the pretrained model (lr 1e-30), so one engine's numbers equal the colocated
    evaluation's exactly (same prompts, seeds, rule reward); two engines split the 9 prompts
    5 + 4 (a wrapped repeat not counted) and their greedy numbers equal it too (the sampled
    ones draw other seeds per engine). The ledger has each evaluated version loaded before
    its evaluation; --save_best_metric keeps the best step.

    The mechanics of the asynchronous step, on this fixed policy: one engine samples the
    colocated run's batches, and the update's losses equal the colocated ones to 1e-4 whatever
    the staleness and the default correction (the behaviour policy is the same weights); the
    pairing audit (FSDP_RLHF_PAIRING_AUDIT) checks every sample's tokens, score, versions and
    group at the update against what the rollout rank sent; the staleness metrics read 0
    (the same weights a version apart)."""
    write_jsonl(prompt_rows(9, seed=99, chat=True), tmp_path / "eval.jsonl")
    (tmp_path / "parity.py").write_text(PARITY_REWARD)

    def flags(save: Path) -> list[str]:
        f = grpo_flags(tiny_qwen2, data, save, 2)
        # frozen in effect (lr > 0 is required): lr * Adam's unit step is below every
        # weight's fp32 spacing, so the weights stay the pretrained ones bit for bit
        f[f.index("--actor_learning_rate") + 1] = "1e-30"
        f[f.index("--remote_rm_url") + 1] = str(tmp_path / "parity.py")
        f += ["--eval_dataset", str(tmp_path / "eval.jsonl"), "--eval_steps", "1"]
        f += ["--eval_n_samples_per_prompt", "2", "--eval_temperature", "1.0"]
        return [*f, "--save_best_metric", "pass@2"]

    runs = {
        "colocated": (flags(tmp_path / "colocated"), 1),
        "one_engine": ([*flags(tmp_path / "one_engine"), *ASYNC, "--partial_rollout"], 2),
        "two_engines": (
            [*flags(tmp_path / "two_engines"), "--async_train", "--vllm_num_engines", "2"],
            3,
        ),
    }
    rows = {}
    for name, (args, nproc) in runs.items():
        run = torchrun(["ppo", *args], nproc=nproc, env={pairing.ENV: "1"})
        assert run.returncode == 0, (name, run.stderr[-3000:])
        rows[name] = read_metrics(tmp_path / name)
        assert [r["step"] for r in rows[name]] == [1, 2], name
    for a, b in zip(rows["colocated"], rows["one_engine"], strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"], a["step"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), (a["step"], key)
        assert b["pairing/rows_checked"] == 64 and "pairing/rows_checked" not in a
        assert b["actor/behaviour_ratio"] == pytest.approx(1.0, abs=1e-4)
    one = rows["one_engine"]
    assert one[0]["rollout/logprob_diff/staleness_0"] < 1e-4  # the first batch: on policy
    assert "rollout/logprob_diff/staleness_1" not in one[0]
    assert one[1]["rollout/logprob_diff/staleness_1"] < 1e-4  # frozen: a version apart, equal
    base = rows["colocated"][0]
    assert 0 < base["eval/pass@1"] < 1, base  # the parity reward: some right, some wrong
    for name in ("one_engine", "two_engines"):
        keys = EVAL_KEYS if name == "one_engine" else EVAL_KEYS[:2]
        for r in rows[name]:
            assert {k: r[k] for k in keys} == {k: base[k] for k in keys}, (name, r["step"])
            assert r["timing/eval_rollout"] > 0 and r["timing/eval"] >= 0
        for i in range(2 if name == "two_engines" else 1):
            ledger = (tmp_path / name / "ledger" / f"rollout{i}.jsonl").read_text()
            records = [json.loads(line) for line in ledger.splitlines()]
            for version in (1, 2):
                kinds = [
                    (r["event"], r.get("loaded"))
                    for r in records
                    if r.get("version") == version and r["event"] in ("weights", "evaluated")
                ]
                assert kinds == [("weights", True), ("evaluated", None)], (name, i, kinds)
        best = json.loads((tmp_path / name / "best" / "best_metric.json").read_text())
        assert best["metric"] == "eval/pass@2" and best["step"] == 1  # equal later: not better
        assert (tmp_path / name / "best" / "model.safetensors").is_file()


def test_a_response_spans_two_weight_versions_and_each_token_keeps_its_own(tiny_qwen2, tmp_path):
    """One rollout whose weights change after 6 engine steps, requests in flight: the
    responses' first tokens carry version 0 and the rest version 1; each token's log-prob
    from the engine is its own version's (within 2e-3 of the trainer's computation, while
    the two versions differ by far more); and the update's rollout correction weighs each
    token against that log-prob: ~1 where the trainer's policy sampled it, the ratio of the
    two versions where the older one did."""
    out = tmp_path / "partial.pt"
    worker = REPO / "tests" / "e2e" / "async_partial_worker.py"
    proc = torchrun_script(worker, [tiny_qwen2, str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(out, weights_only=False)
    exp = Experience(**saved["rows"])
    mask = exp.response_mask.bool()
    versions = exp.token_versions
    spans = [set(versions[i][mask[i]].tolist()) for i in range(exp.num_sequences)]
    assert sum(s == {0, 1} for s in spans) >= 4, spans  # partial responses
    for i in range(exp.num_sequences):
        v = versions[i][mask[i]]
        assert (v[:6] == 0).all() and (v[6:] == 1).all(), v  # switched after 6 tokens
    lp0, lp1 = saved["logprobs"][0], saved["logprobs"][1]
    engine = exp.engine_logprobs
    old, new = mask & (versions == 0), mask & (versions == 1)
    assert (engine - lp0)[old].abs().max() < 2e-3
    assert (engine - lp1)[new].abs().max() < 2e-3
    assert (lp1 - lp0)[mask].abs().max() > 0.1  # the versions are far apart
    # the actor update's correction, with the trainer's policy (version 1) as the old one
    cfg = build_config(
        PPOConfig, ["--is_correction", "tis", "--is_truncated_threshold", "0", "100"]
    )[0]
    weights, _ = _correction(cfg.algo, lp1, lp1, exp)
    assert torch.allclose(weights[new], torch.ones_like(weights[new]), atol=3e-3)
    assert torch.allclose(weights[old], torch.exp(lp1 - lp0)[old], rtol=5e-3)
    # the ratio against the behaviour policy (--off_policy_correction behaviour) takes each
    # token's own version's log-prob: 1 where the trainer's policy sampled it, the two
    # versions' ratio where the older one did
    behaviour = build_config(PPOConfig, ["--off_policy_correction", "behaviour"])[0].algo
    ratio = torch.exp(lp1 - ratio_anchor(behaviour, lp1, exp))
    assert torch.allclose(ratio[new], torch.ones_like(ratio[new]), atol=3e-3)
    assert torch.allclose(ratio[old], torch.exp(lp1 - lp0)[old], rtol=5e-3)


SCRIPTS = Path(__file__).parent / "openrlhf_scripts"

# OpenRLHF's examples/python/agent_func.py with a deterministic grade: an answer with an even
# number of words is correct; one more try after a wrong one
PARITY_AGENT = """
import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        correct = len(states["action_text"].split()) % 2 == 0
        done = correct or self.step_idx >= 1
        reward = torch.tensor(float(correct)) if done else torch.tensor(0.0)
        feedback = (
            "\\n\\nHuman: [CORRECT]\\n"
            if done
            else "\\n\\nHuman: [INCORRECT]\\nPlease try again.\\n\\nAssistant: "
        )
        self.step_idx += 1
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"tries": torch.tensor(float(self.step_idx))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.mark.parametrize("script", ["agent_async_v0.10_flat.sh", "agent_async_v0.11_dotted.sh"])
def test_openrlhf_async_agent_script(tiny_qwen2, tmp_path, script):
    """OpenRLHF's train_reinforce_baseline_ray_agent_async.sh in both spellings, at test
    sizes, ring attention included (2 training ranks in one sequence-parallel group beside a
    rollout rank): async training with partial rollouts, an agent over two tries, dynamic filtering,
    token-budget micro-batches, packing, icepop, bf16, HF checkpoints. Both spellings ask to
    resume (--load_checkpoint, --ckpt.load_enable); the flat one's script is run again and
    resumes from its last checkpoint with nothing left to do (what the resume does does not
    depend on how the flag was spelled)."""
    data = tmp_path / "data"
    rows = [{"prompt": r["input"], "label": r["label"]} for r in prompt_rows(64)]
    write_jsonl(rows, data / "agent_prompts.jsonl")
    (data / "agent_func.py").write_text(PARITY_AGENT)
    save = tmp_path / "run"

    def run() -> subprocess.CompletedProcess:
        env = {"MODEL": tiny_qwen2, "DATA": str(data), "SAVE": str(save)}
        env.update(PORT=str(free_port()), PYTHON=sys.executable)
        return subprocess.run(
            ["bash", str(SCRIPTS / script)],
            capture_output=True,
            text=True,
            env=_env(env),
            timeout=600,
            cwd=REPO,
        )

    proc = run()
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = " ".join((proc.stdout + proc.stderr).split())  # the log wraps long lines
    assert "data-parallel 1, sequence-parallel 2 (Ulysses)" in logged
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # --max_samples 32 / rollout batch 8
    for r in rows:
        assert r["async/staleness_max"] <= 1 and r["dynamic_filter/gen_rounds"] >= 1
        assert r["multiturn/turns/max"] <= 2 and "agent/tries" in r
    config = (save / "config.yaml").read_text()
    for line in (
        "async_train: true",
        "partial_rollout: true",
        "advantage_estimator: reinforce_baseline",
        "is_correction: icepop",
        "off_policy_correction: none",  # OpenRLHF's ratio against the trainer's old log-probs
        "use_dynamic_batch: true",
        "dynamic_filtering: true",
        "bf16: true",
        "sequence_parallel_size: 2",  # the script's ring attention, as Ulysses
        "load_checkpoint: true",
    ):
        assert line in config, line
    assert (save / "ckpt" / "step_4" / "hf" / "model.safetensors").is_file()
    if "dotted" in script:
        return
    again = run()
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from" in again.stdout and [r["step"] for r in read_metrics(save)] == [
        1,
        2,
        3,
        4,
    ]


def test_openrlhf_flash_reinforce_script(tiny_qwen2, tmp_path):
    """OpenRLHF 0.11.2's train_flash_reinforce_ray_agent_async.sh at test sizes: async
    training, over-sampling, one response per prompt, flash_reinforce (every advantage is the
    score minus the batch's mean score), the sequence-level binary-KL trust region (engine and
    trainer agree on the tiny model: no row dropped), seq-mean-token-mean, no KL, bf16."""
    data = tmp_path / "data"
    rows = [{"prompt": r["input"], "label": r["label"]} for r in prompt_rows(64)]
    write_jsonl(rows, data / "flash_prompts.jsonl")
    (data / "parity_reward.py").write_text(PARITY_REWARD)
    save = tmp_path / "run"
    env = {"MODEL": tiny_qwen2, "DATA": str(data), "SAVE": str(save)}
    env.update(PORT=str(free_port()), PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPTS / "flash_reinforce_async_v0.11.2_dotted.sh")],
        capture_output=True,
        text=True,
        env=_env(env),
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--is_correction seq_mask --is_correction_gating binary_kl" in proc.stdout
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # --data.max_samples 32 / batches of 8
    for r in rows:
        mean = r["critic/score/mean"]
        assert r["critic/advantages/max"] == pytest.approx(r["critic/score/max"] - mean)
        assert r["critic/advantages/min"] == pytest.approx(r["critic/score/min"] - mean)
        assert r["rollout_corr/is_seq_masked_frac"] == 0.0
        assert r["async/staleness_max"] <= 2  # --train.async_queue_size 2
    config = (save / "config.yaml").read_text()
    for line in (
        "advantage_estimator: flash_reinforce",
        "n_samples_per_prompt: 1",
        "is_correction: seq_mask",
        "is_correction_gating: binary_kl",
        "off_policy_correction: none",
        "loss_agg_mode: seq-mean-token-mean",
        "init_kl_coef: 0.0",
        "vllm_generate_batch_size: 16",
    ):
        assert line in config, line
    assert (save / "model.safetensors").is_file()


def test_a_rollout_rank_that_dies_ends_the_job_naming_it(tiny_qwen2, data, tmp_path):
    """The rollout rank is killed (SIGKILL, as the OOM killer would) in its reward function at
    the 3rd batch: the training rank's next receive fails at once and the job ends with one
    line naming the rollout rank, not a hang until the collective timeout."""
    reward = tmp_path / "dying_reward.py"
    reward.write_text(
        "import os, signal\ncalls = 0\n\n\ndef reward_func(queries, prompts, labels):\n"
        "    global calls\n    calls += 1\n    if calls == 3:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n    return [0.0] * len(queries)\n"
    )
    save = tmp_path / "dying"
    flags = grpo_flags(tiny_qwen2, data, save, 6)
    flags[flags.index("--remote_rm_url") + 1] = str(reward)
    proc = torchrun(["ppo", *flags, *ASYNC], timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert any("rollout rank 1 (engine 0) is gone" in line for line in lines), proc.stderr[-3000:]


def test_a_live_but_slow_rollout_rank_is_named_alive_not_gone(tiny_qwen2, data, tmp_path):
    """The rollout rank's reward function takes 120 s at the 2nd batch, longer than
    --dist_timeout_min 1: the training rank, which published step 1's weights without
    waiting for the rollout rank to take them, waits for batch 2 and gives up after a minute
    with one line saying who waited for what and that the rollout rank is alive (its
    heartbeat moves), not "gone" as a lost rank is.

    It shares the cores with the other pytest worker's tests (most of its minute is a wait):
    the give-up comes at the bound plus one poll (at most 5 s) whatever the load, and the
    sleep, which starts as the rollout rank scores batch 2 beside step 1's update, outlasts
    the bound by a minute, more than that update takes under load; the job ends at the
    give-up, so the sleep's length costs nothing."""
    reward = tmp_path / "slow_reward.py"
    reward.write_text(
        "import time\ncalls = 0\n\n\ndef reward_func(queries, prompts, labels):\n"
        "    global calls\n    calls += 1\n    if calls == 2:\n        time.sleep(120)\n"
        "    return [0.0] * len(queries)\n"
    )
    save = tmp_path / "slow"
    flags = grpo_flags(tiny_qwen2, data, save, 4)
    flags[flags.index("--remote_rm_url") + 1] = str(reward)
    proc = torchrun(["ppo", *flags, *ASYNC, "--dist_timeout_min", "1"], timeout=400)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error [rank 0]")]
    assert lines, proc.stderr[-3000:]
    line = lines[0]
    assert re.search(
        r"training rank 0 waited 6\d s for rollout rank 1 \(engine 0\), receiving batch 2, "
        r"and gave up \(--dist_timeout_min 1\); rollout rank 1 \(engine 0\) is alive \(its "
        r"heartbeat moved \d+ s ago\), so it is slow, not gone",
        line,
    ), line
    assert "is gone" not in line, line


def test_delta_sync_to_the_rollout_rank_trains_exactly_as_full_sync(tiny_qwen2, data, tmp_path):
    """20 bf16 GRPO steps, one step off policy: training rank 0 publishes only the changed
    elements (a full publication every 7th; the rollout rank's mirror checks every bucket's
    checksum) and the run samples and trains exactly as the one publishing every weight: the
    rollout rank's engine held the same weights at every step."""
    steps = 20
    runs = {}
    for mode in ("delta", "full"):
        run = torchrun(["ppo", *delta_flags(tiny_qwen2, data, tmp_path / mode, mode), *ASYNC])
        assert run.returncode == 0, (mode, run.stderr[-3000:])
        runs[mode] = read_metrics(tmp_path / mode)
    delta, full = runs["delta"], runs["full"]
    assert [r["step"] for r in delta] == [r["step"] for r in full] == list(range(1, steps + 1))
    same = (
        "critic/score/mean",
        "actor/pg_loss",
        "response_length/mean",
        "rollout/logprob_diff/max",
    )
    for d, f in zip(delta, full, strict=True):
        assert all(d[k] == f[k] for k in same), (d["step"], {k: (d[k], f[k]) for k in same})
    # publications after steps 1-19 (the start's is sync 0); the 7th and 14th syncs are full
    check_delta_run(delta, "async", list(range(1, steps)), [7, 14])


def test_sequence_parallel_training_ranks_train_as_one_rank(tiny_qwen2, data, tmp_path):
    """Two training ranks in one sequence-parallel group (3 ranks: SP 2 beside 1 rollout rank)
    against one training rank (2 ranks), the same rollout rank and seed, fp32: the rollout
    rank generates the same batches, both ranks of the group receive them, and the steps'
    losses and scores agree (packed rows split over the group; 4 steps, one off policy)."""
    runs = {}
    for sp, nproc in ((1, 2), (2, 3)):
        save = tmp_path / f"sp{sp}"
        flags = [*grpo_flags(tiny_qwen2, data, save, 4), *ASYNC]
        run = torchrun(["ppo", *flags, "--sequence_parallel_size", str(sp)], nproc=nproc)
        assert run.returncode == 0, (sp, run.stderr[-3000:])
        runs[sp] = read_metrics(save)
    one, two = runs[1], runs[2]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"], a["step"]
        assert a["response_length/mean"] == b["response_length/mean"], a["step"]
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_an_moe_actor_on_two_training_ranks_with_and_without_expert_parallelism(tmp_path):
    """An MoE actor (tiny Qwen3-MoE) on 2 training ranks beside 1 rollout rank, at EP 1 and
    EP 2: both run (a rollout rank's report reaches one training rank, whose statistics then
    held names the other lacked: the ranks' metric reductions mismatched and gloo aborted), and
    the expert-parallel run trains as the other does (same scores, losses within 1e-5)."""
    from fsdp_rlhf.testing.tiny import build_family

    model = str(build_family(tmp_path / "model", "qwen3_moe"))
    data = tmp_path / "data"
    write_jsonl(prompt_rows(256, chat=True), data / "prompts.jsonl")
    (data / "reward.py").write_text(SHORT_REWARD_WITH_PREEMPTION)
    runs = {}
    for ep in (1, 2):
        save = tmp_path / f"ep{ep}"
        flags = [*grpo_flags(model, data, save, 3), *ASYNC, "--expert_parallel_size", str(ep)]
        run = torchrun(["ppo", *flags], nproc=3)
        assert run.returncode == 0, (ep, run.stderr[-3000:])
        runs[ep] = read_metrics(save)
    assert [r["step"] for r in runs[1]] == [r["step"] for r in runs[2]] == [1, 2, 3]
    for a, b in zip(runs[1], runs[2], strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"], a["step"]
        assert "moe/expert_load_max_mean" in b and "moe/ep_group_tokens_max" in b, sorted(b)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
