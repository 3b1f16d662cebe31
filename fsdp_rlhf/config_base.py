"""Typed, frozen config trees: build from defaults < YAML < CLI flags, with strict checking.

Every leaf field is documented by ``doc(...)`` (its help text). A leaf's flag is its own field
name (``--train_batch_size``), or the name a command's ``FLAT_NAMES`` gives it: one way to name
a flag, checked when the command's config class is defined (:func:`command_config`), so two
settings can never silently share one name. Every leaf is also reachable by its dotted path
(``--optim.adam_betas``). Errors name the dotted path and raise ``ConfigError``; the CLI turns
them into one line and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import types
import typing
import urllib.parse
from collections.abc import Sequence
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from fsdp_rlhf.errors import UserError


class ConfigError(UserError, ValueError):
    """A user-facing configuration problem (bad key, bad type, bad value)."""


class ConfigDefinitionError(Exception):
    """A config tree whose flags cannot be named unambiguously (two settings claiming one flag
    name, a ``FLAT_NAMES`` entry naming no setting): a programming error, raised when the
    command's config class is defined, never at a user's command line."""


def doc(
    default: Any = MISSING,
    help: str = "",
    *,
    factory=MISSING,
    secret: bool = False,
):
    """A dataclass field with help text. A ``secret`` string (a credential) is masked in
    :func:`dump_yaml`."""
    meta = {"help": help, "secret": secret}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=not secret)
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


def section(cls: type):
    """A nested sub-config field, defaulting to the sub-config's own defaults."""
    return dataclasses.field(default_factory=cls, metadata={"help": cls.__doc__ or ""})


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One settable field: its dotted path, type and docs."""

    path: str
    type: Any
    default: Any
    help: str
    secret: bool = False


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_leaves(cls: type, prefix: str = "", defaults: Any = None) -> list[Leaf]:
    """All leaf fields of a config class, depth first, with dotted paths. A section built by
    a factory (``actor_optim``: ``OptimConfig(lr=1e-6)``) reports its factory's defaults."""
    out: list[Leaf] = []
    hints = _hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        if is_dataclass(tp):
            section_default = default if is_dataclass(default) else None
            out.extend(iter_leaves(tp, path + ".", section_default))
            continue
        meta = f.metadata
        out.append(Leaf(path, tp, default, meta.get("help", ""), meta.get("secret", False)))
    return out


# ---------------------------------------------------------------- type checking / coercion


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin is tuple:
        return f"{_type_name(get_args(tp)[0])}..."
    if origin in (typing.Union, types.UnionType):
        return "|".join(_type_name(a) for a in get_args(tp) if a is not type(None)) + "|none"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; convert lossless cases (int -> float, strings)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: bad value {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        raise ConfigError(f"{path}: expected one of {list(choices)}, got {value!r}")
    if origin is tuple:
        item_tp = get_args(tp)[0]
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return tuple(coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{path}: expected a bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return int(value)
        raise ConfigError(f"{path}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return float(value)
        raise ConfigError(f"{path}: expected a float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # YAML reads `dataset_probs: 1` as an int
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise AssertionError(f"{path}: unsupported annotation {tp!r}")


# ---------------------------------------------------------------- building


def _suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def from_dict(cls: type, data: dict[str, Any], prefix: str = ""):
    """Build ``cls`` from a nested dict, rejecting unknown keys and wrong types by dotted path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = [f.name for f in fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key {prefix}{key}{_suggest(key, names)}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        tp, path = hints[f.name], f"{prefix}{f.name}"
        if is_dataclass(tp):
            sub = data[f.name]
            if f.default_factory not in (MISSING, tp) and isinstance(sub, dict):
                # a section with its own defaults (e.g. the actor's lr): keys not given keep them
                sub = {**to_dict(f.default_factory()), **sub}
            kwargs[f.name] = from_dict(tp, sub, path + ".")
        else:
            kwargs[f.name] = coerce(data[f.name], tp, path)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples become lists) suitable for YAML."""
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if is_dataclass(v):
            out[f.name] = to_dict(v)
        else:
            out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    node = data
    *parents, last = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{path}: {p} is not a section")
    node[last] = value


def load_yaml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: no such file {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot be read ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: top level must be a mapping")
    return data


def redact_url(url: str) -> str:
    """``url`` safe to log: an http(s) URL loses its password/user and query values.

    Anything else (a ``.py`` path) is returned unchanged.
    """
    if not url.startswith(("http://", "https://")):
        return url
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{k}=***" for k, _ in pairs) if pairs else "***"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _redacted(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _redacted(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_redacted(v) for v in data]
    return redact_url(data) if isinstance(data, str) else data


SWITCH_WORDS = ("true", "false", "1", "0", "yes", "no", "on", "off")


def redacted_dict(cfg: Any) -> dict[str, Any]:
    """:func:`to_dict` with credentials masked: http(s) URLs lose user, password and query
    values; ``secret`` leaves (an API key) become ``***`` unless they hold a switch word
    (``True``)."""
    data = _redacted(to_dict(cfg))
    for leaf in iter_leaves(type(cfg)):
        if not leaf.secret:
            continue
        node = data
        *parents, last = leaf.path.split(".")
        for p in parents:
            node = node[p]
        value = node[last]
        if isinstance(value, str) and value.strip().lower() not in SWITCH_WORDS:
            node[last] = "***"
    return data


def dump_yaml(cfg: Any) -> str:
    """The config as YAML, with credentials masked (:func:`redacted_dict`): the file lands
    next to the model and is copied around, so it must not carry a reward server's or W&B's
    key."""
    return yaml.safe_dump(redacted_dict(cfg), sort_keys=False)


# ---------------------------------------------------------------- CLI flags


@functools.cache
def flag_names(cls: type) -> dict[str, tuple[Leaf, ...]]:
    """Accepted flags -> the leaves they set. A leaf's flat name is the root's ``FLAT_NAMES``
    entry that names it (a leaf of a section used twice, several leaves at once: ``--max_norm``
    sets actor and critic, or a foreign-looking name: ``--lambd``), else its own field name.
    Its dotted path (``--optim.adam_betas``) is accepted too. Foreign spellings (OpenRLHF's) are
    translated before this table is consulted (:mod:`fsdp_rlhf.compat`).

    Raises:
        ConfigDefinitionError: two leaves outside ``FLAT_NAMES`` share a field name (the flag
            would set one of them by chance, or neither), a ``FLAT_NAMES`` entry names no leaf,
            or gives away a name that another leaf has as its own.
    """
    leaves = iter_leaves(cls)
    by_path = {leaf.path: leaf for leaf in leaves}
    table: dict[str, tuple[Leaf, ...]] = {leaf.path: (leaf,) for leaf in leaves}
    named: set[str] = set()
    for name, paths in getattr(cls, "FLAT_NAMES", {}).items():
        paths = (paths,) if isinstance(paths, str) else tuple(paths)
        unknown = [p for p in paths if p not in by_path]
        if unknown or "." in name:
            raise ConfigDefinitionError(
                f"{cls.__name__}.FLAT_NAMES[{name!r}]: "
                + (f"no setting {unknown[0]}" if unknown else "a flat name has no dots")
            )
        table[name] = tuple(by_path[p] for p in paths)
        named.update(paths)
    bare: dict[str, list[Leaf]] = {}
    for leaf in leaves:
        if leaf.path not in named:
            bare.setdefault(leaf.path.rsplit(".", 1)[-1], []).append(leaf)
    for name, group in bare.items():
        paths = ", ".join(leaf.path for leaf in group)
        if len(group) > 1:
            raise ConfigDefinitionError(
                f"{cls.__name__}: --{name} would name {paths}: give each its own flag in "
                "FLAT_NAMES (or one entry that sets them all)"
            )
        if name in table and table[name] != tuple(group):
            taken = ", ".join(leaf.path for leaf in table[name])
            raise ConfigDefinitionError(
                f"{cls.__name__}: --{name} is the flag of {paths} and FLAT_NAMES gives it to "
                f"{taken}"
            )
        table[name] = tuple(group)
    return table


def command_config(cls: type) -> type:
    """Decorator of a command's root config class: its flag table is built (and checked, see
    :func:`flag_names`) when the class is defined, so a clash fails at import."""
    flag_names(cls)
    cls.flags_checked = True  # a plain class attribute, not a field
    return cls


# ---------------------------------------------------------------- the argv grammar


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag as typed: ``spelled`` is the name with its dashes, ``values`` the tokens up to
    the next flag (or the one after ``=``)."""

    spelled: str
    values: tuple[str, ...]
    inline: bool = False  # written --name=value

    @property
    def name(self) -> str:
        return normalise(self.spelled)

    def text(self) -> str:
        if self.inline:
            return f"{self.spelled}={self.values[0]}"
        return " ".join((self.spelled, *self.values))


def normalise(spelled: str) -> str:
    """``--ds.zero-stage`` -> ``ds.zero_stage``."""
    return spelled.lstrip("-").replace("-", "_")


def split_flags(argv: Sequence[str]) -> list[Flag]:
    """The one argv grammar (this parser and the translation layer's): ``--a 1 --b --c x y``
    -> flags with the values that follow each one (``--a=1`` holds exactly one).

    A token that is not a flag before the first flag is kept as a flag of its own with that
    spelling, for :func:`parse_cli` to reject.
    """
    out: list[Flag] = []
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name, eq, inline = tok.partition("=")
            out.append(Flag(name, (inline,), inline=True) if eq else Flag(name, ()))
        elif out and not out[-1].inline and out[-1].spelled.startswith("--"):
            last = out[-1]
            out[-1] = Flag(last.spelled, (*last.values, tok))
        else:
            out.append(Flag(tok, ()))
    return out


def join_flags(flags: Sequence[Flag]) -> list[str]:
    out: list[str] = []
    for f in flags:
        out.extend([f"{f.spelled}={f.values[0]}"] if f.inline else [f.spelled, *f.values])
    return out


def _one_value(flag: Flag, what: str) -> str:
    if len(flag.values) != 1:
        got = "none" if not flag.values else f"{len(flag.values)}: {' '.join(flag.values)}"
        raise ConfigError(f"--{flag.name} needs {what}, got {got}")
    return flag.values[0]


def parse_cli(cls: type, argv: list[str]) -> tuple[str | None, dict[str, Any], bool]:
    """Parse ``--flag value`` style args (:func:`split_flags`) into dotted-path overrides.

    Returns ``(config_path, overrides, debug)``. Booleans are switches (``--bf16``), or take an
    explicit ``--bf16=false``/``--no_bf16``. Tuple fields take one or more values, every other
    flag exactly one.
    """
    table = flag_names(cls)
    overrides: dict[str, Any] = {}
    config_path, debug = None, False
    for flag in split_flags(argv):
        if not flag.spelled.startswith("--"):
            raise ConfigError(f"unexpected argument {flag.spelled!r} (flags start with --)")
        name = flag.name
        if name == "local_rank":  # torch.distributed.launch passes --local-rank=N / --local_rank N
            continue
        if name == "debug":
            if flag.values:
                raise ConfigError(f"--debug takes no value, got {' '.join(flag.values)}")
            debug = True
            continue
        if name == "config":
            config_path = _one_value(flag, "a path")
            continue
        negate = name.startswith("no_") and name not in table and name[3:] in table
        leaves = table.get(name[3:] if negate else name)
        if leaves is None:
            raise ConfigError(f"unknown flag --{name}{_suggest(name, sorted(table))}")
        tp = leaves[0].type
        if tp is bool:
            if flag.values and not flag.inline:
                raise ConfigError(
                    f"--{name} is a switch and takes no value (got {' '.join(flag.values)}); "
                    f"write --{name}=false or --no_{name}"
                )
            value = (not negate) if not flag.values else coerce(flag.values[0], bool, "--" + name)
        elif negate:
            raise ConfigError(f"--no_{name[3:]}: only boolean flags can be negated")
        elif get_origin(tp) is tuple:
            if not flag.values:
                raise ConfigError(f"--{name} needs a value")
            raw = list(flag.values) if len(flag.values) > 1 else flag.values[0]
            value = coerce(raw, tp, "--" + name)
        else:
            value = coerce(_one_value(flag, "one value"), tp, "--" + name)
        overrides.update({leaf.path: value for leaf in leaves})
    return config_path, overrides, debug


def build_config(cls: type, argv: list[str]):
    """defaults < YAML (``--config``) < CLI flags. Returns ``(config, debug)``."""
    config_path, overrides, debug = parse_cli(cls, argv)
    data = load_yaml(config_path) if config_path else {}
    for path, value in overrides.items():
        set_path(data, path, value)
    return from_dict(cls, data), debug


def _default_text(leaf: Leaf) -> str:
    if leaf.default is MISSING:
        return "-"
    if isinstance(leaf.default, tuple):
        return " ".join(str(v) for v in leaf.default) or "()"
    return repr(leaf.default)


def flags_help(cls: type) -> list[tuple[str, str, str, str, str]]:
    """Rows of (section, flag, type, default, help) for ``--help``, one per setting, in the
    order of the config tree: the canonical flat name, or the dotted path for a leaf without
    one. ``section`` is the top-level field the leaf lives in (``""`` for root leaves)."""
    rows, covered = [], set()
    names = flag_names(cls)
    for leaf in iter_leaves(cls):
        if leaf.path in covered:
            continue
        flat = [n for n, group in names.items() if "." not in n and leaf in group]
        if flat:
            name = flat[0]
            covered.update(x.path for x in names[name])
        else:
            name = leaf.path
            covered.add(leaf.path)
        section = leaf.path.split(".", 1)[0] if "." in leaf.path else ""
        rows.append((section, f"--{name}", _type_name(leaf.type), _default_text(leaf), leaf.help))
    return rows
