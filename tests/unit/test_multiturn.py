"""Multi-turn rollouts with a deterministic stand-in engine: the turn loop, token/mask layout,
budgets, environment errors and timeouts, and the env file contract."""

from __future__ import annotations

import logging
import textwrap

import pytest
import torch

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.config_base import ConfigError, build_config
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.rollout.engine import RolloutOutput, SamplingConfig
from fsdp_rlhf.rollout.env import EnvResult, NewPrompt, load_environment
from fsdp_rlhf.rollout.multiturn import MultiTurnRollout, TurnBudget, trajectory_stats
from fsdp_rlhf.testing.tiny import build_tokenizer
from fsdp_rlhf.trainers.experience import experience_from_rollout


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


class FakeEngine:
    """Answers every history with ``turn_len`` tokens derived from its length, ending with
    ``<|im_end|>``; log-prob of token j is ``-(j + 1) / 10``. Records each call's batch."""

    def __init__(self, tok, turn_len: int = 3, finish: str = "stop") -> None:
        self.end = tok.convert_tokens_to_ids("<|im_end|>")
        self.turn_len, self.finish = turn_len, finish
        self.calls: list[list[list[int]]] = []

    def generate(self, histories: list[list[int]], sampling: SamplingConfig) -> RolloutOutput:
        assert sampling.n == 1
        self.calls.append([list(h) for h in histories])
        responses = []
        for h in histories:
            body = [10 + (len(h) + j) % 50 for j in range(self.turn_len - 1)]
            responses.append(body + ([self.end] if self.finish == "stop" else [11]))
        lps = [[-(j + 1) / 10 for j in range(len(r))] for r in responses]
        return RolloutOutput.from_lists(
            histories, responses, [self.finish] * len(responses), lps, pad_id=0, n=1
        )


def write_env(tmp_path, body: str, name: str = "env.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


TWO_TURN_ENV = """
    def reset(prompt, label):
        return None

    def step(history, action):
        turn = sum(m["role"] == "assistant" for m in history)
        assert history[0]["label"] == "L"
        return "obs%d" % turn, float(turn), turn >= 2
"""


def run(tok, env_path, *, prompts=2, n=2, max_turns=4, total=4096, gen=8, timeout=5.0, **kw):
    env = load_environment(env_path, timeout)
    runner = MultiTurnRollout(
        env, tok, TurnBudget(max_turns, total, gen), PhaseTimer(torch.device("cpu"))
    )
    engine = FakeEngine(tok, **kw)
    ps = [Prompt(ids=[5 + i, 6, 7], text=f"p{i}", label="L") for i in range(prompts)]
    out, trajs = runner.run(engine.generate, ps, SamplingConfig(max_new_tokens=gen, n=n, seed=3))
    return out, trajs, engine, runner


def test_turns_layout_masks_and_logprobs(tok, tmp_path):
    out, trajs, engine, runner = run(tok, write_env(tmp_path, TWO_TURN_ENV))
    assert len(engine.calls) == 2  # one batched generate per turn over all live trajectories
    assert [len(c) for c in engine.calls] == [4, 4]
    obs = runner.observations.ids("obs1", "<|im_end|>")
    for i, t in enumerate(trajs):
        assert t.turns == 2 and t.score == 3.0 and not t.error
        assert t.mask == [1] * 3 + [0] * len(obs) + [1] * 3
        # turn 2 generated from the exact token history: prompt, model tokens, observation
        assert engine.calls[1][i] == t.prompt_ids + t.response[: 3 + len(obs)]
        assert t.response[3 : 3 + len(obs)] == obs
    row = out.response_mask[0]
    assert row.tolist() == trajs[0].mask
    assert out.response_attention_mask[0].sum() == len(trajs[0].response)
    lp = out.engine_logprobs[0]
    assert torch.all(lp[row == 0] == 0)
    assert torch.allclose(lp[row == 1], torch.tensor([-0.1, -0.2, -0.3] * 2))
    assert out.n == 2 and out.finish_reasons == ["stop"] * 4
    stats = trajectory_stats(trajs)
    assert stats["turns"].tolist() == [2.0] * 4
    assert stats["env_tokens"].tolist() == [float(len(obs))] * 4


def test_observation_is_a_user_turn_of_the_template(tok):
    runner = MultiTurnRollout(None, tok, TurnBudget(2, 100, 8), PhaseTimer(torch.device("cpu")))
    text = runner.observations.text("hi", "<|im_end|>")
    assert text == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a turn that ended on another token gets the template's end of turn first
    assert runner.observations.text("hi", "<|endoftext|>").startswith("<|im_end|>\n")


def test_env_tokens_are_attended_not_trained(tok, tmp_path):
    """The forwards must see observation tokens: the attention mask covers them while the
    response mask (loss, KL, advantages) does not."""
    out, trajs, _, _ = run(tok, write_env(tmp_path, TWO_TURN_ENV))
    exp = experience_from_rollout(out, torch.device("cpu"))
    T = exp.response_len
    n_tokens = len(trajs[0].response)
    assert exp.attention_mask[0, -T:].sum() == n_tokens
    assert exp.response_mask[0].sum() == 6 < n_tokens


def test_max_turns_stops(tok, tmp_path):
    env = write_env(tmp_path, TWO_TURN_ENV.replace("turn >= 2", "False"))
    _, trajs, engine, _ = run(tok, env, max_turns=3)
    assert len(engine.calls) == 3
    assert all(t.turns == 3 and t.score == 6.0 for t in trajs)
    assert all(t.mask[-1] == 1 for t in trajs)  # no observation after the last turn


def test_token_budget_stops_before_overflow(tok, tmp_path):
    env = write_env(tmp_path, TWO_TURN_ENV.replace("turn >= 2", "False"))
    # prompt 3 + turn 3 + obs (~12) + next turn 8 > 20: the observation is never appended
    out, trajs, engine, _ = run(tok, env, total=20, max_turns=5)
    assert len(engine.calls) == 1
    assert all(t.length <= 20 and t.mask == [1, 1, 1] for t in trajs)
    assert out.response_ids.shape[1] == 3


def test_cut_turn_is_closed_by_the_observation(tok, tmp_path):
    out, trajs, engine, runner = run(tok, write_env(tmp_path, TWO_TURN_ENV), finish="length")
    assert len(engine.calls) == 2 and out.finish_reasons == ["length"] * 4
    obs = runner.observations.ids("obs1", tok.decode([11]))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert obs[0] == end  # the template's end of turn, as an environment token
    assert trajs[0].response[3 : 3 + len(obs)] == obs and trajs[0].mask[3] == 0


def test_env_error_ends_trajectory_and_is_logged_once(tok, tmp_path, caplog):
    env = write_env(
        tmp_path,
        """
        def reset(prompt, label):
            return None

        def step(history, action):
            if history[0]["content"] == "p1":
                raise RuntimeError("calculator broke")
            return "ok", 1.0, len(history) >= 4
        """,
        name="broken_env.py",
    )
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"):
        _, trajs, engine, _ = run(tok, env)
    assert [t.error for t in trajs] == [False, False, True, True]
    assert [t.score for t in trajs] == [2.0, 2.0, 0.0, 0.0]
    assert [len(c) for c in engine.calls] == [4, 2]  # failed trajectories dropped
    logged = [r.getMessage() for r in caplog.records if "calculator broke" in r.getMessage()]
    assert len(logged) == 1 and "broken_env.py" in logged[0]
    assert trajectory_stats(trajs)["errors"].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_env_timeout_is_a_tool_error(tok, tmp_path):
    env = write_env(
        tmp_path,
        """
        import time

        def reset(prompt, label):
            return None

        def step(history, action):
            if history[0]["content"] == "p0":
                time.sleep(5)
            return "", 1.0, True
        """,
    )
    _, trajs, _, _ = run(tok, env, timeout=0.3)
    assert [t.error for t in trajs] == [True, True, False, False]


@pytest.mark.parametrize(
    "bad",
    [
        "return 'obs', float('nan'), False",
        "return 'obs', 1.0",
        "return 3, 1.0, False",
    ],
)
def test_malformed_step_is_a_tool_error(tok, tmp_path, bad):
    env = write_env(tmp_path, f"def reset(p, l):\n    return None\ndef step(h, a):\n    {bad}\n")
    _, trajs, _, _ = run(tok, env)
    assert all(t.error and t.score == 0.0 for t in trajs)


def test_reset_observation_extends_the_prompt(tok, tmp_path):
    env = write_env(tmp_path, TWO_TURN_ENV.replace("return None", "return ' tools: calc'"))
    out, trajs, engine, _ = run(tok, env)
    tools = tok(" tools: calc", add_special_tokens=False)["input_ids"]
    assert trajs[0].prompt_ids == [5, 6, 7] + tools
    assert engine.calls[0][0] == trajs[0].prompt_ids
    assert out.prompt_mask[0].sum() == 3 + len(tools)


def test_reward_func_file_is_a_single_turn_env(tok, tmp_path):
    env = write_env(
        tmp_path,
        """
        def reward_func(queries, prompts, labels):
            rows = zip(queries, prompts, labels)
            return [float(q.startswith(p)) + (lab == "L") for q, p, lab in rows]
        """,
    )
    _, trajs, engine, _ = run(tok, env)
    assert len(engine.calls) == 1 and all(t.score == 2.0 and t.turns == 1 for t in trajs)


def test_env_file_contract_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_environment(str(tmp_path / "nope.py"), 1.0)
    only_reset = write_env(tmp_path, "def reset(p, l):\n    return None\n")
    with pytest.raises(UserError, match=r"--env_file .*defines neither reset"):
        load_environment(only_reset, 1.0)
    broken = write_env(tmp_path, "import not_a_module_xyz\n", name="b.py")
    with pytest.raises(UserError, match="import failed: ModuleNotFoundError"):
        load_environment(broken, 1.0)


def ppo_config(*flags: str) -> PPOConfig:
    return build_config(PPOConfig, ["--pretrain", "m", "--prompt_data", "d", *flags])[0]


def test_config_budgets():
    cfg = ppo_config("--env_file", "e.py", "--max_turns", "3", "--prompt_max_len", "10")
    assert cfg.total_len == 10 + 3 * cfg.rollout.generate_max_len
    assert ppo_config("--prompt_max_len", "10").total_len == 10 + cfg.rollout.generate_max_len
    with pytest.raises(ConfigError, match="max_total_len"):
        ppo_config("--env_file", "e.py", "--prompt_max_len", "10", "--max_total_len", "20")
    with pytest.raises(ConfigError, match="max_turns"):
        ppo_config("--max_turns", "0")
    from fsdp_rlhf.rules import Refused, check_flags

    with pytest.raises(Refused, match="--overlong_buffer_len with --env_file e.py"):
        check_flags("ppo", ppo_config("--env_file", "e.py", "--overlong_buffer_len", "4"))
    # router replay assembles each trajectory's routing from its turns (test below)
    replay = ("--env_file", "e.py", "--router_replay", "--advantage_estimator", "reinforce++")
    check_flags("ppo", ppo_config(*replay))


def test_sample_log_shows_env_turns(tok, tmp_path):
    from fsdp_rlhf.trainers.ppo.metrics import log_samples

    out, trajs, _, _ = run(tok, write_env(tmp_path, TWO_TURN_ENV))
    exp = experience_from_rollout(out, torch.device("cpu"))
    exp.scores = trajectory_stats(trajs)["scores"]
    texts, tables = [], []

    class Logger:
        def text(self, tag, body, step):
            texts.append(body)

        def table(self, tag, rows, step):  # the W&B samples table
            tables.append(rows)

    prompts = [Prompt(ids=[5, 6, 7], text=f"p{i}", label="L") for i in range(2)]
    log_samples(Logger(), tok, exp, prompts, step=1, n_samples=2, save_path=str(tmp_path))
    assert "obs1" in texts[0] and "obs1" in (tmp_path / "samples.jsonl").read_text()
    assert "obs1" in tables[0][0]["response"] and tables[0][0]["prompt"] == "p0"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--reward_pretrain", "rm"], "drop --reward_pretrain"),
        (["--remote_rm_url", "r.py"], "drop --remote_rm_url"),
        (["--eval_dataset", "e.jsonl"], "--eval_dataset"),
    ],
)
def test_prepare_refuses_other_reward_sources(tmp_path, extra, message):
    from fsdp_rlhf.rules import check_flags
    from fsdp_rlhf.trainers.ppo.setup import _check_rewards

    env = write_env(tmp_path, TWO_TURN_ENV)
    with pytest.raises(UserError, match=message):  # the rules table's rows
        check_flags("ppo", ppo_config("--env_file", env, *extra))
    check_flags("ppo", ppo_config("--env_file", env, "--advantage_estimator", "reinforce++"))
    _check_rewards(ppo_config("--env_file", env))  # alone: a valid reward source
    with pytest.raises(UserError, match="--env_file .*no such file"):
        _check_rewards(ppo_config("--env_file", str(tmp_path / "missing.py")))


def test_rank_without_live_trajectories_keeps_generating_with_its_tp_block(
    tok, tmp_path, monkeypatch
):
    """Another rank of the engine still has live trajectories (the all-reduce says so): this
    rank must join every turn's generate, with no prompts, or the TP block would hang."""
    from fsdp_rlhf.rollout import multiturn

    monkeypatch.setattr(multiturn, "all_reduce_scalars", lambda values, op: {"live": 1.0})
    env = write_env(tmp_path, TWO_TURN_ENV.replace("turn >= 2", "True"))
    _, trajs, engine, _ = run(tok, env, max_turns=3)
    assert [len(c) for c in engine.calls] == [4, 0, 0]
    assert all(t.turns == 1 for t in trajs)


class RoutingEngine(FakeEngine):
    """A FakeEngine that reports routed experts as vLLM's adapter does (positions 0 .. L - 2 of
    each sequence, laid out like ``sequences()``): expert ids ``[call, position % 7]`` in one
    MoE layer, so each position shows which call routed it."""

    def generate(self, histories, sampling):
        from fsdp_rlhf.rollout.routing import pad_routing

        out = super().generate(histories, sampling)
        call = len(self.calls) - 1
        routing = []
        for h, n in zip(histories, out.response_mask.sum(-1).tolist(), strict=True):
            pos = torch.arange(len(h) + int(n) - 1)
            routing.append(torch.stack([torch.full_like(pos, call), pos % 7], -1)[:, None].numpy())
        widths = out.prompt_ids.shape[1], out.response_ids.shape[1]
        lens = [len(h) for h in histories]
        return RolloutOutput(
            **{**out.__dict__, "routed_experts": pad_routing(routing, lens, *widths, torch.uint8)}
        )


def test_router_replay_keeps_each_positions_first_call(tok, tmp_path):
    """Model tokens keep the routing of the turn that generated them, observations (and the
    model token before them) the next turn's prefill routing; the last token has none."""
    from fsdp_rlhf.rollout.routing import no_expert

    env = load_environment(write_env(tmp_path, TWO_TURN_ENV), 5.0)
    runner = MultiTurnRollout(env, tok, TurnBudget(4, 4096, 8), PhaseTimer(torch.device("cpu")))
    engine = RoutingEngine(tok)
    ps = [Prompt(ids=[5, 6, 7], text="p0", label="L"), Prompt(ids=[8, 9], text="p1", label="L")]
    out, trajs = runner.run(engine.generate, ps, SamplingConfig(max_new_tokens=8, n=2, seed=3))
    exp = experience_from_rollout(out, torch.device("cpu"))
    assert exp.routed_experts.shape == (*exp.input_ids.shape, 1, 2)
    P = out.prompt_ids.shape[1]
    for i, t in enumerate(trajs):
        p, obs = len(t.prompt_ids), t.mask.count(0)
        routing = exp.routed_experts[i, P - p : P + len(t.response), 0].long()
        # call 0: prompt and turn 1 but its last token; call 1: that token, the observation,
        # turn 2 but its last token (3 model tokens a turn)
        calls = [0] * (p + 2) + [1] * (1 + obs + 2)
        assert routing[:-1, 0].tolist() == calls
        assert routing[:-1, 1].tolist() == [j % 7 for j in range(len(calls))]
        assert (routing[-1] == no_expert(torch.uint8)).all()
    assert (exp.routed_experts[0, : P - 3] == no_expert(torch.uint8)).all()  # left padding


def test_a_vlm_prompts_images_go_with_every_turn(tok, tmp_path):
    """A vision-language prompt: the histories start with its expanded ids, every turn's call
    gets each live history's prompt images (in the live trajectories' order), and a reset that
    replaces such a prompt is one line."""
    env = load_environment(write_env(tmp_path, TWO_TURN_ENV), 5.0)
    runner = MultiTurnRollout(env, tok, TurnBudget(4, 4096, 8), PhaseTimer(torch.device("cpu")))
    engine, seen = FakeEngine(tok), []

    def generate(histories, sampling, images=None):
        seen.append(list(images))
        return engine.generate(histories, sampling)

    ps = [Prompt(ids=[5 + i, 6, 7], text=f"p{i}", label="L") for i in range(2)]
    expanded = [[5, 90, 90, 90, 6, 7], [6, 91, 91, 6, 7]]  # placeholders expanded per image
    images = ["image of p0", "image of p1"]  # stand-ins for PromptImages
    sampling = SamplingConfig(max_new_tokens=8, n=2, seed=3)
    out, trajs = runner.run(generate, ps, sampling, prompt_ids=expanded, images=images)
    assert [t.prompt_ids for t in trajs] == [expanded[0]] * 2 + [expanded[1]] * 2
    assert [c[0][: len(expanded[0])] for c in engine.calls] == [expanded[0]] * 2
    expected = ["image of p0"] * 2 + ["image of p1"] * 2
    assert seen == [expected, expected]  # two turns, all four trajectories live in both
    assert out.prompt_ids.shape[0] == 4 and all(t.turns == 2 for t in trajs)

    class Agent:  # an OpenRLHF agent's reset replaces the prompt text
        def start(self, sampling):
            pass

        def reset(self, texts, labels):
            return [EnvResult(NewPrompt("another prompt")) for _ in texts]

    runner.env = Agent()
    with pytest.raises(UserError, match="reset replaced a prompt that holds images"):
        runner.run(generate, ps, sampling, prompt_ids=expanded, images=images)
