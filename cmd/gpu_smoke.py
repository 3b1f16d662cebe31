"""`make gpu-smoke`: the CUDA paths the CPU test suite cannot reach, on one GPU, in minutes.

Runs from the source tree (``PYTHONPATH=$PWD python3 cmd/gpu_smoke.py``): nothing is installed or
fetched, so it runs on a machine whose only extra packages are wheels carried with the tree
(docs/gpu.md has the bare-box command). Builds its models locally (random weights) and prints one
line per check: ``PASS``, ``FAIL``, or ``SKIP`` with the reason when what a check needs is not
there (vLLM, flash-attn, CUDA). Without vLLM, PPO and doctor run with ``--rollout_engine hf``;
without flash-attn the packed forward is checked with SDPA. Exit 1 when any check fails.

    python3 cmd/gpu_smoke.py                 # every check (about 10 minutes on one H100)
    python3 cmd/gpu_smoke.py --part small    # all but the 1.5B memory check
    python3 cmd/gpu_smoke.py --part memory   # doctor's per-phase estimate vs the measured peaks
    python3 cmd/gpu_smoke.py --cpu           # rehearse the checks' logic on CPU (tiny, gloo)

Without CUDA and without ``--cpu`` it prints ``SKIP: no CUDA device`` and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from the source tree: no install needed

GIB = 2**30
RESULTS: list[bool] = []
# what this run has: filled by main() (vLLM and flash-attn may be absent on the GPU box)
HAVE = {"cuda": False, "vllm": False, "flash_attn": False}
WHY_MISSING = {
    "cuda": "needs CUDA (CPU rehearsal)",
    "vllm": "needs vLLM (not installed: rollouts use --rollout_engine hf)",
    "flash_attn": "needs flash-attn (not installed)",
}
# seconds each torchrun child may take (the whole --part small stays under 10 minutes)
TORCHRUN_TIMEOUT = 240


def available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it (how the tests hide vLLM)
        return False


def check(name: str, fn, *args, needs: tuple[str, ...] = ()):
    """Run one check; print its PASS/FAIL line, or SKIP naming the first missing need.
    Returns fn's second value (state for later checks) or None when it failed or skipped."""
    missing = [n for n in needs if not HAVE[n]]
    if missing:
        print(f"SKIP {name}: {WHY_MISSING[missing[0]]}", flush=True)
        return None
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

    v = versions()
    line = ", ".join(f"{k} {x}" for k, x in v.items())
    if HAVE["vllm"]:
        from fsdp_rlhf.rollout.vllm_engine import check_vllm_internals

        line += f"; vllm adapter ok ({check_vllm_internals()})"
    return line, None


def unmet_requirements(dist: str, seen: set[str] | None = None) -> list[str]:
    """``dist``'s requirements (no extras), and theirs, that the installed packages do not
    meet: read from the packages' metadata, so nothing is imported."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen = set() if seen is None else seen
    bad = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{req.name} missing (needed by {dist})")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have} (needs {req.specifier}, for {dist})")
        elif name not in seen:
            seen.add(name)
            bad += unmet_requirements(req.name, seen)
    return bad


def datasets_check():
    """`datasets` travels as a wheel (docs/gpu.md): its pins, and its requirements' pins, against
    what the box has (pyarrow, fsspec, pandas...), before it is imported."""
    from importlib import metadata

    bad = unmet_requirements("datasets")
    if bad:
        raise RuntimeError("unmet: " + "; ".join(bad))
    import datasets  # noqa: F401 - the data loaders import it where used

    have = {n: metadata.version(n) for n in ("datasets", "pyarrow", "fsspec", "pandas")}
    return "requirements met: " + ", ".join(f"{k} {v}" for k, v in have.items()), None


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


def packed_vs_padded(model: str, env, batch: int, length: int, response: int):
    """One packed row against the padded batch, forward and backward: flash-attn's varlen kernel
    when it is installed, else our per-sequence SDPA (models.attention); same log-probs and
    gradients, both timed."""
    import copy

    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.load import load_causal_lm

    dev, cuda = env.device, env.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    flash = HAVE["flash_attn"] and cuda
    padded = load_causal_lm(model, BackendConfig(flash_attn=flash), dev, dtype=dtype).to(dev)
    padded.set_attn_implementation("sdpa")
    packed = copy.deepcopy(padded)
    if flash:
        packed.set_attn_implementation("flash_attention_2")
    use_varlen_attention(packed, dev.type)
    kernel = packed.config._attn_implementation
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 500, (batch, length), generator=g).to(dev)
    mask = torch.ones_like(ids)
    for i in range(batch):  # left-padded prompts of varying length, like rollouts
        mask[i, : (length - response) * i // batch] = 0
    out = {}
    for m, is_packed in ((padded, False), (packed, True)):
        for _ in range(2):  # warm-up, then timed
            m.zero_grad(set_to_none=True)
            sync(dev)
            t0 = time.perf_counter()
            lp, _ = response_logprobs(m, ids, mask, response, packed=is_packed)
            (-lp.float().mean()).backward()
            sync(dev)
        grad = torch.cat([p.grad.float().flatten() for p in m.parameters()])
        out[is_packed] = (lp.detach().float(), grad, time.perf_counter() - t0)
    lp_gap = (out[True][0] - out[False][0]).abs().max().item()
    grad_gap = ((out[True][1] - out[False][1]).norm() / out[False][1].norm()).item()
    tol = 5e-2 if cuda else 1e-4  # bf16 kernels on the GPU, fp32 on CPU
    if not (lp_gap < tol * 10 and grad_gap < tol):
        raise AssertionError(f"{kernel}: max |log-prob diff| {lp_gap:.4f}, grad rel {grad_gap:.4f}")
    return (
        f"{kernel}: max |log-prob diff| {lp_gap:.2e}, grad rel diff {grad_gap:.2e}; fwd+bwd "
        f"padded {out[False][2] * 1e3:.1f} ms, packed {out[True][2] * 1e3:.1f} ms"
    ), None


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _torchrun(args: list[str], timeout: int = TORCHRUN_TIMEOUT) -> subprocess.CompletedProcess:
    from fsdp_rlhf.testing.launch import local_torchrun

    cmd = local_torchrun(1, ["-m", "fsdp_rlhf.cli", *args])
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _ppo_flags(model: str, root: Path, sizes: dict) -> list[str]:
    from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl, write_reward_file

    root.mkdir(parents=True, exist_ok=True)
    write_jsonl(prompt_rows(64), root / "prompts.jsonl")
    write_reward_file(root / "reward.py")
    flags = ["--pretrain", model, "--critic_pretrain", model, "--remote_rm_url"]
    flags += [str(root / "reward.py"), "--prompt_data", str(root / "prompts.jsonl")]
    flags += ["--input_key", "input", "--rollout_batch_size", "8", "--n_samples_per_prompt", "2"]
    flags += ["--train_batch_size", "16", "--micro_train_batch_size", str(sizes["micro"])]
    flags += ["--micro_rollout_batch_size", str(sizes["micro"]), "--prompt_max_len"]
    flags += [str(sizes["prompt"]), "--generate_max_len", str(sizes["response"])]
    flags += ["--vllm_gpu_memory_utilization", "0.3"]
    if not HAVE["vllm"]:
        flags += ["--rollout_engine", "hf"]
    return flags + ["--save_path", str(root / "out")]


def _metrics(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]


def ppo_steps(model: str, root: Path, sizes: dict, extra: list[str], steps: int = 2):
    flags = [*_ppo_flags(model, root, sizes), *extra, "--max_steps", str(steps)]
    proc = _torchrun(["ppo", *flags])
    if proc.returncode != 0:
        raise RuntimeError(f"ppo exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    rows = _metrics(root)
    peaks = {k: v for k, v in rows[-1].items() if k.startswith("memory/")}
    text = ", ".join(f"{k[7:]} {v:.2f}" for k, v in sorted(peaks.items()))
    engine = "hf" if "--rollout_engine" in flags else "vllm"
    return f"{len(rows)} steps ({engine} engine); peak GiB per phase: {text or 'none'}", rows


def doctor_check(model: str, root: Path, sizes: dict):
    proc = _torchrun(["doctor", *_ppo_flags(model, root / "doctor", sizes)])
    verdict = [x for x in proc.stdout.splitlines() if x.startswith("VERDICT")]
    if proc.returncode != 0:
        raise RuntimeError(verdict[-1] if verdict else proc.stderr.strip()[-500:])
    estimate = [x for x in proc.stdout.splitlines() if "memory estimate" in x]
    return verdict[-1] + (f" | {estimate[-1].split(': ', 1)[-1]}" if estimate else ""), None


# doctor's phases (distributed.memory) and the trainer's timed phases they cover
MEASURED_PHASES = {
    "rollout": ("rollout",),
    "scoring (no-grad)": ("old_log_p", "reference_model", "critic_model", "reward_model"),
    "actor update": ("update",),
    "critic update": ("update_critic",),
}
MEMORY_TOLERANCE = 0.10


def compare_phases(phases, metrics: dict) -> list[dict]:
    """Doctor's per-phase estimate beside the measured peaks of one step's metrics.

    The estimate's tensors (its total less the CUDA context, which the allocator does not see)
    are compared with ``max_memory_allocated``; ``memory_reserved`` and the device's used memory
    (``mem_get_info``, at the phase's end) are shown beside them."""
    rows = []
    for phase in phases:
        timers = [t for t in MEASURED_PHASES.get(phase.name, ()) if f"memory/{t}_gib" in metrics]
        if not timers:
            continue

        def peak(prefix: str, timers=timers) -> float | None:
            vals = [metrics[f"{prefix}/{t}_gib"] for t in timers if f"{prefix}/{t}_gib" in metrics]
            return max(vals) if vals else None

        tensors = (phase.total - phase.parts.get("cuda context + nccl", 0)) / GIB
        allocated = peak("memory")
        rows.append(
            dict(
                phase=phase.name,
                estimate_gib=phase.total / GIB,
                estimate_tensors_gib=tensors,
                allocated_gib=allocated,
                reserved_gib=peak("memory_reserved"),
                device_used_gib=peak("memory_device_used"),
                error=(tensors - allocated) / allocated if allocated else float("inf"),
            )
        )
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    def gib(v):
        return "-" if v is None else f"{v:.2f}"

    out = ["phase | estimate (tensors) GiB | max allocated | max reserved | device used | error"]
    for r in rows:
        out.append(
            f"{r['phase']} | {gib(r['estimate_gib'])} ({gib(r['estimate_tensors_gib'])}) | "
            f"{gib(r['allocated_gib'])} | {gib(r['reserved_gib'])} | {gib(r['device_used_gib'])} "
            f"| {r['error']:+.0%}"
        )
    return out


def build_big_model(out: Path) -> str:
    """Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12/2 heads, 151,936 vocabulary, tied
    embeddings; no head_dim key), random bf16 weights, initialised on the GPU: big enough that
    fixed costs do not dominate the phases' memory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.testing.tiny import _drop_config_keys, build_tokenizer, write_generation_config

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = Qwen2Config(
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    _drop_config_keys(out, ("head_dim",))
    write_generation_config(out, tok)
    return str(out)


def memory_vs_estimate(root: Path):
    """doctor's per-phase estimate (distributed.memory) beside the peaks a 2-step PPO run on
    a 1.5B model measures; FAIL where they differ by more than 10%."""
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.doctor import plan_job

    model = build_big_model(root / "big")
    sizes = dict(micro=4, prompt=128, response=256)
    extra = ["--bf16", "--zero_stage", "3", "--gradient_checkpointing"]
    flags = [*_ppo_flags(model, root / "memory", sizes), *extra]
    cfg = build_config(PPOConfig, flags)[0]
    total = torch.cuda.mem_get_info()[1]
    phases = plan_job(cfg, 1, total, cuda=True)
    _, rows = ppo_steps(model, root / "memory", sizes, extra)
    table = compare_phases(phases, rows[-1])
    for line in format_rows(table):
        print(f"    {line}", flush=True)
    off = [r["phase"] for r in table if abs(r["error"]) > MEMORY_TOLERANCE]
    if off or not table:
        raise AssertionError(f"estimate off by more than 10% in {off or 'every phase'}")
    return f"{len(table)} phases within 10% of max_memory_allocated", None


def in_process_checks(model: str, sizes: dict) -> None:
    """Everything that shares one process group and one engine (vLLM's shutdown destroys the
    group, so the engine closes last)."""
    from fsdp_rlhf.distributed.env import init_distributed

    env = init_distributed()
    vllm_needs = ("vllm", "cuda")
    s = check(
        "engine starts beside resident models", engine_beside_models, model, env, needs=vllm_needs
    )
    if s is not None:
        check("greedy vLLM == HF greedy (bf16)", greedy_matches_hf, model, s)
        check("log-prob gap after step + sync < 0.02", logprob_gap_after_sync, s)
        check("3 sleep/wake cycles, levels 1 and 2", sleep_wake_cycles, s)
        s["actor"] = s["ref"] = None
    elif not all(HAVE[n] for n in vllm_needs):
        for name in ("greedy vLLM == HF greedy", "log-prob gap after sync", "sleep/wake cycles"):
            check(name, None, needs=vllm_needs)
    check("no-grad passes leave params sharded", no_grad_memory, model, env, needs=("cuda",))
    check("one update with --adam_offload", adam_offload_update, model, env, needs=("cuda",))
    kernel = "flash-attn varlen" if HAVE["flash_attn"] and HAVE["cuda"] else "SDPA varlen"
    check(
        f"packed ({kernel}) vs padded training",
        packed_vs_padded,
        model,
        env,
        sizes["batch"],
        sizes["length"],
        sizes["response"],
    )
    if s is not None:
        s["engine"].close()


SIZES = {
    # the GPU: flash-attn tiles and a measurable sync; CPU: a rehearsal of the same logic
    "cuda": dict(
        hidden=512, layers=4, heads=8, micro=4, prompt=64, response=32, batch=16, length=256
    ),
    "cpu": dict(hidden=128, layers=2, heads=2, micro=4, prompt=32, response=8, batch=4, length=48),
}
PPO_CONFIGS = (
    ["--bf16", "--zero_stage", "3", "--ref_reward_offload", "--packing_samples"],
    ["--bf16", "--zero_stage", "2", "--adam_offload"],
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="rehearse on CPU (tiny sizes, gloo)")
    p.add_argument("--part", choices=("all", "small", "memory"), default="all")
    args = p.parse_args(argv)
    HAVE.update(cuda=torch.cuda.is_available() and not args.cpu, vllm=available("vllm"))
    HAVE["flash_attn"] = available("flash_attn")
    if not HAVE["cuda"] and not args.cpu:
        print("SKIP: no CUDA device", flush=True)
        return 0
    from fsdp_rlhf.testing.tiny import build_model

    sizes = SIZES["cuda" if HAVE["cuda"] else "cpu"]
    root = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    if args.part in ("all", "small"):
        check("versions", versions_check)
        check("datasets pins", datasets_check)
        model = str(
            build_model(
                root / "model",
                "qwen2",
                hidden_size=sizes["hidden"],
                num_layers=sizes["layers"],
                num_heads=sizes["heads"],
            )
        )
        # the in-process checks run in a child so its engine and group are gone before torchrun
        results = root / "in_process.json"
        child = [sys.executable, __file__, "--in-process", model, json.dumps(sizes)]
        child += [json.dumps(HAVE), str(results)]
        proc = subprocess.run(child, timeout=300, check=False)
        if results.is_file():
            RESULTS.extend(json.loads(results.read_text()))
        if proc.returncode != 0 and (not results.is_file() or all(RESULTS)):
            print(f"FAIL in-process checks: exit {proc.returncode}", flush=True)
            RESULTS.append(False)
        for i, extra in enumerate(PPO_CONFIGS):
            check(
                f"two PPO steps, {' '.join(extra)}",
                ppo_steps,
                model,
                root / f"ppo{i}",
                sizes,
                extra,
            )
        check("doctor", doctor_check, model, root, sizes)
    if args.part in ("all", "memory"):
        check(
            "memory: doctor's estimate vs measured, 1.5B", memory_vs_estimate, root, needs=("cuda",)
        )
    fails = RESULTS.count(False)
    print(f"gpu-smoke: {sum(RESULTS)} passed, {fails} failed", flush=True)
    return 0 if not fails else 1


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--in-process":
        HAVE.update(json.loads(sys.argv[4]))
        in_process_checks(sys.argv[2], json.loads(sys.argv[3]))
        Path(sys.argv[5]).write_text(json.dumps(RESULTS))
        sys.exit(0 if all(RESULTS) else 1)
    sys.exit(main())
