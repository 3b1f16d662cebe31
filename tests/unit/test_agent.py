"""OpenRLHF agent files (``--agent_func_path``) through the multi-turn rollout: the file runs
unchanged (its ``openrlhf.utils.agent`` import included), what the agent sees and returns maps
onto turns, scores and logs, and what cannot be mapped is refused by name."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch

from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.rollout.agent import load_agent, load_agent_class
from fsdp_rlhf.rollout.engine import SamplingConfig
from fsdp_rlhf.rollout.multiturn import MultiTurnRollout, TurnBudget
from fsdp_rlhf.testing.tiny import build_tokenizer
from fsdp_rlhf.trainers.ppo.metrics import StatCollector
from fsdp_rlhf.trainers.ppo.multiturn import add_agent_logs
from tests.unit.test_multiturn import FakeEngine, ppo_config

# Written the way OpenRLHF's agent examples are: async reset/step on an AgentInstance, tensors
# for rewards, feedback that carries its own chat markup, an executor bound to the instance.
# Each instance asserts what the previous turns must have shown it.
COUNTING_AGENT = """
import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

FEEDBACK = "<|im_end|>\\n<|im_start|>user\\ntry again<|im_end|>\\n<|im_start|>assistant\\n"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.seen = ""

    async def reset(self, states: dict, **kwargs):
        self.seen = states["observation"]
        assert states["label"] == "L"
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        assert states["observation_text"] == self.seen, (states["observation_text"], self.seen)
        assert states["label"] == "L" and states["sampling_params"].max_tokens == 8
        self.turn += 1
        done = self.turn >= 2
        self.seen += states["action_text"] + FEEDBACK
        return {
            "rewards": torch.tensor(float(self.turn)),
            "scores": torch.tensor(0.0),
            "environment_feedback": FEEDBACK,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"turn": torch.tensor(self.turn), "note": "text is not a metric"},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def write_agent(tmp_path, body: str, name: str = "agent_func.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(tok, path, *, prompts=2, n=2, max_turns=4, total=4096, gen=8, timeout=5.0):
    env = load_agent(path, timeout)
    runner = MultiTurnRollout(
        env, tok, TurnBudget(max_turns, total, gen), PhaseTimer(torch.device("cpu"))
    )
    engine = FakeEngine(tok)
    ps = [Prompt(ids=[5 + i, 6, 7], text=f"p{i}", label="L") for i in range(prompts)]
    out, trajs = runner.run(engine.generate, ps, SamplingConfig(max_new_tokens=gen, n=n, seed=3))
    return out, trajs, engine, env


def test_openrlhf_agent_file_runs_unchanged(tok, tmp_path):
    out, trajs, engine, env = run(tok, write_agent(tmp_path, COUNTING_AGENT))
    assert "openrlhf" not in sys.modules  # the stand-ins lived only for the import
    assert [len(c) for c in engine.calls] == [4, 4]
    feedback = "<|im_end|>\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n"
    fb_ids = tok(feedback, add_special_tokens=False)["input_ids"]
    for t in trajs:
        assert not t.error and t.turns == 2
        assert t.score == 1.0 + 2.0  # the step rewards summed; "scores" is not used
        # the feedback is appended verbatim (no chat-template wrapping), masked out
        assert t.response[3 : 3 + len(fb_ids)] == fb_ids
        assert t.mask == [1] * 3 + [0] * len(fb_ids) + [1] * 3
    assert env.trajectory_logs() == [{"turn": 2.0}] * 4  # the last step's numbers


def test_agent_logs_become_global_means():
    stats = StatCollector()
    add_agent_logs(stats, [{"turn": 2.0, "hit": 1.0}, {"turn": 4.0}, {}])
    out = stats.reduce()
    assert out["agent/turn"] == 3.0 and out["agent/hit"] == 1.0


def test_reset_observation_replaces_the_prompt(tok, tmp_path):
    agent = COUNTING_AGENT.replace(
        'return {"observation": states["observation"]}',
        'self.seen = "SYSTEM " + states["observation"]\n        return {"observation": self.seen}',
    )
    out, trajs, engine, _ = run(tok, write_agent(tmp_path, agent))
    ids = tok("SYSTEM p0", add_special_tokens=False)["input_ids"]
    assert trajs[0].prompt_ids == ids and engine.calls[0][0] == ids
    assert trajs[0].history[0]["content"] == "SYSTEM p0"
    assert not any(t.error for t in trajs)


@pytest.mark.parametrize(
    "change,error",
    [
        ('"environment_feedback": FEEDBACK,', '"environment_feedback": 3,'),
        ('"done": done,', '"environment_images": ["x.png"], "done": done,'),
        ('"rewards": torch.tensor(float(self.turn)),', ""),
    ],
)
def test_malformed_step_results_are_tool_errors(tok, tmp_path, change, error, caplog):
    agent = write_agent(tmp_path, COUNTING_AGENT.replace(change, error))
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"):
        _, trajs, _, _ = run(tok, agent)
    assert all(t.error and t.score == 0.0 for t in trajs)
    assert any("--agent_func_path" in r.getMessage() for r in caplog.records)


def test_slow_step_times_out_and_other_sampling_params_warn_once(tok, tmp_path, caplog):
    agent = COUNTING_AGENT.replace(
        "        self.turn += 1\n",
        "        self.turn += 1\n"
        "        if states['observation_text'] == 'p0':\n"
        "            import asyncio\n"
        "            await asyncio.sleep(10)\n",
    ).replace('states.get("sampling_params", None)', "object()")
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"):
        _, trajs, _, _ = run(tok, write_agent(tmp_path, agent), timeout=0.5)
    assert [t.error for t in trajs] == [True, True, False, False]
    warned = [r for r in caplog.records if "sampling_params" in r.getMessage()]
    assert len(warned) == 1


@pytest.mark.parametrize(
    "body,message",
    [
        (
            COUNTING_AGENT.replace(
                "    def __init__(self):\n        super().__init__(AgentInstance)",
                "    async def execute(self, prompt, label, *args, **kw):\n        return {}",
            ),
            r"AgentExecutor overrides execute\(\)",
        ),
        (
            "from openrlhf.utils.agent import AgentExecutorBase\n"
            "class AgentExecutor(AgentExecutorBase):\n    pass\n",
            "must derive from MultiTurnAgentExecutor",
        ),
        (COUNTING_AGENT.replace("class AgentExecutor(", "class Executor("), "no AgentExecutor"),
        (
            "from openrlhf.utils.logging_utils import init_logger\n",
            "only openrlhf.utils.agent",
        ),
        (
            "from openrlhf.utils.agent import SingleTurnAgentExecutor\n"
            "class AgentExecutor(SingleTurnAgentExecutor):\n    pass\n",
            "use --remote_rm_url",
        ),
        (
            COUNTING_AGENT.replace("super().__init__(AgentInstance)", "super().__init__(dict)"),
            "must derive from AgentInstanceBase",
        ),
    ],
)
def test_unmappable_agent_files_are_refused_by_name(tmp_path, body, message):
    path = write_agent(tmp_path, body, name="my_agent.py")
    with pytest.raises(UserError, match=message) as info:
        load_agent_class(path)
    assert "--agent_func_path" in str(info.value) and "my_agent.py" in str(info.value)
    assert "openrlhf" not in sys.modules


def test_agent_flag_in_config_and_prepare(tmp_path):
    from fsdp_rlhf.rules import Refused, check_flags
    from fsdp_rlhf.trainers.ppo.setup import _check_rewards

    path = write_agent(tmp_path, COUNTING_AGENT)
    cfg = ppo_config("--agent_func_path", path, "--max_turns", "3", "--prompt_max_len", "10")
    assert cfg.multiturn.source == ("--agent_func_path", path)
    assert cfg.total_len == 10 + 3 * cfg.rollout.generate_max_len
    _check_rewards(cfg)  # a valid reward source on its own
    with pytest.raises(Refused, match="--agent_func_path .*drop --remote_rm_url"):
        check_flags("ppo", ppo_config("--agent_func_path", path, "--remote_rm_url", "r.py"))
    with pytest.raises(Refused, match="pass one of them"):
        check_flags("ppo", ppo_config("--agent_func_path", path, "--env_file", path))
