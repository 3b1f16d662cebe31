"""``trainers/ppo/eval.py`` on one process: eval sharding, the pass@k assembly from rank sums,
and the best-model swap."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_rlhf.config import CheckpointConfig, PPOConfig, PPOEvalConfig
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.trainers.ppo.eval import (
    BEST_FILE,
    Evaluator,
    finish_eval,
    local_eval_sums,
    pass_budgets,
    shard,
)


def _prompts(tag: int, k: int) -> list[Prompt]:
    return [Prompt(ids=[tag], text=f"{tag}-{i}", label=None) for i in range(k)]


def test_eval_shards_cover_every_prompt_once_with_equal_sizes():
    for P, W in [(5, 2), (4, 3), (1, 2), (8, 4)]:
        parts = [shard(P, r, W) for r in range(W)]
        assert len({len(idx) for idx, _ in parts}) == 1
        counted = sorted(i for idx, real in parts for i, ok in zip(idx, real, strict=True) if ok)
        assert counted == list(range(P))


def test_eval_metrics_from_rank_sums():
    ks = pass_budgets(4, "pass@2")
    assert ks == [1, 2, 4]
    # rank 0: prompts (2 of 4 correct, greedy right), (0 of 4, greedy wrong)
    r0 = local_eval_sums(
        torch.tensor([1.0, 0.0]),
        torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
        [True, True],
        ks,
    )
    # rank 1: one real prompt (4 of 4) and a padding repeat that must not count
    r1 = local_eval_sums(torch.tensor([1.0, 1.0]), torch.ones(2, 4), [True, False], ks)
    total = {k: r0[k] + r1[k] for k in r0}
    m = finish_eval(total)
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    # pass@2 of 2-of-4: 1 - C(2,2)/C(4,2) = 5/6
    assert m["eval/pass@2"] == pytest.approx((5 / 6 + 0.0 + 1.0) / 3)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/greedy_pass@1"] == pytest.approx(2 / 3)
    assert m["eval/score_mean"] == pytest.approx(1.5 / 3)


def _evaluator(tmp_path, load_checkpoint=False) -> Evaluator:
    cfg = PPOConfig(
        eval=PPOEvalConfig(
            eval_dataset="x", eval_n_samples_per_prompt=2, save_best_metric="pass@2"
        ),
        ckpt=CheckpointConfig(save_path=str(tmp_path), load_checkpoint=load_checkpoint),
    )
    env = DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        device=torch.device("cpu"),
        backend="gloo",
    )
    return Evaluator(cfg, env, _prompts(1, 3))


def test_best_model_swaps_in_whole_and_resume_keeps_the_record(tmp_path):
    ev = _evaluator(tmp_path)

    def export(path):
        path.mkdir()
        (path / "model.safetensors").write_text(str(ev_step))

    for ev_step, value in [(1, 0.25), (2, 0.5), (3, 0.4)]:
        metrics = {"eval/pass@2": value}
        if ev.improved(metrics):
            ev.save_best(ev_step, metrics, export)
    best = tmp_path / "best"
    assert json.loads((best / BEST_FILE).read_text()) == {
        "metric": "eval/pass@2",
        "value": 0.5,
        "step": 2,
    }
    assert (best / "model.safetensors").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]  # no staging/old left
    assert _evaluator(tmp_path, load_checkpoint=True).best == 0.5
    assert _evaluator(tmp_path).best is None  # a fresh run starts its own record
    assert not ev.improved({"eval/pass@2": float("nan")})
