"""Read an offline W&B run's ``run-<id>.wandb`` file: the records wandb would upload on
``wandb sync``. Tests use it to check what a run sent without a network.

The file is wandb's record log (the LevelDB log format): a 7-byte header (``:W&B``, magic
``0xBEE1``, version 0), then 32 KiB blocks of chunks, each with a 7-byte header (CRC32,
little-endian uint16 length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of one
serialized ``wandb.proto.wandb_internal_pb2.Record``. Checksums are not verified.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

HEADER = b":W&B\xe1\xbe\x00"
BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list[Any]:
    """Every record of the file, in order (``wandb_internal_pb2.Record`` messages)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path}: not a W&B run file")
    out, pos, pending = [], len(HEADER), b""
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left_in_block
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: str | Path) -> list[dict[str, Any]]:
    """The logged rows, one dict per ``run.log`` step: values decoded from JSON, with
    ``_step`` (and wandb's own ``_runtime``/``_timestamp``)."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({_key(i): json.loads(i.value_json) for i in r.history.item})
    return rows


def run_config(path: str | Path) -> dict[str, Any]:
    """The run's config (``wandb.init(config=...)``), top-level keys decoded from JSON."""
    config: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else []
        items = r.config.update if kind == "config" else items
        for item in items:
            config[_key(item)] = json.loads(item.value_json)
    return config
