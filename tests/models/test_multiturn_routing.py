"""Router replay across the turns of a multi-turn rollout (tiny Qwen3-MoE with near-tied
routers, fp32, CPU).

In the real vLLM engine, recording routed experts, 3 model turns per trajectory with
environment observations between them. Every engine call is recorded as it happens; the
trajectory's routing must hold, at each position, what the call that first computed it
recorded: the prompt and each turn's model tokens what that turn's call routed them to
(prefill, then decode), each observation (and the model token before it) what the next turn's
call routed them to in its prefill; the last token none. Replayed in the trainer's one forward
over the whole trajectory, the log-probs of every turn's tokens equal the engine's (the
trainer routing for itself does not), and equal (1e-5 relative, fp32) what replaying each
turn's call alone gives, single-turn.

End to end: multi-turn GRPO with ``--router_replay`` under torchrun (2 ranks), the engine's and
the trainer's log-probs agreeing after every sync."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.e2e.helpers import read_metrics, torchrun
from tests.e2e.test_ppo_multiturn import WRAPPED_CALCULATOR, flags

pytestmark = [pytest.mark.models, pytest.mark.slow]

ENV = """
def reset(prompt, label):
    return None


def step(history, action):
    turn = sum(m["role"] == "assistant" for m in history)
    return f"result {turn} noted, go on", 0.5, False
"""
TURNS, MAX_NEW, N = 3, 6, 2
LOGPROB_TOL = 1e-4  # engine against trainer, fp32 (as the family matrix)
REL = 1e-5  # the trainer against itself: whole trajectory against each call alone


def _checks(rank: int, world: int, model_path: str, env_file: str) -> dict:
    import numpy as np

    from fsdp_rlhf.config import BackendConfig, RolloutConfig
    from fsdp_rlhf.data.prompts import Prompt
    from fsdp_rlhf.metrics import PhaseTimer
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.models.moe import MoEHooks, routing_scope
    from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups
    from fsdp_rlhf.rollout.env import load_environment
    from fsdp_rlhf.rollout.multiturn import MultiTurnRollout, TurnBudget
    from fsdp_rlhf.rollout.routing import no_expert
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine
    from tests.dist_utils import current_env

    env = current_env()
    tok = load_tokenizer(model_path)
    total = 24 + TURNS * (MAX_NEW + 16)
    engine = VLLMEngine(
        model_path,
        RolloutConfig(generate_max_len=MAX_NEW, enforce_eager=True, vllm_kvcache_space_gib=0.25),
        groups=build_rollout_groups(1),
        prompt_max_len=total - MAX_NEW,
        dtype=torch.float32,
        seed=0,
        pad_token_id=tok.pad_token_id,
        router_replay=True,
    )
    calls = []  # (histories, RolloutOutput) of every engine call, in order

    def generate(histories, sampling):
        out = engine.generate(histories, sampling)
        calls.append(([list(h) for h in histories], out))
        return out

    runner = MultiTurnRollout(
        load_environment(env_file, 30.0),
        tok,
        TurnBudget(TURNS, total, MAX_NEW),
        PhaseTimer(env.device),
    )
    texts = ["the cat sat on", "one two three four five"]
    prompts = [Prompt(tok(t).input_ids, t, None) for t in texts]
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, n=N, seed=5, temperature=1.0)
    out, trajs = runner.run(generate, prompts, sampling)
    engine.close()

    fill = no_expert(out.routed_experts.dtype)
    P, res = out.prompt_ids.shape[1], {"turns": [t.turns for t in trajs]}
    held, expected_mismatch, history_positions, failures = 0, 0, 0, []
    for i, t in enumerate(trajs):
        tokens = t.prompt_ids + t.response
        routing = out.routed_experts[i, P - len(t.prompt_ids) :][: len(tokens)].numpy()
        covered = np.zeros(len(tokens), dtype=bool)
        for c, (histories, call) in enumerate(calls):
            j = _row_of(tokens, histories, call)
            if j is None:
                continue
            h = len(histories[j])
            n = int(call.response_mask[j].sum())
            width = call.prompt_ids.shape[1]
            recorded = call.routed_experts[j, width - h : width + n - 1].numpy()  # 0..h+n-2
            # positions this call computed first: the history tail it read first (the model
            # token before an observation, the observation) in prefill, its turn in decode
            first = ~covered[: h + n - 1]
            if not np.array_equal(routing[: h + n - 1][first], recorded[first]):
                failures.append(f"trajectory {i}, call {c}: replayed routing != recorded")
            # the history an earlier call computed: how often this call's prefill routed it
            # otherwise (a near tie; the earlier call's routing is kept)
            again = covered[: h + n - 1]
            expected_mismatch += int((routing[: h + n - 1][again] != recorded[again]).sum())
            history_positions += int(again.sum()) * recorded.shape[1] * recorded.shape[2]
            covered[: h + n - 1] = True
            held += int(first.sum())
        if covered[-1] or not covered[:-1].all():
            failures.append(f"trajectory {i}: positions not covered once each")
        if not (routing[-1] == fill).all():
            failures.append(f"trajectory {i}: its last token carries routing")
    res["failures"] = failures
    res["positions held"] = held
    res["history routings another call routed otherwise"] = (expected_mismatch, history_positions)

    # the trainer: one replayed forward of each whole trajectory against the engine, and
    # against replaying each call alone (single-turn)
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    hooks = MoEHooks.attach(model)
    ids, mask = out.sequences()
    T = out.response_ids.shape[1]
    inputs = forward_inputs(ids, mask, response_len=T)
    with torch.no_grad(), routing_scope(hooks, out.routed_experts, inputs, collect=False):
        whole, _ = response_logprobs(model, inputs, T)
    with torch.no_grad():  # the control: the trainer routing for itself
        own, _ = response_logprobs(model, inputs, T)
    trained = out.response_mask.bool()
    res["engine vs trainer"] = float((whole - out.engine_logprobs)[trained].abs().max())
    res["engine vs trainer, no replay"] = float((own - out.engine_logprobs)[trained].abs().max())
    worst = 0.0
    for histories, call in calls:
        c_ids, c_mask = call.sequences()
        Tc = call.response_ids.shape[1]
        c_inputs = forward_inputs(c_ids, c_mask, response_len=Tc)
        with torch.no_grad(), routing_scope(hooks, call.routed_experts, c_inputs):
            alone, _ = response_logprobs(model, c_inputs, Tc)
        for j, h in enumerate(histories):
            i = next(
                k
                for k, t in enumerate(trajs)
                if _row_of(t.prompt_ids + t.response, histories, call) == j
            )
            n = int(call.response_mask[j].sum())
            start = len(h) - len(trajs[i].prompt_ids)  # the turn's first response column
            mine = whole[i, start : start + n]
            worst = max(worst, float(((mine - alone[j, :n]).abs() / alone[j, :n].abs()).max()))
    res["whole vs each call alone (relative)"] = worst
    return res


def _row_of(tokens: list[int], histories: list[list[int]], call) -> int | None:
    """The row of an engine call that continued this trajectory (its history and that turn's
    tokens begin it; the n samples of a prompt share their first history), or None."""
    for j, h in enumerate(histories):
        turn = call.response_ids[j][call.response_mask[j].bool()].tolist()
        if tokens[: len(h) + len(turn)] == h + turn:
            return j
    return None


def test_multiturn_trajectories_replay_each_turns_engine_routing(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    # routers tied to within float32 rounding: the trainer's own top k differs from vLLM's
    model = build_family(tmp_path / "model", "qwen3_moe", router_spread=1e-6)
    env_file = tmp_path / "env.py"
    env_file.write_text(ENV)
    (res,) = run_distributed(_checks, 1, str(model), str(env_file))
    print(res)
    assert set(res["turns"]) == {TURNS}, res  # every trajectory: 3 calls, 2 observations
    assert res["failures"] == [], res
    assert res["engine vs trainer, no replay"] > 1e-3, res  # the check sees a wrong routing
    assert res["engine vs trainer"] < LOGPROB_TOL, res
    assert res["whole vs each call alone (relative)"] <= REL, res


def test_calculator_env_with_router_replay_on_a_tiny_moe(tmp_path):
    """Multi-turn GRPO on the tiny Qwen3-MoE with --router_replay: every trajectory's routing
    is assembled from its turns' engine calls (checked above) and the trainer, replaying it,
    reproduces the engine's log-probs of every turn's tokens after each weight sync."""
    from fsdp_rlhf.testing.tiny import build_family

    model = build_family(tmp_path / "moe", "qwen3_moe")
    env_file = tmp_path / "calc_env.py"
    env_file.write_text(WRAPPED_CALCULATOR)
    args = flags(str(model), env_file, tmp_path / "run", 2)
    for flag, value in (("--rollout_batch_size", "8"), ("--train_batch_size", "32")):
        args[args.index(flag) + 1] = value
    proc = torchrun(["ppo", *args, "--router_replay", "--enforce_eager"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multiturn/turns/min"] == 2 and r["multiturn/env_tokens/min"] > 0, r
        assert r["rollout/logprob_diff/max"] < 1e-4, r  # fp32, as the family matrix
        assert r["moe/router_replay_agreement"] > 0.99, r
