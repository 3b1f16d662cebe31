"""Speed on the GPU, so that a lent GPU returns numbers and not only PASS lines: on the 1.5 B
model (Qwen2.5-1.5B's shape, ``suite.build_big_model``), bf16 with fp32 master weights under
FSDP2 and 4k-token packed rows, with the levers of issue #58 (one varlen attention call per
layer, whole layers compiled, selective checkpointing, each layer gathered once per step):

- the actor update's training tokens/s and MFU (forward, backward, optimizer step), FAIL under
  40% MFU (what torchtitan's FSDP2 Llama runs report on an H100; the ladder,
  ``scripts/gpu_mfu_ladder.py``, measures each lever on its own);
- the HF rollout engine's generated tokens/s;
- the weight gather (``iter_full_params``, what every weight sync streams) in s per GB, and a
  full sync into the HF engine.

Each is printed beside the H100 roofline (bf16 dense peak and HBM bandwidth, as in the
project's ``roofline.py``) and written to a dated JSON in ``suite.results_dir()``.

Model FLOPs count what the job needs, not what it recomputes: 6 x the non-embedding parameters
per token, 6 x the LM head per response token (the only positions whose logits are computed),
and causal attention's 6 x 2 x L x d_model per token per layer; hardware FLOPs (HFU) add
what checkpointing recomputes (selective checkpointing recomputes no matmul: HFU = MFU)."""

from __future__ import annotations

import datetime
import json
import statistics
import time

import pytest
import torch

from tests.gpu.suite import results_dir

pytestmark = pytest.mark.gpu

# bf16 dense tensor-core peak and HBM bandwidth: H100 SXM (roofline.py); the H200 has the same
# compute and 4.8 TB/s.
PEAK = {"H100": dict(flops=989e12, hbm=3.35e12), "H200": dict(flops=989e12, hbm=4.8e12)}
MFU_FLOOR = 0.40
# one optimizer step: MICRO micro-batches of ROWS sequences of ROW_LEN tokens packed into one
# row of ROWS * ROW_LEN = 4096 tokens, the last RESPONSE tokens of each sequence the response
ROWS, ROW_LEN, RESPONSE, MICRO = 4, 1024, 768, 4
RESULTS: dict[str, dict] = {}
# the update's levers (issue #58; --accumulate_gathered is auto by default)
LEVERS = ("--torch_compile", "--gradient_checkpointing_policy", "selective")


def _peak() -> tuple[str, dict]:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100"
    key = "H200" if "H200" in name else "H100"
    return key, PEAK[key]


def _on_gpu(env) -> bool:
    return env.device.type == "cuda"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _write(key: str, values: dict) -> None:
    """Add one check's numbers to the run's dated JSON (rewritten after each check)."""
    RESULTS[key] = values
    day = datetime.date.today().isoformat()
    out = results_dir() / f"{day}-gpu-speed.json"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    meta = {"date": day, "device": device, "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, **RESULTS}, indent=1) + "\n")


def _cfg(model: str, *extra: str):
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config

    flags = [
        "--pretrain", model, "--bf16", "--gradient_checkpointing", "--packing_samples",
        "--zero_stage", "3", "--prompt_max_len", str(ROW_LEN - RESPONSE),
        "--generate_max_len", str(RESPONSE), "--actor_learning_rate", "1e-6", *extra,
    ]  # fmt: skip
    return build_config(PPOConfig, flags)[0]


def _actor(model: str, cfg, env):
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.trainers.ppo.setup import load_ppo_model

    def load(weights: bool):
        return load_causal_lm(model, cfg.backend, env.device, weights=weights)

    return load_ppo_model(load, cfg, env, trainable=True, what="the speed check's actor")


def model_flops(config, tokens: int, response_tokens: int, seq_len: int) -> dict[str, float]:
    """FLOPs of forward+backward over ``tokens`` tokens in sequences of ``seq_len``: model
    FLOPs (3 x forward) and hardware FLOPs with one recomputed forward (4 x forward)."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = h // heads
    per_layer = (
        h * (heads * d) + 2 * h * (kv * d) + (heads * d) * h + 3 * h * config.intermediate_size
    )
    body = layers * per_layer
    fwd = 2 * body * tokens + 2 * vocab * h * response_tokens
    fwd += 2 * layers * seq_len * h * tokens  # causal QK^T and AV: 2 * 2 * L/2 * h per token
    return {"model": 3 * fwd, "hardware": 4 * fwd, "body_params": body}


def test_actor_update_speed(big_model, detail):
    """Tokens/s and MFU of the actor update: MICRO micro-batches of one 4096-token packed row
    each (4 sequences of 1024: 256 prompt + 768 response), log-probs of the responses by the
    chunked path, a PPO-clip-shaped loss, backward, grad clipping, AdamW."""
    from fsdp_rlhf.distributed.env import init_distributed
    from fsdp_rlhf.distributed.fsdp import accumulate, clip_grad_norm_
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.optim import build_optimizer
    from fsdp_rlhf.trainers.ppo.setup import update_accumulation

    env = init_distributed()
    cfg = _cfg(big_model, *LEVERS)
    actor = _actor(big_model, cfg, env)
    optim = build_optimizer(actor, cfg.actor_optim)
    gathered = update_accumulation(cfg, env)
    g = torch.Generator().manual_seed(0)
    vocab = actor.config.vocab_size
    batches = [
        torch.randint(10, vocab, (ROWS, ROW_LEN), generator=g).to(env.device) for _ in range(MICRO)
    ]
    mask = torch.ones(ROWS, ROW_LEN, dtype=torch.long, device=env.device)
    adv = torch.randn(ROWS, RESPONSE, generator=g).to(env.device)

    def step() -> float:
        _sync()
        t0 = time.perf_counter()
        for i, ids in enumerate(batches):
            accumulate(actor, i == len(batches) - 1, cfg.fsdp.zero_stage, gathered)
            lp, _ = response_logprobs(actor, forward_inputs(ids, mask, packed=True), RESPONSE)
            ratio = torch.exp(lp - lp.detach())
            loss = -(torch.clamp(ratio, 0.8, 1.2) * adv).mean() / MICRO
            loss.backward()
        clip_grad_norm_(list(actor.parameters()), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        _sync()
        return time.perf_counter() - t0

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up (allocator, kernels' autotuning)
    times = [step() for _ in range(3)]
    seconds = statistics.median(times)
    tokens = MICRO * ROWS * ROW_LEN
    flops = model_flops(actor.config, tokens, MICRO * ROWS * RESPONSE, ROW_LEN)
    gpu, peak = _peak()
    mfu = flops["model"] / seconds / peak["flops"]
    hfu = flops["model"] / seconds / peak["flops"]  # selective: no matmul recomputed
    values = dict(
        step_s=seconds, steps_s=times, tokens_per_step=tokens, tokens_per_s=tokens / seconds,
        mfu=mfu, hfu=hfu, model_tflops_per_step=flops["model"] / 1e12,
        peak_tflops=peak["flops"] / 1e12,
        peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if _on_gpu(env) else 0,
        config="bf16 (fp32 master), FSDP2 zero 3 (--accumulate_gathered auto: "
        f"{'on' if gathered else 'off'}), varlen attention, compiled layers, selective "
        f"checkpointing, {MICRO} x {ROWS * ROW_LEN}-token packed rows per step",
    )  # fmt: skip
    _write("actor_update", values)
    detail(
        f"{tokens / seconds:,.0f} tokens/s, step {seconds:.3f} s (median of {times}), MFU "
        f"{mfu:.1%} (HFU {hfu:.1%}: selective checkpointing recomputes no matmul) of {gpu} "
        f"bf16 peak "
        f"{peak['flops'] / 1e12:.0f} TFLOP/s; peak allocated {values['peak_allocated_gib']:.1f} GiB"
    )
    assert mfu >= MFU_FLOOR, f"actor update MFU {mfu:.1%} < {MFU_FLOOR:.0%}"


def test_hf_rollout_and_weight_gather_speed(big_model, detail):
    """The HF engine's generated tokens/s (64 prompts of 128 tokens, 256 new tokens each, bf16,
    KV cache), and the weight gather of the FSDP2 actor (bf16 full tensors in buckets) with a
    full sync into the engine, in s per GB."""
    from fsdp_rlhf.distributed.env import init_distributed
    from fsdp_rlhf.distributed.fsdp import iter_full_params
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.rollout.engine import SamplingConfig
    from fsdp_rlhf.rollout.hf_engine import HFEngine
    from fsdp_rlhf.rollout.weight_sync import sync_weights

    env = init_distributed()
    cfg = _cfg(big_model)
    actor = _actor(big_model, cfg, env)
    engine_model = load_causal_lm(big_model, cfg.backend, env.device, torch.bfloat16)
    engine = HFEngine(engine_model.to(env.device), pad_token_id=0, eos_token_ids=[1], seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = engine_model.config.vocab_size
    prompts = torch.randint(10, vocab, (64, 128), generator=g).tolist()
    sampling = SamplingConfig(max_new_tokens=256, temperature=1.0, seed=0)
    engine.generate(prompts[:4], SamplingConfig(max_new_tokens=8))  # warm-up
    _sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    _sync()
    gen_s = time.perf_counter() - t0
    generated = int(out.response_mask.sum())
    gpu, peak = _peak()

    _sync()
    t0 = time.perf_counter()
    gathered = sum(t.numel() * t.element_size() for _, t in iter_full_params(actor, torch.bfloat16))
    _sync()
    gather_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    stats = sync_weights(actor, engine, torch.bfloat16)
    _sync()
    sync_s = time.perf_counter() - t0
    gb = gathered / 1e9
    values = dict(
        generated_tokens=generated, generate_s=gen_s, generated_tokens_per_s=generated / gen_s,
        gather_bytes=gathered, gather_s=gather_s, gather_s_per_gb=gather_s / gb,
        sync_s=sync_s, sync_s_per_gb=sync_s / gb, sync_stats=str(stats),
        hbm_roofline_s_per_gb=1e9 / peak["hbm"],
    )  # fmt: skip
    _write("rollout_and_sync", values)
    detail(
        f"HF engine: {generated / gen_s:,.0f} generated tokens/s ({generated} tokens, 64 x 256 "
        f"max, {gen_s:.1f} s); decode roofline at batch 64 about "
        f"{64 * peak['hbm'] / (2 * 1.54e9):,.0f} tokens/s (weights read once per step)"
    )
    detail(
        f"weight gather {gb:.2f} GB bf16 in {gather_s:.3f} s ({gather_s / gb:.3f} s/GB); full sync "
        f"into the HF engine {sync_s:.3f} s ({sync_s / gb:.3f} s/GB); {gpu} HBM copy roofline "
        f"{1e9 / peak['hbm'] * 2:.4f} s/GB (read + write)"
    )
    assert generated > 0 and gathered > 0
