"""A tiny Qwen2.5-VL under FSDP2 on 2 gloo ranks beside in-process vLLM (real engine, fp32,
CPU): images reach both, engine and trainer log-probs agree before and after weight syncs, the
placeholders are never sampled, a frozen vision tower is not synced, and ranks whose
micro-batches have no images run in step with ranks whose do.

One spawn per TP layout does every check (a vLLM start costs ~15 s on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.vlm, pytest.mark.slow]

MAX_NEW = 8
# Max |engine - trainer| log-prob over sampled tokens, fp32 on both sides. Measured here:
# a few 1e-6 (the same float32 math in a different order); the text-only tests allow 1e-3.
LOGPROB_TOL = 1e-4
COLOURS_OF_RANK = {0: ["red", "blue", "green"], 1: ["blue", "red"]}


def _responses(out) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(out.response_ids, out.response_mask, strict=True)]


def _trainer_gap(actor, out, images) -> float:
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.vision import VisionTokens

    ids, mask = out.sequences()
    vision = VisionTokens.from_config(actor.config)
    with torch.no_grad():
        lp, _ = response_logprobs(
            actor,
            forward_inputs(ids, mask, images=images, vision=vision),
            out.response_ids.shape[1],
        )
    return ((lp - out.engine_logprobs).abs() * out.response_mask).max().item()


def _checks(rank: int, world: int, model_path: str, image_dir: str, tp: int) -> dict:
    import copy

    from fsdp_rlhf.config import BackendConfig, FSDPConfig, RolloutConfig
    from fsdp_rlhf.data.prompts import tokenize_prompts
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.vision import (
        VisionTokens,
        is_vision_param,
        prepare_policy,
        vision_prefix,
    )
    from fsdp_rlhf.rollout import HFEngine, SamplingConfig, build_rollout_groups, sync_weights
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine
    from fsdp_rlhf.testing.tiny_vlm import colour_rows
    from fsdp_rlhf.trainers.ppo.vision import StepImages
    from tests.dist_utils import current_env

    env = current_env()
    images = StepImages.from_pretrained(model_path, BackendConfig())
    vision = images.vision
    base = load_causal_lm(model_path, BackendConfig(), env.device)
    tokens = prepare_policy(base)
    hf_model = copy.deepcopy(base)
    hf_model.config.use_cache = True
    hf = HFEngine(
        hf_model,
        pad_token_id=0,
        eos_token_ids=[3],
        seed=rank,
        vision=VisionTokens.from_config(base.config),
    )
    actor = shard_model(base, build_mesh(env.device, world), FSDPConfig(), bf16=False)
    opt = torch.optim.AdamW(actor.parameters(), lr=3e-2)
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
        prompt_max_len=48,
        dtype=torch.float32,
        seed=7,
        pad_token_id=0,
        vision=tokens,
        max_images=2,
    )
    from fsdp_rlhf.config import PromptDataConfig

    names = COLOURS_OF_RANK[rank]
    rows = colour_rows(len(names), f"{image_dir}/rank{rank}", names=names)
    data = PromptDataConfig(input_key="prompt", apply_chat_template=True, prompt_max_len=48)
    prompts = tokenize_prompts(rows, vision.tokenizer, data, vision, "images")
    ids, prompt_images = images.encode(prompts)
    greedy = SamplingConfig(max_new_tokens=MAX_NEW, greedy=True)
    sampled = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, n=4, seed=3)

    v0, h0 = engine.generate(ids, greedy, prompt_images), hf.generate(ids, greedy, prompt_images)
    s0 = engine.generate(ids, sampled, prompt_images)
    rows_s0 = StepImages.rows(prompt_images, 4)
    res = {
        "tower_is_fsdp_unit": type(actor.model.visual).__name__.startswith("FSDP"),
        "greedy_vs_hf": _responses(v0) == _responses(h0),
        "greedy_gap_hf": ((v0.engine_logprobs - h0.engine_logprobs).abs() * v0.response_mask)
        .max()
        .item(),
        "prompt_len_expanded": [len(x) for x in ids],
        "sampled_gap_before": _trainer_gap(actor, s0, rows_s0),
        "placeholders_sampled": int(
            (
                torch.isin(s0.response_ids, torch.tensor(tokens.placeholders))
                & s0.response_mask.bool()
            ).sum()
        ),
    }
    # the same prompt with another image: the pixels reach vLLM
    swapped = [prompt_images[1], prompt_images[0], *prompt_images[2:]]
    other = engine.generate([ids[1], ids[0], *ids[2:]], greedy, swapped)
    res["image_changes_output"] = (
        other.engine_logprobs[0, 0].item() != v0.engine_logprobs[0, 0].item()
    )

    # one update on the sampled rows (images included), then a full sync
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.vision import VisionTokens

    sq, sm = s0.sequences()
    vision = VisionTokens.from_config(actor.config)
    lp, _ = response_logprobs(
        actor, forward_inputs(sq, sm, images=rows_s0, vision=vision), s0.response_ids.shape[1]
    )
    (-(lp * s0.response_mask).sum() / s0.response_mask.sum()).backward()
    opt.step()
    opt.zero_grad()
    # by delta (its first sync: the mirror filled), buckets made while the engine loads
    from fsdp_rlhf.distributed.delta_sync import DeltaSync

    delta = DeltaSync()
    stats = sync_weights(actor, engine, torch.float32, delta=delta, overlap=True)
    s1 = engine.generate(ids, sampled, prompt_images)
    res["sampled_gap_after_sync"] = _trainer_gap(actor, s1, StepImages.rows(prompt_images, 4))
    res["sync_bytes"] = stats.bytes
    res["n_params"] = sum(p.numel() for p in actor.parameters())

    # a frozen tower: only the language model is sent; the engine keeps the tower it has (the
    # one of the last full sync). Every parameter moves, the sync skips the tower, then the
    # trainer's tower goes back to what the engine holds: they agree only if the skipped
    # tower never reached the engine.
    frozen = is_vision_param(vision_prefix(actor))
    res["tower_params"] = sum(p.numel() for n, p in actor.named_parameters() if frozen(n))
    engine_tower = [p.detach().clone() for p in actor.model.visual.parameters()]
    with torch.no_grad():  # the language model a little, the tower a lot
        for n, p in actor.named_parameters():
            p.mul_(1.5 if frozen(n) else 1.01)
    stats = sync_weights(actor, engine, torch.float32, skip=frozen, delta=delta, overlap=True)
    res["frozen_sync_bytes"] = stats.bytes
    s_moved = engine.generate(ids, sampled, prompt_images)
    # control: with the moved tower the trainer must disagree with the engine
    res["gap_with_unsynced_tower"] = _trainer_gap(actor, s_moved, StepImages.rows(prompt_images, 4))
    with torch.no_grad():
        for p, q in zip(actor.model.visual.parameters(), engine_tower, strict=True):
            p.copy_(q)
    s2 = engine.generate(ids, sampled, prompt_images)
    res["sampled_gap_after_frozen_sync"] = _trainer_gap(
        actor, s2, StepImages.rows(prompt_images, 4)
    )

    # rank 1 runs a text-only micro-batch while rank 0 runs one with images (FSDP in step)
    text_ids = torch.tensor([[2, 9, 10, 11, 12]])
    mask = torch.ones_like(text_ids)
    if rank == 0:
        x, m, im = sq[:2], sm[:2], rows_s0[:2]
    else:
        from fsdp_rlhf.models.vision import ImageBatch

        x, m, im = text_ids, mask, ImageBatch([None])
    lp, _ = response_logprobs(actor, forward_inputs(x, m, images=im, vision=vision), 2)
    lp.sum().backward()  # gradients reduced over both ranks, the tower's included
    res["mixed_step_ok"] = all(
        torch.isfinite(p.grad.full_tensor()).all() for p in actor.parameters() if p.grad is not None
    )
    engine.close()
    return res


def _assert(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["tower_is_fsdp_unit"], (rank, r)
        assert r["greedy_vs_hf"] and r["greedy_gap_hf"] < LOGPROB_TOL, (rank, r)
        assert r["image_changes_output"], (rank, r)
        assert r["placeholders_sampled"] == 0, (rank, r)
        for key in (
            "sampled_gap_before",
            "sampled_gap_after_sync",
            "sampled_gap_after_frozen_sync",
        ):
            assert r[key] < LOGPROB_TOL, (rank, key, r)
        assert r["sync_bytes"] == 4 * r["n_params"], (rank, r)
        assert r["frozen_sync_bytes"] == 4 * (r["n_params"] - r["tower_params"]), (rank, r)
        assert r["gap_with_unsynced_tower"] > 100 * LOGPROB_TOL, (rank, r)
        assert r["mixed_step_ok"], (rank, r)
    print({k: v for k, v in results[0].items() if "gap" in k or "bytes" in k})


def test_vlm_rollout_tp1(tiny_vl, tmp_path):
    _assert(run_distributed(_checks, 2, tiny_vl, str(tmp_path), 1))


def test_vlm_rollout_tp2(tiny_vl, tmp_path):
    _assert(run_distributed(_checks, 2, tiny_vl, str(tmp_path), 2))


def test_vlm_rollout_qwen3_vl(tmp_path):
    """The same checks on a tiny Qwen3-VL (interleaved M-RoPE, deepstack features, 16 px
    patches), which vLLM's CPU model list does not name."""
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    path = str(build_vl_model(tmp_path / "qwen3_vl", "qwen3_vl"))
    _assert(run_distributed(_checks, 2, path, str(tmp_path), 1))
