"""Router replay through vLLM's own routed-experts capture on one GPU: the engine's first (here
its only) tensor-parallel rank reads vLLM's rows, colocated and step by step with new weights
loaded while requests are in flight, as a TP >= 2 engine's first rank and the asynchronous
rollout ranks do (the other TP ranks' part, giving up their scheduler's side of vLLM's
connector and taking their rows from the first, needs 2 GPUs; on CPU it runs in
tests/distributed/test_routed_capture.py around vLLM's connector).

What it checks against: the trainer's own routing. A tiny Qwen3-MoE's routers are drawn anew at
the in-flight load, so each position's experts tell which weights computed it: the trainer's
own top k under the weights that sampled the next token (the position's first computation,
what replay must keep) equals the engine's at nearly every position, and under the other
weights at few. Engine bf16 with CUDA graphs, trainer fp32. SKIP without vLLM or CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.suite import require

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26]]
LOAD_AFTER = 6  # engine steps before the new weights load, requests in flight
NEW_TOKENS = 24


def _moved(model) -> dict[str, torch.Tensor]:
    """The model's weights with every router drawn anew."""
    torch.manual_seed(0)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in state.items():
        if name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 0.05)
    return state


def _agreement(model, hooks, out, positions: torch.Tensor) -> tuple[float, int]:
    """The share of token-layer routings at ``positions`` ((N, P + T) of ``out``'s columns)
    where ``model``'s own top k equals the engine's, and how many positions there are."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.moe import routing_scope
    from fsdp_rlhf.rollout.routing import no_expert

    routed = out.routed_experts.clone()
    routed[~positions] = no_expert(routed.dtype)
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in out.sequences())
    inputs = forward_inputs(ids, mask)
    with torch.no_grad(), routing_scope(hooks, routed.to(device), inputs, collect=True):
        response_logprobs(model, inputs, out.response_ids.shape[1])
    return hooks.pop_metrics()["moe/router_replay_agreement"], int(positions.sum())


def _position_versions(out) -> torch.Tensor:
    """(N, P + T): the weight version whose forward first computed each position (the one
    that sampled the next token; the prompt's at the first step, version 0), -1 where none."""
    n, p = out.prompt_ids.shape
    after = out.token_versions[:, 1:]  # the token each response position's forward sampled
    none = torch.full((n, 1), -1, dtype=after.dtype)
    return torch.cat([torch.zeros(n, p, dtype=after.dtype), after, none], dim=1)


def replay_checks(model_path: str) -> dict:
    """The engine's routing against the trainer's own (see the module docstring); on CPU the
    same checks run through the adapter's recorder (a rehearsal of this check)."""
    import dataclasses

    from fsdp_rlhf.config import BackendConfig, RolloutConfig
    from fsdp_rlhf.distributed.env import init_distributed
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.moe import MoEHooks
    from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups
    from fsdp_rlhf.rollout.routing import no_expert
    from fsdp_rlhf.rollout.streaming import stream_rollout
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine

    env = init_distributed()
    cuda = env.device.type == "cuda"
    cfg = RolloutConfig(
        generate_max_len=NEW_TOKENS,
        vllm_gpu_memory_utilization=0.25 if cuda else None,
        vllm_enable_sleep=False,
        vllm_kvcache_space_gib=0.25,
    )
    engine = VLLMEngine(
        model_path,
        cfg,
        groups=build_rollout_groups(1),
        prompt_max_len=16,
        dtype=torch.bfloat16 if cuda else torch.float32,
        seed=3,
        pad_token_id=0,
        streaming=True,
        router_replay=True,
    )
    res = {"runner": engine.runner, "vllm_capture": engine._routing.recorder is None}
    trainer = load_causal_lm(model_path, BackendConfig(), env.device, dtype=torch.float32)
    hooks = MoEHooks.attach(trainer)
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, n=2, seed=5)

    out = engine.generate(PROMPTS, sampling)
    routed = out.routed_experts[..., 0, 0] != no_expert(out.routed_experts.dtype)
    res["colocated"] = _agreement(trainer, hooks, out, routed)

    moved = _moved(trainer)
    polls: list[int] = []

    def poll() -> int:
        polls.append(len(polls))
        if len(polls) == LOAD_AFTER + 1:
            engine.update_weights(iter(moved.items()), in_flight=True)
        return int(len(polls) > LOAD_AFTER)

    streamed = stream_rollout(
        engine,
        PROMPTS,
        dataclasses.replace(sampling, seed=9),
        rank_in_engine=0,
        pad_id=0,
        poll=poll,
    ).output
    versions = _position_versions(streamed)
    routed = streamed.routed_experts[..., 0, 0] != no_expert(streamed.routed_experts.dtype)
    first, then = (versions == 0) & routed, (versions == 1) & routed
    res["v0_positions_under_v0"] = _agreement(trainer, hooks, streamed, first)
    trainer.load_state_dict(moved, strict=False)
    res["v1_positions_under_v1"] = _agreement(trainer, hooks, streamed, then)
    res["v0_positions_under_v1"] = _agreement(trainer, hooks, streamed, first)
    engine.close()  # also destroys the process group
    return res


def test_router_replay_reads_vllms_capture(tmp_path, detail):
    require("vllm", "cuda")
    from fsdp_rlhf.testing.tiny import build_family

    r = replay_checks(str(build_family(tmp_path / "moe", "qwen3_moe", seed=4)))
    assert r["vllm_capture"], r
    (agree, n), (kept, n0), (then, n1), (other, _) = (
        r[k]
        for k in (
            "colocated",
            "v0_positions_under_v0",
            "v1_positions_under_v1",
            "v0_positions_under_v1",
        )
    )
    assert n > 0 and agree > 0.9, r
    assert n0 > 0 and n1 > 0 and kept > 0.9 and then > 0.9, r  # each position's first weights
    assert other < 0.5, r  # the routers drawn anew route the old positions otherwise
    detail(
        f"runner {r['runner']}: colocated {agree:.3f} of {n} positions; in-flight load: "
        f"{n0} positions kept from version 0 agree {kept:.3f} (under version 1: {other:.3f}), "
        f"{n1} of version 1 agree {then:.3f}"
    )
