"""The rules table's row type, what a row reads (:class:`Setting`) and the helpers rows are
written with (see ``fsdp_rlhf.rules``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_rlhf.algorithms.names import CRITIC_ESTIMATORS
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.kind import ModelKind

PPO, SFT, DPO, RM, KD = "ppo", "sft", "dpo", "train-rm", "kd"
OFFLINE = (SFT, DPO, RM, KD)
ALL = (PPO, *OFFLINE)

# The matrix's axes, in order: a feature (a flag, or what the model is) and what turns it on.
FEATURES: dict[str, str] = {
    "async": "`--async_train`",
    "sequence parallel": "`--sequence_parallel_size` > 1",
    "expert parallel": "`--expert_parallel_size` > 1",
    "router replay": "`--router_replay`",
    "aux loss": "`--aux_loss_coef` > 0",
    "packing": "`--packing_samples`",
    "LoRA": "`--lora_rank` > 0",
    "LoRA adapter sync": "`--lora_rank` with `--lora_sync adapter`",
    "delta weight sync": "`--weight_sync delta`",
    "multi-turn": "`--env_file` / `--agent_func_path`",
    "critic": "`--advantage_estimator gae` or `--critic_pretrain`",
    "reward model": "`--reward_pretrain`",
    "rule reward": "`--remote_rm_url`",
    "HF engine": "`--rollout_engine hf`",
    "vLLM TP > 1": "`--vllm_tensor_parallel_size` > 1",
    "dynamic filtering": "`--dynamic_filtering`",
    "eval": "`--eval_dataset`",
    "over-sampling": "`--vllm_generate_batch_size` > `--rollout_batch_size`",
    "partial rollout": "`--partial_rollout`",
    "flash-attn": "`--flash_attn`",
    "fp32": "no `--bf16`",
    "VLM": "a vision-language model",
    "teacher": "`--teacher_pretrain` / `--teacher_url`",
    "served teacher": "`--teacher_url`",
    "no reward": "none of `--reward_pretrain`, `--remote_rm_url`, `--env_file`",
    "knowledge distillation": "`fsdp-rlhf kd`",
    "MoE": "an MoE model",
    "dense": "a dense model",
    "hybrid": "recurrent layers (Qwen3.5, Qwen3-Next, Nemotron-H, Granite-4.0-H, LFM2)",
}


@dataclass(frozen=True)
class Setting:
    """What a rule reads: the command, its resolved config, the kind of each model it loads
    (flag -> kind) and whether the job runs on GPUs."""

    command: str
    cfg: Any
    models: Mapping[str, ModelKind]
    cuda: bool = False

    @property
    def actor(self) -> ModelKind | None:
        """``--pretrain``'s kind (the actor, or the offline commands' model)."""
        return self.models.get("--pretrain")


@dataclass(frozen=True)
class Rule:
    """One row of the table.

    Attributes:
        id: its anchor in docs/compatibility.md and the name tests use.
        features: the features it refuses together (names of :data:`FEATURES` where the
            matrix shows them); with ``needs``, the first needs the second.
        commands: the commands it applies to.
        fires: the settings that meet, as the user wrote them, or None when it does not fire.
        reason: why they cannot run together (yet).
        instead: what to do instead.
        needs: the first feature needs the second (rather than refusing it).
    """

    id: str
    features: tuple[str, ...]
    commands: tuple[str, ...]
    fires: Callable[[Setting], str | None]
    reason: str
    instead: str
    needs: bool = False

    def message(self, setting: Setting) -> str | None:
        """The one line this row refuses ``setting`` with, or None."""
        if setting.command not in self.commands:
            return None
        what = self.fires(setting)
        return None if what is None else f"{what}: {self.reason}; {self.instead}"


class Refused(UserError):
    """A combination the rules table refuses (``rule``: its row)."""

    def __init__(self, message: str, rule: Rule) -> None:
        super().__init__(message)
        self.rule = rule


# ---------------------------------------------------------------- settings the rows read


def sp_size(s: Setting) -> int:
    return s.cfg.fsdp.sequence_parallel_size


def ep_size(s: Setting) -> int:
    return s.cfg.fsdp.expert_parallel_size


def is_async(s: Setting) -> bool:
    return s.cfg.asynchronous.async_train


def multiturn(s: Setting) -> str | None:
    """``--env_file PATH`` / ``--agent_func_path PATH``, or None (single turn)."""
    source = s.cfg.multiturn.source
    return None if source is None else f"{source[0]} {source[1]}"


def adapter_sync(s: Setting) -> bool:
    return s.cfg.lora.enabled and s.cfg.rollout.lora_sync == "adapter"


def uses_critic(s: Setting) -> bool:
    return s.cfg.algo.advantage_estimator in CRITIC_ESTIMATORS


def teacher(s: Setting) -> str | None:
    """``--teacher_pretrain PATH`` / ``--teacher_url URL`` (ppo) or ``--teacher_pretrain PATH``
    (kd), or None without a teacher."""
    if s.command == PPO:
        return s.cfg.distill.teacher
    path = getattr(s.cfg.model, "teacher_pretrain", None)
    return f"--teacher_pretrain {path}" if path else None


def no_reward(s: Setting) -> bool:
    """No reward source at all: a ppo run with a teacher distils only."""
    m = s.cfg.models
    return not (m.reward_pretrain or m.remote_rm_url) and multiturn(s) is None


def oversampling(s: Setting) -> bool:
    generate = s.cfg.asynchronous.vllm_generate_batch_size or 0
    return is_async(s) and generate > s.cfg.batch.rollout_batch_size


def vlm_actor(s: Setting) -> str | None:
    """``--pretrain PATH is a vision-language model`` when the actor is one, else None."""
    actor = s.actor
    if actor is None or not actor.is_vlm:
        return None
    return f"--pretrain {actor.path} is a vision-language model"


def when(cond: Callable[[Setting], bool], what: str | Callable[[Setting], str]):
    """``fires`` of a row whose settings are ``what`` when ``cond`` holds."""

    def fires(s: Setting) -> str | None:
        if not cond(s):
            return None
        return what(s) if callable(what) else what

    return fires


def each_model(s: Setting, problem: Callable[[ModelKind], str | None]) -> str | None:
    """``--sequence_parallel_size N: FLAG PATH: problem`` for the first model with one."""
    for flag, kind in s.models.items():
        if (found := problem(kind)) is not None:
            return f"--sequence_parallel_size {sp_size(s)}: {flag} {kind.path}: {found}"
    return None


def sp_models(problem: Callable[[ModelKind, int], str | None]):
    """``fires`` of a sequence-parallel row about some model the run loads."""

    def fires(s: Setting) -> str | None:
        if sp_size(s) == 1:
            return None
        return each_model(s, lambda kind: problem(kind, sp_size(s)))

    return fires


def actor_moe(
    cond: Callable[[ModelKind], bool],
    what: Callable[[Setting, ModelKind], str],
    flag_on: Callable[[Setting], bool],
):
    """``fires`` of a row about an MoE flag (set when ``flag_on``) and the actor's kind."""

    def fires(s: Setting) -> str | None:
        actor = s.actor
        if not flag_on(s) or actor is None or not cond(actor):
            return None
        return what(s, actor)

    return fires
