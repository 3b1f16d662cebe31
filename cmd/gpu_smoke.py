"""`make gpu-smoke`: the CUDA paths the CPU test suite cannot reach, on one GPU, in minutes.

Builds a small random model locally (fsdp_rlhf.testing.tiny, no downloads) and prints one
``PASS``/``FAIL`` line per check; exit 1 when any check fails. Without CUDA it prints
``SKIP: no CUDA device`` and exits 0. NOTE: written without a GPU; not yet run on one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

GIB = 2**30
RESULTS: list[bool] = []


def check(name: str, fn, *args):
    """Run one check; print its PASS/FAIL line. Returns fn's second value (state for later
    checks) or None when it failed."""
    start = time.perf_counter()
    try:
        detail, state = fn(*args)
        ok = True
    except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
        detail, state, ok = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", None, False
        if os.environ.get("GPU_SMOKE_DEBUG"):
            traceback.print_exc()
    RESULTS.append(ok)
    mark = "PASS" if ok else "FAIL"
    print(f"{mark} {name} ({time.perf_counter() - start:.1f}s): {detail}", flush=True)
    return state


def _cfg(model: str, *extra: str):
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config

    flags = ["--pretrain", model, "--reward_pretrain", model, "--bf16", "--prompt_max_len", "64"]
    flags += ["--generate_max_len", "32", "--vllm_gpu_memory_utilization", "0.3", *extra]
    return build_config(PPOConfig, flags)[0]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def versions_check():
    from fsdp_rlhf.doctor import versions
    from fsdp_rlhf.rollout.vllm_engine import check_vllm_internals

    v = versions()
    return f"{v} vllm adapter ok ({check_vllm_internals()})", None


def model_runner(llm) -> str:
    """Class of the in-process model runner (v1 or v2), found by walking vLLM's objects."""
    obj = llm.llm_engine
    for attr in ("engine_core", "engine_core", "model_executor", "driver_worker", "worker"):
        obj = getattr(obj, attr, obj)
    runner = getattr(obj, "model_runner", None)
    return f"{type(runner).__module__}.{type(runner).__name__}" if runner else "unknown"


def engine_beside_models(model: str, env):
    """Shard actor + ref onto the GPU first, then start vLLM next to them (the job's order
    at every wake-up)."""
    from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer
    from fsdp_rlhf.rollout.memory_budget import check_device_budget
    from fsdp_rlhf.trainers.ppo_setup import build_engine, prepare_ppo_model

    cfg = _cfg(model)
    tok = load_tokenizer(model)
    actor = prepare_ppo_model(
        load_causal_lm(model, cfg.backend, env.device), cfg, env, trainable=True
    )
    ref_model = load_causal_lm(model, cfg.backend, env.device, dtype=torch.bfloat16)
    ref = prepare_ppo_model(ref_model, cfg, env, trainable=False)
    line = check_device_budget(env.device, cfg.rollout.vllm_gpu_memory_utilization)
    engine = build_engine(cfg, env, tok)
    state = dict(cfg=cfg, tok=tok, actor=actor, ref=ref, engine=engine)
    return f"runner {model_runner(engine.llm)}; {line}", state


def _prompts(tok, n: int = 8) -> list[list[int]]:
    from fsdp_rlhf.testing.synthetic import prompt_rows

    return [tok(r["input"], add_special_tokens=False)["input_ids"] for r in prompt_rows(n)]


def greedy_matches_hf(model: str, s: dict):
    from transformers import AutoModelForCausalLM

    from fsdp_rlhf.rollout import SamplingConfig

    prompts = _prompts(s["tok"])
    out = s["engine"].generate(prompts, SamplingConfig(max_new_tokens=16, greedy=True))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    same = 0
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda")
        gen = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
        ref = gen[0, len(p) :].tolist()
        n = int(out.response_mask[i].sum())
        same += out.response_ids[i, :n].tolist() == ref[:n]
    del hf
    if same != len(prompts):
        raise AssertionError(f"{same}/{len(prompts)} greedy rows equal HF's")
    return f"{same}/{len(prompts)} rows equal HF greedy (bf16)", None


def _one_step(actor, optimizer, prompts, s):
    """One AdamW step on a log-likelihood loss over some sampled responses."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.rollout import SamplingConfig

    out = s["engine"].generate(prompts, SamplingConfig(max_new_tokens=16, seed=1))
    ids, mask = (t.cuda() for t in out.sequences())
    lp, _ = response_logprobs(actor, ids, mask, out.response_ids.shape[1])
    (-(lp * out.response_mask.cuda()).sum() / out.response_mask.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def logprob_gap_after_sync(s: dict):
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.rollout import SamplingConfig
    from fsdp_rlhf.rollout.weight_sync import sync_weights

    actor, prompts = s["actor"], _prompts(s["tok"], 16)
    _one_step(actor, torch.optim.AdamW(actor.parameters(), lr=1e-3), prompts, s)
    stats = sync_weights(actor, s["engine"], torch.bfloat16)
    out = s["engine"].generate(prompts, SamplingConfig(max_new_tokens=32, seed=2))
    ids, mask = (t.cuda() for t in out.sequences())
    with torch.no_grad():
        lp, _ = response_logprobs(actor, ids, mask, out.response_ids.shape[1])
    rmask = out.response_mask.cuda().bool()
    gap = (lp - out.engine_logprobs.cuda()).abs()[rmask].mean().item()
    if not gap < 0.02:
        raise AssertionError(f"mean |engine - trainer| log-prob {gap:.4f} >= 0.02")
    return f"mean |diff| {gap:.4f} over {int(rmask.sum())} tokens; sync {stats.seconds:.2f}s", None


def sleep_wake_cycles(s: dict):
    """Three sleep/wake cycles per level; free memory must come back to the awake baseline."""
    from fsdp_rlhf.rollout.weight_sync import stream_actor_weights

    llm, dev = s["engine"].llm, torch.device("cuda", torch.cuda.current_device())
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
                s["engine"].update_weights(stream_actor_weights(s["actor"], torch.bfloat16))
            torch.cuda.empty_cache()
            back = torch.cuda.mem_get_info(dev)[0]
            if abs(back - base) > 256 << 20 or asleep <= base:
                raise AssertionError(
                    f"level {level}: free awake {_gib(base)}, asleep {_gib(asleep)}, "
                    f"after wake {_gib(back)}"
                )
        report.append(f"level {level} frees {_gib(asleep - base)}")
    return "; ".join(report) + f", back to {_gib(base)} free each time", None


def no_grad_memory(model: str, env):
    """After a no-grad forward, allocated memory is back to the sharded size (ZeRO 2 and 3)."""
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.trainers.ppo_setup import prepare_ppo_model

    lines = []
    for stage in ("2", "3"):
        cfg = _cfg(model, "--zero_stage", stage)
        for trainable in (True, False):
            m = prepare_ppo_model(
                load_causal_lm(model, cfg.backend, env.device), cfg, env, trainable
            )
            full = sum(p.numel() for p in m.parameters()) * 2  # bf16 gathered copy
            before = torch.cuda.memory_allocated()
            with torch.no_grad():
                m(input_ids=torch.randint(2, 500, (4, 64), device="cuda"))
            torch.cuda.synchronize()
            extra = torch.cuda.memory_allocated() - before
            del m
            if extra > full // 4:
                raise AssertionError(f"zero {stage} trainable={trainable}: {_gib(extra)} kept")
            lines.append(f"z{stage}{'T' if trainable else 'F'} +{extra >> 20} MiB")
    return ", ".join(lines), None


def adam_offload_update(model: str, env):
    from fsdp_rlhf.distributed.fsdp import clip_grad_norm_
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.trainers.ppo_setup import prepare_ppo_model

    cfg = _cfg(model, "--adam_offload", "--zero_stage", "3")
    m = prepare_ppo_model(load_causal_lm(model, cfg.backend, env.device), cfg, env, trainable=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(2, 500, (4, 64), device="cuda")
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = clip_grad_norm_(list(m.parameters()), 1.0)
    opt.step()
    devices = {p.to_local().device.type for p in m.parameters()}
    state = {t.device.type for st in opt.state.values() for t in st.values() if t.ndim > 0}
    if devices != {"cpu"} or state != {"cpu"}:
        raise AssertionError(f"params on {devices}, Adam state on {state}")
    return f"loss {loss.item():.3f}, grad norm {norm:.3f}, params and Adam on CPU", None


def packed_vs_padded(model: str, env):
    """flash-attn varlen on one packed row vs the padded batch: same loss, both timed."""
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.load import attn_implementation, load_causal_lm

    dev = env.device
    if attn_implementation(True, dev) != "flash_attention_2":
        raise RuntimeError("flash-attn is not installed: the packed path cannot be checked")
    m = load_causal_lm(model, BackendConfig(flash_attn=True), dev, dtype=torch.bfloat16).to(dev)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 500, (16, 256), generator=g).to(dev)
    mask = torch.ones_like(ids)
    for i in range(16):  # left-padded prompts of varying length, like rollouts
        mask[i, : 8 * i] = 0
    out = {}
    for packed in (False, True):
        response_logprobs(m, ids, mask, 64, packed=packed)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            lp, _ = response_logprobs(m, ids, mask, 64, packed=packed)
        torch.cuda.synchronize()
        out[packed] = (lp.float().mean().item(), time.perf_counter() - t0)
    diff = abs(out[True][0] - out[False][0])
    if diff > 1e-2 * max(1.0, abs(out[False][0])):
        raise AssertionError(f"mean log-prob padded {out[False][0]:.4f} packed {out[True][0]:.4f}")
    return (
        f"mean log-prob {out[False][0]:.4f} vs {out[True][0]:.4f}; padded "
        f"{out[False][1] * 1e3:.1f} ms, packed {out[True][1] * 1e3:.1f} ms"
    ), None


def _torchrun(args: list[str], timeout: int = 150) -> subprocess.CompletedProcess:
    from fsdp_rlhf.testing.launch import local_torchrun

    cmd = local_torchrun(1, ["-m", "fsdp_rlhf.cli", *args])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _ppo_flags(model: str, root: Path) -> list[str]:
    from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl, write_reward_file

    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(prompt_rows(64), root / "prompts.jsonl")
    write_reward_file(root / "reward.py")
    flags = ["--pretrain", model, "--critic_pretrain", model, "--remote_rm_url"]
    flags += [str(root / "reward.py"), "--prompt_data", str(root / "prompts.jsonl")]
    flags += ["--input_key", "input", "--rollout_batch_size", "8", "--n_samples_per_prompt", "2"]
    flags += ["--train_batch_size", "16", "--micro_train_batch_size", "4"]
    flags += ["--micro_rollout_batch_size", "8", "--prompt_max_len", "64"]
    flags += ["--generate_max_len", "32", "--vllm_gpu_memory_utilization", "0.3"]
    return flags + ["--save_path", str(root / "out")]


def ppo_two_steps(model: str, root: Path):
    import json

    flags = [*_ppo_flags(model, root), "--bf16", "--zero_stage", "3", "--max_steps", "2"]
    proc = _torchrun(["ppo", *flags])
    if proc.returncode != 0:
        raise RuntimeError(f"ppo exited {proc.returncode}: {proc.stderr[-500:]}")
    rows = [json.loads(x) for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    peaks = {k: v for k, v in rows[-1].items() if k.startswith("memory/")}
    text = ", ".join(f"{k[7:]} {v:.2f}" for k, v in sorted(peaks.items()))
    return f"{len(rows)} steps logged; peak GiB per phase: {text or 'none logged'}", None


def doctor_check(model: str, root: Path):
    proc = _torchrun(["doctor", *_ppo_flags(model, root / "doctor")])
    verdict = [x for x in proc.stdout.splitlines() if x.startswith("VERDICT")]
    if proc.returncode != 0:
        raise RuntimeError(verdict[-1] if verdict else proc.stderr[-500:])
    return verdict[-1], None


def in_process_checks(model: str) -> None:
    """Everything that shares one process group and one engine (vLLM's shutdown destroys the
    group, so the engine closes last)."""
    from fsdp_rlhf.distributed.env import init_distributed

    env = init_distributed()
    s = check("engine starts beside resident models", engine_beside_models, model, env)
    if s is not None:
        check("greedy vLLM == HF greedy (bf16)", greedy_matches_hf, model, s)
        check("log-prob gap after step + sync < 0.02", logprob_gap_after_sync, s)
        check("3 sleep/wake cycles, levels 1 and 2", sleep_wake_cycles, s)
        s["actor"] = s["ref"] = None
    check("no-grad passes leave params sharded", no_grad_memory, model, env)
    check("one update with --adam_offload", adam_offload_update, model, env)
    check("packed flash-attn varlen vs padded", packed_vs_padded, model, env)
    if s is not None:
        s["engine"].close()


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device", flush=True)
        return 0
    from fsdp_rlhf.testing.tiny import build_model

    check("versions", versions_check)
    root = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    # small "bench" shape: big enough for flash-attn tiles and a measurable sync, built locally
    model = str(build_model(root / "model", "qwen2", hidden_size=512, num_layers=4, num_heads=8))
    # the in-process checks run in a child so its engine and group are gone before torchrun;
    # timeouts: child 300 s + PPO 150 s + doctor 150 s keep the whole run under 10 minutes
    child = subprocess.run(
        [sys.executable, __file__, "--in-process", model], timeout=300, check=False
    )
    RESULTS.append(child.returncode == 0)
    check("two PPO steps, --bf16 --zero_stage 3 (torchrun, 1 rank)", ppo_two_steps, model, root)
    check("doctor", doctor_check, model, root)
    print(f"gpu-smoke: {sum(RESULTS)}/{len(RESULTS)} passed", flush=True)
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--in-process":
        in_process_checks(sys.argv[2])
        sys.exit(0 if all(RESULTS) else 1)
    sys.exit(main())
