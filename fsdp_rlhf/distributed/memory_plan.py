"""The memory model (``distributed.memory``) applied to one PPO job: its flags and its model
folders (config.json and safetensors headers; no weights are read), and the vLLM pool fraction
the job may use beside what the trainer keeps resident.

Used by ``doctor`` (every phase, before a job) and by the job itself, which chooses or checks
``--vllm_gpu_memory_utilization`` with it before any model or engine loads.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

from fsdp_rlhf.algorithms.names import CRITIC_ESTIMATORS
from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.distributed.memory import (
    GIB,
    VLLM_MIN_KV_BYTES,
    JobFlags,
    ModelShape,
    Phase,
    engine_only_phases,
    engine_weight_bytes,
    expert_parallel_options,
    fraction_limit,
    gathered_update_fits,
    plan_phases,
    pool_fraction_limit,
)
from fsdp_rlhf.errors import UserError

# --vllm_gpu_memory_utilization left unset: the largest fraction the plan fits, at most this
# (vLLM's own default is 0.92 of a device it has to itself).
AUTO_UTILIZATION_CAP = 0.9
UTIL_FLAG = "--vllm_gpu_memory_utilization"
_OFFLOAD = "--adam_offload / --ref_reward_offload"


def count_params(path: str) -> tuple[int, bool, int]:
    """(parameters, has an ``lm_head.weight``, routed expert parameters) of a local safetensors
    checkpoint, from its headers only. A checkpoint without ``lm_head.weight`` ties it to the
    embeddings (or has a scalar head): one ``V x h`` matrix. Routed experts are the tensors
    under a block's ``experts.`` (fused or one per expert; not ``shared_experts.``)."""
    from safetensors import safe_open

    total, lm_head, experts = 0, False, 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118
                n = math.prod(st.get_slice(key).get_shape())
                total += n
                lm_head |= key.endswith("lm_head.weight")
                experts += n if ".experts." in key else 0
    return total, lm_head, experts


def model_shape(path: str) -> ModelShape:
    """Shape from config.json, parameter counts (and whether the LM head is its own matrix)
    from the safetensors headers when there are any."""
    config = json.loads((Path(path) / "config.json").read_text())
    params, lm_head, experts = count_params(path)
    if not params:
        return ModelShape.from_hf_config(config)
    embeddings = 2 if lm_head else 1
    return ModelShape.from_hf_config(config, params, embeddings=embeddings, experts=experts)


def job_flags(cfg: PPOConfig, world: int, device_bytes: int) -> JobFlags:
    """The memory-relevant flags of a PPO config, for ``distributed.memory`` (an unset
    ``--vllm_gpu_memory_utilization`` is planned at ``AUTO_UTILIZATION_CAP``; see
    :func:`resolve_vllm_utilization` for the value the job uses)."""
    util = cfg.rollout.vllm_gpu_memory_utilization
    n = cfg.batch.n_samples_per_prompt
    # the actor's rows share their prompt pass (ppo.setup.prompt_group_size: padded attention
    # only); taken as n here, the batch sizes may let a smaller group share
    sharing = cfg.batch.share_prompt_prefix and n > 1
    sharing = sharing and not (cfg.batch.packing_samples or cfg.backend.flash_attn)
    return JobFlags(
        world=world,
        device_bytes=device_bytes,
        zero_stage=cfg.fsdp.zero_stage,
        bf16=cfg.backend.bf16,
        adam_offload=cfg.fsdp.adam_offload,
        ref_reward_offload=cfg.placement.ref_reward_offload,
        gpu_memory_utilization=AUTO_UTILIZATION_CAP if util is None else util,
        vllm_sleep=cfg.rollout.vllm_enable_sleep,
        micro_train_batch_size=cfg.batch.micro_train_batch_size,
        micro_rollout_batch_size=cfg.rollout.micro_rollout_batch_size,
        seq_len=cfg.total_len,
        response_len=cfg.rollout.generate_max_len,
        gradient_checkpointing=cfg.backend.gradient_checkpointing,
        checkpointing_policy=cfg.backend.gradient_checkpointing_policy,
        critic=cfg.algo.advantage_estimator in CRITIC_ESTIMATORS,
        reward=bool(cfg.models.reward_pretrain),
        lora=cfg.lora.enabled,
        engine=cfg.rollout.rollout_engine,
        rollout_seqs=max(1, cfg.batch.rollout_batch_size * cfg.batch.n_samples_per_prompt // world),
        ema=cfg.algo.enable_ema,
        cuda_graphs=not cfg.rollout.enforce_eager,
        vllm_tp=cfg.rollout.vllm_tensor_parallel_size,
        expert_parallel=cfg.fsdp.expert_parallel_size,
        sequence_parallel=cfg.fsdp.sequence_parallel_size,
        packing=cfg.batch.packing_samples,
        flash_attn=cfg.backend.flash_attn,
        shared_prompts=n if sharing else 1,
        teacher_offload=cfg.distill.teacher_offload,
    )


@dataclasses.dataclass(frozen=True)
class JobModels:
    """The job's model shapes as ``plan_phases`` takes them."""

    actor: ModelShape
    critic: ModelShape | None
    frozen: list[ModelShape]
    teacher: ModelShape | None = None  # on-policy distillation's colocated teacher


def job_models(cfg: PPOConfig, flags: JobFlags) -> JobModels:
    actor = model_shape(cfg.models.pretrain)
    critic_src = cfg.models.critic_pretrain or cfg.models.reward_pretrain
    critic = model_shape(critic_src) if flags.critic and critic_src else None
    reward = [model_shape(cfg.models.reward_pretrain)] if flags.reward else []
    frozen = reward if flags.lora else [actor, *reward]  # LoRA: no reference model
    path = cfg.distill.teacher_pretrain
    return JobModels(actor, critic, frozen, model_shape(path) if path else None)


def plan_job(
    cfg: PPOConfig, world: int, device_bytes: int, cuda: bool, hosts: int = 1
) -> list[Phase]:
    """Every phase of a step on one device of this job (reads the model folders' headers),
    over ``hosts`` hosts. An unset ``--vllm_gpu_memory_utilization`` is planned at the value
    the job would choose."""
    return plan_job_at(cfg, world, device_bytes, cuda, cfg.fsdp.sequence_parallel_size, hosts)


def plan_job_at(
    cfg: PPOConfig,
    world: int,
    device_bytes: int,
    cuda: bool,
    sequence_parallel: int,
    hosts: int = 1,
    expert_parallel: int | None = None,
) -> list[Phase]:
    """:func:`plan_job` with ``--sequence_parallel_size`` set to ``sequence_parallel`` (and
    ``--expert_parallel_size`` to ``expert_parallel`` when given)."""
    flags = dataclasses.replace(
        job_flags(cfg, world, device_bytes), sequence_parallel=sequence_parallel
    )
    if expert_parallel is not None:
        flags = dataclasses.replace(flags, expert_parallel=expert_parallel)
    models = job_models(cfg, flags)
    if not cuda and cfg.weight_sync_mode("cpu", hosts) == "delta":
        flags = dataclasses.replace(flags, sync_mirror=True)  # host memory is the device here
    if not cuda and cfg.rollout.rollout_engine == "vllm":
        # vLLM-CPU: the weights of its TP slice + --vllm_kvcache_space_gib (floor 1)
        kv = cfg.rollout.vllm_kvcache_space_gib or 1.0
        pool = engine_weight_bytes(flags, models.actor) + int(kv * GIB)
        flags = dataclasses.replace(flags, vllm_pool_bytes=pool)
    elif cfg.rollout.vllm_gpu_memory_utilization is None and flags.engine == "vllm":
        util = _auto_fraction(pool_fraction_limit(flags, *_args(models)))
        flags = dataclasses.replace(flags, gpu_memory_utilization=max(util, 0.01))
    return plan_phases(flags, *_args(models))


def expert_parallel_fit(
    cfg: PPOConfig, world: int, device_bytes: int, cuda: bool
) -> tuple[int | None, dict[int, int]]:
    """The smallest ``--expert_parallel_size`` with which every phase fits (None: none does;
    1 for a dense actor that fits), and the actor's routed expert bytes one rank gathers per
    MoE layer at each size this world and the experts allow."""
    actor = model_shape(cfg.models.pretrain)
    flags = job_flags(cfg, world, device_bytes)
    options = expert_parallel_options(world, actor.num_experts)
    per_layer = actor.experts // max(1, actor.layers)
    gathered = {e: flags.dtype_bytes * per_layer // e for e in options}
    sp = cfg.fsdp.sequence_parallel_size
    for e in options:
        if all(p.fits for p in plan_job_at(cfg, world, device_bytes, cuda, sp, expert_parallel=e)):
            return e, gathered
    return None, gathered


def _args(models: JobModels) -> tuple:
    return models.actor, models.critic, models.frozen, models.teacher


def _auto_fraction(limit: float) -> float:
    """The fraction an unset flag gets: ``limit`` rounded down to 0.01, at most the cap."""
    return min(AUTO_UTILIZATION_CAP, math.floor(limit * 100) / 100)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


Plan = Callable[[JobFlags], list[Phase]]


def _planner(models: JobModels, engine_only: bool) -> Plan:
    """The phases of one device: a colocated rank's (every model and the engine), or with
    ``engine_only`` an asynchronous job's rollout rank (its engine's TP slice only)."""
    if engine_only:
        return engine_only_phases
    return lambda flags: plan_phases(flags, *_args(models))


def _worst_pool_phase(flags: JobFlags, plan: Plan) -> Phase:
    """The phase holding vLLM's pool that overshoots its limit most (the wake, usually)."""
    phases = [p for p in plan(flags) if p.parts.get("vllm pool")]
    phases = phases or plan(flags)
    return max(phases, key=lambda p: p.total - p.limit)


def resolve_vllm_utilization(
    cfg: PPOConfig, world: int, device_bytes: int, *, engine_only: bool = False
) -> tuple[float, str]:
    """The ``gpu_memory_utilization`` a CUDA job hands vLLM, and a log line with the numbers.

    vLLM's pool is ``utilization x`` the whole device, re-created at that size on every wake
    beside everything the trainer keeps resident then, so the fraction must leave room for it.
    Unset: the largest fraction with which the plan's wake and rollout fit, at most
    ``AUTO_UTILIZATION_CAP``. Set: checked against the same plan. Raises a one-line UserError
    naming the flag and the numbers when the fraction does not fit, or when the pool that fits
    cannot hold the engine's weights and some KV cache. Runs before any model loads.

    ``engine_only``: the device of an asynchronous job's rollout rank (``world``: its engine's
    TP size), which holds no trainer model and whose engine never sleeps.
    """
    flags = job_flags(cfg, world, device_bytes)
    if engine_only:
        flags = dataclasses.replace(flags, vllm_sleep=False)
    models = job_models(cfg, flags)
    plan = _planner(models, engine_only)
    limit = fraction_limit(plan, flags)
    requested = cfg.rollout.vllm_gpu_memory_utilization
    util = _auto_fraction(limit) if requested is None else requested
    if not 0 < util <= 1:
        raise UserError(f"{UTIL_FLAG} {util:g}: must be in (0, 1]")
    at = dataclasses.replace(flags, gpu_memory_utilization=util)
    phase = _worst_pool_phase(at, plan)
    pool = phase.parts.get("vllm pool", 0)
    resident = {k: v for k, v in phase.parts.items() if k != "vllm pool"}
    top = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(resident.items(), key=lambda kv: -kv[1]))
    numbers = (
        f"{phase.name}: vLLM pool {_gib(pool)} GiB ({util:g} x {_gib(device_bytes)}) + "
        f"{_gib(sum(resident.values()))} GiB resident ({top}) = {_gib(phase.total)} of "
        f"{_gib(phase.limit)} GiB"
    )
    offload = "a larger --vllm_tensor_parallel_size" if engine_only else _OFFLOAD
    if requested is not None and util > limit + 1e-9:
        most = f"at most {math.floor(limit * 100) / 100:.2f}" if limit > 0 else "none fits"
        beside = (
            "beside the CUDA context and the weight buckets a rollout rank receives"
            if engine_only
            else "beside what stays resident while vLLM is awake (its pool comes back at full "
            "size on every wake)"
        )
        raise UserError(
            f"{UTIL_FLAG} {util:g} does not fit {beside}: {numbers}; use {most}, or "
            f"{offload}, or leave it unset to choose"
        )
    need = engine_weight_bytes(flags, models.actor) + VLLM_MIN_KV_BYTES
    if pool < need:
        why = "the largest pool that fits" if requested is None else "its pool"
        more = "" if engine_only else f"{offload}, or "
        raise UserError(
            f"{UTIL_FLAG} {util:g}: {why} ({_gib(pool)} GiB) cannot hold the engine's weights "
            f"and a KV cache ({_gib(need)} GiB: {_gib(need - VLLM_MIN_KV_BYTES)} GiB of weights "
            f"per TP slice + {_gib(VLLM_MIN_KV_BYTES)}); {numbers}. Use {more}a larger "
            "--vllm_tensor_parallel_size"
        )
    how = "chosen" if requested is None else "requested"
    return util, f"vLLM pool fraction {util:g} ({how}; fits up to {limit:.2f}): {numbers}"


def accumulate_gathered(cfg: PPOConfig, world: int, device_type: str, device_bytes: int) -> bool:
    """Whether the PPO updates accumulate with every layer gathered (``--accumulate_gathered``;
    ``distributed.fsdp.accumulate``): ``auto`` asks the memory model whether every update
    phase fits that way (a model folder it cannot read: no)."""
    from fsdp_rlhf.distributed.fsdp import resolve_accumulate_gathered

    def fits() -> bool:
        flags = job_flags(cfg, world, device_bytes)
        try:
            models = job_models(cfg, flags)
        except (OSError, ValueError, KeyError):
            return False
        return gathered_update_fits(flags, models.actor, models.critic, models.frozen)

    setting, zero = cfg.fsdp.accumulate_gathered, cfg.fsdp.zero_stage
    return resolve_accumulate_gathered(setting, zero, device_type, fits)


def offline_accumulate_gathered(cfg, world: int, device_type: str, device_bytes: int) -> bool:
    """:func:`accumulate_gathered` for ``sft``, ``dpo`` and ``train-rm`` (one trained model,
    no rollout engine): the update phase of ``--pretrain``'s shape at ``--max_len`` and the
    micro-batch (pairs count twice), gathered."""
    from fsdp_rlhf.distributed.fsdp import resolve_accumulate_gathered

    def fits() -> bool:
        try:
            shape = model_shape(cfg.models.pretrain)
        except (OSError, ValueError, KeyError):
            return False
        pairs = not hasattr(cfg.data, "pretrain_mode")  # preference pairs: chosen + rejected
        flags = JobFlags(
            world=world,
            device_bytes=device_bytes,
            zero_stage=cfg.fsdp.zero_stage,
            bf16=cfg.backend.bf16,
            adam_offload=cfg.fsdp.adam_offload,
            micro_train_batch_size=cfg.batch.micro_train_batch_size * (2 if pairs else 1),
            seq_len=cfg.data.max_len,
            response_len=cfg.data.max_len,
            gradient_checkpointing=cfg.backend.gradient_checkpointing,
            checkpointing_policy=cfg.backend.gradient_checkpointing_policy,
            critic=False,
            reward=False,
            engine="none",
            packing=bool(getattr(cfg.batch, "packing_samples", False)),
            flash_attn=cfg.backend.flash_attn,
        )
        return gathered_update_fits(flags, shape, None, [])

    setting, zero = cfg.fsdp.accumulate_gathered, cfg.fsdp.zero_stage
    return resolve_accumulate_gathered(setting, zero, device_type, fits)
