"""`fsdp-rlhf ppo --env_file` end to end: 2 CPU ranks, tiny Qwen2, real vLLM, the calculator
environment of configs/ over several turns."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, read_metrics, run_cli, torchrun

pytestmark = pytest.mark.slow

# A random tiny model never writes <calc>: its first turn goes to the calculator as a call (an
# error result, mostly), the second is graded as the answer. Short turns earn a shaping reward
# a tiny model can move in a few steps.
WRAPPED_CALCULATOR = f"""
import importlib.util

spec = importlib.util.spec_from_file_location("calc", {str(REPO / "configs/calculator_env.py")!r})
calc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calc)

def reset(prompt, label):
    return calc.reset(prompt, label)

def step(history, action):
    turn = sum(m["role"] == "assistant" for m in history)
    obs, reward, done = calc.step(history, "<calc>" + action + "</calc>" if turn == 1 else action)
    return obs, reward + max(0.0, 1.0 - len(action) / 64), done
"""


def flags(model: str, env_file: Path, save: Path, steps: int) -> list[str]:
    return [
        *("--pretrain", model, "--env_file", str(env_file), "--max_turns", "3"),
        *("--max_total_len", "256"),
        *("--prompt_data", str(REPO / "configs/calculator_prompts.jsonl")),
        *("--input_key", "input", "--label_key", "label", "--apply_chat_template"),
        *("--rollout_batch_size", "16", "--n_samples_per_prompt", "4"),
        *("--advantage_estimator", "grpo", "--train_batch_size", "64"),
        *("--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16"),
        *("--packing_samples", "--generate_max_len", "16", "--prompt_max_len", "96"),
        *("--max_steps", str(steps), "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0"),
        *("--use_kl_loss", "--init_kl_coef", "0.001", "--save_path", str(save)),
        *("--ckpt_path", str(save / "ckpt"), "--save_steps", "-1", "--seed", "7"),
    ]


def test_calculator_env_turns_masks_and_engine_agreement(tiny_qwen2, tmp_path):
    env_file = tmp_path / "calc_env.py"
    env_file.write_text(WRAPPED_CALCULATOR)
    steps = 3
    proc = torchrun(["ppo", *flags(tiny_qwen2, env_file, tmp_path / "run", steps)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # every trajectory: a tool turn, its observation, an answer turn
        assert r["multiturn/turns/min"] == r["multiturn/turns/max"] == 2, r
        assert r["multiturn/env_tokens/min"] > 0 and r["multiturn/tool_error_ratio"] == 0
        assert r["timing/env"] > 0
        # the trainer, attending to the observation tokens, reproduces the engine's
        # log-probs of the model's tokens (env tokens are masked out of the comparison)
        assert r["rollout/logprob_diff/max"] < 1e-3, r
        assert 0 < r["critic/score/mean"] < 3
    # the short-turn shaping moves (not arithmetic: a random tiny model cannot learn it here)
    scores = [r["critic/score/mean"] for r in rows]
    assert scores[-1] > scores[0] + 0.03, scores


def test_env_file_without_contract_is_one_line(tiny_qwen2, tmp_path):
    bad = tmp_path / "bad_env.py"
    bad.write_text("def reset(prompt, label):\n    return None\n")
    args = flags(tiny_qwen2, bad, tmp_path / "bad", 1)
    proc = run_cli(["ppo", *args], env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--env_file" in lines[0] and "bad_env.py" in lines[0], lines
    assert not (tmp_path / "bad").exists()


OWN_EXECUTOR_AGENT = """
from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        return await llm_engine.generate(prompt, sampling_params)
"""


def test_agent_driving_the_engine_itself_is_refused_in_one_line(tiny_qwen2, tmp_path):
    agent = tmp_path / "server_agent.py"
    agent.write_text(OWN_EXECUTOR_AGENT)
    args = flags(tiny_qwen2, agent, tmp_path / "bad", 1)
    args[args.index("--env_file")] = "--agent_func_path"
    proc = run_cli(["ppo", *args], env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--agent_func_path" in lines[0], lines
    assert "server_agent.py" in lines[0] and "overrides execute()" in lines[0], lines
    assert not (tmp_path / "bad").exists()
