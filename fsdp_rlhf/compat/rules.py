"""How a foreign flag ends: it takes effect, is accepted as what we do anyway, or is refused.

A command line is split into flags by the config parser's own grammar
(:func:`fsdp_rlhf.config_base.split_flags`: ``--name`` with the values up to the next flag);
each flag that has a rule in the command's table is replaced by canonical flags, or dropped with a
note, or refused with a :class:`~fsdp_rlhf.config_base.ConfigError` naming it. Flags without a
rule pass through untouched to the config parser, which knows only canonical names.

Some foreign flags only mean something together (OpenRLHF's ``--max_len`` with
``--max_new_tokens``, the per-model placement counts, the IS-correction switch with its type):
their rules :class:`Gather` the values, and the table's ``finish`` function turns the gathered
values into canonical flags once the whole line has been read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fsdp_rlhf.config_base import ConfigError, Flag, join_flags, split_flags

Values = tuple[str, ...]


# ------------------------------------------------------------------ rule kinds


@dataclass(frozen=True)
class To:
    """Takes effect: ``--theirs VALUES`` -> ``emit(VALUES)`` (canonical flags).

    ``shown`` is the canonical spelling for docs when ``emit`` depends on the value.
    """

    emit: Callable[[Values], list[str]]
    shown: str
    note: str = ""
    secret: bool = False  # an API key: the start-up note shows *** for its value


@dataclass(frozen=True)
class Accept:
    """Accepted: the flag describes what this trainer does anyway. ``check(values)`` returns
    a refusal reason for values that would describe something else (``--zpg 8``)."""

    why: str
    check: Callable[[Values], str | None] | None = None


@dataclass(frozen=True)
class Refuse:
    """Refused by name before anything loads: why, and what to use instead."""

    why: str
    instead: str = ""


@dataclass(frozen=True)
class Gather:
    """Part of a setting made of several flags: kept under ``key`` for the table's finish."""

    key: str
    shown: str
    note: str = ""


Rule = To | Accept | Refuse | Gather


@dataclass
class Translation:
    """The canonical command line and one note per foreign flag (what it became)."""

    argv: list[str]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Table:
    """The foreign spellings of one command: ``rules`` by normalised name, and ``finish``,
    which turns the gathered values (key -> (flag, values)) into canonical flags; it also sees
    every flag of the line."""

    command: str
    rules: dict[str, Rule]
    finish: Callable[[dict[str, tuple[Flag, Values]], list[Flag]], list[str]] | None = None


def refusal(flag: Flag, why: str, instead: str = "") -> ConfigError:
    tail = f"; {instead}" if instead else ""
    return ConfigError(f"{flag.text()}: not supported here: {why}{tail}")


def translate_with(table: Table, argv: Sequence[str]) -> Translation:
    """Replace every foreign flag of ``argv`` by canonical ones (see the module docstring)."""
    kept: list[Flag] = []
    emitted: list[str] = []
    notes: list[str] = []
    gathered: dict[str, tuple[Flag, Values]] = {}
    flags = split_flags(argv)
    for flag in flags:
        rule = table.rules.get(flag.name)
        if rule is None:
            kept.append(flag)
            continue
        if isinstance(rule, Refuse):
            raise refusal(flag, rule.why, rule.instead)
        if isinstance(rule, Accept):
            reason = rule.check(flag.values) if rule.check else None
            if reason:
                raise refusal(flag, reason)
            notes.append(f"{flag.text()}: accepted, {rule.why}")
            continue
        if isinstance(rule, Gather):
            gathered[rule.key] = (flag, flag.values)
            continue
        try:
            out = rule.emit(flag.values)
        except ConfigError as e:
            raise ConfigError(f"{flag.text()}: {e}") from None
        emitted.extend(out)
        if out == [f"--{flag.name}", *flag.values]:
            continue  # our spelling too (--advantage_estimator grpo): nothing to say
        arrow = " ".join(out) if out else "(nothing)"
        given = flag.text()
        if rule.secret:
            given, arrow = f"{flag.spelled} ***", f"{out[0]} ***"
        notes.append(f"{given} -> {arrow}" + (f" ({rule.note})" if rule.note else ""))
    if table.finish is not None and gathered:
        out, finish_notes = _finish(table, gathered, flags)
        emitted.extend(out)
        notes.extend(finish_notes)
    # canonical flags the user typed come last, so they win over translated ones
    return Translation(emitted + join_flags(kept), notes)


def _finish(
    table: Table, gathered: dict[str, tuple[Flag, Values]], flags: list[Flag]
) -> tuple[list[str], list[str]]:
    out = table.finish(gathered, flags)
    given = " ".join(flag.text() for flag, _ in gathered.values())
    if not out:  # e.g. an IS-correction type without its switch: OpenRLHF ignores it too
        return out, [f"{given}: accepted, it changes nothing here on its own"]
    return out, [f"{given} -> {' '.join(out)}"]


# ------------------------------------------------------------------ rule builders


def _one(values: Values) -> str:
    if len(values) != 1:
        raise ConfigError(f"expected one value, got {len(values)}")
    return values[0]


def rename(canonical: str, note: str = "", *, secret: bool = False) -> To:
    """Same meaning, other name: values pass through (a switch stays a switch)."""
    return To(lambda v: [f"--{canonical}", *v], f"--{canonical}", note, secret)


def switch(canonical: str, note: str = "") -> To:
    """An OpenRLHF store_true flag -> our boolean flag (``--x=false`` honoured)."""

    def emit(values: Values) -> list[str]:
        if not values:
            return [f"--{canonical}"]
        return [f"--{canonical}={_one(values)}"]

    return To(emit, f"--{canonical}", note)


def choice(canonical: str, mapping: dict[str, str | None], note: str = "") -> To:
    """A value map (``group_norm`` -> ``grpo``); values missing from ``mapping`` pass through;
    a value mapped to None emits nothing."""

    def emit(values: Values) -> list[str]:
        value = _one(values)
        target = mapping.get(value, value)
        return [] if target is None else [f"--{canonical}", target]

    return To(emit, f"--{canonical}", note)


def when_default(default: str, why: str, refuse: str) -> Accept:
    """Accepted at ``default`` (a setting that describes what we do); refused otherwise."""

    def check(values: Values) -> str | None:
        value = values[0] if values else "true"
        same = value == default
        try:
            same = same or float(value) == float(default)
        except ValueError:
            pass
        return None if same else refuse

    return Accept(why, check)
