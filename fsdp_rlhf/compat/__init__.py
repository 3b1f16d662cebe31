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
from fsdp_rlhf.compat.rules import Accept, Gather, Refuse, Table, To, Translation, translate_with


def table_of(command: str) -> Table | None:
    """The foreign spellings ``command`` accepts (``doctor``: ppo's); None for none."""
    known = BY_NAME.get(command)
    return TABLES.get(known.flags_command if known else command)


def translate(command: str, argv: Sequence[str]) -> Translation:
    """``argv`` with every foreign flag of ``command`` replaced by canonical flags."""
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
