"""The pairwise matrix (``make test-pairs``): the jobs of ``fsdp_rlhf.rules.pairs.plan()``, each a
2-step ``fsdp-rlhf ppo`` under torchrun with real vLLM rollouts on tiny models shaped like
published checkpoints, together covering every pair of {SP, async, router replay, VLM, packing,
LoRA, multi-turn, critic} that no row of the rules table refuses. Each job must finish both
steps with finite losses and show each of its features at work. The jobs are read from the
rules table at collection time: deleting a row adds its pairs to them.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from fsdp_rlhf.rules.pairs import MODEL_KINDS, Job, plan
from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl, write_reward_file
from tests.e2e.helpers import REPO, read_metrics, torchrun
from tests.vlm.conftest import COLOUR_REWARD

pytestmark = [pytest.mark.slow, pytest.mark.pairs]

PLAN = plan()


# a metric each feature's code writes at every step: the feature ran, not only its flag
EVIDENCE = {
    "router replay": "moe/router_replay_agreement",
    "multi-turn": "multiturn/turns/max",
    "critic": "critic/vf_loss",
    "async": "async/staleness_max",
    "teacher": "distill/topk_mass",
}
# what the start-up log says for the feature
LOG = {"sequence parallel": "sequence-parallel 2 (Ulysses)", "async": "+ 1 rollout ranks"}
# engine vs trainer log-probs of the sampled tokens after each sync (measured: <= 1e-6 in fp32;
# bf16: the hybrid SP test's bound); under async only step 1's rollouts are on-policy
LOGPROB_DIFF_MAX = {"fp32": 1e-4}
LOGPROB_DIFF_MEAN = {"bf16": 0.02}


def _build(role: str, root: Path) -> Path:
    from fsdp_rlhf.testing import tiny_vlm
    from fsdp_rlhf.testing.tiny import build_family, build_model

    if role == "dense":  # GQA: 4 query / 2 key-value heads of 64 (vLLM's CPU kernels)
        return build_model(root, "qwen2", hidden_size=256, num_heads=4, num_kv_heads=2)
    if role == "moe":
        return build_family(root, "qwen3_moe")
    if role == "vlm":
        return tiny_vlm.build_vl_model(root)
    # Qwen3.5-MoE's VLM (the class of Qwen3.6-35B-A3B): hybrid attention, MoE, a vision tower
    return tiny_vlm.build_vl_model(root, "qwen3_5_moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """role -> the folder of its tiny model, built on first use; each reads as the kind the
    plan checked the rules with."""
    built: dict[str, str] = {}

    def get(role: str) -> str:
        if role not in built:
            from fsdp_rlhf.models.kind import read_model_kind

            path = _build(role, tmp_path_factory.mktemp(role))
            kind = read_model_kind(str(path), "--pretrain")
            assert dataclasses.replace(kind, path="{model}") == MODEL_KINDS[role], kind
            built[role] = str(path)
        return built[role]

    return get


def _data(kind: str, root: Path) -> dict[str, str]:
    """The placeholders of the job's data: prompts, reward, environment."""
    env = {"{env}": str(REPO / "configs/calculator_env.py")}
    if kind == "calculator":
        return {"{prompts}": str(REPO / "configs/calculator_prompts.jsonl"), **env}
    if kind == "images":
        from fsdp_rlhf.testing.tiny_vlm import colour_rows, write_rows

        prompts = write_rows(colour_rows(32, root / "images", seed=0), root / "prompts.jsonl")
        (root / "reward.py").write_text(COLOUR_REWARD)
        return {"{prompts}": str(prompts), "{reward}": str(root / "reward.py"), **env}
    prompts = write_jsonl(prompt_rows(32, chat=True), root / "prompts.jsonl")
    return {"{prompts}": str(prompts), "{reward}": str(write_reward_file(root / "r.py", "short"))}


def _fill(argv: tuple[str, ...], values: dict[str, str]) -> list[str]:
    out = []
    for token in argv:
        for key, value in values.items():
            token = token.replace(key, value)
        assert "{" not in token, token
        out.append(token)
    return out


def _param(job: Job):
    """make test runs the first job (the most features: today all eight, SP, async, router
    replay, VLM, packing, LoRA, multi-turn and a critic on the tiny Qwen3.5-MoE VLM, about
    55 s), make test-pairs the others (none today) and the plan's unit tests."""
    name = f"job{job.number}-" + "+".join(f.replace(" ", "_") for f in job.features)
    marks = [pytest.mark.featured] if job.number == 1 else []
    return pytest.param(job, id=name, marks=marks)


@pytest.mark.parametrize("job", [_param(job) for job in PLAN.jobs])
def test_pair_job_runs_two_steps(job: Job, models, tmp_path):
    values = {"{model}": models(job.model), "{save}": str(tmp_path / "run")}
    values.update(_data(job.data, tmp_path / "data"))
    proc = torchrun(_fill(job.argv, values), nproc=job.nproc, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        losses = {k: v for k, v in r.items() if k.endswith("_loss") or k.endswith("grad_norm")}
        assert losses and all(math.isfinite(v) for v in losses.values()), losses
        for feature in job.features:
            if feature in EVIDENCE:
                assert math.isfinite(r[EVIDENCE[feature]]), (feature, r)
    dtype = "bf16" if "--bf16" in job.argv else "fp32"
    for r in rows[:1] if "async" in job.features else rows:
        if dtype in LOGPROB_DIFF_MAX:
            assert r["rollout/logprob_diff/max"] < LOGPROB_DIFF_MAX[dtype], r
        else:
            assert r["rollout/logprob_diff/mean"] < LOGPROB_DIFF_MEAN[dtype], r
    log = " ".join((proc.stdout + proc.stderr).split())
    for feature in job.features:
        if feature in LOG:
            assert LOG[feature] in log, (feature, log[-3000:])
    keys = [k for k in sorted(rows[-1]) if "loss" in k or k.startswith("rollout/logprob_diff")]
    print(job.number, job.features, [{k: r.get(k) for k in keys} for r in rows])
