"""PPO step pieces on one process: advantages per estimator, the reuse-log-probs decision, rule
rewards (file and HTTP)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from fsdp_rlhf.algorithms import FixedKLController
from fsdp_rlhf.config import PPOAlgoConfig
from fsdp_rlhf.config_base import ConfigError
from fsdp_rlhf.errors import Fault, UserError
from fsdp_rlhf.rollout.engine import RolloutOutput
from fsdp_rlhf.trainers.experience import Experience, experience_from_rollout, truncated
from fsdp_rlhf.trainers.ppo.rewards import (
    add_overlong_penalty,
    add_stop_properly_penalty,
    compute_advantages,
    observe_kl,
)
from fsdp_rlhf.trainers.ppo.update import (
    _correction,
    clip_range,
    ratio_anchor,
    reuse_update_logprobs,
)
from fsdp_rlhf.trainers.rule_reward import build_rule_reward, http_reward


def _experience(n_prompts: int = 3, n: int = 4, T: int = 6, seed: int = 0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    N = n_prompts * n
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    return Experience(
        input_ids=torch.zeros(N, 4 + T, dtype=torch.long),
        attention_mask=torch.ones(N, 4 + T, dtype=torch.long),
        response_mask=mask,
        engine_logprobs=torch.zeros(N, T),
        old_logprobs=-torch.rand(N, T, generator=g) * mask,
        ref_logprobs=-torch.rand(N, T, generator=g) * mask,
        values=torch.randn(N, T, generator=g) * mask,
        scores=torch.randn(N, generator=g),
    )


@pytest.mark.parametrize(
    "estimator", ["gae", "reinforce++", "rloo", "grpo", "dr_grpo", "flash_reinforce"]
)
@pytest.mark.parametrize("kl_in_loss", [False, True])
def test_every_estimator_fills_masked_advantages_and_returns(estimator, kl_in_loss):
    exp = _experience()
    algo = PPOAlgoConfig(advantage_estimator=estimator, use_kl_loss=kl_in_loss)
    ctl = FixedKLController(0.1)
    compute_advantages(exp, algo, ctl.value, n_samples_per_prompt=4)
    out = observe_kl(exp, algo, ctl)
    for t in (exp.rewards, exp.advantages, exp.returns):
        assert t.shape == exp.response_mask.shape and torch.isfinite(t).all()
        assert (t[exp.response_mask == 0] == 0).all()
    # the mean of per-sequence token means (not the token mean: rows differ in length)
    per_token = (exp.old_logprobs - exp.ref_logprobs) * exp.response_mask
    per_seq = per_token.sum(1) / exp.response_mask.sum(1)
    assert out["actor/kl"] == pytest.approx(float(per_seq.mean()), rel=1e-5)
    token_mean = float(per_token.sum() / exp.response_mask.sum())
    assert out["actor/kl"] != pytest.approx(token_mean, rel=1e-3)
    # The score lands on the last response token; KL only when it belongs in the reward.
    last = exp.response_mask.sum(1).long() - 1
    penalty = -0.1 * (exp.old_logprobs - exp.ref_logprobs) * (0.0 if kl_in_loss else 1.0)
    expected_last = exp.scores + penalty[torch.arange(len(last)), last]
    assert torch.allclose(exp.rewards[torch.arange(len(last)), last], expected_last, atol=1e-6)


def test_group_estimators_see_whole_groups_in_order():
    exp = _experience(n_prompts=2, n=3, T=2)
    exp.response_mask[:] = 1
    exp.scores = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 40.0])
    compute_advantages(
        exp,
        PPOAlgoConfig(advantage_estimator="dr_grpo", use_kl_loss=True),
        0.0,
        n_samples_per_prompt=3,
    )
    # Dr. GRPO: score minus its own group's mean, on every token
    assert torch.allclose(exp.advantages[:, 0], torch.tensor([-1.0, 0.0, 1.0, -10, -10, 20]))


def test_advantages_without_old_logprobs_when_kl_is_not_in_the_reward():
    exp = _experience_without_old()  # the actor update will supply them
    kl_in_loss = PPOAlgoConfig(advantage_estimator="grpo", use_kl_loss=True)
    compute_advantages(exp, kl_in_loss, 0.1, 4)
    assert torch.isfinite(exp.advantages).all() and exp.advantages.abs().sum() > 0


def _experience_without_old() -> Experience:
    exp = _experience()
    exp.old_logprobs = None
    return exp


@pytest.mark.parametrize(
    "change, reuses",
    [
        ({}, True),
        ({"ppo_epochs": 2}, False),
        ({"steps": 2}, False),  # two optimizer steps per rollout batch
        ({"use_kl_loss": False}, False),  # KL penalty in the reward needs them first
        ({"use_kl_loss": False, "init_kl_coef": 0.0}, True),
        ({"kl_target": 0.1}, False),  # adaptive coefficient is set before the update
        ({"actor_frozen": True}, False),
        ({"bypass": True}, False),  # the engine's log-probs are the old ones
    ],
)
def test_old_logprobs_come_from_the_update_only_when_exact(change, reuses):
    algo = PPOAlgoConfig(
        advantage_estimator="grpo",
        use_kl_loss=change.get("use_kl_loss", True),
        init_kl_coef=change.get("init_kl_coef", 0.01),
        kl_target=change.get("kl_target"),
        ppo_epochs=change.get("ppo_epochs", 1),
        use_rollout_logprobs_as_old=change.get("bypass", False),
    )
    steps = change.get("steps", 1)
    assert reuse_update_logprobs(algo, steps, not change.get("actor_frozen", False)) is reuses


def test_overlong_penalty_joins_the_scores_only_when_asked():
    exp = _experience(n_prompts=1, n=4, T=8)
    exp.response_mask = (torch.arange(8) < torch.tensor([[2], [5], [6], [8]])).float()
    exp.scores = torch.zeros(4)
    add_overlong_penalty(exp, PPOAlgoConfig(), max_len=8)
    assert exp.scores.tolist() == [0.0, 0.0, 0.0, 0.0]
    algo = PPOAlgoConfig(overlong_buffer_len=4, overlong_penalty_factor=2.0)
    add_overlong_penalty(exp, algo, max_len=8)
    # free up to 8 - 4 = 4 tokens, then -2 * (L - 4) / 4
    assert exp.scores.tolist() == pytest.approx([0.0, -0.5, -1.0, -2.0])


def test_stop_properly_penalty_after_the_overlong_one_only_when_asked():
    exp = _experience(n_prompts=1, n=4, T=8)
    exp.response_mask = (torch.arange(8) < torch.tensor([[2], [5], [8], [8]])).float()
    exp.truncated = torch.tensor([False, False, True, True])
    exp.scores = torch.tensor([1.0, 1.0, 1.0, 0.0])
    add_stop_properly_penalty(exp, PPOAlgoConfig())
    assert exp.scores.tolist() == [1.0, 1.0, 1.0, 0.0]
    algo = PPOAlgoConfig(overlong_buffer_len=4, stop_properly_penalty_coef=0.5)
    add_overlong_penalty(exp, algo, max_len=8)
    add_stop_properly_penalty(exp, algo)
    # overlong first (-0.25, -1, -1 for 5, 8, 8 tokens), then truncated rows are halved
    assert exp.scores.tolist() == pytest.approx([1.0, 0.75, 0.0, -0.5])
    fixed = PPOAlgoConfig(stop_properly_penalty_coef=-1.0)
    add_stop_properly_penalty(exp, fixed)
    assert exp.scores.tolist() == pytest.approx([1.0, 0.75, -1.0, -1.0])


def test_stop_properly_penalty_coef_range():
    assert PPOAlgoConfig(stop_properly_penalty_coef=-0.5).stop_properly_penalty_coef == -0.5
    with pytest.raises(ConfigError, match="stop_properly_penalty_coef"):
        PPOAlgoConfig(stop_properly_penalty_coef=1.5)


def test_experience_carries_the_truncation_flags():
    out = RolloutOutput.from_lists(
        [[1, 2], [3]], [[4, 5], [6]], ["length", "stop"], [[-0.1, -0.2], [-0.3]], pad_id=0, n=1
    )
    exp = experience_from_rollout(out, torch.device("cpu"))
    assert exp.truncated.tolist() == [True, False]
    assert exp.rows(torch.tensor([1])).truncated.tolist() == [False]


def test_truncated_flags():
    assert truncated(["stop", "length", "length", "stop"]).tolist() == [0.0, 1.0, 1.0, 0.0]


def test_python_rule_reward_file(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return [len(q) - len(p) + (l or 0) for q, p, l in zip(queries, prompts, labels)]\n"
    )
    fn = build_rule_reward(str(f))
    assert fn(["ab", "abcd"], ["a", "a"], [None, 10]).tolist() == [1.0, 13.0]
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(UserError, match="reward_func"):
        build_rule_reward(str(bad))
    with pytest.raises(UserError, match="no such file"):
        build_rule_reward(str(tmp_path / "missing.py"))


class _Handler(BaseHTTPRequestHandler):
    calls: list[int] = []

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.calls.append(len(body["query"]))
        if len(_Handler.calls) == 1:  # the first request fails: the client must retry
            self.send_response(503)
            self.end_headers()
            return
        rewards = [float(len(q)) for q in body["query"]]
        data = json.dumps({"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_http_rule_reward_batches_and_retries(monkeypatch):
    monkeypatch.setattr("fsdp_rlhf.trainers.rule_reward.time.sleep", lambda s: None)
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _Handler.calls = []
        fn = http_reward(f"http://127.0.0.1:{server.server_port}/", batch_size=2, timeout_s=5)
        out = fn(["a", "bb", "ccc", "dddd", "eeeee"], ["", "", "", "", ""], [None] * 5)
        assert out.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert _Handler.calls == [2, 2, 2, 1]  # failed batch, then 3 batches of <= 2
    finally:
        server.shutdown()


def test_http_rule_reward_gives_up_after_retries(monkeypatch):
    monkeypatch.setattr("fsdp_rlhf.trainers.rule_reward.time.sleep", lambda s: None)
    fn = http_reward("http://127.0.0.1:9/", retries=2, timeout_s=0.5)  # discard port: refused
    with pytest.raises(Fault) as err:
        fn(["q"], ["p"], [None])
    # one line: the endpoint, the number of tries and the last error
    assert str(err.value) == (
        "HTTP reward endpoint http://127.0.0.1:9/: 3 tries failed, the last with: "
        "<urlopen error [Errno 111] Connection refused>"
    )


def test_stat_collector_mean_only_entry():
    from fsdp_rlhf.trainers.ppo.metrics import StatCollector

    stats = StatCollector()
    stats.add_mean("response_length/clip_ratio", truncated(["length", "stop", "stop", "stop"]))
    stats.add("response_length", torch.tensor([3.0, 5.0]))
    out = stats.reduce()
    assert out["response_length/clip_ratio"] == 0.25
    stats.add_mean("response_length/clip_ratio", truncated(["length"] * 4))  # a second round
    assert stats.reduce()["response_length/clip_ratio"] == 5 / 8
    assert out["response_length/mean"] == 4.0
    assert not any(k.startswith("response_length/clip_ratio/") for k in out)


def _eight_samples_config():
    """4 prompts x 2 samples per step."""
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config

    argv = "--pretrain x --rollout_batch_size 4 --n_samples_per_prompt 2".split()
    return build_config(PPOConfig, argv)[0]


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_rollout_tps_always_and_vllm_tps_only_when_vllm_generated(engine):
    from fsdp_rlhf.trainers.ppo.metrics import throughput_metrics

    cfg = _eight_samples_config()
    metrics = {
        "response_length/mean": 6.0,
        "prompt_length/mean": 4.0,
        "rollout/generated_length": 10.0,
    }
    times = {"all": 4.0, "update": 1.0, "rollout": 2.0}
    out = throughput_metrics(metrics, times, cfg, world_size=2, engine_name=engine)
    # (6 + 4) tokens x 8 samples / 2 ranks / seconds
    assert out["e2e_tps"] == 10.0 and out["update_tps"] == 40.0 and out["rollout_tps"] == 20.0
    assert ("vllm_tps" in out) is (engine == "vllm")


def test_rollout_tps_counts_every_dynamic_sampling_round():
    from fsdp_rlhf.trainers.ppo.metrics import throughput_metrics

    cfg = _eight_samples_config()
    # three rounds generated 3 x 8 sequences of 12 tokens on average in 3 s; the kept batch
    # (8 sequences of 10 tokens) trained in 1 s
    metrics = {
        "response_length/mean": 6.0,
        "prompt_length/mean": 4.0,
        "rollout/generated_length": 12.0,
        "dynamic_filter/gen_rounds": 3.0,
    }
    out = throughput_metrics(metrics, {"rollout": 3.0, "update": 1.0}, cfg, 2, "vllm")
    assert out["rollout_tps"] == 12.0 * 24 / 2 / 3.0 and out["update_tps"] == 40.0


def test_running_averages_take_the_max_of_max_entries():
    from fsdp_rlhf.trainers.ppo.metrics import RunningAverages

    avg = RunningAverages()
    avg.add({"rollout_corr/mismatch_abs_diff": 0.1, "rollout_corr/mismatch_abs_diff_max": 0.5})
    avg.add({"rollout_corr/mismatch_abs_diff": 0.3, "rollout_corr/mismatch_abs_diff_max": 2.0})
    out = avg.reduce()
    assert out["rollout_corr/mismatch_abs_diff"] == pytest.approx(0.2)
    assert out["rollout_corr/mismatch_abs_diff_max"] == 2.0


def test_actor_loss_pieces_follow_the_correction_and_loss_flags():
    from fsdp_rlhf.trainers.ppo.update import _correction, _policy_term

    exp = _experience(n_prompts=1, n=4, T=6)
    exp.advantages = torch.ones_like(exp.response_mask)
    exp.engine_logprobs = exp.old_logprobs - 1.0 * exp.response_mask  # ratio e on valid tokens
    current = exp.old_logprobs.clone().requires_grad_(True)

    weights, st = _correction(PPOAlgoConfig(), current, exp.old_logprobs, exp)
    assert weights is None and st["rollout_corr/mismatch_abs_diff_max"] == pytest.approx(1.0)
    tis = PPOAlgoConfig(is_correction="tis", is_truncated_threshold=(0.0, 2.0))
    weights, st = _correction(tis, current, exp.old_logprobs, exp)
    assert torch.allclose(weights, 2.0 * exp.response_mask)  # e clamped to 2
    icepop = PPOAlgoConfig(is_correction="icepop", is_truncated_threshold=(0.5, 2.0))
    weights, st = _correction(icepop, current, exp.old_logprobs, exp)
    assert weights.sum() == 0 and st["rollout_corr/is_masked_frac"] == 1.0
    # bypass: old == engine, so the mismatch is measured on the update's own log-probs
    bypass = PPOAlgoConfig(use_rollout_logprobs_as_old=True)
    _, st = _correction(bypass, current, exp.engine_logprobs, exp)
    assert st["rollout_corr/mismatch_abs_diff_max"] == pytest.approx(1.0)

    agg = dict(loss_agg="seq-mean-token-sum-norm", num_tokens=None, num_seqs=4, norm_len=6)
    gspo = PPOAlgoConfig(policy_loss_type="gspo")
    loss, st = _policy_term(gspo, current, exp.old_logprobs, exp, None, agg)
    assert "actor/seq_clipfrac" in st and st["actor/seq_ratio"] == pytest.approx(1.0)
    # ratio 1, advantage 1: loss -sum_t(1) / norm_len per row, mean over rows
    expected = -(exp.response_mask.sum(1) / 6).mean()
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    loss, st = _policy_term(PPOAlgoConfig(), current, exp.old_logprobs, exp, None, agg)
    assert "actor/seq_clipfrac" not in st and float(loss.detach()) == pytest.approx(float(expected))


def test_flash_reinforce_subtracts_the_batch_mean_in_the_trainer():
    exp = _experience(n_prompts=6, n=1)
    algo = PPOAlgoConfig(advantage_estimator="flash_reinforce", init_kl_coef=0.0)
    compute_advantages(exp, algo, 0.0, n_samples_per_prompt=1)
    centred = (exp.scores - exp.scores.mean())[:, None] * exp.response_mask
    torch.testing.assert_close(exp.advantages, centred)


def test_the_update_reads_the_gating_of_the_config():
    """--is_correction seq_mask --is_correction_gating binary_kl reaches the actor update:
    the row whose trainer and engine probabilities differ (0.25 vs 0.5) is dropped by a
    0.05 bound on its mean binary KL, the agreeing row keeps weight 1."""
    exp = _experience(n_prompts=2, n=1, T=2)
    exp.response_mask = torch.ones(2, 2)
    exp.engine_logprobs = torch.tensor([[0.5, 0.9], [0.5, 0.5]]).log()
    trainer = torch.tensor([[0.25, 0.9], [0.5, 0.5]]).log()
    algo = PPOAlgoConfig(
        is_correction="seq_mask", is_correction_gating="binary_kl", is_truncated_threshold=(0.05,)
    )
    weights, stats = _correction(algo, trainer, trainer, exp)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert stats["rollout_corr/is_seq_masked_frac"].item() == 0.5


def test_the_ratio_anchor_and_the_weights_of_each_off_policy_correction():
    """none: the PPO ratio against the trainer's old log-probs, no weights; behaviour: against
    the engine's (each token's behaviour log-prob); decoupled: against the old ones, each token
    weighted by pi_old / pi_behaviour, those above --behaviour_weight_cap given 0 (AReaL)."""
    exp = _experience(n_prompts=1, n=4, T=6)
    gap = torch.tensor([0.5, -0.3, 2.0, 0.0, 0.1, -1.0])  # log pi_old - log pi_behaviour
    exp.engine_logprobs = (exp.old_logprobs - gap) * exp.response_mask
    current = exp.old_logprobs.clone()
    for mode, anchor in (("none", exp.old_logprobs), ("behaviour", exp.engine_logprobs)):
        algo = PPOAlgoConfig(off_policy_correction=mode)
        assert torch.equal(ratio_anchor(algo, exp.old_logprobs, exp), anchor), mode
        weights, _ = _correction(algo, current, exp.old_logprobs, exp)
        assert weights is None, mode
    decoupled = PPOAlgoConfig(off_policy_correction="decoupled", behaviour_weight_cap=5.0)
    assert torch.equal(ratio_anchor(decoupled, exp.old_logprobs, exp), exp.old_logprobs)
    weights, st = _correction(decoupled, current, exp.old_logprobs, exp)
    ratio = gap.exp().expand_as(weights)
    expected = torch.where(ratio <= 5.0, ratio, torch.zeros_like(ratio)) * exp.response_mask
    assert torch.allclose(weights, expected)  # exp(2) = 7.4 > 5: dropped
    assert st["rollout_corr/is_masked_frac"] > 0
    # bypass mode: the old log-probs already are the engine's
    bypass = PPOAlgoConfig(use_rollout_logprobs_as_old=True)
    assert torch.equal(ratio_anchor(bypass, exp.engine_logprobs, exp), exp.engine_logprobs)


def test_stat_collector_leaves_out_an_optional_mean_nothing_counted():
    from fsdp_rlhf.trainers.ppo.metrics import StatCollector

    stats = StatCollector()
    stats.add_sum_over_count("a", torch.tensor(3.0), torch.tensor(2))
    stats.add_sum_over_count("b", torch.tensor(0.0), torch.tensor(0))
    stats.add_weighted_mean("c", torch.tensor(0.0), torch.tensor(0))
    out = stats.reduce()
    assert out["a"] == 1.5 and "b" not in out and out["c"] == 0.0


def test_the_clip_around_the_behaviour_policy_widens_with_each_tokens_staleness():
    """--off_policy_correction behaviour under async training: a token sampled k versions
    before the policy the step starts from clips at (1 +- eps)^(1 + k); colocated batches (no
    versions) and the other corrections keep the flags' range."""
    exp = _experience(n_prompts=1, n=2, T=3)
    exp.response_mask = torch.ones(2, 3)
    algo = PPOAlgoConfig(off_policy_correction="behaviour", eps_clip=0.2, eps_clip_high=0.28)
    assert clip_range(algo, exp, None) == (0.2, 0.28)  # no versions: colocated
    exp.token_versions = torch.tensor([[4, 4, 4], [3, 4, 2]])
    low, high = clip_range(algo, exp, trained_version=4)
    assert torch.allclose(1 + high, torch.tensor([[1.28, 1.28, 1.28], [1.28**2, 1.28, 1.28**3]]))
    assert torch.allclose(1 - low, torch.tensor([[0.8, 0.8, 0.8], [0.8**2, 0.8, 0.8**3]]))
    for mode in ("none", "decoupled"):
        other = PPOAlgoConfig(off_policy_correction=mode, eps_clip=0.2, eps_clip_high=0.28)
        assert clip_range(other, exp, trained_version=4) == (0.2, 0.28)
    with pytest.raises(ValueError, match="needs the version"):
        clip_range(algo, exp, None)
