"""The in-process vLLM engine on one GPU, in the job's order: the engine starts (its pool fraction
chosen or checked against the memory plan), sleeps, the sharded actor and reference load beside
it, then it wakes with the actor's weights. Which model runner ran (V2 on CUDA with Triton unless
``VLLM_USE_V2_MODEL_RUNNER=0``), greedy decoding against HF's, the log-prob gap after an update
and a weight sync, and sleep/wake cycles returning their memory. SKIP without vLLM (the bare
box: rollouts use the HF engine there)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.suite import available, build_odd_model, require

pytestmark = pytest.mark.gpu
GIB = 2**30


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    require("vllm", "cuda")
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.env import init_distributed
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.rollout import sync_weights
    from fsdp_rlhf.trainers.ppo.setup import build_engine, load_ppo_model

    model = build_odd_model(tmp_path_factory.mktemp("vllm") / "model")
    flags = ["--pretrain", model, "--bf16", "--prompt_max_len", "64", "--generate_max_len", "32"]
    cfg = build_config(PPOConfig, [*flags, "--vllm_gpu_memory_utilization", "0.3"])[0]
    env = init_distributed()
    tok = load_tokenizer(model)
    engine = build_engine(cfg, env, tok, vision=None)  # the engine first, then to sleep
    engine.sleep()

    def loader(dtype):
        return lambda w: load_causal_lm(model, cfg.backend, env.device, dtype, weights=w)

    actor = load_ppo_model(loader(torch.float32), cfg, env, True, "actor")
    ref = load_ppo_model(loader(torch.bfloat16), cfg, env, False, "reference")
    engine.wake_up(["weights"])  # the first rollout's wake-up, beside the shards
    sync_weights(actor, engine, torch.bfloat16)
    engine.wake_up(["kv_cache"])
    yield dict(model=model, cfg=cfg, env=env, tok=tok, engine=engine, actor=actor, ref=ref)
    engine.close()  # also destroys the process group (test_cuda's fixture re-makes it)


def _prompts(tok, n: int = 8) -> list[list[int]]:
    from fsdp_rlhf.testing.synthetic import prompt_rows

    return [tok(r["input"], add_special_tokens=False)["input_ids"] for r in prompt_rows(n)]


def test_model_runner_is_the_expected_one(state, detail):
    expected = "v2" if available("triton") else "v1"
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") in ("0", "false", "False"):
        expected = "v1"
    engine = state["engine"]
    detail(f"vLLM {engine.version}: model runner {engine.runner.upper()}")
    assert engine.runner == expected, (engine.runner, expected)


def test_greedy_vllm_agrees_with_hf(state, detail):
    """vLLM's greedy tokens against HF's distribution at the same prefix (teacher forcing), in
    bf16, both without the checkpoint's repetition penalty (generation_config.json has 1.05;
    vLLM's explicit sampling parameters do not take it, HF's generate would). Near-flat random
    logits make exact token equality a coin toss between close candidates, so each vLLM token
    must be within ``BEST_GAP`` of HF's best, and vLLM's log-probs close to HF's."""
    from transformers import AutoModelForCausalLM

    from fsdp_rlhf.rollout import SamplingConfig
    from fsdp_rlhf.rollout.hf_engine import generation_config

    best_gap_max, lp_gap_mean = 0.1, 0.02
    prompts = _prompts(state["tok"])
    sampling = SamplingConfig(max_new_tokens=16, greedy=True)
    out = state["engine"].generate(prompts, sampling)
    hf = AutoModelForCausalLM.from_pretrained(state["model"], dtype=torch.bfloat16).cuda().eval()
    pad = state["tok"].pad_token_id
    neutral = generation_config(sampling, [], pad)
    assert neutral.repetition_penalty == 1.0
    best_gaps, lp_gaps, same = [], [], 0
    for i, p in enumerate(prompts):
        n = int(out.response_mask[i].sum())
        tokens = out.response_ids[i, :n].tolist()
        ids = torch.tensor([p + tokens], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=ids).logits[0, len(p) - 1 : -1].float(), -1)
        chosen = logp.gather(-1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        best_gaps.append((logp.max(-1).values - chosen).max().item())
        lp_gaps.append((chosen.cpu() - out.engine_logprobs[i, :n].float()).abs().mean().item())
        gen = hf.generate(torch.tensor([p], device="cuda"), generation_config=neutral)
        same += gen.sequences[0, len(p) : len(p) + n].tolist() == tokens
    del hf
    detail(
        f"max HF best - vLLM pick {max(best_gaps):.4f} nats, mean |vLLM - HF log-prob| "
        f"{sum(lp_gaps) / len(lp_gaps):.4f}; {same}/{len(prompts)} rows token-equal"
    )
    assert max(best_gaps) < best_gap_max, best_gaps
    assert sum(lp_gaps) / len(lp_gaps) < lp_gap_mean, lp_gaps


def test_logprob_gap_after_an_update_and_a_sync(state, detail):
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.rollout import SamplingConfig, sync_weights

    actor, engine, prompts = state["actor"], state["engine"], _prompts(state["tok"], 16)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=16, seed=1))
    ids, mask = (t.cuda() for t in out.sequences())
    lp, _ = response_logprobs(actor, forward_inputs(ids, mask), out.response_ids.shape[1])
    (-(lp * out.response_mask.cuda()).sum() / out.response_mask.sum()).backward()
    opt.step()
    stats = sync_weights(actor, engine, torch.bfloat16)
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=32, seed=2))
    ids, mask = (t.cuda() for t in out.sequences())
    with torch.no_grad():
        lp, _ = response_logprobs(actor, forward_inputs(ids, mask), out.response_ids.shape[1])
    rmask = out.response_mask.cuda().bool()
    gap = (lp - out.engine_logprobs.cuda()).abs()[rmask].mean().item()
    detail(f"mean |engine - trainer| {gap:.4f} over {int(rmask.sum())} tokens; sync "
           f"{stats.seconds:.2f}s")  # fmt: skip
    assert gap < 0.02, gap


def test_sleep_wake_cycles_return_their_memory(state, detail):
    from fsdp_rlhf.rollout.weight_sync import stream_actor_weights

    llm, dev = state["engine"].llm, torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    base = torch.cuda.mem_get_info(dev)[0]
    report = []
    for level in (1, 2):
        for _ in range(3):
            llm.sleep(level=level)
            torch.cuda.empty_cache()
            asleep = torch.cuda.mem_get_info(dev)[0]
            llm.wake_up()
            if level == 2:  # discarded weights: a full sync, as the trainer does
                state["engine"].update_weights(stream_actor_weights(state["actor"], torch.bfloat16))
            torch.cuda.empty_cache()
            back = torch.cuda.mem_get_info(dev)[0]
            assert abs(back - base) <= 256 << 20 and asleep > base, (level, base, asleep, back)
        report.append(f"level {level} frees {(asleep - base) / GIB:.2f} GiB")
    detail("; ".join(report) + f", back to {base / GIB:.2f} GiB free each time")
