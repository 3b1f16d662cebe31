"""PPO setup: cheap checks before any heavy work, then building each component from its section.

``prepare`` runs before the process group and before any model is loaded, so bad input fails
in a second with one line naming the problem (the same step as the other commands' ``prepare``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_rlhf.algorithms.names import CRITIC_ESTIMATORS
from fsdp_rlhf.config import (
    BackendConfig,
    PPOBatchPlan,
    PPOConfig,
    async_rollout_ranks,
    plan_ppo_batches,
)
from fsdp_rlhf.data.prompts import Prompt, check_chat_template, tokenize_prompts
from fsdp_rlhf.distributed.ema import ShardedEMA
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.memory_plan import accumulate_gathered, resolve_vllm_utilization
from fsdp_rlhf.distributed.offload import offload_model, offload_optimizer
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.compile import check_compile_toolchain
from fsdp_rlhf.models.kind import ModelKind
from fsdp_rlhf.models.load import (
    check_expert_parallel,
    check_model_path,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    model_context,
    reward_normalization,
    text_config,
)
from fsdp_rlhf.models.lora import add_lora, check_target_modules, target_module_names
from fsdp_rlhf.models.lora import scaling as lora_scaling
from fsdp_rlhf.models.save import check_save_path, recover_interrupted_export
from fsdp_rlhf.models.shared_prefix import shared_group_size, sharing_blocker
from fsdp_rlhf.models.vision import (
    VisionTokens,
    freeze_vision_tower,
    is_vision_param,
    prepare_policy,
    vision_prefix,
)
from fsdp_rlhf.optim import build_optimizer, build_scheduler
from fsdp_rlhf.rollout import AdapterSpec, HFEngine, RolloutEngine, build_rollout_groups
from fsdp_rlhf.rollout.agent import load_agent_class
from fsdp_rlhf.rollout.env import load_environment
from fsdp_rlhf.rollout.memory_budget import check_device_budget
from fsdp_rlhf.rules import PPO, check_command, check_flags, model_paths
from fsdp_rlhf.trainers.common import load_and_prepare, log_startup
from fsdp_rlhf.trainers.ppo.rollout import adapter_sync
from fsdp_rlhf.trainers.ppo.teacher import check_teacher, load_teacher
from fsdp_rlhf.trainers.ppo.vision import row_check
from fsdp_rlhf.trainers.rule_reward import RewardFn, auth_headers, build_rule_reward

log = logging.getLogger("fsdp_rlhf")


def uses_critic(cfg: PPOConfig) -> bool:
    return cfg.algo.advantage_estimator in CRITIC_ESTIMATORS


def critic_path(cfg: PPOConfig) -> str | None:
    return cfg.models.critic_pretrain or cfg.models.reward_pretrain


def _check_world(cfg: PPOConfig, world_size: int) -> None:
    p = cfg.placement
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if cfg.asynchronous.async_train:
        _check_async_world(cfg, world_size, local)
        return
    if p.num_gpus_per_node is not None and p.num_gpus_per_node != local:
        raise UserError(
            f"--num_gpus_per_node {p.num_gpus_per_node} but torchrun started {local} ranks per "
            f"node (--nproc_per_node)"
        )
    if p.num_nodes is not None and p.num_nodes * local != world_size:
        raise UserError(
            f"--num_nodes {p.num_nodes} x {local} ranks per node != torchrun world size "
            f"{world_size} (--nnodes)"
        )
    tp = cfg.rollout.vllm_tensor_parallel_size
    if tp > 1 and local % tp and tp % local:  # vLLM's TP blocks are contiguous global ranks
        raise UserError(
            f"--vllm_tensor_parallel_size {tp} with {local} ranks per node: an engine would "
            f"span parts of two nodes (an all-reduce over the network every decoded token); "
            f"use a divisor of the ranks per node"
        )


def _check_async_world(cfg: PPOConfig, world_size: int, local: int) -> None:
    """--async_train: the last vllm_num_engines x TP ranks generate, the others train; the
    per-model node and GPU counts (OpenRLHF's actor pool) describe the training ranks."""
    from fsdp_rlhf.distributed.split_world import SplitWorld

    split = SplitWorld(
        world_size, async_rollout_ranks(cfg, world_size), cfg.rollout.vllm_tensor_parallel_size
    )
    p, training = cfg.placement, split.training_ranks
    nodes, per_node = p.num_nodes, p.num_gpus_per_node
    if (
        per_node is not None
        and training % per_node
        or (nodes is not None and per_node is not None and nodes * per_node != training)
    ):
        raise UserError(
            f"--async_train: --num_nodes {nodes} x --num_gpus_per_node {per_node} describe the "
            f"training ranks, but {world_size} ranks minus {split.rollout_ranks} rollout ranks "
            f"leave {training}"
        )
    crossing = split.blocks_crossing_nodes(local)
    if crossing:
        raise UserError(
            f"--async_train: vLLM engine {crossing[0]} (ranks {split.engine_ranks(crossing[0])}) "
            f"would span two nodes of {local} ranks: the rollout ranks are the world's last "
            f"{split.rollout_ranks}; choose sizes whose engines fit within a node"
        )
    if not torch.cuda.is_available() and split.tp_size > 1 and split.engines_per_node(local) > 1:
        raise UserError(
            "--async_train on CPU: at most one vLLM engine with --vllm_tensor_parallel_size > 1 "
            "per host (vLLM names its CPU shared-memory segments per host and engine world); "
            "use fewer engines per host or TP 1"
        )


def _check_lora(cfg: PPOConfig) -> None:
    """--target_modules against the actor's modules (built empty, nothing loaded)."""
    if cfg.lora.enabled:
        check_target_modules(cfg.models.pretrain, cfg.lora, cfg.backend.trust_remote_code)


def _check_rewards(cfg: PPOConfig) -> None:
    """Reward sources: paths, normalisation statistics, the rule reward and its token."""
    m = cfg.models
    if cfg.multiturn.source is not None:
        _check_env(cfg)
        return
    if not m.reward_pretrain and not m.remote_rm_url:
        if cfg.distill.enabled:  # on-policy distillation only: the teacher is the signal
            return
        raise UserError(
            "no reward source: pass --reward_pretrain and/or --remote_rm_url (or distil from a "
            "teacher: --teacher_pretrain / --teacher_url)"
        )
    if m.reward_pretrain:
        check_model_path(m.reward_pretrain, "--reward_pretrain")
        if m.normalize_reward and reward_normalization(m.reward_pretrain) is None:
            raise UserError(
                f"--normalize_reward: {m.reward_pretrain}/config.json has no reward_mean/"
                "reward_std (fsdp-rlhf train-rm writes them); drop the flag or add them"
            )
    url = m.remote_rm_url
    if url and url.endswith(".py") and not os.path.isfile(url):
        raise UserError(f"--remote_rm_url {url}: no such file")
    if m.remote_rm_auth_env:
        if not (url or "").startswith(("http://", "https://")):
            raise UserError("--remote_rm_auth_env applies only to an http(s) --remote_rm_url")
        auth_headers(m.remote_rm_auth_env)  # raises when the variable is unset


def _check_env(cfg: PPOConfig) -> None:
    """--env_file / --agent_func_path: it must load and define the contract (its rewards are
    the scores: the rules table refuses other reward sources beside it)."""
    path = cfg.multiturn.source[1]
    if cfg.multiturn.env_file is not None:
        load_environment(path, cfg.multiturn.env_timeout_s)
    else:
        load_agent_class(path)


def check_context_length(cfg: PPOConfig) -> None:
    """The engine's ``max_model_len`` (``cfg.total_len``: prompt + response, or the multi-turn
    budget) against the actor's context, before anything starts: vLLM would refuse it at
    start-up (a traceback), and nothing here lowers the user's lengths behind their back."""
    if cfg.rollout.rollout_engine != "vllm":
        return
    context = model_context(cfg.models.pretrain, cfg.backend.trust_remote_code)
    if context is None:
        return
    text = text_config(cfg.models.pretrain, cfg.backend.trust_remote_code)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    kind = kind if kind not in (None, "default") and rope.get("factor") else None
    need = cfg.total_len
    if need > context:
        if cfg.multiturn.source is not None:
            what = "--max_total_len"
        elif cfg.rollout.max_len is not None and cfg.rollout.max_len == need:
            what = "--max_len"
        else:
            what = "--prompt_max_len + --generate_max_len"
        raise UserError(
            f"{what} = {need} tokens per sequence, more than {cfg.models.pretrain}'s context "
            f"of {context} (max_position_embeddings{' x rope factor' if kind else ''}): vLLM "
            "would refuse that max_model_len; lower the lengths or use a longer-context model"
        )


def _check_outputs(cfg: PPOConfig) -> None:
    """The final export must be able to land in --save_path (it is renamed into place)."""
    m = cfg.models
    inputs = {"--pretrain": m.pretrain, "--reward_pretrain": m.reward_pretrain}
    check_save_path(
        cfg.ckpt.save_path, other_paths={**inputs, "--critic_pretrain": m.critic_pretrain}
    )
    # Before anything reads checkpoints under save_path: put back what a crash mid-export
    # moved aside. Rank 0 only, and it finishes before joining the process group.
    if os.environ.get("RANK", "0") == "0":
        recover_interrupted_export(cfg.ckpt.save_path)


def prepare(cfg: PPOConfig, world_size: int) -> tuple[PPOBatchPlan, Any, dict[str, ModelKind]]:
    """Validate flags, paths, data and sizes; the rules table (``fsdp_rlhf.rules``) refuses
    what does not combine. Returns the batch plan, the raw prompt rows and the kind of every
    model the run loads (flag -> kind, read here once)."""
    from fsdp_rlhf.data.sources import check_keys, load_sources
    from fsdp_rlhf.data.vision import load_processor

    check_flags(PPO, cfg)  # the rules table's rows of the flags alone, first
    _check_world(cfg, world_size)
    plan = plan_ppo_batches(cfg, world_size)
    kinds = check_command(PPO, cfg)  # every model's config read once, every row checked
    m = cfg.models
    _check_lora(cfg)
    if cfg.backend.torch_compile:
        check_compile_toolchain()
    _check_rewards(cfg)
    paths = model_paths(PPO, cfg)
    trust = cfg.backend.trust_remote_code
    # over the training ranks (--async_train: the world less the rollout ranks)
    ranks = "the training ranks" if plan.rollout_ranks else "the world size"
    check_expert_parallel(cfg.fsdp.expert_parallel_size, plan.world_size, paths, trust, ranks)
    check_context_length(cfg)
    check_teacher(cfg)  # its context; a served teacher's answer, context and tokenizer
    _check_outputs(cfg)
    vlm = kinds["--pretrain"].is_vlm
    if vlm:
        load_processor(m.pretrain, cfg.backend.trust_remote_code)  # torchvision, the processor
    if cfg.data.apply_chat_template:
        check_chat_template(load_tokenizer(m.pretrain, cfg.backend), m.pretrain)
    if not cfg.data.prompt_data:
        raise UserError("--prompt_data is required")
    keys = [cfg.data.input_key] + ([cfg.data.label_key] if cfg.data.label_key else [])
    flags = ["--input_key"] + (["--label_key"] if cfg.data.label_key else [])
    rows = load_sources(
        cfg.data.prompt_data,
        cfg.data.prompt_data_probs,
        max_samples=cfg.data.max_samples,
        seed=cfg.seed,
        flag_name="--prompt_data",
        split=cfg.data.prompt_split,
        # every row's images against its placeholders (a text model: none at all), by row
        check=row_check(cfg.vision, cfg.data.input_key, text_only=not vlm),
    )
    check_keys(rows, keys, flags)
    if len(rows) < cfg.batch.rollout_batch_size:
        raise UserError(
            f"--prompt_data has {len(rows)} prompts, fewer than --rollout_batch_size "
            f"{cfg.batch.rollout_batch_size}"
        )
    if cfg.eval.eval_dataset is not None:
        from fsdp_rlhf.trainers.ppo.eval import load_eval_rows

        load_eval_rows(cfg)  # bad eval data fails here, not after the models are loaded
    if cfg.rollout.rollout_engine == "vllm":  # last: importing vLLM prints lines of its own
        from fsdp_rlhf.rollout.vllm.engine import check_architecture

        check_architecture(m.pretrain, cfg.backend.trust_remote_code)
    return plan, rows, kinds


@dataclass
class Models:
    """Everything with weights. ``critic``/``reward`` are None when not used; ``ref`` is None
    with LoRA (the reference policy is the actor with its adapters disabled); ``teacher`` is
    the colocated teacher of on-policy distillation (None: none, or a served one)."""

    tokenizer: Any
    actor: nn.Module
    ref: nn.Module | None
    critic: nn.Module | None
    reward: nn.Module | None
    reward_norm: tuple[float, float] | None
    rule_reward: RewardFn | None
    teacher: nn.Module | None = None


def load_ppo_model(
    load: Callable[[bool], nn.Module],
    cfg: PPOConfig,
    env: DistEnv,
    trainable: bool,
    what: str,
    parallel: ParallelLayout | None = None,
) -> nn.Module:
    """``common.load_and_prepare`` with PPO's settings (also used by ``doctor``): ``load(True)``
    the model with its weights (rank 0 only when there are several), ``load(False)`` the
    meta-device skeleton every rank shards. ``parallel``: the run's layout (None: one data shard per
    rank, no sequence parallelism)."""
    if parallel is None:
        parallel = ParallelLayout(world_size=env.world_size, rank=env.rank)
    # Token-mean losses are normalised by the global token count, so ranks must sum grads.
    return load_and_prepare(
        load,
        env,
        cfg.fsdp,
        cfg.backend,
        parallel=parallel,
        what=what,
        packed=cfg.batch.packing_samples,
        trainable=trainable,
        grad_reduce="sum",
    )


def build_models(cfg: PPOConfig, env: DistEnv, tokenizer, parallel: ParallelLayout) -> Models:
    m, backend = cfg.models, cfg.backend
    log_startup(env, cfg.fsdp.zero_stage, cfg.backend.bf16)

    def actor_model(weights: bool) -> nn.Module:
        model = load_causal_lm(m.pretrain, backend, env.device, weights=weights)
        # a VLM: placeholders suppressed, the tower frozen under --freeze_visual_encoder
        prepare_policy(model, freeze_tower=cfg.vision.freeze_visual_encoder)
        if cfg.lora.enabled:
            add_lora(model, cfg.lora, quiet=not weights)
        return model

    actor = load_ppo_model(actor_model, cfg, env, True, "--pretrain", parallel)
    # Frozen models never run backward: recomputation would only cost time.
    no_ckpt = dataclasses.replace(backend, gradient_checkpointing=False)
    # Frozen weights need no fp32 master copy: bf16 shards under --bf16 halve their memory.
    frozen_dtype = torch.bfloat16 if backend.bf16 else torch.float32
    ref = None
    if not cfg.lora.enabled:  # LoRA: the actor's frozen base is the reference

        def ref_model(weights: bool) -> nn.Module:
            model = load_causal_lm(m.pretrain, no_ckpt, env.device, frozen_dtype, weights=weights)
            prepare_policy(model)
            return model

        ref = load_ppo_model(ref_model, cfg, env, False, "the reference model", parallel)
    critic = reward = None
    norm = None
    if uses_critic(cfg):

        def critic_model(weights: bool) -> nn.Module:
            model = load_scalar_model(
                critic_path(cfg),
                backend,
                env.device,
                value_head_prefix=m.value_head_prefix,
                weights=weights,
            )
            if cfg.vision.freeze_visual_encoder and vision_prefix(model) is not None:
                freeze_vision_tower(model)  # as the actor's: the language model trains
            if cfg.lora.enabled:
                add_lora(model, cfg.lora, head="score", quiet=not weights)
            return model

        critic = load_ppo_model(critic_model, cfg, env, True, "the critic", parallel)
    if m.reward_pretrain:
        reward = load_ppo_model(
            lambda w: load_reward_model(cfg, no_ckpt, env.device, weights=w),
            cfg,
            env,
            False,
            "--reward_pretrain",
            parallel,
        )
        # prepare already refused --normalize_reward without the statistics
        norm = reward_normalization(m.reward_pretrain) if m.normalize_reward else None
    rule = build_rule_reward(m.remote_rm_url, m.remote_rm_auth_env) if m.remote_rm_url else None
    teacher = None
    if cfg.distill.teacher_pretrain:
        teacher = load_teacher(cfg, env, parallel, load_ppo_model)
    return Models(tokenizer, actor, ref, critic, reward, norm, rule, teacher)


def load_reward_model(
    cfg: PPOConfig, backend: BackendConfig, device: torch.device, *, weights: bool
) -> nn.Module:
    """``--reward_pretrain`` as a frozen scalar-head model (bf16 under --bf16; its head must be
    in the checkpoint)."""
    return load_scalar_model(
        cfg.models.reward_pretrain,
        backend,
        device,
        value_head_prefix=cfg.models.value_head_prefix,
        init_head_if_missing=False,
        dtype=torch.bfloat16 if backend.bf16 else torch.float32,
        weights=weights,
    )


def prompt_group_size(cfg: PPOConfig, plan: PPOBatchPlan, actor: nn.Module) -> int:
    """Rows that share one pass of their prompt in the actor's and reference's log-prob
    forwards (``--share_prompt_prefix``; 1: none), logged once with the reason when off."""
    n = cfg.batch.n_samples_per_prompt
    if not cfg.batch.share_prompt_prefix or n == 1:
        return 1
    blocker = sharing_blocker(actor, cfg.batch.packing_samples)
    # --use_dynamic_batch packs whole groups into its micro-batches: only the minibatch counts
    batches = (plan.micro_rollout_batch_size, plan.micro_train_batch_size)
    if cfg.batch.use_dynamic_batch:
        batches = ()
    size = shared_group_size(n, *batches, plan.train_batch_size_per_rank)
    if blocker is None and size == 1:
        blocker = (
            f"n_samples_per_prompt ({n}) shares no factor with the batches "
            f"{(*batches, plan.train_batch_size_per_rank)}"
        )
    if blocker is not None:
        log.info("shared prompt prefix: off, %s", blocker)
        return 1
    log.info("shared prompt prefix: each prompt runs once for %d of its %d samples", size, n)
    return size


def build_optimizers(cfg: PPOConfig, models: Models, total_updates: int) -> tuple[dict, dict]:
    """AdamW + schedule for the actor and (with GAE) the critic, keyed like the models."""
    optimizers = {"actor": build_optimizer(models.actor, cfg.actor_optim)}
    schedulers = {"actor": build_scheduler(optimizers["actor"], cfg.actor_optim, total_updates)}
    if models.critic is not None:
        optimizers["critic"] = build_optimizer(models.critic, cfg.critic_optim)
        schedulers["critic"] = build_scheduler(
            optimizers["critic"], cfg.critic_optim, total_updates
        )
    return optimizers, schedulers


def build_ema(cfg: PPOConfig, actor: nn.Module, optimizer) -> ShardedEMA | None:
    """``--enable_ema``: the actor's EMA, updated after each of its optimizer steps; in host
    memory when the run offloads (``--adam_offload``, ``--ref_reward_offload``)."""
    if not cfg.algo.enable_ema:
        return None
    host = cfg.fsdp.adam_offload or cfg.placement.ref_reward_offload
    ema = ShardedEMA(actor, cfg.algo.ema_beta, host=host)
    ema.attach(optimizer)
    devices = sorted({str(t.device) for t in ema.shadow.values()})
    log.info(
        "EMA of the actor (beta %g, fp32 shards on %s): the model saved at the end",
        ema.beta,
        ", ".join(devices),
    )
    return ema


def check_ema_resumable(path: Path, enabled: bool) -> None:
    """A checkpoint written without --enable_ema has no EMA to resume with it."""
    saved = json.loads((path / "trainer.json").read_text())
    if enabled and not saved.get("enable_ema", False):
        raise UserError(
            f"--load_checkpoint {path}: written without --enable_ema, so it holds no EMA of the "
            "actor; resume without --enable_ema or start with a new --ckpt_path"
        )


def build_prompts(cfg: PPOConfig, rows, tokenizer, images=None) -> list[Prompt]:
    """Every prompt, tokenized (``images``: a VLM's ``ppo.vision.StepImages``)."""
    vision = images.vision if images is not None else None
    prompts = tokenize_prompts(rows, tokenizer, cfg.data, vision, cfg.vision.image_key)
    if len(prompts) < cfg.batch.rollout_batch_size:
        raise UserError(
            f"only {len(prompts)} non-empty prompts, fewer than --rollout_batch_size "
            f"{cfg.batch.rollout_batch_size}"
        )
    return prompts


def engine_dtype(cfg: PPOConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.backend.bf16 else torch.float32


def eos_token_ids(tokenizer, model_path: str) -> list[int]:
    """EOS ids the engines stop on: the tokenizer's plus the generation config's."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id}
    # Without generation_config.json (OSError) the tokenizer's EOS is all there is.
    with contextlib.suppress(OSError):
        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)


def build_engine(
    cfg: PPOConfig,
    env: DistEnv,
    tokenizer,
    max_images: int = 1,
    *,
    vision: VisionTokens | None,
    streaming: bool = False,
    engine_id: int = 0,
) -> RolloutEngine:
    """The rollout engine of this rank (collective: all ranks build theirs together).
    ``vision``: the actor's special tokens when it is a vision-language model (its
    ``ModelKind.vision``; None: text), ``max_images`` the images per prompt its engine accepts.

    ``streaming``: asynchronous training's engine, alone in its default group (so it is
    engine 0 of its world; ``engine_id`` is its place in the job, for its seed), driven step
    by step and never asleep.

    NOTE: the process group must already exist; vLLM reuses it (see distributed.env).
    """
    groups = build_rollout_groups(cfg.rollout.vllm_tensor_parallel_size)
    rollout = cfg.rollout
    if streaming:  # its world holds this engine only, and nothing else shares its device
        rollout = dataclasses.replace(rollout, vllm_num_engines=None, vllm_enable_sleep=False)
    if cfg.rollout.rollout_engine == "vllm":
        from fsdp_rlhf.rollout.vllm.engine import VLLMEngine

        if env.device.type == "cuda":
            util = cuda_pool(cfg, env, engine_only=streaming)
            rollout = dataclasses.replace(rollout, vllm_gpu_memory_utilization=util)
        return VLLMEngine(
            cfg.models.pretrain,
            rollout,
            groups=groups,
            # multi-turn histories grow past the prompt: max_model_len = --max_total_len
            prompt_max_len=cfg.total_len - cfg.rollout.generate_max_len,
            dtype=engine_dtype(cfg),
            seed=cfg.seed + engine_id,
            pad_token_id=tokenizer.pad_token_id,
            trust_remote_code=cfg.backend.trust_remote_code,
            lora_rank=cfg.lora.lora_rank if adapter_sync(cfg) else 0,
            streaming=streaming,
            router_replay=cfg.moe.router_replay,
            vision=vision,
            max_images=max_images,
        )
    # In the engine dtype, like vLLM: an fp32 copy under --bf16 sampled from other logits than
    # the trainer computes, and generated slower on a bf16-capable CPU (benchmarks/).
    model = load_causal_lm(cfg.models.pretrain, cfg.backend, env.device)
    model = model.to(device=env.device, dtype=engine_dtype(cfg))
    model.config.use_cache = True
    prepare_policy(model)  # a VLM's placeholders suppressed, as in the actor
    return HFEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=eos_token_ids(tokenizer, cfg.models.pretrain),
        seed=cfg.seed + groups.engine_index,
        vision=vision,
        unsynced=unsynced_params(cfg, model),
    )


def unsynced_params(cfg: PPOConfig, actor: nn.Module):
    """Predicate on HF names of the parameters no weight sync sends: a VLM's vision tower
    when it is frozen (--freeze_visual_encoder, or LoRA, whose adapters skip it). None: all."""
    prefix = vision_prefix(actor)
    if prefix is None or not (cfg.vision.freeze_visual_encoder or cfg.lora.enabled):
        return None
    return is_vision_param(prefix)


def cuda_pool(cfg: PPOConfig, env: DistEnv, *, engine_only: bool = False) -> float:
    """The fraction of the device vLLM's pool takes, chosen or checked against the memory plan
    (the pool comes back at that size on every wake, beside the resident shards), then against
    what is free now (vLLM refuses to start without ``fraction x total`` free). One line each;
    a UserError naming the flag when either does not fit. Before any model loads.

    ``engine_only``: an asynchronous job's rollout rank, whose device holds its engine's TP
    slice and nothing of the trainer (``env`` is the engine's group)."""
    total = torch.cuda.mem_get_info(env.device)[1]
    util, line = resolve_vllm_utilization(cfg, env.world_size, total, engine_only=engine_only)
    log.info(line)
    log.info(check_device_budget(env.device, util))
    return util


def update_accumulation(cfg: PPOConfig, env: DistEnv) -> bool:
    """Whether the updates keep each layer gathered across micro-batches at ZeRO-3
    (``--accumulate_gathered``; ``auto``: the memory model decides on CUDA), logged once."""
    total = torch.cuda.mem_get_info(env.device)[1] if env.device.type == "cuda" else 0
    gathered = accumulate_gathered(cfg, env.world_size, env.device.type, total)
    if cfg.fsdp.zero_stage >= 3:
        how = (
            "each layer gathered once per optimizer step, grads reduced after its last micro-batch"
            if gathered
            else "each layer gathered and its grads reduced at every micro-batch"
        )
        log.info("--accumulate_gathered %s: %s", cfg.fsdp.accumulate_gathered, how)
    return gathered


def merged_lora_scaling(cfg: PPOConfig) -> float | None:
    """alpha / r when LoRA is synced merged into the base weights, else None."""
    if not cfg.lora.enabled or adapter_sync(cfg):
        return None
    return lora_scaling(cfg.lora)


def adapter_spec(cfg: PPOConfig, actor: nn.Module) -> AdapterSpec | None:
    """What the engine must know of the actor's adapters (None: full fine-tuning, or LoRA
    synced merged)."""
    if not adapter_sync(cfg):
        return None
    modules = tuple(target_module_names(actor))
    return AdapterSpec(rank=cfg.lora.lora_rank, alpha=cfg.lora.lora_alpha, target_modules=modules)


def offload_idle(
    models: Models,
    optimizers: dict,
    ref_reward_offload: bool,
    device: torch.device,
    teacher_offload: bool = False,
) -> None:
    """Before the first rollout, what it does not use goes to host memory (no-op on CPU jobs
    and for --adam_offload models): the critic and its optimizer state (restored by a resume),
    with --ref_reward_offload the reference and reward models, with --teacher_offload the
    teacher."""
    if models.critic is not None:
        offload_optimizer(optimizers["critic"], device)
        offload_model(models.critic, device)
    frozen = [models.ref, models.reward] if ref_reward_offload else []
    if teacher_offload:
        frozen.append(models.teacher)
    for model in frozen:
        if model is not None:
            offload_model(model, device)


def data_settings(cfg: PPOConfig, num_prompts: int) -> dict[str, int]:
    """What a checkpoint's prompt order depends on: a resume with other values cannot continue
    it (the sampler state would index another permutation)."""
    return {
        "num_prompts": num_prompts,
        "rollout_batch_size": cfg.batch.rollout_batch_size,
        "seed": cfg.seed,
    }
