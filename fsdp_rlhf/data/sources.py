"""Load and mix datasets named by a comma-separated flag (``--dataset a.jsonl,b_folder,org/name``).

A source is a local ``.json``/``.jsonl``/``.parquet`` file, a folder of such files (split names
inferred from file names by ``datasets``), a folder written by ``datasets.save_to_disk``, or a
Hugging Face Hub name when it is not a local path. Every problem becomes a ``UserError`` naming
the flag (and for JSON, the file and line), because ``datasets``' own errors point deep into
pyarrow and rarely say which file or line is wrong.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the GPU box runs without `datasets`
    import datasets

from fsdp_rlhf.errors import UserError

log = logging.getLogger(__name__)

DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def split_spec(spec: str) -> list[str]:
    """``"a, b,"`` -> ``["a", "b"]``."""
    return [s.strip() for s in spec.split(",") if s.strip()]


def parse_probs(probs: str, n_sources: int, flag_name: str) -> list[float]:
    """Mixing probabilities, one per source, each >= 0, summing to 1."""
    try:
        values = [float(p) for p in split_spec(probs)]
    except ValueError:
        raise UserError(f"{flag_name} {probs!r}: expected comma-separated numbers") from None
    if len(values) != n_sources:
        raise UserError(
            f"{flag_name} has {len(values)} value(s) ({probs}) but there are {n_sources} "
            "source(s): give one probability per source"
        )
    if any(p < 0 or not math.isfinite(p) for p in values):
        raise UserError(f"{flag_name} {probs}: probabilities must be finite and >= 0")
    if not math.isclose(sum(values), 1.0, abs_tol=1e-6):
        raise UserError(
            f"{flag_name} {probs}: probabilities must sum to 1 (they sum to {sum(values):g})"
        )
    return values


def _looks_like_path(src: str) -> bool:
    """A string meant as a local path (so a missing one is an error, not a hub lookup)."""
    return (
        src.startswith(("/", ".", "~"))
        or src.count("/") > 1
        or src.endswith(DATA_SUFFIXES)
        or "\\" in src
    )


def _data_files(folder: Path) -> list[Path]:
    """Data files under ``folder``, skipping hidden entries (``.cache``, ``.git``)."""
    return sorted(
        f
        for f in folder.rglob("*")
        if f.is_file()
        and f.suffix in DATA_SUFFIXES
        and not any(part.startswith(".") for part in f.relative_to(folder).parts)
    )


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _check_json_lines(path: Path) -> None:
    # Streamed: JSONL files can be larger than memory allows to read at once.
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None


def validate_json_file(path: Path) -> None:
    """Fail with ``file:line`` on malformed JSON.

    ``.jsonl`` is checked line by line. A ``.json`` file may be one document (array or object)
    or, as often in practice, JSON Lines: when the whole file does not parse but its first line
    does, it is checked line by line so the error names the offending line.
    """
    if path.suffix == ".json":
        text = path.read_text(encoding="utf-8")
        try:
            json.loads(text)
            return
        except json.JSONDecodeError as e:
            first = next((line for line in text.splitlines() if line.strip()), "")
            if not _parses(first):  # a multi-line document, not JSON Lines
                raise UserError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
    _check_json_lines(path)


def _pick_split(data, split: str, src: str, flag_name: str) -> datasets.Dataset:
    import datasets

    if isinstance(data, datasets.Dataset):
        return data
    if split in data:
        return data[split]
    if len(data) == 1:
        # A single-split source (one file, one folder of files) is unambiguous whatever its name.
        (only,) = data.values()
        return only
    raise UserError(f"{flag_name} {src}: no split {split!r} (available: {', '.join(data)})")


def _load_local(path: Path, src: str, split: str, flag_name: str) -> datasets.Dataset:
    import datasets

    if path.is_dir() and (
        (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    ):
        return _pick_split(datasets.load_from_disk(str(path)), split, src, flag_name)
    if path.is_file() and path.suffix not in DATA_SUFFIXES:
        raise UserError(f"{flag_name} {src}: unsupported file type (use {'/'.join(DATA_SUFFIXES)})")
    files = _data_files(path) if path.is_dir() else [path]
    if not files:
        raise UserError(
            f"{flag_name} {src}: no {'/'.join(DATA_SUFFIXES)} data found (a folder written by "
            "datasets.save_to_disk also works)"
        )
    for f in files:
        if f.suffix in (".json", ".jsonl"):
            validate_json_file(f)
    if path.is_dir():
        data = datasets.load_dataset(str(path))
    else:
        builder = "parquet" if path.suffix == ".parquet" else "json"
        data = datasets.load_dataset(builder, data_files=str(path))
    return _pick_split(data, split, src, flag_name)


def load_source(src: str, *, split: str, flag_name: str) -> datasets.Dataset:
    """One source as a ``datasets.Dataset`` (see the module docstring for what a source is)."""
    import datasets

    path = Path(src).expanduser()
    if not path.exists() and _looks_like_path(src):
        raise UserError(f"{flag_name} {src}: no such file or folder")
    try:
        if path.exists():
            return _load_local(path, src, split, flag_name)
        return _pick_split(datasets.load_dataset(src), split, src, flag_name)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is reported as bad input
        where = (
            "reading it failed"
            if path.exists()
            else "not a local path; loading it from the Hub failed"
        )
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{flag_name} {src}: {where} ({first})") from e


def check_keys(
    dataset: datasets.Dataset,
    keys: Sequence[str],
    flag_names: Sequence[str],
    *,
    where: str = "the dataset",
) -> None:
    """Fail naming the flag and the missing key, listing the keys that exist.

    Args:
        keys: column names the caller needs, e.g. ``["chosen", "rejected"]``.
        flag_names: the flag each key came from, same length, e.g. ``["--chosen_key", ...]``.
    """
    if len(keys) != len(flag_names):
        raise ValueError("check_keys: keys and flag_names must have the same length")
    for key, flag in zip(keys, flag_names, strict=True):
        if key not in dataset.column_names:
            raise UserError(
                f"{flag} {key!r}: no such key in {where} (available keys: "
                f"{', '.join(dataset.column_names)})"
            )


RowCheck = Callable[[dict], "str | None"]


def check_rows(dataset: datasets.Dataset, check: RowCheck, where: str) -> None:
    """Fail on the first row ``check`` objects to, naming ``where`` (flag and source) and the
    row, counted from 1 (a JSON Lines file's line number when it has no blank lines)."""
    start = 0
    for batch in dataset.iter(batch_size=4096):
        n = len(next(iter(batch.values()))) if batch else 0
        for i in range(n):
            problem = check({k: v[i] for k, v in batch.items()})
            if problem:
                raise UserError(f"{where}: row {start + i + 1}: {problem}")
        start += n


def _mix(parts: list[datasets.Dataset], probs: list[float] | None, seed: int, flag_name: str):
    import datasets

    if len(parts) == 1:
        return parts[0]
    try:
        if probs is None:
            return datasets.concatenate_datasets(parts)
        return datasets.interleave_datasets(
            parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted"
        )
    except ValueError as e:
        raise UserError(f"{flag_name}: the sources cannot be combined ({e})") from e


def load_sources(
    spec: str,
    probs: str | None,
    *,
    max_samples: int,
    seed: int,
    flag_name: str,
    probs_flag: str | None = None,
    columns: Mapping[str, str] | None = None,
    split: str = "train",
    check: RowCheck | None = None,
    optional_columns: Sequence[str] = (),
) -> datasets.Dataset:
    """Load comma-separated sources and mix them into one dataset.

    Args:
        spec: comma-separated sources, e.g. ``"a.jsonl,data_dir,Dahoas/full-hh-rlhf"``.
        probs: comma-separated sampling probabilities, one per source, summing to 1: sources
            are interleaved with them until every source is exhausted (smaller ones repeat).
            ``None`` concatenates the sources instead (used for eval sets).
        max_samples: keep at most this many rows of the mixture (the first ones).
        seed: seed of the interleaving.
        flag_name: the flag the spec came from, named in errors (``"--dataset"``).
        probs_flag: the flag of ``probs`` (default ``flag_name + "_probs"``).
        columns: flag name -> column this caller needs; each source is checked for them and
            reduced to them before mixing (sources may carry different extra columns).
        split: split to use when a source has several (single-split sources are used as is).
        check: row -> problem or None, run on every row of each source before mixing, so that
            a bad row is named by its source and position (:func:`check_rows`).
        optional_columns: columns kept besides ``columns`` where a source has them (a VLM's
            images: text-only sources have none).

    Returns:
        A ``datasets.Dataset`` with at most ``max_samples`` rows.
    """
    sources = split_spec(spec)
    if not sources:
        raise UserError(f"{flag_name} is required (comma-separated files, folders or hub names)")
    weights = None
    if probs is not None:
        weights = parse_probs(probs, len(sources), probs_flag or f"{flag_name}_probs")
    parts = []
    for src in sources:
        part = load_source(src, split=split, flag_name=flag_name)
        if columns is not None:
            check_keys(part, list(columns.values()), list(columns), where=f"{flag_name} {src}")
            extra = [c for c in optional_columns if c in part.column_names]
            part = part.select_columns(list(dict.fromkeys([*columns.values(), *extra])))
        if check is not None:
            check_rows(part, check, f"{flag_name} {src}")
        log.info("%s %s: %d rows", flag_name, src, len(part))
        parts.append(part)
    mixed = _mix(parts, weights, seed, flag_name)
    if len(mixed) > max_samples:
        mixed = mixed.select(range(max_samples))
    return mixed
