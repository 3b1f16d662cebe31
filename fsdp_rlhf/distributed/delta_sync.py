"""Delta weight sync: after the first sync, only the actor's elements that changed travel.

The actor's FSDP2 shards are grouped in the buckets of the full gathers
(:func:`fsdp_rlhf.distributed.fsdp.param_buckets`). A bucket's gathered form is a
``(world, row)`` buffer: rank r's row holds its shard of each parameter of the bucket back to
back (each padded to FSDP2's per-rank chunk), cast to the engine's dtype; the full tensors are
views of it (:meth:`BucketLayout.views`).

Each rank keeps its row of every bucket as last sent (host memory). At the next sync it
compares its new row with it bit by bit and sends only what differs, encoded whichever way is
smallest for that bucket (every rank uses the same: chosen from the largest count).
The comparison, the encoding and both checksum passes run where the actor's shards are: on a
GPU the row as last sent is copied up for the comparison and the mirror's bucket for its
checksum (the engine loads from that copy), and only the encoded changes come down to the
host, so the host's memory bandwidth is not on the sync's path (on an H200 the host-side
passes made a 1.5B model's delta sync 250 times slower than a full one).

    dense    every element (a first or forced full sync, or when most elements changed)
    sparse   an int32 index and the value of each changed element
    bitmap   one bit per element (changed or not), then the changed values

The engine side keeps the whole bucket as last synced (:class:`Mirror`, host memory), writes
every rank's changes into it, checks each row against its sender's checksum, and hands the
engine the full tensors as a full sync does: vLLM's loader builds its fused, tensor-parallel
and (on CPU) repacked weights from full checkpoint tensors, so the engine still loads every
weight. What shrinks is what crosses the wire: the gathers among training ranks and the
broadcast to rollout ranks. What it costs: the mirror, one copy of the weights in the engine's
dtype in host memory per engine rank (colocated: a rank's own rows are its snapshot), and a
comparison and a checksum pass over them per sync.

Checksums: a row's bytes read as int64 words, in rows of ``CHECK_WORDS``, folded into two
sums with odd weights (by position in a row, and by row): any single changed word changes
both. The sender sums its new row; the receiver sums the mirror's row after applying the
delta, so a mirror that differs from the actor anywhere, not only where the delta wrote, is
caught (:class:`WeightSyncMismatch`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_rlhf.distributed.collectives import collective_device
from fsdp_rlhf.distributed.fsdp import all_gather_row, gather_bucket, local_row, param_buckets


# A measurement hook for benchmarks/ (not a setting): with FSDP_RLHF_MEASURE_DELTA_BLOCKS=16,128
# each delta sync also counts the blocks of that many elements holding a change, to compare a
# changed-blocks encoding with the ones used (DeltaStats.blocks).
def measure_blocks() -> tuple[int, ...]:
    """The block sizes FSDP_RLHF_MEASURE_DELTA_BLOCKS names (read per call, not at import)."""
    raw = os.environ.get("FSDP_RLHF_MEASURE_DELTA_BLOCKS", "")
    return tuple(int(b) for b in raw.split(",") if b.strip())


CHECK_WORDS = 512  # int64 words per checksum row (4 KiB)
ROW_ALIGN_BYTES = 8 * CHECK_WORDS  # a rank's row is padded to whole checksum rows
ENCODINGS = ("dense", "sparse", "bitmap")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class WeightSyncMismatch(RuntimeError):
    """The engine side's copy of a bucket differs from what the actor holds."""


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


@dataclass(frozen=True)
class BucketLayout:
    """Where each parameter of one bucket lives in its ``(world, row)`` buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    chunks: tuple[int, ...]  # elements per rank of each parameter (all of it when world == 1)
    world: int
    dtype: str
    row: int  # elements per rank row: the chunks' sum, padded to whole checksum rows

    @classmethod
    def of(cls, names, shapes, chunks, world: int, dtype: torch.dtype) -> BucketLayout:
        row = _align(sum(chunks) * dtype.itemsize, ROW_ALIGN_BYTES) // dtype.itemsize
        shapes = tuple(tuple(s) for s in shapes)
        return cls(tuple(names), shapes, tuple(chunks), world, str(dtype), row)

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: dict) -> BucketLayout:
        shapes = tuple(tuple(s) for s in d["shapes"])
        return cls(
            **{**d, "names": tuple(d["names"]), "shapes": shapes, "chunks": tuple(d["chunks"])}
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _dtype(self.dtype)

    @property
    def row_bytes(self) -> int:
        return self.row * self.torch_dtype.itemsize

    @property
    def elements(self) -> int:
        """Elements of the bucket's parameters (no padding)."""
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def empty(self, pin: bool = False) -> torch.Tensor:
        """A zeroed host buffer (``pin``: page-locked, for fast copies to and from a GPU)."""
        return torch.zeros(self.world, self.row, dtype=self.torch_dtype, pin_memory=pin)

    def views(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of each parameter, from the bucket's buffer (with more than
        one rank a parameter's rows come from every rank's row: a copy)."""
        offset = 0
        for name, shape, n in zip(self.names, self.shapes, self.chunks, strict=True):
            part = buffer[:, offset : offset + n]
            if self.world == 1:
                yield name, part.reshape(shape)
            else:  # rank r's chunk holds rows r*c .. r*c + c - 1
                yield name, part.reshape(-1, *shape[1:])[: shape[0]]
            offset += n


def checksum(row: torch.Tensor) -> tuple[int, int]:
    """Two int64 sums (wrapping) of a row's bytes read as int64 words: weighted by the word's
    position in its ``CHECK_WORDS``-word row, and by that row's index; odd weights, so any one
    changed word changes both. The row's bytes must be whole checksum rows."""
    words = row.reshape(-1).view(torch.uint8).view(torch.int64).view(-1, CHECK_WORDS)
    by_row = words.sum(1)
    by_col = words.sum(0)
    row_w = torch.arange(1, 2 * by_row.numel(), 2, dtype=torch.int64, device=row.device)
    col_w = torch.arange(1, 2 * CHECK_WORDS, 2, dtype=torch.int64, device=row.device)
    return int((by_row * row_w).sum()), int((by_col * col_w).sum())


def encoded_bytes(encoding: str, row: int, itemsize: int, changed: int) -> int:
    """Bytes of one rank's section under ``encoding`` with ``changed`` changed elements."""
    values = _align(changed * itemsize, 8)
    if encoding == "dense":
        return row * itemsize
    if encoding == "sparse":
        return _align(changed * _index_dtype(row).itemsize, 8) + values
    return _align(-(-row // 8), 8) + values  # bitmap


def choose_encoding(row: int, itemsize: int, changed: int) -> str:
    """The smallest encoding of a row with ``changed`` changed elements (dense on ties)."""
    return min(ENCODINGS, key=lambda e: encoded_bytes(e, row, itemsize, changed))


def _index_dtype(row: int) -> np.dtype:
    return np.dtype(np.int32 if row < 2**31 else np.int64)


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """``np.packbits(mask, bitorder="little")`` on ``mask``'s device."""
    pad = -mask.numel() % 8
    bits = torch.nn.functional.pad(mask.view(-1).to(torch.uint8), (0, pad)).view(-1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (bits << shifts).sum(1, dtype=torch.uint8)


@dataclass
class BucketDelta:
    """One bucket's changes from every rank: what the engine side needs to update its copy."""

    encoding: str
    counts: list[int]  # changed elements per rank (dense: the row)
    sums: list[tuple[int, int]]  # each rank's new row's checksum
    section: int  # payload bytes per rank
    payload: torch.Tensor  # (world, section) uint8 on the host
    changed: int | None = None  # elements that differ from the last sync (None: not compared)
    blocks: dict[int, int] = field(default_factory=dict)  # measure_blocks(): changed blocks

    def manifest(self) -> dict:
        return {
            "encoding": self.encoding,
            "counts": self.counts,
            "sums": self.sums,
            "section": self.section,
        }

    @classmethod
    def from_manifest(cls, manifest: dict, payload: torch.Tensor) -> BucketDelta:
        world = len(manifest["counts"])
        return cls(
            manifest["encoding"],
            list(manifest["counts"]),
            [tuple(s) for s in manifest["sums"]],
            manifest["section"],
            payload.view(world, manifest["section"]),
        )


@dataclass
class DeltaStats:
    """What one sync moved and where its time went (this rank)."""

    gathered_bytes: int = 0  # bytes of the all-gathers' outputs (full sync: the full tensors)
    full_bytes: int = 0  # what a full sync's gathers would hold
    changed: int = 0  # elements that differ from the last sync
    elements: int = 0  # elements compared
    encodings: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENCODINGS, 0))
    blocks: dict[int, int] = field(default_factory=dict)  # size -> changed blocks (measured)
    block_total: dict[int, int] = field(default_factory=dict)  # size -> blocks compared
    diff_s: float = 0.0  # comparing rows and encoding the changes
    exchange_s: float = 0.0  # the collectives
    apply_s: float = 0.0  # writing the deltas into the mirror
    check_s: float = 0.0  # checksums

    @property
    def changed_frac(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    def add(self, layout: BucketLayout, delta: BucketDelta) -> None:
        self.gathered_bytes += layout.world * delta.section
        self.full_bytes += layout.world * layout.row_bytes
        if delta.changed is not None:
            self.changed += delta.changed
            self.elements += layout.elements
            for size, n in delta.blocks.items():
                self.blocks[size] = self.blocks.get(size, 0) + n
                self.block_total[size] = (
                    self.block_total.get(size, 0) + layout.world * layout.row // size
                )
        self.encodings[delta.encoding] += 1


def _gather_bytes(send: torch.Tensor, group: dist.ProcessGroup | None, world: int):
    """All-gather of a byte tensor over ``group`` (None: this rank only); host result."""
    if group is None:
        return send.view(1, -1).cpu()
    device = collective_device(group)
    out = torch.empty(world * send.numel(), dtype=send.dtype, device=device)
    all_gather_row(out, send.to(device), group)
    return out.view(world, -1).cpu()


def encode_bucket(
    new_row: torch.Tensor,
    old_row: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    *,
    dense_into: torch.Tensor | None = None,
    stats: DeltaStats | None = None,
) -> BucketDelta:
    """Every rank's changes to one bucket (collective over ``group``; None: one rank).

    ``new_row``: this rank's new row (on the actor's device: the comparison, the checksum and
    the encoding run there); ``old_row``: its row as last sent (any device), None for a full
    sync (on any rank: then every rank sends its row dense). ``dense_into``: a host
    ``(world, row)`` buffer that a dense gather fills in place (the mirror), saving a copy.
    The payload comes back on the host.
    """
    stats = stats if stats is not None else DeltaStats()
    t0 = time.perf_counter()
    world = 1 if group is None else group.size()
    row, itemsize = new_row.numel(), new_row.element_size()
    new_bits = new_row.view(_BITS[itemsize])
    mask = None
    if old_row is not None:
        old_bits = old_row.view(_BITS[itemsize]).to(new_row.device)
        mask = new_bits != old_bits
        count = int(torch.count_nonzero(mask))
    t1 = time.perf_counter()
    sums = checksum(new_row)
    t2 = time.perf_counter()
    sizes = measure_blocks()
    blocks = [0 if mask is None else int(mask.view(-1, b).any(1).sum()) for b in sizes]
    header = torch.tensor([row if mask is None else count, int(mask is not None), *sums, *blocks])
    headers = _gather_bytes(header.view(torch.uint8), group, world).view(torch.int64)
    t3 = time.perf_counter()
    counts = [int(c) for c in headers[:, 0]]
    everyone_has_old = bool(headers[:, 1].all())
    changed = sum(counts) if everyone_has_old else None
    encoding = choose_encoding(row, itemsize, max(counts)) if everyone_has_old else "dense"
    if encoding == "dense":
        counts = [row] * world
    section = encoded_bytes(encoding, row, itemsize, max(counts))
    send = _section(encoding, new_row, mask, section)
    t4 = time.perf_counter()
    if encoding == "dense" and dense_into is not None and group is not None:
        device = collective_device(group)
        out = dense_into.view(torch.uint8).view(-1)
        if device.type == "cpu":
            all_gather_row(out, send, group)
        else:
            gathered = torch.empty(out.numel(), dtype=torch.uint8, device=device)
            all_gather_row(gathered, send.to(device), group)
            out.copy_(gathered)
        payload = out.view(world, -1)
    else:
        payload = _gather_bytes(send, group, world)
    t5 = time.perf_counter()
    stats.diff_s += (t1 - t0) + (t4 - t3)
    stats.check_s += t2 - t1
    stats.exchange_s += (t3 - t2) + (t5 - t4)
    sums_all = [(int(h[2]), int(h[3])) for h in headers]
    delta = BucketDelta(encoding, counts, sums_all, section, payload, changed)
    if everyone_has_old and sizes:
        delta.blocks = {b: int(headers[:, 4 + i].sum()) for i, b in enumerate(sizes)}
    return delta


def _section(
    encoding: str, new_row: torch.Tensor, mask: torch.Tensor | None, section: int
) -> torch.Tensor:
    """This rank's bytes of the bucket's payload (``section`` bytes, zero-padded), on
    ``new_row``'s device."""
    if encoding == "dense":
        return new_row.view(torch.uint8)
    out = torch.zeros(section, dtype=torch.uint8, device=new_row.device)
    bits = new_row.view(_BITS[new_row.element_size()])
    if encoding == "sparse":
        index = mask.nonzero().view(-1)
        values = bits[index].view(torch.uint8)
        index_dtype = torch.int32 if _index_dtype(new_row.numel()).itemsize == 4 else torch.int64
        head = index.to(index_dtype).view(torch.uint8)
    else:  # bitmap
        head = _packbits(mask)
        values = bits[mask].view(torch.uint8)
    start = _align(head.numel(), 8)
    out[: head.numel()] = head
    out[start : start + values.numel()] = values
    return out


def apply_delta(
    buffer: torch.Tensor,
    layout: BucketLayout,
    delta: BucketDelta,
    stats: DeltaStats | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Write every rank's changes into ``buffer`` (the bucket as last synced, host), then check
    each row against its sender's checksum (raises :class:`WeightSyncMismatch`) on ``device``
    (None: the host). Returns the checked bucket: ``buffer``, or its copy on ``device``."""
    stats = stats if stats is not None else DeltaStats()
    t0 = time.perf_counter()
    itemsize = buffer.element_size()
    row = layout.row
    for r in range(layout.world):
        section = delta.payload[r]
        target = buffer[r].view(_BITS[itemsize])
        if delta.encoding == "dense":
            if section.data_ptr() != target.data_ptr():
                target.copy_(section.view(_BITS[itemsize]))
            continue
        n = delta.counts[r]
        if n == 0:
            continue
        raw = section.numpy()
        bits = target.numpy()
        if delta.encoding == "sparse":
            index_dtype = _index_dtype(row)
            head = n * index_dtype.itemsize
            index = raw[:head].view(index_dtype)
        else:
            head = _align(row, 8) // 8
            index = np.unpackbits(raw[:head], count=row, bitorder="little").view(bool)
        start = _align(head, 8)
        bits[index] = raw[start : start + n * itemsize].view(bits.dtype)
    t1 = time.perf_counter()
    checked = buffer
    if device is not None and device.type != "cpu":
        checked = buffer.to(device)
    for r in range(layout.world):
        if checksum(checked[r]) != tuple(delta.sums[r]):
            raise WeightSyncMismatch(
                f"weight sync: after the {delta.encoding} update, rank {r}'s part of the bucket "
                f"holding {layout.names[0]} .. {layout.names[-1]} differs from what that rank "
                "sent (checksum); the engine would generate with other weights than the actor's. "
                "Rerun with --weight_sync full, and report it"
            )
    stats.apply_s += t1 - t0
    stats.check_s += time.perf_counter() - t1
    return checked


class Mirror:
    """The engine side's copy of every bucket as last synced (host memory, engine dtype)."""

    def __init__(self) -> None:
        self.layouts: dict[int, BucketLayout] = {}
        self.buffers: dict[int, torch.Tensor] = {}

    def buffer(
        self, index: int, layout: BucketLayout, device: torch.device | None = None
    ) -> tuple[torch.Tensor, bool]:
        """Bucket ``index``'s buffer, and whether it holds a synced copy (a new or changed
        layout starts empty: that bucket must be synced dense). Page-locked when the work is
        on a GPU (``device``)."""
        if self.layouts.get(index) != layout:
            self.layouts[index] = layout
            self.buffers[index] = layout.empty(pin=_on_gpu(device))
            return self.buffers[index], False
        return self.buffers[index], True

    def apply(
        self,
        index: int,
        layout: BucketLayout,
        delta: BucketDelta,
        stats: DeltaStats | None = None,
        device: torch.device | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Update bucket ``index`` with ``delta`` (checked on ``device``); its full tensors, on
        ``device`` (None: the host)."""
        buffer, held = self.buffer(index, layout, device)
        if not held and delta.encoding != "dense":
            raise WeightSyncMismatch(
                f"weight sync: a {delta.encoding} update for a bucket this engine side holds no "
                f"copy of ({layout.names[0]} ..): the first sync must be full"
            )
        return layout.views(apply_delta(buffer, layout, delta, stats, device))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass
class _Row:
    """One bucket on this rank: its layout, this rank's new row (on the actor's device), the
    group (None: the parameter is whole on every rank)."""

    layout: BucketLayout
    new_row: torch.Tensor
    group: dist.ProcessGroup | None
    rank: int


def _rows(
    model: nn.Module,
    dtype: torch.dtype,
    include: Callable[[str], bool] | None,
    rename: Callable[[str], str],
    bucket_bytes: int | None,
) -> Iterator[_Row]:
    """Every bucket of ``model`` as this rank's row of it (collective: a parameter that is not
    an FSDP2 ``Shard(0)`` shard is gathered whole)."""
    for bucket, out in param_buckets(model, dtype, bucket_bytes, include):
        if isinstance(bucket, list) and bucket[0][1].device_mesh.ndim == 1:
            mesh = bucket[0][1].device_mesh
            names = [rename(n) for n, _, _ in bucket]
            shapes = [tuple(p.shape) for _, p, _ in bucket]
            layout = BucketLayout.of(names, shapes, [n for *_, n in bucket], mesh.size(), out)
            row = local_row(bucket, out, layout.row)
            yield _Row(layout, row, mesh.get_group(), mesh.get_local_rank())
            continue
        # expert shards on the 2-D expert-parallel mesh are gathered whole (one collective,
        # rows in expert order) and each compared as a parameter every rank holds
        if isinstance(bucket, list):
            fulls = list(gather_bucket(bucket, out))
        else:
            name, p = bucket
            fulls = [(name, (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(out))]
        for name, full in fulls:
            layout = BucketLayout.of([rename(name)], [tuple(full.shape)], [full.numel()], 1, out)
            row = torch.zeros(layout.row, dtype=out, device=full.device)
            row[: full.numel()].copy_(full.reshape(-1))
            yield _Row(layout, row, None, 0)


def _on_gpu(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda"


def _keep(row: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """``row`` copied to the host, into ``kept`` when it fits (page-locked when ``row`` is on a
    GPU: the next sync copies it back up for the comparison)."""
    if kept is None or kept.shape != row.shape or kept.dtype != row.dtype:
        kept = torch.empty(row.shape, dtype=row.dtype, pin_memory=_on_gpu(row.device))
    return kept.copy_(row)


def _forced(syncs: int, full_every: int) -> bool:
    return syncs == 0 or (full_every > 0 and syncs % full_every == 0)


class DeltaSync:
    """A colocated rank's delta-sync state: the mirror of every bucket (its own row of each is
    what it compares against). ``full_every``: every that many syncs is a full one (0: only
    the first, and the first after a restart, which starts without a mirror)."""

    def __init__(self, full_every: int = 0, bucket_bytes: int | None = None) -> None:
        self.mirror = Mirror()
        self.full_every = full_every
        self.bucket_bytes = bucket_bytes
        self.syncs = 0

    def buckets(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        include: Callable[[str], bool] | None = None,
        rename: Callable[[str], str] = lambda n: n,
        stats: DeltaStats | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full tensors of each bucket, synced by delta (collective over the ranks)."""
        stats = stats if stats is not None else DeltaStats()
        forced = _forced(self.syncs, self.full_every)
        for i, r in enumerate(_rows(model, dtype, include, rename, self.bucket_bytes)):
            buffer, held = self.mirror.buffer(i, r.layout, r.new_row.device)
            old = buffer[r.rank] if held and not forced else None
            into = buffer if r.group is not None else None
            delta = encode_bucket(r.new_row, old, r.group, dense_into=into, stats=stats)
            stats.add(r.layout, delta)
            yield list(self.mirror.apply(i, r.layout, delta, stats, r.new_row.device))
        self.syncs += 1


class DeltaSender:
    """A training rank's delta-sync state when the engines are on other ranks: its row of
    every bucket as last sent (``1/world`` of the weights)."""

    def __init__(self, full_every: int = 0, bucket_bytes: int | None = None) -> None:
        self.rows: dict[int, tuple[BucketLayout, torch.Tensor]] = {}
        self.full_every = full_every
        self.bucket_bytes = bucket_bytes
        self.syncs = 0

    def deltas(
        self,
        model: nn.Module,
        dtype: torch.dtype,
        include: Callable[[str], bool] | None = None,
        rename: Callable[[str], str] = lambda n: n,
        stats: DeltaStats | None = None,
    ) -> Iterator[tuple[int, BucketLayout, BucketDelta]]:
        """``(bucket index, layout, every rank's changes)`` of each bucket (collective)."""
        stats = stats if stats is not None else DeltaStats()
        forced = _forced(self.syncs, self.full_every)
        for i, r in enumerate(_rows(model, dtype, include, rename, self.bucket_bytes)):
            kept = self.rows.get(i)
            old = kept[1] if kept is not None and kept[0] == r.layout and not forced else None
            delta = encode_bucket(r.new_row, old, r.group, stats=stats)
            stats.add(r.layout, delta)
            self.rows[i] = (r.layout, _keep(r.new_row, kept[1] if kept is not None else None))
            yield i, r.layout, delta
        self.syncs += 1
