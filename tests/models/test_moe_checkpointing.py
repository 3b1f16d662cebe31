"""Router replay under activation checkpointing (models.moe): two model loads and a backward
each, so it runs with the family matrix (``make test-models``) rather than in ``make test``."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.models.forward import response_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.load import load_causal_lm
from fsdp_rlhf.models.moe import MoEHooks, routing_scope
from tests.unit.test_moe import own_routing, shifted
from tests.unit.test_shared_prefix import T, grouped_batch

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny import build_family

    return str(build_family(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=4))


def test_gradient_checkpointing_recompute_replays_and_counts_once(tiny_qwen3_moe):
    """The recomputation in backward routes as the forward did (the hooks stay active over
    forward and backward) and is not counted a second time."""
    ref_model = load_causal_lm(tiny_qwen3_moe, BackendConfig(), torch.device("cpu"))
    ckpt_model = load_causal_lm(
        tiny_qwen3_moe, BackendConfig(gradient_checkpointing=True), torch.device("cpu")
    )
    ids, mask, rmask = grouped_batch(ref_model.config.vocab_size, seed=7)
    routing = shifted(own_routing(ref_model, ids, mask), ref_model.config.num_experts)
    grads, metrics = [], []
    for model in (ref_model, ckpt_model):
        model.train()
        hooks = MoEHooks.attach(model)
        inputs = forward_inputs(ids, mask)
        with routing_scope(hooks, routing, inputs):
            lp, _ = response_logprobs(model, inputs, T)
            (lp * rmask).sum().backward()
        grads.append(model.model.layers[0].mlp.gate.weight.grad.clone())
        metrics.append(hooks.pop_metrics())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    assert metrics[1] == pytest.approx(metrics[0])
