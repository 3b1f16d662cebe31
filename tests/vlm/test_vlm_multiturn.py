"""A vision-language actor in multi-turn rollouts (``--env_file``): the prompt's images go to
the engine with every turn's history, the environment answers in text, and the trainer's
forward over the whole trajectory (images, model turns, observations, each with its M-RoPE
positions) gives the engine's log-probs back.

The environment asks once more after the first answer ("what colour is it", words of the tiny
model's vocabulary) and rewards the second answer's colour: every trajectory has two model
turns, the second one after an observation the model never wrote.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import read_metrics, torchrun
from tests.vlm.test_vlm_grpo import grpo_flags

pytestmark = [pytest.mark.vlm, pytest.mark.slow]

ASK_AGAIN_ENV = '''
def reset(prompt, label):
    return None


def step(history, action):
    """The first answer gets a question back; the second is graded by its first word."""
    turns = sum(1 for m in history if m["role"] == "assistant")
    words = action.split()
    right = float(bool(words) and words[0] == history[0]["label"])
    if turns == 1:
        return "what colour is it", 0.0, False
    return None, right, True
'''
# engine (fp32) vs trainer log-probs of the sampled tokens after each sync: single-turn VLM
# GRPO measured <= 1e-6; text positions in place of M-RoPE's would be ~1e-2 off
LOGPROB_DIFF_MAX = 1e-4


def _flags(model: str, data, save, extra=()) -> list[str]:
    flags = grpo_flags(model, data, "prompts.jsonl", save, extra)
    flags = flags[:2] + flags[4:]  # the environment's rewards are the scores
    flags[flags.index("--max_steps") + 1] = "2"
    flags[flags.index("--rollout_batch_size") + 1] = "8"
    flags[flags.index("--train_batch_size") + 1] = "64"
    return [*flags, "--env_file", str(data / "env.py"), "--max_turns", "2"]


# async: the rollout rank's step-by-step engine turn by turn (make test-long; make test's pairs
# job runs a VLM with multi-turn under async, in bf16)
@pytest.mark.parametrize("placement", ["colocated", pytest.param("async", marks=pytest.mark.long)])
def test_every_turn_sees_the_images_and_the_trainer_agrees(colour_vl, colour_data, tmp_path,
                                                            placement):  # fmt: skip
    (colour_data / "env.py").write_text(ASK_AGAIN_ENV)
    save = tmp_path / "run"
    extra = ["--max_total_len", "128"]
    if placement == "async":  # the rollout rank's step-by-step engine, turn by turn
        extra += ["--async_train", "--vllm_num_engines", "1"]
    flags = _flags(colour_vl, colour_data, save, extra)
    assert "--remote_rm_url" not in flags
    proc = torchrun(["ppo", *flags], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multiturn/turns/min"] == r["multiturn/turns/max"] == 2, r
        assert r["multiturn/env_tokens/min"] > 0, r  # the observation went into every row
        assert r["multiturn/tool_error_ratio"] == 0, r
    # under async only step 1's batch was sampled by the weights the trainer holds
    for r in rows[:1] if placement == "async" else rows:
        assert r["rollout/logprob_diff/max"] < LOGPROB_DIFF_MAX, r
    print(placement, [(r["rollout/logprob_diff/max"], r["critic/score/mean"]) for r in rows])
