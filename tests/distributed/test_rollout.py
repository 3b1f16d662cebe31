"""Colocated vLLM on 2 gloo ranks beside an FSDP2 actor (real vLLM, tiny fp32 model, CPU).

One spawn per TP layout does every check, because each vLLM start costs ~15 s on 2 cores:
tp=1 (two data-parallel engines, one per rank) on the untied Qwen2, and tp=2 (one engine over
both ranks, prompts exchanged inside the TP group) on the tied-embedding Qwen2.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

# Different prompts (and counts) per rank, so the TP=2 gather/slice is exercised.
TEXTS = {
    0: ["the cat runs", "hello big dog and the red bird sings", "one two"],
    1: ["why does the moon sleep", "kind honest helpful"],
}
MAX_NEW = 16


def _responses(out) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(out.response_ids, out.response_mask, strict=True)]


def _logprob_gap(a, b) -> float:
    """Max |a - b| of engine log-probs over valid tokens (outputs with equal tokens)."""
    return ((a.engine_logprobs - b.engine_logprobs).abs() * a.response_mask).max().item()


def _sampled_checks(actor, engine, prompts, n: int) -> dict:
    """Sampled rollouts: prompt-major rows, seeded reproducibility, logprobs vs the trainer."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.rollout import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, n=n, seed=11)
    out = engine.generate(prompts, sampling)
    again = engine.generate(prompts, sampling)
    ids, mask = out.sequences()
    lp, _ = response_logprobs(actor, forward_inputs(ids, mask), out.response_ids.shape[1])
    gap = ((lp.detach() - out.engine_logprobs).abs() * out.response_mask).max().item()
    rows = _responses(out)
    prompt_rows = [
        r[m.bool()].tolist() for r, m in zip(out.prompt_ids, out.prompt_mask, strict=True)
    ]
    return {
        "sample_rows": out.response_ids.shape[0],
        "prompt_major": prompt_rows == [p for p in prompts for _ in range(n)],
        "distinct_per_prompt": [
            len({tuple(r) for r in rows[i * n : (i + 1) * n]}) for i in range(len(prompts))
        ],
        "seeded_repeat_equal": rows == _responses(again),
        "trainer_logprob_gap": gap,
        "loss": -(lp * out.response_mask).sum() / out.response_mask.sum(),
    }


def _stop_checks(engine, hf, prompts, greedy_rows) -> dict:
    """Greedy with a stop token: rows cut right after its first occurrence, reason "stop"."""
    from fsdp_rlhf.distributed.env import broadcast_object
    from fsdp_rlhf.rollout import SamplingConfig

    # every rank of one TP engine must pass the same settings: take rank 0's choice
    stop_tok = broadcast_object(greedy_rows[0][3])
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, greedy=True, stop_token_ids=(stop_tok,))
    v, h = engine.generate(prompts, sampling), hf.generate(prompts, sampling)
    expected = [
        (r[: r.index(stop_tok) + 1], "stop") if stop_tok in r else (r, "length")
        for r in greedy_rows
    ]
    mask = v.response_mask
    return {
        "stop_as_expected": list(zip(_responses(v), v.finish_reasons, strict=True)) == expected,
        "stop_rows": v.finish_reasons.count("stop"),
        "stop_mask_is_prefix": torch.equal(mask.cumprod(-1), mask),
        "stop_vs_hf": _responses(v) == _responses(h) and v.finish_reasons == h.finish_reasons,
    }


def _rollout_checks(rank: int, world: int, model_path: str, tp: int) -> dict:
    import copy

    from fsdp_rlhf.config import BackendConfig, FSDPConfig, RolloutConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.rollout import (
        HFEngine,
        SamplingConfig,
        build_rollout_groups,
        stream_actor_weights,
        sync_weights,
    )
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine
    from tests.dist_utils import current_env

    env = current_env()
    tok = load_tokenizer(model_path)
    base = load_causal_lm(model_path, BackendConfig(), env.device)
    hf = HFEngine(
        copy.deepcopy(base),
        pad_token_id=tok.pad_token_id,
        eos_token_ids=[tok.eos_token_id],
        seed=rank,
    )
    actor = shard_model(base, build_mesh(env.device, world), FSDPConfig(), bf16=False)
    # built before any forward: with zero_stage < 3 a forward leaves unsharded params in place
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    torch.manual_seed(1234)
    expected_rng = torch.rand(4)
    torch.manual_seed(1234)
    cfg = RolloutConfig(
        vllm_tensor_parallel_size=tp,
        generate_max_len=MAX_NEW,
        enforce_eager=True,
        vllm_kvcache_space_gib=0.25,
    )
    engine = VLLMEngine(
        model_path,
        cfg,
        groups=build_rollout_groups(tp),
        prompt_max_len=32,
        dtype=torch.float32,
        seed=7,
        pad_token_id=tok.pad_token_id,
    )
    prompts = [tok(t).input_ids for t in TEXTS[rank]]
    greedy = SamplingConfig(max_new_tokens=MAX_NEW, greedy=True)

    v0, h0 = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
    res = {
        "greedy_vs_hf": _responses(v0) == _responses(h0),
        "greedy_logprob_gap": _logprob_gap(v0, h0),
    }
    res.update(_stop_checks(engine, hf, prompts, _responses(v0)))
    res.update(_sampled_checks(actor, engine, prompts, n=3))

    # one optimizer step with a large lr, then sync into both engines; at TP 2 by delta (its
    # first sync: the mirror filled by the gathers) in 64 KiB buckets, each gathered while
    # the engine loads the one before (a thread issuing gloo collectives beside vLLM's TP group)
    res.pop("loss").backward()
    opt.step()
    if tp == 2:
        from fsdp_rlhf.distributed.delta_sync import DeltaSync

        delta = DeltaSync(bucket_bytes=64 << 10)
        stats = sync_weights(actor, engine, torch.float32, delta=delta, overlap=True)
        res["delta_buckets"] = len(delta.mirror.buffers)
    else:
        stats = sync_weights(actor, engine, torch.float32)
    hf.update_weights(stream_actor_weights(actor, torch.float32))
    v1, h1 = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
    res.update(
        synced_vs_hf=_responses(v1) == _responses(h1),
        synced_logprob_gap=_logprob_gap(v1, h1),
        changed=_responses(v1) != _responses(v0),
        sync_bytes=stats.bytes,
        sync_bytes_per_s=stats.bytes_per_s,
        n_params=sum(p.numel() for p in actor.parameters()),
        embed_numel=actor.get_input_embeddings().weight.numel(),
        training_rng_untouched=torch.equal(torch.rand(4), expected_rng),
        vllm_version=engine.version,
    )
    engine.close()
    return res


def _assert_rollout(results: list[dict], tied: bool) -> None:
    for rank, r in enumerate(results):
        assert r.get("delta_buckets", 2) > 1, r  # several buckets: the overlap had work
        n_prompts = len(TEXTS[rank])
        assert r["greedy_vs_hf"], (rank, r)
        assert r["greedy_logprob_gap"] < 1e-3, (rank, r)
        assert r["stop_as_expected"] and r["stop_mask_is_prefix"], (rank, r)
        assert r["stop_vs_hf"] and r["stop_rows"] >= (1 if rank == 0 else 0), (rank, r)
        assert r["sample_rows"] == 3 * n_prompts and r["prompt_major"], (rank, r)
        assert all(d >= 2 for d in r["distinct_per_prompt"]), (rank, r)
        assert r["seeded_repeat_equal"], (rank, r)
        assert r["trainer_logprob_gap"] < 1e-3, (rank, r)
        assert r["changed"], (rank, r)
        assert r["synced_vs_hf"], (rank, r)
        assert r["synced_logprob_gap"] < 1e-3, (rank, r)
        assert r["training_rng_untouched"], (rank, r)
        # fp32 bytes of every parameter; a tied embedding goes twice (also as lm_head)
        sent = r["n_params"] + (r["embed_numel"] if tied else 0)
        assert r["sync_bytes"] == 4 * sent, (rank, r)
    print({k: v for k, v in results[0].items() if "sync" in k or "gap" in k or k == "vllm_version"})


@pytest.mark.slow
def test_vllm_tp1_two_engines(tiny_qwen2):
    _assert_rollout(run_distributed(_rollout_checks, 2, tiny_qwen2, 1), tied=False)


@pytest.mark.slow
def test_vllm_tp2_one_engine_tied(tiny_qwen2_tied):
    _assert_rollout(run_distributed(_rollout_checks, 2, tiny_qwen2_tied, 2), tied=True)


def _sleep_wake_cuda(rank: int, world: int, model_path: str) -> dict:
    """Sleep level 2 on CUDA: memory released, generate refused until a full sync, same output."""
    from fsdp_rlhf.config import BackendConfig, RolloutConfig
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups, sync_weights
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine
    from tests.dist_utils import current_env

    env = current_env()
    tok = load_tokenizer(model_path)
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    cfg = RolloutConfig(
        generate_max_len=MAX_NEW,
        vllm_enable_sleep=True,
        vllm_sleep_level=2,
        vllm_gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    engine = VLLMEngine(
        model_path,
        cfg,
        groups=build_rollout_groups(1),
        prompt_max_len=32,
        dtype=torch.float32,
        seed=0,
        pad_token_id=tok.pad_token_id,
    )
    prompts = [tok(t).input_ids for t in TEXTS[0]]
    greedy = SamplingConfig(max_new_tokens=MAX_NEW, greedy=True)
    before = _responses(engine.generate(prompts, greedy))
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    res = {"released_bytes": torch.cuda.mem_get_info()[0] - free_awake, "refused": []}
    # asleep, then awake but with the weights level 2 discarded: both must be refused
    for message in ("call wake_up first", "full update_weights"):
        try:
            engine.generate(prompts, greedy)
            res["refused"].append("generated")
        except RuntimeError as e:
            res["refused"].append(message in str(e) or str(e))
        engine.wake_up(None)
    engine.sleep()
    sync_weights(model, engine, torch.float32)  # wake weights, full sync, wake KV cache
    res["same_after_sync"] = _responses(engine.generate(prompts, greedy)) == before
    engine.close()
    return res


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_sleep_level2_cuda(tiny_qwen2):
    (res,) = run_distributed(_sleep_wake_cuda, 1, tiny_qwen2)
    assert res["released_bytes"] > 0, res
    assert res["refused"] == [True, True], res
    assert res["same_after_sync"], res
