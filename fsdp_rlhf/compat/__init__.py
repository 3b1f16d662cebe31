"""Every foreign spelling of our flags, in one place.

Users bring launch scripts written for OpenRLHF v0.10 (flat flags, ``--ref_num_nodes``), v0.11
(dotted, ``--ds.zero_stage``) or AIAK-RLHF (OpenRLHF's 2024 names, most of which are ours). The
config tree keeps one canonical name per setting (``fsdp_rlhf.config``); this package turns each
foreign flag into canonical ones before the config parser sees the line, accepts the ones that
describe what this trainer does anyway, and refuses by name the ones it cannot honour, with the
reason. Each command's table is in :mod:`fsdp_rlhf.compat.openrlhf`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_rlhf.commands import BY_NAME
from fsdp_rlhf.compat.openrlhf import TABLES
from fsdp_rlhf.compat.rules import (
    Accept,
    Gather,
    Refuse,
    Table,
    To,
    Translation,
    refusal,
    split_flags,
    translate_with,
)

# Expert parallelism as other trainers and vLLM spell it (DeepSpeed-MoE's ep_size, Megatron's
# expert model/tensor parallel sizes, vLLM's --enable-expert-parallel, verl's and NeMo-RL's
# config keys written as flags). OpenRLHF has none. Refused for every command.
EXPERT_PARALLEL = Refuse(
    "expert parallelism is not implemented: FSDP2 shards each layer's fused expert tensors "
    "along the expert dimension over all ranks and gathers them for the layer's forward, and "
    "each vLLM engine holds every expert of its tensor-parallel slice",
    "drop the flag (docs/models.md#mixture-of-experts)",
)
EXPERT_PARALLEL_FLAGS = (
    "ep_size",
    "moe_ep_size",
    "expert_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "enable_expert_parallel",
    "vllm_enable_expert_parallel",
    "ds.ep_size",
    "ds.expert_parallel_size",
    "vllm.enable_expert_parallel",
    "actor.expert_model_parallel_size",
)


def table_of(command: str) -> Table | None:
    """The foreign spellings ``command`` accepts (``doctor``: ppo's); None for none."""
    known = BY_NAME.get(command)
    return TABLES.get(known.flags_command if known else command)


def translate(command: str, argv: Sequence[str]) -> Translation:
    """``argv`` with every foreign flag of ``command`` replaced by canonical flags."""
    for flag in split_flags(argv):
        if flag.name in EXPERT_PARALLEL_FLAGS:
            raise refusal(flag, EXPERT_PARALLEL.why, EXPERT_PARALLEL.instead)
    table = table_of(command)
    if table is None:
        return Translation(list(argv))
    return translate_with(table, argv)


def aliases(command: str) -> list[tuple[str, str]]:
    """(foreign flag, what it becomes) for ``--help`` and the migration page."""
    table = table_of(command)
    if table is None:
        return []
    rows = []
    for name, rule in sorted(table.rules.items()):
        if isinstance(rule, To | Gather):
            if rule.shown == f"--{name}":
                continue  # our flag too; only OpenRLHF's values are translated
            target = rule.shown
        elif isinstance(rule, Accept):
            target = "accepted: " + rule.why
        else:
            assert isinstance(rule, Refuse)
            target = "refused: " + rule.why
        rows.append((f"--{name}", target))
    return rows


__all__ = ["Translation", "aliases", "translate"]
