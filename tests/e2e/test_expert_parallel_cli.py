"""`--expert_parallel_size 2` through the real command line on 2 CPU ranks with vLLM rollouts
(``make test-ep``).

GRPO on a tiny Qwen3-MoE whose routers are near-tied (the engine and the trainer route some
tokens differently), with --router_replay and --aux_loss_coef: the engine's routing drives the
expert-parallel dispatch, engine and trainer agree after every weight sync, the run learns,
and a run preempted by SIGTERM resumes from its EP=2 checkpoint at EP=1 with the uninterrupted
run's later metrics. Bad sizes are refused in one line before anything loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl
from tests.e2e.helpers import read_metrics, run_cli, torchrun
from tests.e2e.test_ppo_cli import PREEMPTING_REWARD

pytestmark = [pytest.mark.slow, pytest.mark.ep]

# prefers short answers (in characters); each rank's reward function can preempt its process
SHORT_REWARD = (
    PREEMPTING_REWARD
    + "    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]\n"
)
STEPS, KILL_AT = 8, 5


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    from fsdp_rlhf.testing.tiny import build_family

    root = tmp_path_factory.mktemp("ep_grpo")
    model = str(build_family(root / "model", "qwen3_moe", router_spread=1e-6))
    write_jsonl(prompt_rows(128, chat=True), root / "prompts.jsonl")
    (root / "reward.py").write_text(SHORT_REWARD)
    return model, root


def _grpo(model: str, data: Path, save: Path, ep: int) -> list[str]:
    return [
        "ppo", "--pretrain", model, "--remote_rm_url", str(data / "reward.py"),
        "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "input",
        "--apply_chat_template", "--rollout_batch_size", "8", "--n_samples_per_prompt", "4",
        "--advantage_estimator", "grpo", "--train_batch_size", "32",
        "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16",
        "--generate_max_len", "24", "--prompt_max_len", "64", "--max_steps", str(STEPS),
        "--actor_learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--use_kl_loss",
        "--kl_estimator", "k3", "--init_kl_coef", "0.001", "--save_path", str(save),
        "--ckpt_path", str(save / "ckpt"), "--save_steps", "-1", "--seed", "7",
        "--router_replay", "--aux_loss_coef", "0.01", "--enforce_eager",
        "--expert_parallel_size", str(ep),
        # an MoE distillation teacher (the model itself) split like the actor, scoring every
        # batch; weight 0: the learning and the resume below are GRPO's
        "--teacher_pretrain", model, "--distill_coef", "0",
    ]  # fmt: skip


def test_moe_grpo_ep2_replays_the_engines_routing_learns_and_resumes_at_ep1(moe_run, tmp_path):
    model, data = moe_run
    full = torchrun(_grpo(model, data, tmp_path / "full", 2))
    assert full.returncode == 0, full.stderr[-3000:]
    # the start-up log's parallel layout (wrapped by the log: compare without line breaks)
    logged = " ".join((full.stdout + full.stderr).split())
    assert "parallel layout: world 2, data-parallel 2, expert-parallel 2" in logged
    rows = read_metrics(tmp_path / "full")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # every step's rollout follows a weight sync of the split experts
        assert r["rollout/logprob_diff/max"] < 1e-4, r
        assert r["moe/aux_loss"] > 0 and r["moe/ep_group_load_max_mean"] >= 1.0, r
        assert r["timing/teacher"] > 0 and r["distill/teacher_logprob"] < 0, r
    assert rows[0]["moe/router_replay_agreement"] < 0.9, rows[0]  # the ties are real
    scores = [r["critic/score/mean"] for r in rows]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.05, scores

    # SIGTERM during step KILL_AT's rollout: step KILL_AT - 1's checkpoint, written at EP=2,
    # then resumed at EP=1 (DCP reshards the experts and their Adam moments)
    save = tmp_path / "preempted"
    cut = torchrun(_grpo(model, data, save, 2), env={"TEST_SIGTERM_AT_CALL": str(KILL_AT)})
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert (save / "ckpt" / f"step_{KILL_AT - 1}" / "COMPLETE").is_file()
    resumed = torchrun([*_grpo(model, data, save, 1), "--load_checkpoint"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = {r["step"]: r for r in read_metrics(save) if r["step"] >= KILL_AT}
    assert sorted(after) == list(range(KILL_AT, STEPS + 1))
    keys = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "moe/aux_loss")
    for step, r in after.items():
        for key in keys:
            ref = rows[step - 1][key]
            assert r[key] == pytest.approx(ref, rel=1e-3, abs=1e-4), (step, key, r[key], ref)
        assert r["rollout/logprob_diff/max"] < 1e-4, r
    print([{k: r[k] for k in ("critic/score/mean", "rollout/logprob_diff/max")} for r in rows])


@pytest.mark.parametrize(
    ("extra", "nproc", "words"),
    [
        (
            ["--expert_parallel_size", "3"],
            2,
            "--expert_parallel_size 3 must divide the world size 2",
        ),
        # 2 ranks under --async_train: 1 training rank beside 1 rollout rank
        (
            ["--ep_size", "2", "--async_train", "--vllm_num_engines", "1"],
            2,
            "--expert_parallel_size 2 must divide the training ranks 1",
        ),
    ],
)
def test_sizes_that_cannot_split_are_refused_in_one_line(moe_run, tmp_path, extra, nproc, words):
    """Before the process group and any model: WORLD_SIZE alone, no torchrun."""
    model, data = moe_run
    args = _grpo(model, data, tmp_path / "run", 1)
    args = args[: args.index("--router_replay")]
    env = {"WORLD_SIZE": str(nproc), "RANK": "0", "LOCAL_RANK": "0"}
    proc = run_cli([*args, *extra], env={**env, "LOCAL_WORLD_SIZE": str(nproc)})
    assert proc.returncode != 0
    assert words in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_doctor_shards_the_experts_and_says_what_each_rank_gathers(moe_run):
    model, data = moe_run
    flags = ["--pretrain", model, "--remote_rm_url", str(data / "reward.py")]
    flags += ["--prompt_max_len", "32", "--generate_max_len", "16", "--expert_parallel_size", "2"]
    # critic-free, as a run with these flags must be (doctor checks the rules table too)
    flags += ["--advantage_estimator", "reinforce++"]
    proc = torchrun(["doctor", *flags])
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-3000:]
    for check in ("--expert_parallel_size", "--pretrain loads", "expert parallelism"):
        for rank in (0, 1):
            assert f"[rank {rank}] PASS {check}" in out, (check, out[-3000:])
    assert "1 groups of 2 ranks split each MoE layer's experts" in out
    # 16 experts of 3 x 128 x 64 per layer: a rank gathers its 8
    assert "active per token" in out and "gathers 0.20M of its 0.39M expert params" in out
    # the same bytes per rank at fp32 (no --bf16): 16 x 3 x 128 x 64 x 4 B = 1.5 MiB, / E
    per_layer = 16 * 3 * 128 * 64 * 4 / 2**20
    sizes = f"E=1: {per_layer:.1f} MiB, E=2: {per_layer / 2:.1f} MiB"
    assert sizes in out and "fits from E=1" in out, out[-3000:]
    assert "VERDICT: READY" in out and "Traceback" not in proc.stderr


def test_shared_expert_family_at_ep2_with_lora_packing_and_token_budgets(tmp_path):
    """The family matrix's Qwen2-MoE case (a shared expert behind a gate; packed rows,
    token-budget micro-batches, LoRA synced merged) at --expert_parallel_size 2: the engine's
    log-probs equal the trainer's after every weight sync."""
    from fsdp_rlhf.testing.tiny import build_family
    from tests.models.test_families import LAYOUT, assert_engine_matches_trainer, grpo, ran

    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(prompt_rows(64, chat=True), data / "prompts.jsonl")
    (data / "reward.py").write_text(SHORT_REWARD)
    model = build_family(tmp_path / "model", "qwen2_moe")
    flags = ["--router_replay", *LAYOUT["qwen2_moe"], "--expert_parallel_size", "2"]
    rows = ran(grpo(model, data, tmp_path / "run", 3, *flags), tmp_path / "run")
    assert_engine_matches_trainer(rows, 3)
    assert all(r["moe/router_replay_agreement"] > 0.99 for r in rows)
    assert all(r["moe/ep_group_load_max_mean"] >= 1.0 for r in rows)


def test_vlm_moe_grpo_on_images_at_ep2_equals_ep1(tmp_path):
    """GRPO on the colour images with a tiny Qwen3-VL-MoE (fp32), --router_replay and
    --aux_loss_coef, at --expert_parallel_size 2 and 1: step 1 (the same rollout) gives the
    same scores, losses and gradient norm, and the engine's log-probs equal the trainer's after
    every weight sync of the split experts (the vision tower synced beside them)."""
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model, colour_rows, write_rows
    from tests.vlm.conftest import COLOUR_REWARD
    from tests.vlm.conftest import COLOUR_WORDS as WORDS
    from tests.vlm.test_vlm_grpo import grpo_flags

    model = str(build_vl_model(tmp_path / "model", "qwen3_vl_moe", words=WORDS, seed=3))
    data = tmp_path / "data"
    write_rows(colour_rows(32, data / "images", seed=0), data / "prompts.jsonl")
    (data / "reward.py").write_text(COLOUR_REWARD)
    rows = {}
    for ep in (2, 1):
        save = tmp_path / f"ep{ep}"
        args = grpo_flags(model, data, "prompts.jsonl", save)
        args[args.index("--max_steps") + 1] = "2"
        extra = ["--router_replay", "--aux_loss_coef", "0.01", "--enforce_eager"]
        proc = torchrun(["ppo", *args, *extra, "--expert_parallel_size", str(ep)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[ep] = read_metrics(save)
        assert [r["step"] for r in rows[ep]] == [1, 2]
        for r in rows[ep]:
            assert r["rollout/logprob_diff/max"] < 1e-4, r
            assert r["moe/router_replay_agreement"] > 0.99, r
    a, b = rows[2][0], rows[1][0]
    assert "moe/ep_group_load_max_mean" in a and "moe/ep_group_load_max_mean" not in b
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "moe/aux_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])
    keys = ("actor/pg_loss", "actor/grad_norm", "rollout/logprob_diff/max")
    print({ep: [{k: r[k] for k in keys} for r in rs] for ep, rs in rows.items()})
