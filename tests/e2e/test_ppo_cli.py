"""`fsdp-rlhf ppo` end to end under torchrun: 2 CPU ranks, tiny models, real vLLM rollouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl
from tests.e2e.helpers import python_c, read_metrics, run_cli, torchrun

pytestmark = pytest.mark.slow

# Rule rewards that can preempt their own process with SIGTERM on a given call (counted per
# rank), like a scheduler would; each appends its return line.
PREEMPTING_REWARD = """
import os, signal
KILL_AT = int(os.environ.get("TEST_SIGTERM_AT_CALL", "0"))
calls = 0

def reward_func(queries, prompts, labels):
    global calls
    calls += 1
    if calls == KILL_AT:
        os.kill(os.getpid(), signal.SIGTERM)
"""
# prefers short answers: learnable in a few steps by a random tiny model
SHORT_REWARD_WITH_PREEMPTION = (
    PREEMPTING_REWARD
    + "    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]\n"
)
# 0/1 and verifier-like (even word count): groups of 4 are often all-equal, so dynamic
# filtering has groups to drop, and "correct" (score > 0) is meaningful for pass@k
PARITY_REWARD = (
    PREEMPTING_REWARD
    + "    return [float(len(q[len(p):].split()) % 2 == 0) for q, p in zip(queries, prompts)]\n"
)


@pytest.fixture(scope="module")
def ppo_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_data")
    write_jsonl(prompt_rows(256, chat=True), root / "prompts.jsonl")
    write_jsonl(prompt_rows(6, seed=99, chat=True), root / "eval.jsonl")
    (root / "reward.py").write_text(SHORT_REWARD_WITH_PREEMPTION)
    (root / "parity_reward.py").write_text(PARITY_REWARD)
    return root


def grpo_flags(model: str, data: Path, save: Path, steps: int) -> list[str]:
    return [
        "--pretrain",
        model,
        "--remote_rm_url",
        str(data / "reward.py"),
        "--prompt_data",
        str(data / "prompts.jsonl"),
        "--input_key",
        "input",
        "--rollout_batch_size",
        "16",
        "--n_samples_per_prompt",
        "4",
        "--advantage_estimator",
        "grpo",
        # one optimizer step per rollout batch: old_logprobs come from the update itself
        "--train_batch_size",
        "64",
        "--micro_train_batch_size",
        "8",
        "--micro_rollout_batch_size",
        "16",
        "--packing_samples",
        "--generate_max_len",
        "16",
        "--prompt_max_len",
        "32",
        "--max_steps",
        str(steps),
        "--actor_learning_rate",
        "2e-3",
        "--lr_warmup_ratio",
        "0",
        "--use_kl_loss",
        "--init_kl_coef",
        "0.001",
        "--save_path",
        str(save),
        "--ckpt_path",
        str(save / "ckpt"),
        "--save_steps",
        "-1",
        "--seed",
        "7",
    ]


def test_rule_reward_rises_and_sigterm_resume_reproduces(tiny_qwen2, ppo_data, tmp_path):
    steps, kill_at = 14, 6

    def flags(save: Path) -> list[str]:
        # icepop masks tokens whose trainer/engine ratio leaves [0.5, 5]; after every weight
        # sync the fp32 engine must agree with the trainer, so it should mask nothing
        return [*grpo_flags(tiny_qwen2, ppo_data, save, steps), "--is_correction", "icepop"]

    full = torchrun(["ppo", *flags(tmp_path / "full")])
    assert full.returncode == 0, full.stderr[-3000:]
    rows = read_metrics(tmp_path / "full")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    scores = [r["critic/score/mean"] for r in rows]
    early, late = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    assert late > early + 0.05, scores
    # folded: no separate old-log-prob forward, yet the KL and engine-mismatch stats are there
    assert "timing/old_log_p" not in rows[-1]
    assert rows[-1]["actor/ppo_kl"] == 0.0 and rows[-1]["rollout/logprob_diff/mean"] < 0.05
    assert all(r["actor/kl"] > 0 for r in rows[1:])
    # no drift between the trainer and the engine at any step, though the weights move
    for r in rows:
        assert r["rollout/logprob_diff/max"] < 1e-3, r["step"]
        assert r["rollout_corr/mismatch_abs_diff_max"] < 1e-3, r["step"]
        assert abs(r["rollout/mismatch_kl"]) < 1e-6 and r["rollout_corr/is_masked_frac"] == 0

    # Preempted at step 6: each rank's reward function sends itself SIGTERM, so the signal
    # comes during the rollout and the step is abandoned before its update; the checkpoint is
    # step 5's state and the resumed run redoes step 6 from the same prompts and seeds.
    save = tmp_path / "preempted"
    env = {"TEST_SIGTERM_AT_CALL": str(kill_at)}
    cut = torchrun(["ppo", *flags(save)], env=env)
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert "abandoned the step before its update" in cut.stderr
    assert [r["step"] for r in read_metrics(save)] == list(range(1, kill_at))
    assert (save / "ckpt" / f"step_{kill_at - 1}" / "COMPLETE").is_file()
    assert not (save / "ckpt" / f"step_{kill_at}").exists()
    assert not (save / "model.safetensors").exists()  # preempted: no final model
    resumed = torchrun(["ppo", *flags(save), "--load_checkpoint"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = {r["step"]: r for r in read_metrics(save) if r["step"] >= kill_at}
    assert sorted(after) == list(range(kill_at, steps + 1))
    for step in after:
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss"):
            ref = rows[step - 1][key]
            assert after[step][key] == pytest.approx(ref, rel=1e-3, abs=1e-4), (step, key)
    assert (save / "model.safetensors").is_file()


# An OpenRLHF agent file (--agent_func_path), written their way: a second, shorter answer
# is asked for and graded; the feedback carries its own "Human:/Assistant:" markup.
SHORTER_PLEASE_AGENT = """
import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turns = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turns += 1
        done = self.turns >= 2
        reward = max(0.0, 1.0 - len(states["action_text"]) / 64) if done else 0.0
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": "" if done else "\\nHuman: Shorter, please.\\nAssistant: ",
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"turns": torch.tensor(self.turns)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_gae_on_tied_odd_gqa_llama_with_an_openrlhf_agent(tiny_llama, ppo_data, tmp_path):
    """Actor, reference and critic shaped like a published small Llama (9 query / 3 KV heads,
    tied embeddings: no lm_head.weight among the parameters): weight sync into vLLM, packed
    forwards, a critic built from a causal checkpoint, and the HF export. Rewards come from an
    OpenRLHF agent file over two turns (GAE over the holes the feedback leaves in the response
    mask), with ProRL's stop-properly penalty on truncated answers. The micro-batches are token
    budgets (``--use_dynamic_batch``): the update's own log-probs, collected from micro-batches
    cut to their own length, are still the engine's."""
    save = tmp_path / "llama"
    agent = tmp_path / "agent_func.py"
    agent.write_text(SHORTER_PLEASE_AGENT)
    flags = _set_flags(
        grpo_flags(tiny_llama, ppo_data, save, 3),
        advantage_estimator="gae",
        remote_rm_url=str(agent),
    )
    flags[flags.index("--remote_rm_url")] = "--agent_func_path"
    flags += ["--critic_pretrain", tiny_llama, "--critic_learning_rate", "1e-3"]
    # room for the feedback: every trajectory takes both turns
    flags += ["--max_turns", "2", "--max_total_len", "128", "--stop_properly_penalty_coef", "-0.5"]
    flags += ["--use_dynamic_batch", "--train_max_tokens_per_gpu", "300"]
    flags += ["--rollout_max_tokens_per_gpu", "400"]
    proc = torchrun(["ppo", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = " ".join(proc.stdout.split())
    assert "dynamic batching: micro-batches of at most 300 tokens per rank" in console
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # at lr 2e-3 a head left stale by the sync would move the engine far off the trainer
    assert all(r["rollout/logprob_diff/mean"] < 0.05 for r in rows), rows
    assert all("critic/vf_loss" in r for r in rows)
    assert any(r["response_length/clip_ratio"] > 0 for r in rows)  # the penalty had work
    for r in rows:
        assert r["multiturn/turns/min"] == 2 and r["multiturn/tool_error_ratio"] == 0, r
        assert r["agent/turns"] == 2.0 and r["multiturn/env_tokens/min"] > 0
        # truncated answers score exactly -0.5, the others the agent's reward in [0, 1]
        cut = r["response_length/clip_ratio"]
        assert r["critic/score/min"] == (-0.5 if cut > 0 else pytest.approx(0, abs=1)), r
        assert r["critic/score/max"] <= 1.0
        if cut == 1.0:
            assert r["critic/score/mean"] == -0.5
    _check_export(
        save,
        "assert m.config.tie_word_embeddings and m.config.num_key_value_heads == 3; "
        "assert m.lm_head.weight is m.model.embed_tokens.weight",
    )


def _check_export(save: Path, extra: str = "pass") -> None:
    """In a fresh interpreter (as a user would): the actor export loads with transformers as
    a causal LM and ``critic/`` as a scalar-head model; ``extra`` asserts about ``m``."""
    check = (
        "import sys; from transformers import AutoModelForCausalLM as C, "
        "AutoModelForSequenceClassification as S; m = C.from_pretrained(sys.argv[1]); "
        f"{extra}; S.from_pretrained(sys.argv[2])"
    )
    proc = python_c(check, [str(save), str(save / "critic")])
    assert proc.returncode == 0, proc.stderr[-3000:]


def _set_flags(flags: list[str], **values: str) -> list[str]:
    out = list(flags)
    for name, value in values.items():
        out[out.index(f"--{name}") + 1] = value
    return out


def test_shared_prompt_forwards_agree_with_the_engine(tiny_llama, ppo_data, tmp_path):
    """``--share_prompt_prefix`` (the default) on a 9/3 GQA Llama with tied embeddings: pairs
    of samples share one pass of their prompt in the old, reference and update forwards
    (micro-batches of 2, groups of 4), and the old log-probs still match the fp32 engine's
    at every step while the weights move (a KL penalty in the reward keeps the old-log-prob
    forward separate from the update)."""
    save = tmp_path / "shared"
    flags = _set_flags(
        grpo_flags(tiny_llama, ppo_data, save, steps=3),
        rollout_batch_size="8",
        train_batch_size="32",
        micro_train_batch_size="2",
        micro_rollout_batch_size="4",
        init_kl_coef="0.01",
    )
    flags = [f for f in flags if f not in ("--packing_samples", "--use_kl_loss")]
    proc = torchrun(["ppo", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = " ".join(proc.stdout.split())  # rank 0's rich log, wrapped at the terminal width
    assert "shared prompt prefix: each prompt runs once for 2 of its 4 samples" in console
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["timing/old_log_p"] > 0 and r["timing/reference_model"] > 0
        assert r["rollout/logprob_diff/max"] < 1e-3, r["step"]
    assert rows[-1]["actor/kl"] > 0  # the actor moved away from the reference


def test_dynamic_sampling_gspo_bypass_overlong_and_eval_in_one_run(tiny_qwen2, ppo_data, tmp_path):
    save = tmp_path / "dapo"
    flags = _set_flags(
        grpo_flags(tiny_qwen2, ppo_data, save, steps=2),
        remote_rm_url=str(ppo_data / "parity_reward.py"),
        rollout_batch_size="8",
        train_batch_size="32",
        micro_rollout_batch_size="8",
    )
    flags += [
        "--dynamic_filtering",
        "--max_num_gen_batches",
        "4",
        "--overlong_buffer_len",
        "4",
        "--policy_loss_type",
        "gspo",
        "--loss_agg_mode",
        "seq-mean-token-sum-norm",
        "--use_rollout_logprobs_as_old",
        "--eval_dataset",
        str(ppo_data / "eval.jsonl"),
        "--eval_steps",
        "1",
        "--eval_n_samples_per_prompt",
        "2",
        "--eval_temperature",
        "1.0",
        "--save_best_metric",
        "pass@2",
    ]
    proc = torchrun(["ppo", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # every round generated a full global batch of 8 prompts; some groups were kept
        assert 1 <= r["dynamic_filter/gen_rounds"] <= 4
        assert r["dynamic_filter/prompts_drawn"] == 8 * r["dynamic_filter/gen_rounds"]
        assert 0 < r["dynamic_filter/kept_frac"] <= 1
        for k in ("eval/pass@1", "eval/pass@2", "eval/greedy_pass@1"):
            assert 0 <= r[k] <= 1, (k, r[k])
        assert r["eval/pass@2"] >= r["eval/pass@1"]
        assert "actor/seq_clipfrac" in r and r["actor/pg_loss"] is not None
        # bypass: no trainer old-log-prob forward; the update still reports the mismatch
        assert "timing/old_log_p" not in r and "rollout/logprob_diff/mean" not in r
        assert r["rollout_corr/mismatch_abs_diff_max"] < 0.05
        assert r["critic/score/min"] >= -1.0  # 0/1 reward plus an overlong penalty >= -1
    best = json.loads((save / "best" / "best_metric.json").read_text())
    assert best["metric"] == "eval/pass@2" and best["step"] in (1, 2)
    assert best["value"] == max(r["eval/pass@2"] for r in rows)
    assert (save / "best" / "model.safetensors").is_file()


@pytest.mark.faults  # a stop mid-step: `make test-faults`
def test_stop_during_dynamic_sampling_resumes_the_same_batches(tiny_qwen2, ppo_data, tmp_path):
    """A stop signal inside a dynamic-sampling step (possibly several prompt batches drawn)
    abandons it; the resumed run draws the same batches again and matches the uninterrupted
    run step for step."""

    def flags(save: Path) -> list[str]:
        return _set_flags(
            grpo_flags(tiny_qwen2, ppo_data, save, steps=3),
            remote_rm_url=str(ppo_data / "parity_reward.py"),
            rollout_batch_size="8",
            train_batch_size="32",
            micro_rollout_batch_size="8",
        ) + ["--dynamic_filtering", "--max_num_gen_batches", "4"]

    full = torchrun(["ppo", *flags(tmp_path / "full")])
    assert full.returncode == 0, full.stderr[-3000:]
    rows = read_metrics(tmp_path / "full")
    rounds = [int(r["dynamic_filter/gen_rounds"]) for r in rows]
    # each rank calls the reward once per round: stop at the last round of the step with the
    # most rounds after the first (the most prompt batches to put back)
    step = max((2, 3), key=lambda s: rounds[s - 1])
    kill_at = sum(rounds[:step])
    save = tmp_path / "cut"
    cut = torchrun(["ppo", *flags(save)], env={"TEST_SIGTERM_AT_CALL": str(kill_at)})
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert "abandoned the step before its update" in cut.stderr
    assert [r["step"] for r in read_metrics(save)] == list(range(1, step))
    resumed = torchrun(["ppo", *flags(save), "--load_checkpoint"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = {r["step"]: r for r in read_metrics(save) if r["step"] >= step}
    assert sorted(after) == list(range(step, 4))
    keys = ("dynamic_filter/gen_rounds", "dynamic_filter/prompts_drawn", "critic/score/mean")
    for s in after:
        for key in (*keys, "actor/pg_loss", "response_length/mean"):
            ref = rows[s - 1][key]
            assert after[s][key] == pytest.approx(ref, rel=1e-3, abs=1e-4), (s, key, rounds)


def test_aiak_flag_set_with_trained_reward_model(tiny_qwen2, trained_rm, ppo_data, tmp_path):
    save = tmp_path / "ppo"
    # The AIAK section 2.3 flag set, verbatim apart from paths and sizes.
    flags = [
        "--num_nodes",
        "1",
        "--num_gpus_per_node",
        "2",
        "--vllm_num_engines",
        "2",
        "--vllm_tensor_parallel_size",
        "1",
        "--vllm_gpu_memory_utilization",
        "0.9",
        "--colocate_all",
        "--ref_reward_offload",
        "--pretrain",
        tiny_qwen2,
        "--reward_pretrain",
        trained_rm,
        "--save_path",
        str(save),
        "--micro_train_batch_size",
        "4",
        "--micro_rollout_batch_size",
        "8",
        "--rollout_batch_size",
        "16",
        "--max_samples",
        "1000000",
        "--max_epochs",
        "1",
        "--prompt_max_len",
        "32",
        "--generate_max_len",
        "16",
        "--zero_stage",
        "3",
        "--bf16",
        "--actor_learning_rate",
        "5e-7",
        "--critic_learning_rate",
        "9e-6",
        "--init_kl_coef",
        "0.01",
        "--prompt_data",
        str(ppo_data / "prompts.jsonl"),
        "--input_key",
        "context_messages",
        "--apply_chat_template",
        "--normalize_reward",
        "--adam_offload",
        "--flash_attn",
        "--tensorboard",
        str(save / "tb"),
        "--gradient_checkpointing",
        # sizes for 2 CPU ranks
        "--train_batch_size",
        "16",
        "--max_steps",
        "2",
        "--sample_log_steps",
        "1",
        # OpenRLHF's flags, v0.10 spelling: W&B (no key here: offline), an EMA of the actor,
        # a HF export in every checkpoint, rotation by size (below one checkpoint: only the
        # newest stays)
        "--use_wandb",
        "True",
        "--wandb_run_name",
        "seed_flags",
        "--enable_ema",
        "--ema_beta",
        "0.5",
        "--save_steps",
        "1",
        "--ckpt_path",
        str(save / "ckpt"),
        "--save_hf_ckpt",
        "--max_ckpt_mem",
        "0.000001",
    ]
    env = {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "no_netrc"), "COLUMNS": "1000"}
    proc = torchrun(["ppo", *flags], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "has no reward_mean" not in proc.stderr + proc.stdout  # the trained RM has them
    # vLLM sizes its memory when it starts: it must start before the four models load
    log = proc.stderr + proc.stdout
    assert log.index("rollout engine started and asleep") < log.index("zero_stage=")
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    expected = [
        "timing/all",
        "timing/rollout",
        "timing/old_log_p",
        "timing/reference_model",
        "timing/reward_model",
        "timing/critic_model",
        "timing/adv",
        "timing/update",
        "timing/update_critic",
        "timing/resharding_to_train",
        "timing/resharding_to_infer",
        "timing/ref_onload",
        "timing/ref_offload",
        "actor/entropy",
        "actor/kl_loss",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/lr",
        "actor/kl_coef",
        "grad_norm",
        "actor/grad_norm",
        "critic/grad_norm",
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/lr",
        "critic/vf_explained_var",
        "response_length/clip_ratio",
        "e2e_tps",
        "update_tps",
        "vllm_tps",
        "rollout_tps",
        "rollout/logprob_diff/mean",
    ]
    for group in ("score", "rewards", "advantages", "returns", "values"):
        expected += [f"critic/{group}/{s}" for s in ("mean", "max", "min")]
    expected += [
        f"{g}/{s}" for g in ("response_length", "prompt_length") for s in ("mean", "min", "max")
    ]
    missing = [k for k in expected if k not in rows[-1]]
    assert not missing, missing
    assert rows[-1]["rollout/logprob_diff/mean"] < 0.05  # bf16 engine vs bf16 trainer
    assert list((save / "tb").glob("events.out.tfevents*"))
    samples = [json.loads(line) for line in (save / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "response", "score"} <= set(samples[0])
    _check_export(save)
    _check_wandb_run(save, log, rows)
    _check_ema_and_hf_checkpoints(save, log, tiny_qwen2)


def _check_wandb_run(save: Path, log: str, rows: list[dict]) -> None:
    """An offline W&B run (no key) under save_path, said so in one line, holding every step's
    metrics under the metrics.jsonl names, the samples table and the run config."""
    from fsdp_rlhf.testing.wandb_file import history, run_config

    (run_file,) = save.glob("wandb/offline-run-*/run-*.wandb")
    offline = run_file.parent
    assert f"wandb sync {offline}" in log and "no API key" in log
    logged = {r["_step"]: r for r in history(run_file) if "critic/score/mean" in r}
    assert sorted(logged) == [1, 2]
    for row in rows:
        for key in ("critic/score/mean", "actor/pg_loss", "timing/all"):
            assert logged[row["step"]][key] == pytest.approx(row[key]), key
    assert list(offline.glob("files/media/table/samples_*.table.json"))
    config = run_config(run_file)
    assert config["logging"]["wandb_run_name"] == "seed_flags" and config["algo"]["enable_ema"]


def _check_ema_and_hf_checkpoints(save: Path, log: str, base: str) -> None:
    """--max_ckpt_mem below one checkpoint keeps only the newest, which holds the HF export of
    the actor's EMA (and the critic); the final export is that same EMA."""
    from safetensors.torch import load_file

    assert "EMA of the actor (beta 0.5" in log
    assert "removed checkpoint" in log and "--max_ckpt_mem" in log
    assert sorted(p.name for p in (save / "ckpt").iterdir()) == ["step_2"]
    hf = save / "ckpt" / "step_2" / "hf"
    assert (hf / "config.json").is_file() and (hf / "critic" / "config.json").is_file()
    final, in_ckpt = load_file(save / "model.safetensors"), load_file(hf / "model.safetensors")
    initial = load_file(Path(base) / "model.safetensors")
    assert final.keys() == in_ckpt.keys()
    assert all(torch.equal(final[k], in_ckpt[k]) for k in final)
    assert any(not torch.equal(final[k], initial[k].to(final[k].dtype)) for k in initial)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"--input_key": "question"}, "--input_key"),
        ({"--remote_rm_url": None}, "no reward source"),
        ({"--rollout_batch_size": "15"}, "rollout_batch_size"),
        ({"--pretrain": "/nonexistent/model"}, "--pretrain /nonexistent/model"),
        ({"--num_nodes": "3"}, "--num_nodes"),
        ({"--eval_dataset": "/nonexistent/eval.jsonl"}, "--eval_dataset"),
    ],
)
def test_bad_input_one_line_before_heavy_work(tiny_qwen2, ppo_data, tmp_path, change, message):
    flags = grpo_flags(tiny_qwen2, ppo_data, tmp_path / "bad", 2)
    for flag, value in change.items():
        if flag not in flags:
            flags += [flag, value]
            continue
        i = flags.index(flag)
        flags[i + 1 : i + 2] = [] if value is None else [value]
        if value is None:
            del flags[i]
    proc = run_cli(["ppo", *flags], env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    # rank 0 of 2 without torchrun's store: it speaks for itself, naming its rank
    assert len(lines) == 1 and lines[0].startswith("error [rank 0]: "), lines
    assert message in lines[0], lines
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "bad").exists()


def test_a_truncated_checkpoint_is_one_line_naming_the_file(tiny_qwen2, ppo_data, tmp_path):
    """model.safetensors cut in half under --pretrain: one line naming the file, before the
    engine (or anything else) loads it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    flags = grpo_flags(str(model), ppo_data, tmp_path / "out", 2)
    proc = run_cli(["ppo", *flags], env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert f"--pretrain {model}: model.safetensors is cut short" in lines[0], lines
    assert not (tmp_path / "out").exists()


def _with(flags: list[str], **values: str) -> list[str]:
    """``flags`` with ``--name value`` set (replaced where present)."""
    flags = list(flags)
    for name, value in values.items():
        flag = f"--{name}"
        if flag in flags:
            flags[flags.index(flag) + 1] = value
        else:
            flags += [flag, value]
    return flags


def delta_flags(model: str, data: Path, save: Path, mode: str, steps: int = 20) -> list[str]:
    """bf16 GRPO at an RL learning rate (a few percent of the engine's bf16 weights change per
    step), synced by ``mode`` with a full sync every 7th."""
    base = grpo_flags(model, data, save, steps)
    small = dict(rollout_batch_size="4", train_batch_size="16", generate_max_len="8")
    base = _with(base, actor_learning_rate="1e-6", micro_rollout_batch_size="8", **small)
    return [*base, "--bf16", "--weight_sync", mode, "--weight_sync_full_every", "7"]


def check_delta_run(rows: list[dict], prefix: str, synced: list[int], full: list[int]) -> None:
    """A delta-synced run's sync metrics: the steps ``synced`` synced, ``full`` of them in
    full; the others compared a few percent of changed elements and carried a fraction of a
    full sync's bytes."""
    frac_key, wire_key = f"{prefix}/weight_sync_changed_frac", f"{prefix}/weight_sync_wire_bytes"
    by_step = {r["step"]: r for r in rows}
    assert sorted(s for s, r in by_step.items() if wire_key in r) == synced
    assert sorted(s for s in synced if frac_key not in by_step[s]) == full
    fracs = [by_step[s][frac_key] for s in synced if s not in full]
    assert all(0 < frac < 0.2 for frac in fracs), fracs
    most = max(by_step[s][wire_key] for s in synced)  # a full sync's
    assert all(by_step[s][wire_key] < most / 3 for s in synced if s not in full)


def test_delta_weight_sync_over_20_steps(tiny_qwen2, ppo_data, tmp_path):
    """20 bf16 GRPO steps synced by delta: every sync's buckets pass their checksums (a
    mismatch ends the run), the engine's log-probs agree with the trainer's at every step as
    bf16 allows, and the delta syncs carry a fraction of the bytes. (That the engine holds
    exactly the fully synced weights: tests/distributed/test_delta_sync.py, and the async
    run against a fully synced one in test_ppo_async.py.)"""
    steps = 20
    run = torchrun(["ppo", *delta_flags(tiny_qwen2, ppo_data, tmp_path / "delta", "delta")])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = read_metrics(tmp_path / "delta")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # colocated: step s syncs before its rollout (sync s - 1), the 1st, 8th and 15th in full
    check_delta_run(rows, "rollout", list(range(1, steps + 1)), [1, 8, 15])
    for r in rows:
        assert r["rollout/logprob_diff/max"] < 0.05, r["step"]
        assert r["rollout/weight_sync_bytes"] == rows[0]["rollout/weight_sync_bytes"]
