"""OpenRLHF's flag spellings, v0.10 (flat, until April 2026) and v0.11 (dotted: 0.11.0 and the
flags 0.11.1 and 0.11.2 added or replaced), per command.

The flags each OpenRLHF parser defines are in ``data/openrlhf-<version>-<command>.json``
(extracted by ``scripts/openrlhf_flags.py``); ``tests/unit/test_compat.py`` walks them and fails on
any flag without one of the three outcomes here. A flag missing from a table is one our own
config parser knows under the same name (``--pretrain``, ``--zero_stage``, ``--ckpt.save_steps``),
which takes effect as it is.

The tables are built from pairs ``(v0.10 name, v0.11 name)`` that share one rule.
"""

from __future__ import annotations

import re

from fsdp_rlhf.compat.rules import (
    Accept,
    Gather,
    Refuse,
    Rule,
    Table,
    To,
    Values,
    choice,
    refusal,
    rename,
    switch,
    when_default,
)
from fsdp_rlhf.config import PPOBatchConfig
from fsdp_rlhf.config_base import ConfigError, Flag

# ------------------------------------------------------------------ shared pieces

NO_RAY = "one torchrun world runs every model and the vLLM engine in-process; there is no Ray"
FULL_COLOCATION = "every rank holds its shard of every model and a vLLM slice (full colocation)"
COLOCATED = (
    "every training rank holds its shard of every model, and a vLLM slice unless "
    "--async_train gives the engines ranks of their own"
)
SLEEP = "idle models leave the GPU between phases, and vLLM sleeps outside the rollout"
TRAIN_TP = (
    "training-side tensor parallelism is not implemented: FSDP2 shards over all ranks",
    "use --zero_stage 3 to shard parameters as well",
)


def _pairs(*entries: tuple[str | None, str | None, Rule]) -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    for flat, dotted, rule in entries:
        for name in (flat, dotted):
            if name is not None:
                if name in rules:
                    raise AssertionError(f"two rules for --{name}")
                rules[name] = rule
    return rules


def _param_dtype(values: Values) -> list[str]:
    value = values[0] if values else "bf16"
    if value == "bf16":
        return ["--bf16"]
    raise ConfigError("fp16 training is not supported; use --param_dtype bf16")


def _attn(values: Values) -> list[str]:
    value = values[0] if values else "flash_attention_2"
    if value.startswith("flash_attention") or "flash-attn" in value or "flash_attn" in value:
        return ["--flash_attn"]
    if value in ("sdpa", "eager"):
        return []  # SDPA is the default; eager is the same attention without the fused kernel
    raise ConfigError(f"attention implementation {value!r}: use flash_attention_2 or sdpa")


def _grad_accum(values: Values) -> str | None:
    value = values[0] if values else "fp32"
    if value in ("fp32", "float32", "None", "none"):
        return None
    return f"gradients are reduced and accumulated in fp32; {value} accumulation is not offered"


def _int(values: Values) -> list[str]:
    """OpenRLHF v0.11 types some token counts as float (``512.0``)."""
    (value,) = values
    number = float(value)
    if number != int(number):
        raise ConfigError(f"expected a whole number of tokens, got {value}")
    return [str(int(number))]


def _clip_range(values: Values) -> list[str]:
    """OpenRLHF's reward clip is LOW HIGH; ours is symmetric (one value)."""
    if len(values) == 1:
        return ["--reward_clip_range", values[0]]
    low, high = (float(v) for v in values)
    if low != -high:
        raise ConfigError(
            f"scores are clipped to a symmetric range [-x, x] here; got [{low}, {high}]"
        )
    return ["--reward_clip_range", str(high)]


def _optim(values: Values) -> str | None:
    value = values[0] if values else "adam"
    return None if value == "adam" else "Muon is not implemented here (AdamW only)"


COMMON: dict[str, Rule] = _pairs(
    # checkpoints
    (None, "ckpt.output_dir", rename("save_path")),
    (None, "ckpt.save_hf", switch("save_hf_ckpt")),
    (
        "disable_ds_ckpt",
        "ckpt.disable_ds",
        Refuse(
            "resumable checkpoints are FSDP2 DCP shards, the state --load_checkpoint resumes from",
            "use --save_steps -1 to write none",
        ),
    ),
    (None, "ckpt.save_steps", rename("save_steps")),
    (None, "ckpt.path", rename("ckpt_path")),
    (None, "ckpt.max_num", rename("max_ckpt_num")),
    (None, "ckpt.max_mem", rename("max_ckpt_mem")),
    (None, "ckpt.load_enable", switch("load_checkpoint")),
    (
        "use_ds_universal_ckpt",
        "ds.use_universal_ckpt",
        Accept("DCP checkpoints are resharded on load, so they resume at another world size"),
    ),
    # logging
    (None, "logger.logging_steps", rename("logging_steps")),
    (None, "eval.steps", rename("eval_steps")),
    ("use_tensorboard", "logger.tensorboard_dir", rename("tensorboard")),
    (None, "logger.wandb.key", rename("use_wandb", secret=True)),
    (None, "logger.wandb.org", rename("wandb_org")),
    (None, "logger.wandb.group", rename("wandb_group")),
    (None, "logger.wandb.project", rename("wandb_project")),
    (None, "logger.wandb.run_name", rename("wandb_run_name")),
    # DeepSpeed -> FSDP2
    (None, "ds.zero_stage", rename("zero_stage")),
    (None, "ds.adam_offload", switch("adam_offload")),
    ("param_dtype", "ds.param_dtype", To(_param_dtype, "--bf16")),
    ("attn_implementation", "ds.attn_implementation", To(_attn, "--flash_attn")),
    (
        "deepcompile",
        "ds.deepcompile",
        switch("torch_compile", "decoder blocks compiled with torch.compile"),
    ),
    (
        "zpg",
        "ds.zpg",
        when_default(
            "1",
            "FSDP2 shards over the whole world",
            "ZeRO++ hierarchical partitioning (HSDP) is not implemented; FSDP2 shards over all "
            "ranks",
        ),
    ),
    ("grad_accum_dtype", "ds.grad_accum_dtype", Accept("fp32 gradient accumulation", _grad_accum)),
    ("overlap_comm", "ds.overlap_comm", Accept("FSDP2 prefetches the next layer's all-gather")),
    (
        "ds_tensor_parallel_size",
        "ds.tensor_parallel_size",
        when_default("1", "no training-side tensor parallelism", "; ".join(TRAIN_TP)),
    ),
    (
        "ring_attn_size",
        "ds.ring_attn_size",
        rename(
            "sequence_parallel_size",
            "each sequence split over that many ranks by Ulysses all-to-all, not a ring",
        ),
    ),
    (
        "ring_head_stride",
        "ds.ring_attn_head_stride",
        Accept(
            "the sequence split is Ulysses all-to-all (each rank attends over whole rows for "
            "1/N of the heads), not a ring: there are no head strides to step through"
        ),
    ),
    (
        "load_in_4bit",
        "ds.load_in_4bit",
        Refuse("4-bit (QLoRA) base weights are not implemented", "use --lora_rank with bf16"),
    ),
    (None, "ds.lora.rank", rename("lora_rank")),
    (None, "ds.lora.alpha", rename("lora_alpha")),
    (None, "ds.lora.dropout", rename("lora_dropout")),
    (None, "ds.lora.target_modules", rename("target_modules")),
    (None, "ds.packing_samples", switch("packing_samples")),
    (None, "ds.value_head_prefix", rename("value_head_prefix")),
    (
        "gradient_checkpointing_use_reentrant",
        None,
        Accept("activation checkpointing is non-reentrant here (same gradients)"),
    ),
    (None, "data.disable_fast_tokenizer", switch("disable_fast_tokenizer")),
    (
        "dataloader_num_workers",
        "data.dataloader_num_workers",
        Accept("data is tokenized in memory before the first step; no loader workers are used"),
    ),
    (None, "train.seed", rename("seed")),
    (None, "train.full_determinism_enable", switch("full_determinism")),
    (None, "train.max_epochs", rename("max_epochs")),
    (None, "train.batch_size", rename("train_batch_size")),
    (None, "train.micro_batch_size", rename("micro_train_batch_size")),
    (
        "use_ms",
        None,
        Refuse("ModelScope hub downloads are not implemented", "pass a local model folder"),
    ),
    (
        None,
        "ds.experts_implementation",
        Refuse("MoE expert kernels are transformers' default here", "drop the flag"),
    ),
)

# ------------------------------------------------------------------ train-rm

LIGER = Accept("a fused-kernel choice for speed and memory: the same loss is computed without it")

# train-rm, sft and dpo: one model, one optimizer (OpenRLHF's --model.*, --adam.*, --muon.*)
OFFLINE: dict[str, Rule] = {
    **COMMON,
    **_pairs(
        (None, "model.model_name_or_path", rename("pretrain")),
        (None, "model.gradient_checkpointing_enable", switch("gradient_checkpointing")),
        (
            None,
            "model.gradient_checkpointing_reentrant",
            Accept("activation checkpointing is non-reentrant here (same gradients)"),
        ),
        (
            "aux_loss_coef",
            "model.aux_loss_coef",
            when_default(
                "0",
                "no MoE load-balancing loss",
                "the MoE load-balancing loss is implemented for ppo's actor only",
            ),
        ),
        ("optim", None, Accept("the optimizer is AdamW", _optim)),
        (None, "muon.lr", Accept("it only applies to --optim muon")),
        (None, "muon.momentum", Accept("it only applies to --optim muon")),
        (None, "muon.ns_steps", Accept("it only applies to --optim muon")),
        (None, "muon.nesterov", Accept("it only applies to --optim muon")),
        (None, "muon.no_nesterov", Accept("it only applies to --optim muon")),
        (None, "adam.lr", rename("learning_rate")),
        (None, "adam.betas", rename("adam_betas")),
        (None, "adam.eps", rename("adam_eps")),
        (None, "adam.weight_decay", rename("l2")),
        (None, "eval.dataset", rename("eval_dataset")),
        (None, "eval.split", rename("eval_split")),
    ),
}

RM_RULES: dict[str, Rule] = {
    **OFFLINE,
    **_pairs(
        (
            "compute_fp32_loss",
            "model.compute_fp32_loss_enable",
            Accept("scores and the loss are computed in fp32"),
        ),
        (
            "margin_loss",
            "model.margin_loss_enable",
            To(lambda v: ["--margin_key", "margin"], "--margin_key margin"),
        ),
        (None, "model.loss_type", rename("loss")),
    ),
}

SFT_RULES: dict[str, Rule] = {
    **OFFLINE,
    **_pairs(
        ("train_split", None, rename("dataset_split")),
        ("use_liger_kernel", "ds.use_liger_kernel", LIGER),
        (None, "model.pretrain_mode_enable", switch("pretrain_mode")),
    ),
}

DPO_RULES: dict[str, Rule] = {
    **OFFLINE,
    **_pairs(
        ("use_liger_kernel", "ds.use_liger_kernel", LIGER),
        (None, "ref.model_name_or_path", rename("ref_pretrain")),
        (None, "ref.offload", switch("ref_offload")),
        (None, "model.beta", rename("beta")),
        (None, "model.ipo_enable", switch("ipo")),
        (None, "model.label_smoothing", rename("label_smoothing")),
        (None, "model.nll_loss_coef", rename("nll_loss_coef")),
    ),
}

# ------------------------------------------------------------------ kd


# OpenRLHF's offline knowledge distillation (openrlhf.cli.train_kd, releases 0.2.5 to 0.9.5,
# and the FSDP2 rewrite's branch that renamed its checkpoint and model flags): its SFT flags
# plus the teacher's. Its parsers are in data/openrlhf-*-kd.json (tests/unit/test_kd.py).
def _reshard(values: Values) -> list[str]:
    value = values[0].lower() if values else "true"
    return ["--zero_stage", "3" if value in ("true", "1", "yes") else "2"]


KD_RULES: dict[str, Rule] = {
    **SFT_RULES,
    **_pairs(
        ("teacher_model", None, rename("teacher_pretrain")),
        ("model_name_or_path", None, rename("pretrain")),
        ("ckpt_save_path", None, rename("save_path")),
        ("max_checkpoints_to_keep", None, rename("max_ckpt_num")),
        (
            "disable_fsdp2_ckpt",
            None,
            Refuse(
                "resumable checkpoints are FSDP2 DCP shards, the state --load_checkpoint "
                "resumes from",
                "use --save_steps -1 to write none",
            ),
        ),
        (
            "dcp_checkpoint_from_path",
            None,
            Refuse(
                "a step folder of OpenRLHF's own checkpoint layout cannot be resumed here",
                "resume this trainer's checkpoints with --ckpt_path DIR --load_checkpoint",
            ),
        ),
        (
            "resume_training",
            None,
            Accept("a resume (--load_checkpoint) restores the optimizer, schedule and data order"),
        ),
        (
            "fsdp2_cpu_offload",
            None,
            switch("adam_offload", "FSDP2's CPUOffloadPolicy: parameters, gradients, optimizer"),
        ),
        (
            "fsdp2_reshard_after_forward",
            None,
            To(_reshard, "--zero_stage 3", "--no-...: --zero_stage 2 (kept after the forward)"),
        ),
        ("fsdp2_tp_size", None, when_default("1", "no tensor parallelism", "; ".join(TRAIN_TP))),
        ("fsdp2_tp_sequence_parallel", None, Accept("it only applies to --fsdp2_tp_size > 1")),
        ("fsdp2_tp_loss_parallel", None, Accept("it only applies to --fsdp2_tp_size > 1")),
        (
            "fsdp2_cp_size",
            None,
            rename(
                "sequence_parallel_size",
                "each sequence split over that many ranks by Ulysses all-to-all",
            ),
        ),
        (
            "hf_max_shard_size_gb",
            None,
            Accept("the exported model is written in transformers' default safetensors shards"),
        ),
        (
            "universal_ckpt",
            None,
            Accept("DCP checkpoints are resharded on load, so they resume at another world size"),
        ),
        (
            "disable_trace_cache",
            None,
            Accept("a DeepSpeed ZeRO-3 trace cache switch; FSDP2 has none"),
        ),
    ),
}

# ------------------------------------------------------------------ ppo

PLACEMENT = ("ref", "reward", "actor", "critic")


def _placement_rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    for model in PLACEMENT:
        for what in ("num_nodes", "num_gpus_per_node"):
            rule = Gather(f"{model}.{what}", f"--{what}")
            rules.update(_pairs((f"{model}_{what}", f"{model}.{what}", rule)))
    return rules


def _per_model(model: str, optim: str) -> dict[str, Rule]:
    """v0.11's ``--actor.adam.lr`` ... for one of actor / critic."""
    lr = "actor_learning_rate" if model == "actor" else "critic_learning_rate"
    muon = Accept(f"it only applies to --{model}.optim muon")
    return _pairs(
        (None, f"{model}.optim", Accept("the optimizer is AdamW", _optim)),
        (None, f"{model}.muon.lr", muon),
        (None, f"{model}.muon.momentum", muon),
        (None, f"{model}.muon.ns_steps", muon),
        (None, f"{model}.muon.nesterov", muon),
        (None, f"{model}.muon.no_nesterov", muon),
        (None, f"{model}.adam.lr", rename(lr)),
        (None, f"{model}.adam.betas", rename(f"{optim}.adam_betas")),
        (None, f"{model}.adam.eps", rename(f"{optim}.adam_eps")),
        (None, f"{model}.adam.weight_decay", rename(f"{optim}.l2")),
        (None, f"{model}.lr_scheduler", rename(f"{optim}.lr_scheduler")),
        (None, f"{model}.lr_warmup_ratio", rename(f"{optim}.lr_warmup_ratio")),
        (None, f"{model}.min_lr_ratio", rename(f"{optim}.min_lr_ratio")),
        (None, f"{model}.max_norm", rename(f"{optim}.max_norm")),
    )


PPO_RULES: dict[str, Rule] = {
    **COMMON,
    **_placement_rules(),
    **_per_model("actor", "actor_optim"),
    **_per_model("critic", "critic_optim"),
    **_pairs(
        # placement
        ("colocate_actor_ref", "train.colocate_actor_ref", Accept(COLOCATED)),
        ("colocate_critic_reward", "train.colocate_critic_reward", Accept(COLOCATED)),
        ("colocate_all_models", "train.colocate_all", Accept(COLOCATED)),
        ("actor_init_on_gpu", None, Accept("models are sharded onto the GPU layer by layer")),
        # vLLM
        (
            "vllm_num_engines",
            "vllm.num_engines",
            To(
                lambda v: ["--rollout_engine", "hf"] if v == ("0",) else ["--vllm_num_engines", *v],
                "--vllm_num_engines",
                "0 means HF generate, as in OpenRLHF",
            ),
        ),
        (None, "vllm.tensor_parallel_size", rename("vllm_tensor_parallel_size")),
        (
            "vllm_sync_backend",
            "vllm.sync_backend",
            Accept(
                "weights go into the in-process engine by DTensor gathers on every rank (with "
                "--async_train, gathered on the training ranks and sent in buckets: NCCL on GPU, "
                "gloo on CPU)"
            ),
        ),
        ("vllm_sync_with_ray", "vllm.sync_with_ray", Refuse(NO_RAY)),
        (
            "enable_prefix_caching",
            "vllm.enable_prefix_caching",
            Accept("vLLM's prefix caching is always on here"),
        ),
        (None, "vllm.enforce_eager", switch("enforce_eager")),
        (None, "vllm.enable_sleep", switch("vllm_enable_sleep")),
        (None, "vllm.gpu_memory_utilization", rename("vllm_gpu_memory_utilization")),
        ("deepspeed_enable_sleep", "ds.enable_sleep", Accept(SLEEP)),
        (
            "vllm_generate_batch_size",
            "rollout.vllm_generate_batch_size",
            Gather(
                "async.generate",
                "--vllm_generate_batch_size",
                "with --async_train; without it, up to --rollout_batch_size changes nothing",
            ),
        ),
        # rollout correction: until 0.11.1 a switch, a type and a threshold; from 0.11.2 a
        # level, a mode, a gating and one threshold (HIGH) or two
        (
            "enable_vllm_is_correction",
            "algo.advantage.is_correction_enable",
            Gather("is.enable", "--is_correction"),
        ),
        (
            "vllm_is_correction_type",
            "algo.advantage.is_correction_type",
            Gather("is.type", "--is_correction", "OpenRLHF's seq-mask-tis is seq_mask here"),
        ),
        (
            None,
            "algo.advantage.is_correction_level",
            Gather(
                "is.level",
                "--is_correction",
                "with --algo.advantage.is_correction_mode: token clip is tis, token mask "
                "icepop, seq mask seq_mask",
            ),
        ),
        (None, "algo.advantage.is_correction_mode", Gather("is.mode", "--is_correction")),
        (
            None,
            "algo.advantage.is_correction_gating",
            Gather("is.gating", "--is_correction_gating"),
        ),
        (
            "vllm_is_truncated_threshold",
            "algo.advantage.is_correction_threshold",
            rename("is_truncated_threshold"),
        ),
        # earlier names of truncated IS (this trainer's own, before --is_correction)
        ("use_tis", None, Gather("tis.use", "--is_correction tis")),
        ("tis_cap", None, Gather("tis.cap", "--is_truncated_threshold 0 CAP")),
        # async training (the flat names are ours too)
        (None, "train.async_enable", switch("async_train")),
        (None, "train.async_queue_size", rename("async_queue_size")),
        (None, "train.partial_rollout_enable", switch("partial_rollout")),
        # lengths: OpenRLHF's --max_len is prompt + response
        ("max_len", "data.max_len", Gather("len.max_len", "--max_len")),
        ("max_new_tokens", "rollout.max_new_tokens", Gather("len.max_new", "--generate_max_len")),
        # models and rewards
        (None, "actor.model_name_or_path", rename("pretrain")),
        (None, "reward.model_name_or_path", rename("reward_pretrain")),
        (None, "critic.model_name_or_path", rename("critic_pretrain")),
        (None, "reward.remote_url", rename("remote_rm_url")),
        (None, "reward.normalize_enable", switch("normalize_reward")),
        ("reward_clip_range", "reward.clip_range", To(_clip_range, "--reward_clip_range")),
        (
            "overlong_buffer_len",
            "reward.overlong_buffer_len",
            To(lambda v: ["--overlong_buffer_len", *_int(v)], "--overlong_buffer_len"),
        ),
        (None, "reward.overlong_penalty_factor", rename("overlong_penalty_factor")),
        (None, "reward.stop_properly_penalty_coef", rename("stop_properly_penalty_coef")),
        (None, "ref.offload", switch("ref_reward_offload", "offloads the reward model too")),
        (None, "reward.offload", switch("ref_reward_offload", "offloads the reference too")),
        (None, "train.agent_func_path", rename("agent_func_path")),
        (
            "save_value_network",
            "critic.save_value_network",
            Accept("the critic is always exported to <save_path>/critic with GAE"),
        ),
        (None, "actor.gradient_checkpointing_enable", switch("gradient_checkpointing")),
        (
            None,
            "actor.gradient_checkpointing_reentrant",
            Accept("activation checkpointing is non-reentrant here (same gradients)"),
        ),
        ("use_liger_kernel", "ds.use_liger_kernel", LIGER),
        ("perf", None, Accept("timing/* and throughput metrics are always logged")),
        # PPO objective
        (
            "ptx_coef",
            None,
            Accept("OpenRLHF v0.10 has no pretraining data flag, so PPO-ptx is off there too"),
        ),
        (None, "actor.eps_clip", rename("eps_clip")),
        (None, "actor.eps_clip_low_high", rename("eps_clip_low_high")),
        (None, "actor.dual_clip", rename("dual_clip")),
        (None, "actor.policy_loss_type", rename("policy_loss_type")),
        (
            None,
            "actor.loss_agg_mode",
            rename(
                "loss_agg_mode",
                "here it also averages the KL-loss and entropy terms, and the critic's loss",
            ),
        ),
        (None, "critic.value_clip", rename("value_clip")),
        (None, "actor.entropy_coef", rename("entropy_loss_coef")),
        (None, "actor.aux_loss_coef", rename("aux_loss_coef")),
        (None, "critic.freezing_steps", rename("freezing_actor_steps")),
        (None, "algo.advantage.lambd", rename("lambd")),
        (None, "algo.advantage.gamma", rename("gamma")),
        (
            "advantage_estimator",
            "algo.advantage.estimator",
            choice(
                "advantage_estimator",
                {"group_norm": "grpo", "reinforce": "reinforce++"},
                "OpenRLHF's group_norm is GRPO, reinforce is REINFORCE++",
            ),
        ),
        (None, "algo.advantage.no_std_norm", switch("no_advantage_std_norm")),
        (None, "algo.kl.target", rename("kl_target")),
        (None, "algo.kl.horizon", rename("kl_horizon")),
        (None, "algo.kl.init_coef", rename("init_kl_coef")),
        (None, "algo.kl.estimator", rename("kl_estimator")),
        (None, "algo.kl.use_loss", switch("use_kl_loss")),
        (None, "algo.kl.unbiased_gradient", switch("kl_unbiased_gradient")),
        (None, "algo.dynamic_filtering_enable", switch("dynamic_filtering")),
        (None, "algo.dynamic_filtering_range", rename("dynamic_filtering_reward_range")),
        # batches
        (None, "train.num_episodes", rename("num_episodes")),
        (None, "rollout.batch_size", rename("rollout_batch_size")),
        (None, "rollout.micro_batch_size", rename("micro_rollout_batch_size")),
        (None, "rollout.n_samples_per_prompt", rename("n_samples_per_prompt")),
        (None, "train.dynamic_batch_enable", switch("use_dynamic_batch")),
        (None, "train.max_tokens_per_gpu", rename("train_max_tokens_per_gpu")),
        (None, "rollout.max_tokens_per_gpu", rename("rollout_max_tokens_per_gpu")),
        (None, "train.enable_ema", switch("enable_ema")),
        (None, "train.ema_beta", rename("ema_beta")),
        # data
        (None, "data.prompt_dataset", rename("prompt_data")),
        (None, "data.prompt_probs", rename("prompt_data_probs")),
        (None, "eval.dataset", rename("eval_dataset")),
        (None, "eval.split", rename("eval_split")),
        (None, "eval.temperature", rename("eval_temperature")),
        (None, "eval.n_samples_per_prompt", rename("eval_n_samples_per_prompt")),
        ("best_metric_key", "ckpt.best_metric_key", Gather("eval.best", "--save_best_metric")),
        # vision-language models (v0.10's flat names are ours)
        (None, "data.image_key", rename("image_key")),
        (None, "actor.freeze_visual_encoder", switch("freeze_visual_encoder")),
        (
            None,
            "data.max_images_per_prompt",
            rename(
                "max_images_per_prompt",
                "0 means the most images any row has (OpenRLHF: text-only); a VLM is "
                "recognised by its config",
            ),
        ),
    ),
}


def _placement(gathered: dict[str, tuple[Flag, Values]], out: list[str]) -> None:
    """The per-model node and GPU counts must all describe one pool: the torchrun world."""
    counts: dict[str, dict[str, int]] = {}
    for key, (flag, values) in gathered.items():
        model, _, what = key.partition(".")
        if model in PLACEMENT:
            try:
                counts.setdefault(what, {})[model] = int(values[0])
            except (ValueError, IndexError):
                raise ConfigError(f"{flag.text()}: expected a whole number") from None
    for what, by_model in counts.items():
        if len(set(by_model.values())) > 1:
            seen = ", ".join(f"{m} {n}" for m, n in by_model.items())
            raise ConfigError(
                f"--*_{what} ({seen}): not supported here: models on separate node pools; "
                f"{FULL_COLOCATION}, so give every model the same counts and launch torchrun "
                "over that many nodes and GPUs"
            )
        out += [f"--{what}", str(next(iter(by_model.values())))]


def _lengths(gathered: dict[str, tuple[Flag, Values]], out: list[str]) -> None:
    """OpenRLHF's ``--max_len`` counts prompt + response; ``--max_new_tokens`` the response
    (when absent, each response may use ``max_len`` minus its prompt's length)."""
    max_len = gathered.get("len.max_len")
    max_new = gathered.get("len.max_new")
    if max_new is not None:
        out += ["--generate_max_len", *_int(max_new[1])]
    if max_len is None:
        return
    total = int(_int(max_len[1])[0])
    if max_new is not None:
        new = int(_int(max_new[1])[0])
        if total <= new:
            raise ConfigError(
                f"{max_len[0].text()}: must exceed --max_new_tokens ({new}): it counts the "
                "prompt and the response"
            )
        out += ["--prompt_max_len", str(total - new)]
    else:  # each response gets what its prompt leaves (prompts keep at least one token's room)
        out += ["--max_len", str(total), "--generate_max_len", str(total - 1)]
        out += ["--prompt_max_len", str(total - 1)]


# OpenRLHF's names of its IS corrections as --is_correction: 0.11.0's types, and 0.11.2's
# (level, mode) pairs (its own table: TIS = token clip, ICEPOP = token mask, seq-mask-tis = seq
# mask). Its seq-mask-tis keeps the untruncated ratio on kept rows: our seq_mask.
IS_TYPES = {"tis": "tis", "icepop": "icepop", "seq-mask-tis": "seq_mask"}
IS_LEVEL_MODES = {
    ("token", "clip"): "tis",
    ("token", "mask"): "icepop",
    ("seq", "mask"): "seq_mask",
}
IS_CHOICES = {
    "is.type": tuple(IS_TYPES),
    "is.level": ("off", "token", "seq"),
    "is.mode": ("mask", "clip"),
    "is.gating": ("ratio", "binary_kl", "tv"),
}


def _is_value(gathered: dict[str, tuple[Flag, Values]], key: str, default: str) -> str:
    if key not in gathered:
        return default
    flag, values = gathered[key]
    value = values[0] if values else ""
    if value not in IS_CHOICES[key]:
        raise ConfigError(f"{flag.text()}: expected one of {', '.join(IS_CHOICES[key])}")
    return value


# OpenRLHF's IS correction weighs its trainer's old log-probs (recomputed by the actor, under
# async training too) against the engine's, and takes the PPO ratio against the old ones: a
# script that sets one keeps that meaning (the ratio against the behaviour log-probs, this
# trainer's default under --async_train, would replace the correction it asked for)
KEEP_TRAINER_OLD = ["--off_policy_correction", "none"]


def _is_correction(gathered: dict[str, tuple[Flag, Values]], out: list[str]) -> None:
    """OpenRLHF's IS correction in either release's spelling (one of them per line), with the
    PPO ratio against the trainer's old log-probs, as OpenRLHF takes it (``KEEP_TRAINER_OLD``)."""
    old = [gathered[k][0] for k in ("is.enable", "is.type") if k in gathered]
    new = [gathered[k][0] for k in ("is.level", "is.mode", "is.gating") if k in gathered]
    if old and new:
        raise ConfigError(
            f"{old[0].text()} (OpenRLHF 0.11.0) and {new[0].text()} (0.11.2) both set the IS "
            "correction: use one release's flags"
        )
    if old:
        if "is.enable" not in gathered:
            return  # OpenRLHF ignores the type unless the switch is on
        out += ["--is_correction", IS_TYPES[_is_value(gathered, "is.type", "tis")]]
        out += KEEP_TRAINER_OLD
        return
    level = _is_value(gathered, "is.level", "off")
    mode = _is_value(gathered, "is.mode", "mask")
    gating = _is_value(gathered, "is.gating", "ratio")
    if level == "off":
        return  # the mode and the gating mean nothing then, there too
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        flag = gathered["is.mode"][0]
        raise refusal(
            flag,
            f"clip clamps each token's ratio; with level {level} and gating {gating} it "
            "would clamp a row statistic or a divergence (OpenRLHF refuses it too)",
            "use --algo.advantage.is_correction_mode mask",
        )
    out += ["--is_correction", IS_LEVEL_MODES[(level, mode)]]
    if gating != "ratio":
        out += ["--is_correction_gating", gating]
    out += KEEP_TRAINER_OLD


def _tis(gathered: dict[str, tuple[Flag, Values]], flags: list[Flag], out: list[str]) -> None:
    """``--use_tis [--tis_cap C]`` is ``--is_correction tis --is_truncated_threshold 0 C``."""
    use = gathered.get("tis.use")
    if use is None:
        return
    cap = gathered.get("tis.cap")
    value = float(cap[1][0]) if cap else 2.0
    if value <= 0:
        raise ConfigError(f"--tis_cap must be > 0, got {value}")
    for flag in flags:
        if flag.name == "is_correction" and flag.values and flag.values[0] not in ("tis", "none"):
            raise ConfigError(f"--use_tis is --is_correction tis; it conflicts with {flag.text()}")
    out += ["--is_correction", "tis", "--is_truncated_threshold", "0", str(value)]


def _best_metric(
    gathered: dict[str, tuple[Flag, Values]], flags: list[Flag], out: list[str]
) -> None:
    """OpenRLHF's ``--best_metric_key``: '' picks the first pass@1 metric, 'none' turns it off,
    otherwise a key like ``eval_default_pass4`` (pass@4)."""
    best = gathered.get("eval.best")
    if best is None:
        return
    flag, values = best
    key = values[0] if values else ""
    if key.lower() == "none":
        return
    if key == "":
        if any(f.name in ("eval_dataset", "eval.dataset") for f in flags):
            out += ["--save_best_metric", "pass@1"]
        return
    match = re.fullmatch(r"(?:eval_\w+_)?pass(?:@)?(\d+)", key)
    if match is None:
        raise refusal(
            flag,
            f"metric key {key!r}: only pass@K keys are kept here",
            "use --save_best_metric pass@K",
        )
    out += ["--save_best_metric", f"pass@{match[1]}"]


def _switched_on(flags: list[Flag], names: tuple[str, ...]) -> bool:
    on = [f for f in flags if f.name in names]
    return bool(on) and (not on[-1].values or on[-1].values[0].lower() in ("true", "1", "yes"))


def _generate_batch(
    gathered: dict[str, tuple[Flag, Values]], flags: list[Flag], out: list[str]
) -> None:
    """``--vllm_generate_batch_size``: over-sampling, which needs async training (as in
    OpenRLHF); without it a value up to the rollout batch describes what happens anyway."""
    given = gathered.get("async.generate")
    if given is None:
        return
    flag, values = given
    if _switched_on(flags, ("async_train", "train.async_enable")):
        out += ["--vllm_generate_batch_size", *values]
        return
    batch = [f for f in flags if f.name in ("rollout_batch_size", "rollout.batch_size")]
    default = PPOBatchConfig().rollout_batch_size
    rollout = int(batch[-1].values[0]) if batch and batch[-1].values else default
    if int(values[0]) > rollout:
        raise refusal(
            flag,
            f"over-sampling (more than --rollout_batch_size {rollout}) needs async training",
            "add --async_train",
        )


def _finish_ppo(gathered: dict[str, tuple[Flag, Values]], flags: list[Flag]) -> list[str]:
    out: list[str] = []
    _generate_batch(gathered, flags, out)
    _placement(gathered, out)
    _lengths(gathered, out)
    _is_correction(gathered, out)
    _tis(gathered, flags, out)
    _best_metric(gathered, flags, out)
    return out


# The foreign spellings of each command with flags of its own (fsdp_rlhf.commands; `doctor`
# takes ppo's). The parsers each answers for are its ``Command.openrlhf``.
TABLES: dict[str, Table] = {
    "ppo": Table("ppo", PPO_RULES, _finish_ppo),
    "train-rm": Table("train-rm", RM_RULES),
    "sft": Table("sft", SFT_RULES),
    "dpo": Table("dpo", DPO_RULES),
    "kd": Table("kd", KD_RULES),
}
# Every release whose parsers changed (0.10.2-0.10.4 define 0.11.0's flags; 0.11.1 adds
# --algo.kl.unbiased_gradient, 0.11.2 the rest of its rollout-correction and FlashREINFORCE
# flags). 0.11.2 is the newest on PyPI (checked 2026-11-27).
VERSIONS = ("0.10.1.post2", "0.11.0", "0.11.1", "0.11.2")

__all__ = ["TABLES", "VERSIONS", "To"]
