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
from fsdp_rlhf.config_base import Flag, join_flags

# Expert parallelism as other trainers spell it: DeepSpeed-MoE's ep_size, Megatron's expert
# model parallel size, Molt's --fsdp.ep_size, verl's FSDP-Turbo key and NeMo-RL-style keys
# written as flags. OpenRLHF has none. All become --expert_parallel_size for every command.
EXPERT_PARALLEL_SPELLINGS = (
    "ep_size",
    "moe_ep_size",
    "expert_model_parallel_size",
    "ds.ep_size",
    "ds.expert_parallel_size",
    "fsdp.ep_size",
    "actor.expert_model_parallel_size",
    "fsdp_config.turbo_config.distributed.expert_parallel_size",
    "actor.fsdp_config.turbo_config.distributed.expert_parallel_size",
)
# What stays refused: experts split inside (tensor parallelism of each expert) and vLLM's own
# expert parallelism for the engine.
EXPERT_TENSOR_PARALLEL = Refuse(
    "expert tensor parallelism is not implemented: each expert's weights stay whole on the "
    "ranks of its expert group (FSDP2 shards them between steps)",
    "drop the flag, or set it to 1; --expert_parallel_size splits the experts themselves "
    "(docs/models.md#expert-parallelism)",
)
ENGINE_EXPERT_PARALLEL = Refuse(
    "vLLM's expert parallelism is not used: each engine holds every expert of its "
    "tensor-parallel slice (docs/models.md#expert-parallelism)",
    "drop the flag; --expert_parallel_size splits the experts in training",
)
EXPERT_PARALLEL_REFUSED = {
    "expert_tensor_parallel_size": EXPERT_TENSOR_PARALLEL,
    "enable_expert_parallel": ENGINE_EXPERT_PARALLEL,
    "vllm_enable_expert_parallel": ENGINE_EXPERT_PARALLEL,
    "vllm.enable_expert_parallel": ENGINE_EXPERT_PARALLEL,
}
EXPERT_PARALLEL_FLAGS = (*EXPERT_PARALLEL_SPELLINGS, *EXPERT_PARALLEL_REFUSED)


def _expert_parallel(argv: Sequence[str]) -> Translation:
    """Other trainers' expert-parallel spellings -> ``--expert_parallel_size``; the rest of
    them refused by name (an expert tensor-parallel size of 1 is what happens anyway)."""
    flags, notes = [], []
    for flag in split_flags(argv):
        name = flag.name
        if name == "expert_tensor_parallel_size" and flag.values == ("1",):
            notes.append(f"{flag.text()}: accepted, each expert's weights stay whole")
            continue
        if name in EXPERT_PARALLEL_REFUSED:
            rule = EXPERT_PARALLEL_REFUSED[name]
            raise refusal(flag, rule.why, rule.instead)
        if name in EXPERT_PARALLEL_SPELLINGS:
            given = flag.text()
            flag = Flag("--expert_parallel_size", flag.values, flag.inline)
            notes.append(f"{given} -> {flag.text()}")
        flags.append(flag)
    return Translation(join_flags(flags), notes)


def table_of(command: str) -> Table | None:
    """The foreign spellings ``command`` accepts (``doctor``: ppo's); None for none."""
    known = BY_NAME.get(command)
    return TABLES.get(known.flags_command if known else command)


def translate(command: str, argv: Sequence[str]) -> Translation:
    """``argv`` with every foreign flag of ``command`` replaced by canonical flags."""
    ep = _expert_parallel(argv)
    table = table_of(command)
    if table is None:
        return ep
    out = translate_with(table, ep.argv)
    return Translation(out.argv, ep.notes + out.notes)


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
