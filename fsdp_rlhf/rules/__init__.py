"""What combines: one table of every feature pair or setting the trainer refuses, checked in one
place before any model loads.

Each :class:`Rule` (``rules.table``) is one row: the settings that meet, as the user wrote
them, the reason, and what to do instead. :func:`check_command` reads the kind of every model
the command loads (``models.kind``: dense or MoE and its router, hybrid attention, a VLM, its
heads; from the configs, no weights), runs every row against the resolved config and those
kinds, and raises :class:`Refused` (a one-line :class:`~fsdp_rlhf.errors.UserError`, exit 2)
at the first row that fires; the kinds it read travel on with the run. Lifting a refusal is
deleting its row (and its test). ``docs/compatibility.md`` is generated from the table
(``python -m scripts.gen_docs``): a features x features matrix whose refused cells link to
their row.

Not here: sizes that do not divide (batch plans, world and tensor-parallel sizes,
``config.plan_ppo_batches``), values out of range (each config section's own checks), paths
and data that are missing or malformed, the placement of ranks on nodes (``ppo.setup``), and
what only vLLM can tell (``rollout.vllm.engine.check_architecture``).
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_rlhf.algorithms.names import CRITIC_ESTIMATORS
from fsdp_rlhf.models.kind import ModelKind, read_model_kinds
from fsdp_rlhf.rules.base import ALL, FEATURES, PPO, Refused, Rule, Setting
from fsdp_rlhf.rules.table import RULES


def check_rules(setting: Setting) -> None:
    """Raise :class:`Refused` at the first row that refuses ``setting``."""
    for rule in RULES:
        if (line := rule.message(setting)) is not None:
            raise Refused(line, rule)


def model_paths(command: str, cfg: Any) -> dict[str, str | None]:
    """Flag -> folder of every model ``command`` loads with ``cfg`` (None: not loaded)."""
    if command != PPO:
        ref = getattr(cfg.model, "ref_pretrain", None)  # dpo's separate reference
        teacher = getattr(cfg.model, "teacher_pretrain", None)  # kd's teacher
        return {
            "--pretrain": cfg.model.pretrain,
            "--ref_pretrain": ref,
            "--teacher_pretrain": teacher,
        }
    m = cfg.models
    critic = m.critic_pretrain if cfg.algo.advantage_estimator in CRITIC_ESTIMATORS else None
    return {
        "--pretrain": m.pretrain,
        "--reward_pretrain": m.reward_pretrain,
        "--critic_pretrain": critic,
        "--teacher_pretrain": cfg.distill.teacher_pretrain,
    }


def check_flags(command: str, cfg: Any, cuda: bool | None = None) -> None:
    """The rows that read the flags alone (those about a model skip it), before any model
    path is read: a refused pair of flags is reported before a missing folder. ``cuda``:
    whether the job runs on GPUs (default: whether this process sees one)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    check_rules(Setting(command, cfg, {}, cuda))


def check_command(command: str, cfg: Any, cuda: bool | None = None) -> dict[str, ModelKind]:
    """Every row against ``command``'s resolved ``cfg`` and the kinds of its models (read
    here, once, each folder checked first); returns those kinds (flag -> kind)."""
    check_flags(command, cfg, cuda)
    kinds = read_model_kinds(model_paths(command, cfg), cfg.backend.trust_remote_code)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    check_rules(Setting(command, cfg, kinds, cuda))
    return kinds


__all__ = [
    "ALL",
    "FEATURES",
    "RULES",
    "ModelKind",
    "Refused",
    "Rule",
    "Setting",
    "check_command",
    "check_flags",
    "check_rules",
    "model_paths",
]
