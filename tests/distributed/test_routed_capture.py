"""Router replay through vLLM's own routed-experts capture (the CUDA path) on one vLLM engine
over 2 CPU ranks (tensor parallel 2): vLLM's connector, as it ships, runs around the CPU
runner (``capture_glue``), the adapter's CPU recorder beside it as the reference.

The connector keeps its rows on the TP group's first rank only; on the engine's other rank the
scheduler's side of it asks for none, the first rank reads the rows and hands the other its own
sequences'. Colocated (``generate``) and step by step (``submit`` / ``step`` /
``take_routing``, asynchronous training) with the weights loaded in flight, where every
position must keep the routing of its first computation, as the CPU recorder's ``keep_first``
assembly has it; the routers are drawn anew at the load, so the recomputation routes otherwise
and the two assemblies differ. What runs on CUDA only (the V2 runner's own calls around a step
and the capture inside CUDA graphs) is the GPU suite's (tests/gpu/test_vllm.py)."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.asynchronous]

# different prompts and counts per rank: each rank's rows come from the block's first rank
PROMPTS = {0: [[5, 6, 7, 8, 9], [10, 11, 12]], 1: [[20, 21, 22, 23, 24, 25, 26]]}
LOAD_AFTER = 4  # engine steps before the new weights load, requests in flight


def _rows(ids, mask) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]


def _reference(records, out, fill, keep_first: bool):
    """The CPU recorder's routing of ``out``'s sequences, laid out as ``out.routed_experts``."""
    from fsdp_rlhf.rollout.routing import assemble_routing, pad_routing

    sequences = _rows(*out.sequences())
    routing = assemble_routing(records, sequences, fill, keep_first=keep_first)
    prompts = [int(m.sum()) for m in out.prompt_mask]
    P, T = out.prompt_ids.shape[1], out.response_ids.shape[1]
    return pad_routing(routing, prompts, P, T, out.routed_experts.dtype)


def _moved_routers(model_path: str) -> list:
    """The model's weights with every router drawn anew (the experts' choice changes)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.05)
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _capture_checks(rank: int, world: int, model_path: str) -> dict:
    import dataclasses

    import numpy as np
    import torch

    from fsdp_rlhf.config import RolloutConfig
    from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups
    from fsdp_rlhf.rollout.routing import no_expert
    from fsdp_rlhf.rollout.streaming import stream_rollout
    from fsdp_rlhf.rollout.vllm import moe as moe_ops
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine
    from tests.distributed import capture_glue

    groups = build_rollout_groups(2)
    cfg = RolloutConfig(
        vllm_tensor_parallel_size=2,
        generate_max_len=12,
        enforce_eager=True,
        vllm_kvcache_space_gib=0.25,
    )
    # streaming (the step-by-step calls checked), prefix caching on (the connector needs it)
    engine = VLLMEngine(
        model_path,
        cfg,
        groups=groups,
        prompt_max_len=16,
        dtype=torch.float32,
        seed=3,
        pad_token_id=0,
        streaming=True,
    )
    recorder = engine.llm.collective_rpc(moe_ops.install_recorder, args=(np.uint8,))[0]
    res = {"worker": engine.llm.collective_rpc(capture_glue.install)[0]}
    capture_glue.install_scheduler_side(engine.llm)
    engine._routing = engine._vllm_capture(torch.uint8)  # what the engine starts with on CUDA
    side = moe_ops.engine_scheduler(engine.llm).aux_output_connector
    res["asks_rows"] = side.take_output is not moe_ops._no_rows
    fill = no_expert(torch.uint8)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, n=2, seed=5)

    # colocated: every prefix the rollout reuses is computed in it, where the recorder sees it
    engine.llm.reset_prefix_cache()
    recorder.armed = True
    out = engine.generate(PROMPTS[rank], sampling)
    recorder.armed = False
    expected = _reference(recorder.take(), out, fill, keep_first=False)
    valid = out.routed_experts != fill
    res["colocated_rows"] = out.routed_experts.shape[0]
    res["colocated_positions"] = int(valid[..., 0, 0].sum())
    res["colocated_equal"] = torch.equal(out.routed_experts, expected)

    # step by step, the routers drawn anew after LOAD_AFTER steps with requests in flight
    moved = _moved_routers(model_path)
    polls: list[int] = []

    def poll() -> int:
        polls.append(len(polls))
        if len(polls) == LOAD_AFTER + 1:
            engine.update_weights(iter(moved), in_flight=True)
        return int(len(polls) > LOAD_AFTER)

    recorder.armed = True
    streamed = stream_rollout(
        engine,
        PROMPTS[rank],
        dataclasses.replace(sampling, seed=9),
        rank_in_engine=groups.rank_in_engine,
        pad_id=0,
        poll=poll,
    ).output
    recorder.armed = False
    records = recorder.take()
    first = _reference(records, streamed, fill, keep_first=True)
    recomputed = _reference(records, streamed, fill, keep_first=False)
    spans = (streamed.token_versions == 0).any(-1) & (streamed.token_versions == 1).any(-1)
    res["streamed_rows"] = streamed.routed_experts.shape[0]
    res["spanning_versions"] = int(spans.sum())
    res["streamed_equal_first"] = torch.equal(streamed.routed_experts, first)
    res["first_differs_from_recomputed"] = not torch.equal(first, recomputed)
    res["lookup_error"] = _failed_lookup(groups)
    engine.close()
    return res


def _failed_lookup(groups) -> str | None:
    """A look-up failing on the first rank raises on every rank (none waits in the scatter)."""
    from fsdp_rlhf.rollout.groups import serve_from_first

    def lookup(keys):
        return [{"k0": 0}[k] for k in keys]

    try:
        serve_from_first(groups, ["k9"], lookup if groups.rank_in_engine == 0 else None)
    except KeyError as e:
        return str(e)
    return None


def test_vllm_capture_at_tp2_colocated_and_step_by_step(tmp_path):
    from fsdp_rlhf.testing.tiny import build_family

    model = str(build_family(tmp_path / "model", "qwen3_moe", seed=4))
    results = run_distributed(_capture_checks, 2, model)
    print(results)
    assert [r["worker"] for r in results] == ["data plane", "capture only"]  # vLLM's design
    assert [r["asks_rows"] for r in results] == [True, False]
    for rank, r in enumerate(results):
        n = 2 * len(PROMPTS[rank])
        assert r["colocated_rows"] == n and r["colocated_positions"] > 0, (rank, r)
        assert r["colocated_equal"], (rank, r)
        assert r["streamed_rows"] == n and r["streamed_equal_first"], (rank, r)
    assert [r["lookup_error"] for r in results] == ["'k9'", "'k9'"]
    # the load changed routing where responses span both versions (the check can fail)
    assert sum(r["spanning_versions"] for r in results) > 0, results
    assert any(r["first_differs_from_recomputed"] for r in results), results
