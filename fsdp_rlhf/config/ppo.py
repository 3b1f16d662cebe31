"""The config tree of `fsdp-rlhf ppo` (PPO with a critic, GRPO, RLOO, REINFORCE++, Dr. GRPO,
DAPO, GSPO; multi-turn, MoE, asynchronous training)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Literal

from fsdp_rlhf.algorithms.names import (
    TOPK_DISTILL_LOSSES,
    AdvantageEstimator,
    DistillLoss,
    ISGating,
    LossAgg,
    correction_problem,
)
from fsdp_rlhf.config.common import (
    BackendConfig,
    CheckpointConfig,
    FSDPConfig,
    GuardConfig,
    LoggingConfig,
    LoraConfig,
    OptimConfig,
    VisionConfig,
)
from fsdp_rlhf.config_base import ConfigError, command_config, doc, section


@dataclass(frozen=True, kw_only=True)
class PPOModelsConfig:
    """The four models and where rewards come from."""

    pretrain: str = doc("", "SFT model: initial actor and the reference model.")
    reward_pretrain: str | None = doc(None, "Reward model folder (HF sequence classification).")
    critic_pretrain: str | None = doc(None, "Critic init (default: the reward model).")
    value_head_prefix: str = doc("score", "Value-head name to look for in reward/critic folders.")
    remote_rm_url: str | None = doc(
        None, "Rule reward: a .py file with reward_func(queries, prompts, labels), or an HTTP URL."
    )
    remote_rm_auth_env: str | None = doc(
        None, "Name of an environment variable whose value is sent as 'Authorization: Bearer'."
    )
    normalize_reward: bool = doc(False, "Normalise scores by the mean/std in the RM's config.")


# verl's default number of teacher tokens per position for its top-k losses
DEFAULT_DISTILL_TOPK = 32


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores every token the
    student samples; off without --teacher_pretrain / --teacher_url."""

    teacher_pretrain: str | None = doc(
        None,
        "Teacher model folder: frozen, FSDP2-sharded over the ranks like the reference, scoring "
        "each sampled token (its tokenizer must equal --pretrain's).",
    )
    teacher_url: str | None = doc(
        None,
        "A served teacher instead: the base URL of an OpenAI-compatible vLLM server "
        "(http://host:port), asked for prompt_logprobs over each prompt + response.",
    )
    teacher_offload: bool = doc(
        False, "Keep the teacher in host memory between its forwards (--teacher_pretrain)."
    )
    distill_coef: float = doc(1.0, "Weight of the distillation signal.")
    distill_loss: DistillLoss = doc(
        "advantage",
        "advantage: A_t += -coef (log pi_S - log pi_T) on each sampled token, under the "
        "policy loss; k1 / k2 / k3: KL(student || teacher) estimated from the sampled tokens, "
        "coef x it in the loss; forward_kl_topk / reverse_kl_topk: the KL over the teacher's "
        "top --distill_topk tokens plus a tail bucket, in the loss.",
    )
    distill_topk: int | None = doc(
        None,
        f"Teacher tokens per position of the top-k losses (default {DEFAULT_DISTILL_TOPK}).",
    )
    teacher_batch_size: int = doc(16, "--teacher_url: sequences per request.")
    teacher_timeout_s: float = doc(120.0, "--teacher_url: the most seconds one request may take.")
    teacher_retries: int = doc(3, "--teacher_url: attempts per request before the run stops.")

    def __post_init__(self) -> None:
        if self.teacher_pretrain and self.teacher_url:
            raise ConfigError("--teacher_pretrain and --teacher_url both name a teacher: pass one")
        if self.distill_coef < 0:
            raise ConfigError(f"distill_coef must be >= 0, got {self.distill_coef}")
        topk = self.distill_loss in TOPK_DISTILL_LOSSES
        if self.distill_topk is not None and not topk:
            raise ConfigError(
                f"--distill_topk applies to --distill_loss {' / '.join(TOPK_DISTILL_LOSSES)}, "
                f"not {self.distill_loss}"
            )
        if topk and self.distill_topk is None:
            object.__setattr__(self, "distill_topk", DEFAULT_DISTILL_TOPK)
        if self.distill_topk is not None and self.distill_topk < 1:
            raise ConfigError(f"distill_topk must be >= 1, got {self.distill_topk}")
        for name in ("teacher_batch_size", "teacher_retries"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.teacher_timeout_s <= 0:
            raise ConfigError(f"teacher_timeout_s must be > 0, got {self.teacher_timeout_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_pretrain or self.teacher_url)

    @property
    def teacher(self) -> str | None:
        """``--teacher_pretrain PATH`` or ``--teacher_url URL`` (None: no teacher)."""
        if self.teacher_pretrain:
            return f"--teacher_pretrain {self.teacher_pretrain}"
        if self.teacher_url:
            return f"--teacher_url {self.teacher_url}"
        return None

    @property
    def topk(self) -> bool:
        return self.distill_loss in TOPK_DISTILL_LOSSES


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where models live. By default everything is colocated on every rank (--async_train
    gives the vLLM engines ranks of their own); the flags are kept for AIAK-RLHF's scripts."""

    colocate_all: bool = doc(
        True,
        "All models and the vLLM engine share every GPU (with --async_train: the training "
        "models share the training ranks).",
    )
    num_nodes: int | None = doc(
        None, "Expected nodes; checked against the torchrun world (--async_train: training ranks)."
    )
    num_gpus_per_node: int | None = doc(None, "Expected ranks per node; checked likewise.")
    ref_reward_offload: bool = doc(False, "Keep reference and reward models in host memory.")


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Asynchronous training (docs/async.md): rollout ranks generate the next batches while the
    training ranks train on the current one."""

    async_train: bool = doc(
        False,
        "Split the world: the last vllm_num_engines x vllm_tensor_parallel_size ranks hold only "
        "vLLM engines and generate while the other ranks hold the models and train.",
    )
    async_queue_size: int = doc(
        1,
        "With --async_train: the most weight versions a batch's tokens may lag behind the policy "
        "trained on them (1: one-step-off-policy).",
    )
    partial_rollout: bool = doc(
        False,
        "With --async_train: generations in flight when new weights arrive are paused, the "
        "weights loaded, and continue under them; each token keeps the version that sampled it "
        "and its log-prob.",
    )
    vllm_generate_batch_size: int | None = doc(
        None,
        "With --async_train: prompts generated per step, global; above rollout_batch_size the "
        "first rollout_batch_size groups to finish are kept and the stragglers dropped.",
    )

    def __post_init__(self) -> None:
        if self.async_queue_size < 1:
            raise ConfigError(f"async_queue_size must be >= 1, got {self.async_queue_size}")
        if self.vllm_generate_batch_size is not None and self.vllm_generate_batch_size < 1:
            raise ConfigError(
                f"vllm_generate_batch_size must be >= 1, got {self.vllm_generate_batch_size}"
            )


@dataclass(frozen=True, kw_only=True)
class PromptDataConfig:
    """Prompt data for rollouts."""

    prompt_data: str = doc(
        "", "Comma-separated sources: JSON/JSONL/parquet file, folder, hub name."
    )
    prompt_data_probs: str = doc("1.0", "Comma-separated mixing probabilities, one per source.")
    prompt_split: str = doc("train", "Split to read from sources that have several.")
    input_key: str = doc("input", "Key of the prompt (string or chat-message list).")
    label_key: str | None = doc(None, "Key of a label passed to the rule reward.")
    input_template: str | None = doc(
        "Human: {}\nAssistant: ", "Template for raw prompts when no chat template is applied."
    )
    apply_chat_template: bool = doc(False, "Render prompts with the tokenizer's chat template.")
    prompt_max_len: int = doc(
        1024, "Prompts longer than this (tokens) are truncated from the left."
    )
    max_samples: int = doc(100_000, "Use at most this many prompts.")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Generation: engine, sampling, vLLM layout."""

    rollout_engine: Literal["vllm", "hf"] = doc("vllm", "vllm (default) or HF generate.")
    lora_sync: Literal["adapter", "merged"] = doc(
        "adapter",
        "With --lora_rank: adapter (vLLM serves the adapters, only they are synced) or merged "
        "(each adapted weight synced as W + (alpha/r) B A, like full fine-tuning: more bytes, "
        "base-model decode speed where vLLM's LoRA kernels are slow, as on CPU).",
    )
    weight_sync: Literal["auto", "delta", "full"] = doc(
        "auto",
        "How the actor's weights reach the engines: delta (after a first full sync, each rank "
        "sends only the elements that changed, checked by checksum; the engine side keeps a "
        "copy of the synced weights in host memory), full (every weight every time), or auto "
        "(delta when the job spans hosts, but colocated on CUDA and with LoRA; "
        "docs/weight_sync.md).",
    )
    weight_sync_full_every: int = doc(
        0, "With delta sync: every N-th sync is a full one (0: only the first after a start)."
    )
    weight_sync_overlap: bool = doc(
        True, "Gather the next weight bucket while the engine loads the current one."
    )
    vllm_num_engines: int | None = doc(None, "Engines = world / TP (checked when given).")
    vllm_tensor_parallel_size: int = doc(1, "TP size of each engine (contiguous ranks).")
    vllm_gpu_memory_utilization: float | None = doc(
        None,
        "Fraction of the whole GPU vLLM's pool takes at start-up and again at every wake, beside "
        "the resident shards (unset: the largest that the memory plan fits, at most 0.9; a value "
        "that does not fit is refused before the models load).",
    )
    vllm_enable_sleep: bool = doc(True, "Release vLLM memory between rollouts (GPU only).")
    # 2 by default: the actor's weights are streamed into the engine before every rollout, so
    # level 1's copy to host memory and back would be thrown away.
    vllm_sleep_level: int = doc(
        2, "2: discard weights while asleep (re-synced every step); 1: offload them to CPU."
    )
    vllm_kvcache_space_gib: float = doc(0.0, "CPU only: KV cache size (0: sized from the config).")
    enforce_eager: bool = doc(False, "Disable CUDA graphs in vLLM.")
    generate_max_len: int = doc(1024, "Max new tokens per response.")
    max_len: int | None = doc(
        None,
        "Tokens per sequence, prompt + response (OpenRLHF's --max_len): each response may use "
        "max_len minus its prompt's length, at most generate_max_len (none: generate_max_len).",
    )
    temperature: float = doc(1.0, "Sampling temperature.")
    top_p: float = doc(1.0, "Nucleus sampling.")
    top_k: int = doc(-1, "Top-k sampling (-1: off).")
    micro_rollout_batch_size: int = doc(8, "Sequences per forward in the scoring phases, per rank.")

    def __post_init__(self) -> None:
        if self.vllm_sleep_level not in (1, 2):
            raise ConfigError(f"vllm_sleep_level must be 1 or 2, got {self.vllm_sleep_level}")
        util = self.vllm_gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ConfigError(f"vllm_gpu_memory_utilization must be in (0, 1], got {util}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.max_len is not None and self.max_len < 2:
            raise ConfigError(f"max_len must be >= 2, got {self.max_len}")
        if self.weight_sync_full_every < 0:
            raise ConfigError(
                f"weight_sync_full_every must be >= 0, got {self.weight_sync_full_every}"
            )


@dataclass(frozen=True, kw_only=True)
class PPOBatchConfig:
    """Batch sizes; 'global' means summed over all ranks."""

    rollout_batch_size: int = doc(512, "Prompts per step, global.")
    n_samples_per_prompt: int = doc(1, "Responses sampled per prompt.")
    train_batch_size: int = doc(128, "Sequences per optimizer step, global.")
    micro_train_batch_size: int = doc(8, "Sequences per forward/backward on one rank.")
    max_epochs: int = doc(1, "Passes over the prompt data.")
    num_episodes: int = doc(1, "Repeat the whole schedule this many times.")
    max_steps: int = doc(-1, "Stop after this many steps (-1: run the data out).")
    packing_samples: bool = doc(
        False,
        "Pack each micro-batch into one row without padding for every training-side forward "
        "(attention per sequence).",
    )
    share_prompt_prefix: bool = doc(
        True,
        "With n_samples_per_prompt > 1, run each prompt through the actor and reference once for "
        "its samples in a micro-batch (same log-probs and gradients, fewer tokens). Not with "
        "--packing_samples or flash-attn; the log says when it is off.",
    )
    use_dynamic_batch: bool = doc(
        False,
        "Form micro-batches by token count instead of row count: each rank's rows sorted by "
        "length and bin-packed into micro-batches of at most --train_max_tokens_per_gpu "
        "(updates) / --rollout_max_tokens_per_gpu (no-grad forwards) tokens, each cut to its "
        "own longest row; --micro_train_batch_size / --micro_rollout_batch_size then do not "
        "apply. Same loss and gradients.",
    )
    train_max_tokens_per_gpu: int = doc(
        16192,
        "With --use_dynamic_batch: tokens per micro-batch of the updates on one rank (padded: "
        "rows x the longest; with --packing_samples: their sum); with --sequence_parallel_size "
        "N a micro-batch holds N times this, 1/N on each rank of its group.",
    )
    rollout_max_tokens_per_gpu: int | None = doc(
        None,
        "With --use_dynamic_batch: tokens per micro-batch of the no-grad forwards (old and "
        "reference log-probs, values, rewards); default --train_max_tokens_per_gpu.",
    )

    def __post_init__(self) -> None:
        for name in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")

    @property
    def scoring_max_tokens(self) -> int | None:
        """The no-grad forwards' token budget (None: fixed-size micro-batches)."""
        if not self.use_dynamic_batch:
            return None
        return self.rollout_max_tokens_per_gpu or self.train_max_tokens_per_gpu


GSPO_PAPER_CLIP = (3e-4, 4e-4)


def _pair(value: tuple[float, ...], name: str, *, ordered: bool = False) -> tuple[float, float]:
    if len(value) != 2:
        raise ConfigError(f"{name} needs 2 values (LOW HIGH), got {list(value)}")
    low, high = value
    if ordered and not low < high:
        raise ConfigError(f"{name} needs LOW < HIGH, got {list(value)}")
    return low, high


# What --off_policy_correction auto becomes (chosen by measurement:
# benchmarks/2026-12-01-async-correction.md)
AUTO_OFF_POLICY = {"async": "behaviour", "colocated": "none"}


def resolve_off_policy_correction(
    mode: str, async_train: bool, is_correction: str, rollout_logprobs_as_old: bool
) -> str:
    """``--off_policy_correction`` with ``auto`` resolved: the flag's own value when set; an
    ``--is_correction`` keeps the ratio against the trainer's old log-probs (the correction's
    definition, and OpenRLHF's meaning of its flags under async training); bypass mode takes
    it against the behaviour log-probs; otherwise the measured choice for the placement."""
    if mode != "auto":
        return mode
    if rollout_logprobs_as_old:
        return "behaviour"
    if is_correction != "none":
        return "none"
    return AUTO_OFF_POLICY["async" if async_train else "colocated"]


@dataclass(frozen=True, kw_only=True)
class PPOAlgoConfig:
    """PPO objective, advantages and KL."""

    advantage_estimator: AdvantageEstimator = doc(
        "gae",
        "gae needs a critic; the others are critic-free. reinforce_plus_plus_baseline (verl's "
        "name; reinforce_baseline is OpenRLHF's for the same): group-mean baseline, then "
        "REINFORCE++ batch whitening. flash_reinforce: score minus the rollout batch's mean "
        "score, no groups, no whitening (for n_samples_per_prompt 1).",
    )
    gamma: float = doc(1.0, "Discount factor.")
    advantage_std_norm: bool = doc(
        True,
        "Divide batch-whitened advantages (gae, reinforce++, reinforce_plus_plus_baseline) by "
        "their std; --no_advantage_std_norm only subtracts the mean.",
    )
    lam: float = doc(0.95, "GAE lambda.")
    eps_clip: float = doc(0.2, "Policy ratio clip (lower side).")
    eps_clip_high: float | None = doc(None, "Upper-side clip (default: eps_clip).")
    eps_clip_low_high: tuple[float, ...] = doc(
        (),
        "OpenRLHF's two-value form LOW HIGH (DAPO clip-higher, e.g. 0.2 0.28): sets eps_clip "
        "and eps_clip_high, overriding both.",
    )
    policy_loss_type: Literal["ppo", "gspo"] = doc(
        "ppo",
        "ppo: token-level ratio; gspo: sequence-level ratio (geometric mean of token ratios, "
        "GSPO), aggregated per sequence (seq-mean-token-mean).",
    )
    gspo_eps_clip_low_high: tuple[float, ...] = doc(
        (),
        "GSPO's clip range LOW HIGH on the sequence ratio (default: --eps_clip_low_high when "
        "given, else the paper's 3e-4 4e-4).",
    )
    value_clip: float = doc(0.2, "Value clip around old values (<= 0 disables).")
    dual_clip: float | None = doc(None, "Dual-clip constant c > 1 for negative advantages.")
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = doc("k1", "KL estimator (Schulman).")
    use_kl_loss: bool = doc(False, "KL in the actor loss instead of in the reward.")
    kl_unbiased_gradient: bool = doc(
        False,
        "With --use_kl_loss: keep the estimator's value but take the importance-weighted "
        "gradient of KL(policy || ref), min(pi/pi_old, 10) x log-ratio, the same for k1/k2/k3.",
    )
    init_kl_coef: float = doc(0.02, "KL coefficient (initial value when kl_target is set).")
    kl_target: float | None = doc(None, "Adaptive KL controller target (Ziegler et al.).")
    kl_horizon: int = doc(10000, "Adaptive KL controller horizon.")
    entropy_loss_coef: float = doc(0.0, "Entropy bonus weight.")
    reward_clip_range: float = doc(10.0, "Clip scores to [-x, x].")
    ppo_epochs: int = doc(1, "Passes over each rollout batch.")
    freezing_actor_steps: int = doc(-1, "Train only the critic for the first N steps.")
    loss_agg_mode: LossAgg = doc(
        "token-mean",
        "How per-token losses are averaged (global over ranks): token-mean; "
        "seq-mean-token-mean; seq-mean-token-sum; seq-mean-token-sum-norm (Dr. GRPO: token "
        "sums / generate_max_len, mean over sequences).",
    )
    is_correction: Literal[
        "none", "tis", "icepop", "seq_mask", "seq_mask_tis", "seq-mask", "seq-mask-tis"
    ] = doc(
        "none",
        "Rollout/trainer log-prob mismatch correction with ratio pi_old/pi_rollout: tis "
        "(weights clamped to [LOW, HIGH]), icepop (tokens outside [LOW, HIGH] get weight 0), "
        "seq_mask (rows whose geometric-mean ratio is outside [LOW, HIGH] get weight 0, others "
        "keep the ratio: OpenRLHF's seq-mask-tis), seq_mask_tis (the same rows rejected, others "
        "tis: verl's).",
    )
    is_correction_gating: ISGating = doc(
        "ratio",
        "What icepop and seq_mask compare with the thresholds: the ratio, or the sampled "
        "token's binary_kl or tv divergence between the two policies (a trust region: give "
        "one threshold, the upper bound).",
    )
    is_truncated_threshold: tuple[float, ...] = doc(
        (0.5, 5.0),
        "LOW HIGH thresholds of --is_correction, or one value HIGH (LOW 0).",
    )
    use_rollout_logprobs_as_old: bool = doc(
        False,
        "Bypass mode: the rollout engine's log-probs serve as the old log-probs (no trainer "
        "recomputation; the PPO ratio then corrects the mismatch itself).",
    )
    off_policy_correction: Literal["auto", "none", "behaviour", "decoupled"] = doc(
        "auto",
        "How the behaviour policy (the weights that sampled each token, its engine log-prob) "
        "enters the PPO objective: none (the ratio against the trainer's old log-probs); "
        "behaviour (the ratio against each token's behaviour log-prob); decoupled (AReaL: the "
        "clip around the trainer's old log-probs, each token's loss weighted by pi_old / "
        "pi_behaviour, tokens above --behaviour_weight_cap dropped); auto: "
        f"{AUTO_OFF_POLICY['async']} under --async_train, {AUTO_OFF_POLICY['colocated']} "
        "colocated, none with --is_correction (docs/async.md).",
    )
    behaviour_weight_cap: float = doc(
        5.0,
        "--off_policy_correction decoupled: tokens whose pi_old / pi_behaviour exceeds this "
        "are dropped (AReaL's behaviour importance weight cap; > 1).",
    )
    dynamic_filtering: bool = doc(
        False,
        "DAPO dynamic sampling: drop prompt groups whose scores are all equal (or, with "
        "--dynamic_filtering_reward_range, whose mean is outside it) and sample more.",
    )
    dynamic_filtering_reward_range: tuple[float, ...] = doc(
        (),
        "LOW HIGH: keep groups with LOW < mean score < HIGH (OpenRLHF's rule); empty: keep "
        "groups whose scores are not all equal (DAPO/verl's rule).",
    )
    max_num_gen_batches: int = doc(
        0,
        "Dynamic filtering: give up after this many generation rounds in one step and fill "
        "the batch with dropped groups (verl's name; 0: until full, capped at 32 rounds).",
    )
    overlong_buffer_len: int | None = doc(
        None,
        "DAPO overlong shaping: penalise responses longer than generate_max_len - this, "
        "linearly up to -overlong_penalty_factor at generate_max_len (none: off).",
    )
    overlong_penalty_factor: float = doc(1.0, "Largest overlong penalty (DAPO).")
    stop_properly_penalty_coef: float | None = doc(
        None,
        "ProRL: scores of responses cut by generate_max_len (no EOS): in [0, 1] they are "
        "multiplied by it, below 0 they are replaced by it (none: off).",
    )
    enable_ema: bool = doc(
        False,
        "Keep an exponential moving average of the actor's weights (updated after every actor "
        "optimizer step, checkpointed); it is the model exported to save_path.",
    )
    ema_beta: float = doc(0.992, "EMA decay: ema = beta * ema + (1 - beta) * actor.")

    def _set(self, **values) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)  # normalising a frozen dataclass at init

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"lambd must be in [0, 1], got {self.lam}")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"dual_clip must be > 1, got {self.dual_clip}")
        self._check_clips()
        self._check_is_correction()
        self._check_off_policy()
        if self.dynamic_filtering_reward_range:
            _pair(
                self.dynamic_filtering_reward_range, "dynamic_filtering_reward_range", ordered=True
            )
        if self.max_num_gen_batches < 0:
            raise ConfigError(f"max_num_gen_batches must be >= 0, got {self.max_num_gen_batches}")
        if self.overlong_buffer_len is not None and self.overlong_buffer_len <= 0:
            raise ConfigError(f"overlong_buffer_len must be > 0, got {self.overlong_buffer_len}")
        if self.overlong_penalty_factor < 0:
            raise ConfigError(
                f"overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}"
            )
        coef = self.stop_properly_penalty_coef
        if coef is not None and coef > 1:
            raise ConfigError(
                f"stop_properly_penalty_coef must be in [0, 1] (a factor) or < 0 (a fixed "
                f"score), got {coef}"
            )
        if not 0.0 <= self.ema_beta < 1.0:
            raise ConfigError(f"ema_beta must be in [0, 1), got {self.ema_beta}")

    def _check_clips(self) -> None:
        if self.eps_clip_low_high:
            low, high = _pair(self.eps_clip_low_high, "eps_clip_low_high")
            self._set(eps_clip=low, eps_clip_high=high)
        if self.eps_clip < 0 or (self.eps_clip_high is not None and self.eps_clip_high < 0):
            raise ConfigError(
                f"eps_clip values must be >= 0, got {self.eps_clip}, {self.eps_clip_high}"
            )
        gspo = self.gspo_eps_clip_low_high or self.eps_clip_low_high or GSPO_PAPER_CLIP
        low, high = _pair(tuple(gspo), "gspo_eps_clip_low_high")
        if low < 0 or high < 0:
            raise ConfigError(f"gspo_eps_clip_low_high must be >= 0, got {[low, high]}")
        self._set(gspo_eps_clip_low_high=(low, high))

    def _check_off_policy(self) -> None:
        mode = self.off_policy_correction
        if self.behaviour_weight_cap <= 1.0:
            raise ConfigError(
                f"behaviour_weight_cap must be > 1 (a cap below 1 drops on-policy tokens), "
                f"got {self.behaviour_weight_cap}"
            )
        if self.use_rollout_logprobs_as_old and mode in ("none", "decoupled"):
            raise ConfigError(
                f"--use_rollout_logprobs_as_old takes the PPO ratio against the behaviour "
                f"policy; --off_policy_correction {mode} takes it against the trainer's old "
                "log-probs: use one of them"
            )
        if mode in ("behaviour", "decoupled") and self.is_correction != "none":
            raise ConfigError(
                f"--off_policy_correction {mode} corrects with the behaviour log-probs itself; "
                f"--is_correction {self.is_correction} weighs the trainer's old log-probs "
                "against them too: use one of them (--off_policy_correction none keeps "
                "--is_correction)"
            )

    def _check_is_correction(self) -> None:
        mode = self.is_correction.replace("-", "_")
        threshold = tuple(self.is_truncated_threshold)
        if len(threshold) == 1:  # an upper bound only (OpenRLHF 0.11.2's one-value form)
            threshold = (0.0, threshold[0])
        low, high = _pair(threshold, "is_truncated_threshold", ordered=True)
        if low < 0:
            raise ConfigError(f"is_truncated_threshold LOW must be >= 0, got {low}")
        if self.use_rollout_logprobs_as_old and mode != "none":
            raise ConfigError(
                f"--use_rollout_logprobs_as_old makes the PPO ratio correct the mismatch; "
                f"--is_correction {mode} would need the trainer's own old log-probs"
            )
        gating = self.is_correction_gating
        if mode == "none" and gating != "ratio":
            raise ConfigError(
                f"--is_correction_gating {gating} chooses what --is_correction icepop or "
                "seq_mask compares with the thresholds: add one of them"
            )
        problem = correction_problem(mode, low, high, gating)
        if problem is not None:
            raise ConfigError(
                f"--is_correction {mode} --is_correction_gating {gating} "
                f"--is_truncated_threshold {low:g} {high:g}: {problem}"
            )
        self._set(is_correction=mode, is_truncated_threshold=(low, high))


@dataclass(frozen=True, kw_only=True)
class PPOEvalConfig:
    """Evaluation on held-out prompts every --eval_steps (pass@1 / pass@k)."""

    eval_dataset: str | None = doc(
        None, "Held-out prompt sources, same format as prompt_data (none: no evaluation)."
    )
    eval_split: str = doc("train", "Split to read from eval sources that have several.")
    eval_n_samples_per_prompt: int = doc(4, "Responses sampled per eval prompt (n of pass@k).")
    eval_temperature: float = doc(0.6, "Sampling temperature for evaluation.")
    save_best_metric: str | None = doc(
        None,
        "Keep a copy of the model with the best value of this eval metric: pass@1 or pass@K "
        "with K <= eval_n_samples_per_prompt (none: off).",
    )

    def __post_init__(self) -> None:
        if self.eval_n_samples_per_prompt < 1:
            raise ConfigError(
                f"eval_n_samples_per_prompt must be >= 1, got {self.eval_n_samples_per_prompt}"
            )
        if self.eval_temperature < 0:
            raise ConfigError(f"eval_temperature must be >= 0, got {self.eval_temperature}")
        if self.save_best_metric is None:
            return
        match = re.fullmatch(r"(?:eval/)?pass@(\d+)", self.save_best_metric)
        if match is None or not 1 <= int(match[1]) <= self.eval_n_samples_per_prompt:
            raise ConfigError(
                f"save_best_metric must be pass@K with 1 <= K <= eval_n_samples_per_prompt "
                f"({self.eval_n_samples_per_prompt}), got {self.save_best_metric!r}"
            )


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """Multi-turn rollouts against a Python environment (``--env_file``); off without it."""

    env_file: str | None = doc(
        None,
        "A .py file with reset(prompt, label) and step(history, action) -> (observation, "
        "reward, done), or only reward_func(queries, prompts, labels) for one turn. Its "
        "rewards are the scores (replaces --reward_pretrain / --remote_rm_url).",
    )
    agent_func_path: str | None = doc(
        None,
        "An OpenRLHF agent file (AgentInstance with async reset/step, AgentExecutor = "
        "MultiTurnAgentExecutor(AgentInstance)), run unchanged as the environment; instead of "
        "--env_file.",
    )
    max_turns: int = doc(
        4, "Model turns per trajectory at most (with --env_file or --agent_func_path)."
    )
    max_total_len: int | None = doc(
        None,
        "Prompt + every model and environment turn, in tokens (none: prompt_max_len + "
        "max_turns * generate_max_len).",
    )
    env_timeout_s: float = doc(
        30.0, "Per reset/step call; a call over it ends its trajectory as a tool error."
    )

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_len is not None and self.max_total_len < 1:
            raise ConfigError(f"max_total_len must be >= 1, got {self.max_total_len}")
        if self.env_timeout_s <= 0:
            raise ConfigError(f"env_timeout_s must be > 0, got {self.env_timeout_s}")

    @property
    def source(self) -> tuple[str, str] | None:
        """``(flag, path)`` of the environment, or None for single-turn rollouts."""
        if self.env_file is not None:
            return "--env_file", self.env_file
        if self.agent_func_path is not None:
            return "--agent_func_path", self.agent_func_path
        return None


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Mixture-of-experts actors (docs/models.md#mixture-of-experts)."""

    router_replay: bool = doc(
        False,
        "Router replay (R3): the actor's training forwards route each token to the experts "
        "the rollout engine chose; the reference and the critic route for themselves.",
    )
    aux_loss_coef: float = doc(
        0.0, "Weight of the load-balancing loss (Switch Transformer's) in the actor loss."
    )

    def __post_init__(self) -> None:
        if self.aux_loss_coef < 0:
            raise ConfigError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


@command_config
@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """`fsdp-rlhf ppo`."""

    FLAT_NAMES: ClassVar[dict[str, str | tuple[str, ...]]] = {
        "actor_learning_rate": "actor_optim.lr",
        "critic_learning_rate": "critic_optim.lr",
        "max_norm": ("actor_optim.max_norm", "critic_optim.max_norm"),
        "lr_warmup_ratio": ("actor_optim.lr_warmup_ratio", "critic_optim.lr_warmup_ratio"),
        "lr_scheduler": ("actor_optim.lr_scheduler", "critic_optim.lr_scheduler"),
        "adam_betas": ("actor_optim.adam_betas", "critic_optim.adam_betas"),
        "l2": ("actor_optim.l2", "critic_optim.l2"),
        "min_lr_ratio": ("actor_optim.min_lr_ratio", "critic_optim.min_lr_ratio"),
        "adam_eps": ("actor_optim.adam_eps", "critic_optim.adam_eps"),
        "lambd": "algo.lam",  # OpenRLHF's and AIAK's name (lambda is a Python keyword)
    }

    models: PPOModelsConfig = section(PPOModelsConfig)
    distill: DistillConfig = section(DistillConfig)
    placement: PlacementConfig = section(PlacementConfig)
    asynchronous: AsyncConfig = section(AsyncConfig)
    backend: BackendConfig = section(BackendConfig)
    fsdp: FSDPConfig = section(FSDPConfig)
    data: PromptDataConfig = section(PromptDataConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    batch: PPOBatchConfig = section(PPOBatchConfig)
    algo: PPOAlgoConfig = section(PPOAlgoConfig)
    eval: PPOEvalConfig = section(PPOEvalConfig)
    multiturn: MultiTurnConfig = section(MultiTurnConfig)
    moe: MoEConfig = section(MoEConfig)
    vision: VisionConfig = section(VisionConfig)
    actor_optim: OptimConfig = doc(help="Actor optimizer.", factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = doc(help="Critic optimizer.", factory=lambda: OptimConfig(lr=9e-6))
    ckpt: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    guard: GuardConfig = section(GuardConfig)
    lora: LoraConfig = section(LoraConfig)
    sample_log_steps: int = doc(10, "Every N steps log a few prompt/response/reward samples.")
    seed: int = doc(42, "Seed for data order, init and sampling.")

    def __post_init__(self) -> None:
        max_len = self.rollout.max_len
        if max_len is not None and self.data.prompt_max_len >= max_len:
            raise ConfigError(
                f"prompt_max_len ({self.data.prompt_max_len}) must be < max_len ({max_len}): "
                "max_len counts the prompt and its response"
            )
        algo = self.algo
        resolved = resolve_off_policy_correction(
            algo.off_policy_correction,
            self.asynchronous.async_train,
            algo.is_correction,
            algo.use_rollout_logprobs_as_old,
        )
        algo._set(off_policy_correction=resolved)  # written resolved into config.yaml
        buffer = self.algo.overlong_buffer_len
        if buffer is not None and buffer > self.rollout.generate_max_len:
            raise ConfigError(
                f"overlong_buffer_len ({buffer}) must be <= generate_max_len "
                f"({self.rollout.generate_max_len})"
            )
        # feature combinations that are refused are rows of the rules table (fsdp_rlhf.rules)
        mt = self.multiturn
        shortest = self.data.prompt_max_len + self.rollout.generate_max_len
        if mt.source is not None and mt.max_total_len is not None and mt.max_total_len < shortest:
            raise ConfigError(
                f"max_total_len ({mt.max_total_len}) must be >= prompt_max_len + "
                f"generate_max_len ({shortest}): the first turn must fit"
            )

    def weight_sync_mode(self, device_type: str, hosts: int = 1) -> str:
        """``"delta"`` or ``"full"``: how the actor's weights reach the engines on a job
        whose devices are ``device_type``, over ``hosts`` hosts (``--weight_sync``; LoRA's
        adapter sync moves only the adapters either way).

        Delta sync saves bytes on the wire and costs memory passes on both ends, so ``auto``
        uses it where the wire is a network: a job over several hosts. Not on one host (the
        gathers and the transfer to rollout ranks go through shared memory or NVLink:
        measured slower with delta on CPU, benchmarks/2026-11-27-weight-sync.md), not with
        LoRA (the adapters, or the merged weights, move whole) or the HF engine (itself a
        full copy), and not colocated on CUDA, where the engine side's copy lives in host
        memory and would cross PCIe into the engine at every sync (docs/weight_sync.md).
        """
        r = self.rollout
        if r.weight_sync != "auto":
            return r.weight_sync
        if self.lora.enabled or r.rollout_engine == "hf" or hosts < 2:
            return "full"
        if device_type == "cuda" and not self.asynchronous.async_train:
            return "full"
        return "delta"

    @property
    def total_len(self) -> int:
        """Token budget of one trajectory: prompt + all model and environment turns."""
        mt, r = self.multiturn, self.rollout
        if mt.source is None:
            longest = self.data.prompt_max_len + r.generate_max_len
            return longest if r.max_len is None else min(longest, r.max_len)
        if mt.max_total_len is not None:
            return mt.max_total_len
        return self.data.prompt_max_len + mt.max_turns * r.generate_max_len
