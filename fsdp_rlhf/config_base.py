"""Typed, frozen config trees: build from defaults < YAML < CLI flags, with strict checking.

Every leaf field is documented by ``doc(...)`` (its help text) and may carry a ``flag``: the flat
OpenRLHF/AIAK flag name users already type (``--train_batch_size``). Leaves without a flag are
reachable by their dotted path (``--optim.betas``). Errors name the dotted path and raise
``ConfigError``; the CLI turns them into one line and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
import typing
import urllib.parse
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from fsdp_rlhf.errors import UserError


class ConfigError(UserError, ValueError):
    """A user-facing configuration problem (bad key, bad type, bad value)."""


def doc(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    factory=MISSING,
    secret: bool = False,
):
    """A dataclass field with help text and an optional flat CLI flag name. A ``secret``
    string (a credential) is masked in :func:`dump_yaml`."""
    meta = {"help": help, "flag": flag, "secret": secret}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=not secret)
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


def section(cls: type):
    """A nested sub-config field, defaulting to the sub-config's own defaults."""
    return dataclasses.field(
        default_factory=cls, metadata={"help": cls.__doc__ or "", "flag": None}
    )


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One settable field: its dotted path, type and docs."""

    path: str
    type: Any
    default: Any
    help: str
    flag: str | None
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
        out.append(
            Leaf(
                path, tp, default, meta.get("help", ""), meta.get("flag"), meta.get("secret", False)
            )
        )
    return out


def flag_table(cls: type) -> dict[str, Leaf]:
    """Map every accepted flag name (flat flag and dotted path) to its leaf."""
    table: dict[str, Leaf] = {}
    for leaf in iter_leaves(cls):
        names = [leaf.path] + ([leaf.flag] if leaf.flag else [])
        for name in names:
            if name in table and table[name].path != leaf.path:
                raise AssertionError(f"flag {name!r} maps to {table[name].path} and {leaf.path}")
            table[name] = leaf
    return table


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


def _flag_names(cls: type) -> dict[str, list[Leaf]]:
    """Accepted flags -> the leaves they set. Each leaf has one canonical flat name: the root's
    ``FLAT_NAMES`` entry that names it (for a leaf of a section used twice, or several leaves
    at once: ``--max_norm`` sets actor and critic), else its ``flag=``, else its own name when
    that is unique in the tree. Its dotted path (``--optim.adam_betas``) is accepted too.
    Foreign spellings (OpenRLHF's) are translated before this table is consulted
    (:mod:`fsdp_rlhf.compat`)."""
    leaves = iter_leaves(cls)
    by_path = {leaf.path: leaf for leaf in leaves}
    table: dict[str, list[Leaf]] = {leaf.path: [leaf] for leaf in leaves}
    named: set[str] = set()
    for name, paths in getattr(cls, "FLAT_NAMES", {}).items():
        paths = (paths,) if isinstance(paths, str) else paths
        table[name] = [by_path[p] for p in paths]
        named.update(paths)
    bare: dict[str, list[Leaf]] = {}
    for leaf in leaves:
        if leaf.path in named:
            continue
        if leaf.flag:
            if leaf.flag in table and table[leaf.flag] != [leaf]:
                raise AssertionError(f"flag {leaf.flag!r} names two settings")
            table[leaf.flag] = [leaf]
            continue
        bare.setdefault(leaf.path.rsplit(".", 1)[-1], []).append(leaf)
    for name, group in bare.items():
        if len(group) == 1 and name not in table:
            table[name] = group
    return table


def parse_cli(cls: type, argv: list[str]) -> tuple[str | None, dict[str, Any], bool]:
    """Parse ``--flag value`` style args into dotted-path overrides.

    Returns ``(config_path, overrides, debug)``. Booleans are switches (``--bf16``), or take an
    explicit ``--bf16=false``/``--no_bf16``. Tuple fields take one or more following values.
    """
    table = _flag_names(cls)
    overrides: dict[str, Any] = {}
    config_path, debug = None, False
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r} (flags start with --)")
        name, eq, inline = tok[2:].partition("=")
        name = name.replace("-", "_")
        if name == "local_rank":  # torch.distributed.launch passes --local-rank=N / --local_rank N
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        if name == "debug":
            debug = True
            continue
        if name == "config":
            if not eq:
                if i >= len(argv):
                    raise ConfigError("--config needs a path")
                inline, i = argv[i], i + 1
            config_path = inline
            continue
        negate = name.startswith("no_") and name not in table and name[3:] in table
        leaves = table.get(name[3:] if negate else name)
        if leaves is None:
            raise ConfigError(f"unknown flag --{name}{_suggest(name, sorted(table))}")
        tp = leaves[0].type
        if tp is bool:
            value = (not negate) if not eq else coerce(inline, bool, "--" + name)
            overrides.update({leaf.path: value for leaf in leaves})
            continue
        if negate:
            raise ConfigError(f"--no_{name[3:]}: only boolean flags can be negated")
        if eq:
            values = [inline]
        else:
            values = []
            while i < len(argv) and not (argv[i].startswith("--") and len(argv[i]) > 2):
                values.append(argv[i])
                i += 1
                if get_origin(tp) is not tuple:
                    break
            if not values:
                raise ConfigError(f"--{name} needs a value")
        raw = values if get_origin(tp) is tuple and len(values) > 1 else values[0]
        value = coerce(raw, tp, "--" + name)
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
    names = _flag_names(cls)
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
