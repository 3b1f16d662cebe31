"""Router replay under `--async_train` (#48): the rollout ranks' step-by-step engine records
the experts it routed every token to, the samples carry them through the queue, and the
training ranks replay them; with `--partial_rollout` across weight versions too. Tiny
Qwen3-MoE, CPU, real vLLM. `make test-async` runs these (marker ``asynchronous``)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from fsdp_rlhf.testing.launch import local_torchrun
from fsdp_rlhf.trainers.experience import Experience
from tests.e2e.helpers import REPO, _env

pytestmark = [pytest.mark.slow, pytest.mark.asynchronous]


def _gap(saved: dict, name: str, mask: torch.Tensor) -> float:
    """Max |trainer - engine| over ``mask``'s tokens, each under its own version's weights."""
    exp = Experience(**saved["rows"])
    worst = 0.0
    for version in (0, 1):
        tokens = mask & (exp.token_versions == version)
        diff = (saved["logprobs"][(version, name)] - exp.engine_logprobs)[tokens].abs()
        worst = max(worst, float(diff.max()) if tokens.any() else 0.0)
    return worst


def test_a_partial_rollouts_tokens_replay_the_experts_of_the_newest_weights_that_sampled(
    tmp_path,
):
    """An MoE model with near-tied routers; the weights change after 6 engine steps, requests
    in flight, which vLLM then computes again from their tokens under the new weights. The
    batch (through the queue's message) carries each position's experts from its last
    computation: one forward of the new weights over the prefix, then their decode steps.

    Replaying them, the trainer under version 1 gives the engine's log-probs of every
    version-1 token (fp32 rounding, as colocated replay; routing for itself it does not). The
    version-0 tokens replay experts the new weights chose. Assembled the other way (each
    position's first computation), the version-0 tokens would be exact and the version-1
    tokens replay a prefix the old weights routed, which the engine no longer attended to:
    measured, that gap is the larger (numbers in docs/async.md)."""
    from fsdp_rlhf.testing.tiny import build_family

    model = build_family(tmp_path / "model", "qwen3_moe", router_spread=1e-6)
    out = tmp_path / "replay.pt"
    worker = str(REPO / "tests" / "e2e" / "async_replay_worker.py")
    cmd = local_torchrun(2, [worker, str(model), str(out)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(None), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = torch.load(out, weights_only=False)
    exp = Experience(**saved["rows"])
    mask = exp.response_mask.bool()
    versions = exp.token_versions
    spans = [set(versions[i][mask[i]].tolist()) for i in range(exp.num_sequences)]
    assert sum(s == {0, 1} for s in spans) >= 4, spans  # partial responses
    routed = exp.routed_experts
    assert routed is not None and routed.shape[:2] == exp.input_ids.shape
    old, new = mask & (versions == 0), mask & (versions == 1)
    gaps = {
        (name, part): _gap(saved, name, m)
        for name in ("own", "last", "first")
        for part, m in (("old", old), ("new", new))
    }
    agreement = {k: v["moe/router_replay_agreement"] for k, v in saved["metrics"].items()}
    print("engine vs trainer, max |diff| per version's tokens:", gaps)
    print("router replay agreement:", agreement)
    assert gaps[("last", "new")] < 1e-5, gaps  # the new weights' experts: exact
    assert gaps[("first", "old")] < 1e-5, gaps  # the alternative: exact on the old tokens
    assert gaps[("own", "old")] > 1e-3, gaps  # the near ties: routing for itself differs
    # the alternative's worst token is further off than ours
    assert max(gaps[("first", "old")], gaps[("first", "new")]) > gaps[("last", "old")], gaps
    # the trainer's own top k under the new weights (whose routers no longer tie) is what
    # the engine recorded at nearly every replayed position: the experts sit on their tokens
    assert agreement[(1, "last")] > 0.95, agreement
