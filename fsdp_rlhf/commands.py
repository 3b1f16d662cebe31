"""The commands of `fsdp-rlhf`, in one table: the CLI registers them from it, ``--help``, the
generated docs, the flag translation and the tests read it.

Config classes are named, not imported, so that ``fsdp-rlhf --help`` stays fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One subcommand.

    Attributes:
        name: as typed (``fsdp-rlhf train-rm``).
        config: its config class in :mod:`fsdp_rlhf.config`.
        module: the module whose ``main(cfg, debug)`` runs it.
        summary: its line in ``fsdp-rlhf --help``.
        openrlhf: the OpenRLHF parsers whose flags it answers for (``compat/data/``).
        flags_of: the command whose flags it takes (``doctor`` takes ``ppo``'s), or None.
    """

    name: str
    config: str
    module: str
    summary: str
    openrlhf: tuple[str, ...] = ()
    flags_of: str | None = None

    def config_class(self) -> type:
        return getattr(importlib.import_module("fsdp_rlhf.config"), self.config)

    @property
    def flags_command(self) -> str:
        """The command whose flags (and foreign spellings) this one takes."""
        return self.flags_of or self.name


COMMANDS: tuple[Command, ...] = (
    Command(
        "sft",
        "SFTConfig",
        "fsdp_rlhf.trainers.offline.sft",
        "Supervised fine-tuning of a causal LM (OpenRLHF train_sft).",
        openrlhf=("sft",),
    ),
    Command(
        "train-rm",
        "RMConfig",
        "fsdp_rlhf.trainers.offline.rm",
        "Train a pairwise (Bradley-Terry) reward model (OpenRLHF train_rm).",
        openrlhf=("rm",),
    ),
    Command(
        "dpo",
        "DPOConfig",
        "fsdp_rlhf.trainers.offline.dpo",
        "DPO, IPO or cDPO on preference pairs (OpenRLHF train_dpo).",
        openrlhf=("dpo",),
    ),
    Command(
        "kd",
        "KDConfig",
        "fsdp_rlhf.trainers.offline.kd",
        "Knowledge distillation: SFT plus KL to a frozen teacher's distributions (OpenRLHF "
        "train_kd).",
    ),
    Command(
        "ppo",
        "PPOConfig",
        "fsdp_rlhf.trainers.ppo",
        "PPO / GRPO / RLOO / REINFORCE++ with in-process vLLM rollouts (OpenRLHF train_ppo_ray).",
        openrlhf=("ppo",),
    ),
    Command(
        "doctor",
        "PPOConfig",
        "fsdp_rlhf.doctor",
        "Preflight checks under the same launcher: versions, devices, all-reduce, vLLM, memory.",
        flags_of="ppo",
    ),
)
BY_NAME: dict[str, Command] = {c.name: c for c in COMMANDS}
# the commands with flags of their own: one section each in docs/configuration.md
WITH_OWN_FLAGS: tuple[Command, ...] = tuple(c for c in COMMANDS if c.flags_of is None)
