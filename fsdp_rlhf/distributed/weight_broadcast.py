"""New actor weights from the training ranks to the rollout ranks of an asynchronous job.

Every training rank consumes the gathered weight stream (``rollout.weight_sync``'s: each
bucket of FSDP2 shards is an all-gather over the training ranks); training rank 0 packs the
full tensors into buckets of up to ``bucket_bytes`` and sends each bucket to every rollout
rank, which unpacks it into ``(name, tensor)`` pairs for its engine (each engine keeps its
tensor-parallel shard). On the wire, per bucket::

    manifest (object, over the bridge)   [(name, dtype, shape) | (name, "alias", other)]
    payload  (one flat byte tensor)      gloo over the bridge on CPU, an NCCL broadcast on GPU

and a final ``{"end": True}`` manifest, after the version's header on the control channel. A
tied LM head is sent once and named twice (an ``alias`` entry).

Each rollout rank takes a version when it is ready for it, not when the slowest one is: over
gloo, training rank 0 posts every send without waiting, and keeps each version's buffers
until every rollout rank has taken it. The schedule bounds how many versions can be on their
way (``depth``: ``--async_queue_size`` + 1; a rollout rank takes version ``v - 1 - K`` before
it generates batch ``v``, which step ``v`` trains before version ``v`` is published), so the
training side never waits for a rollout rank here, and holds at most ``depth`` full sets of
weights in host memory (the receiving side one bucket). The NCCL broadcast (GPU) is one
collective over training rank 0 and every rollout rank: there, each version still waits for
the last rollout rank to be ready for it.

With delta sync (:mod:`fsdp_rlhf.distributed.delta_sync`) a bucket is one gather bucket's
changes instead: its manifest is a dict (``{"delta": index, "layout": ..., "encoding": ...}``),
its payload every training rank's encoded changes, and each rollout rank writes them into its
mirror of the synced weights (checked by checksum) and loads the bucket's full tensors from it.
Each version's changes are relative to the version before it, so a rollout rank applies every
version to its mirror in order, also the ones it receives without loading.
"""

from __future__ import annotations

import collections
import datetime
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_rlhf.distributed.bridge import Bridge, Channel, Outbox
from fsdp_rlhf.distributed.delta_sync import BucketDelta, BucketLayout, DeltaStats, Mirror
from fsdp_rlhf.distributed.fsdp import GATHER_BUCKET_BYTES

# A measurement hook (not a setting), read when a link is built: with
# FSDP_RLHF_LOCKSTEP_WEIGHTS=1 every header, manifest and payload waits until every rollout
# rank took it, as the delivery did before each rollout rank took versions at its own pace
# (scripts/benchkit/async_decoupled compares the two)
LOCKSTEP_ENV = "FSDP_RLHF_LOCKSTEP_WEIGHTS"
Entry = tuple  # (name, dtype name, shape) or (name, "alias", other name)
WHAT = "sending new weights"
ALIGN = 16  # bytes: every tensor starts at a multiple, so its view has an aligned start


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class PublishStats:
    """One publication: bytes sent to each rollout rank, wall time (gathers included), and
    how much of it went to waiting for rollout ranks (over gloo: for a version ``depth``
    publications old to be taken; over NCCL: for every rollout rank to start receiving, which
    they do between two engine steps, or when a batch that needs the weights starts)."""

    bytes: int
    seconds: float
    waited: float = 0.0
    delta: DeltaStats | None = None  # a delta sync's counts and times (training rank 0's view)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def pack(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[Entry], torch.Tensor]:
    """One bucket's manifest and its payload (the tensors' bytes back to back)."""
    manifest: list[Entry] = []
    parts: list[torch.Tensor] = []
    seen: dict[int, str] = {}
    for name, t in tensors:
        if id(t) in seen:
            manifest.append((name, "alias", seen[id(t)]))
            continue
        seen[id(t)] = name
        manifest.append((name, str(t.dtype), tuple(t.shape)))
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(data)
        if len(data) % ALIGN:
            parts.append(torch.zeros(_aligned(len(data)) - len(data), dtype=torch.uint8))
    device = parts[0].device if parts else torch.device("cpu")
    parts = [p.to(device) for p in parts]
    payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return manifest, payload


def unpack(manifest: list[Entry], payload: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one bucket, as views of ``payload`` (in manifest order)."""
    offset, named = 0, {}
    for name, kind, spec in manifest:
        if kind == "alias":
            yield name, named[spec]
            continue
        dtype, shape = _dtype(kind), tuple(spec)
        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        t = payload[offset : offset + nbytes].view(dtype).view(shape)
        offset += _aligned(nbytes)
        named[name] = t
        yield name, t


def payload_bytes(manifest: list[Entry]) -> int:
    total = 0
    for _, kind, spec in manifest:
        if kind != "alias":
            count = 1
            for d in spec:
                count *= d
            total += _aligned(count * _dtype(kind).itemsize)
    return total


def buckets(
    stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a ``(name, tensor)`` stream into lists of at most ``bucket_bytes`` (a larger
    tensor goes alone; an alias joins the bucket of its tensor)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in stream:
        nbytes = t.numel() * t.element_size()
        alias = any(t is other for _, other in bucket)
        if bucket and not alias and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += 0 if alias else nbytes
    if bucket:
        yield bucket


class WeightLink:
    """How a version travels: gloo sends over the bridge (CPU), posted without waiting and
    kept until taken (``depth`` versions at most, see the module docstring), or an NCCL
    broadcast from training rank 0 to the rollout ranks (GPU)."""

    def __init__(self, bridge: Bridge, receivers: list[int], nccl=None, depth: int = 2) -> None:
        self.bridge, self.receivers, self.nccl = bridge, receivers, nccl
        self.depth = max(1, depth)
        self.held = os.environ.get(LOCKSTEP_ENV) == "1"  # the measurement hook above
        self.lockstep = self.held or nccl is not None  # the NCCL broadcast needs them all
        self.in_flight: collections.deque[Outbox] = collections.deque()  # oldest first

    @classmethod
    def build(
        cls,
        bridge: Bridge,
        store: dist.Store,
        receivers: list[int],
        device: torch.device,
        timeout_min: int,
        depth: int = 2,
    ) -> WeightLink:
        """On CUDA, training rank 0 and the rollout ranks build an NCCL group of their own
        (rank 0 is its root); everyone else, and CPU jobs, send over the bridge. ``depth``:
        the versions that may be on their way at once (``--async_queue_size`` + 1)."""
        members = [0, *receivers]
        if device.type != "cuda" or bridge.rank not in members:
            return cls(bridge, receivers, depth=depth)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(minutes=timeout_min)
        nccl = dist.ProcessGroupNCCL(
            dist.PrefixStore("fsdp_rlhf/weights", store),
            members.index(bridge.rank),
            len(members),
            opts,
        )
        return cls(bridge, receivers, nccl, depth)

    @property
    def device(self) -> torch.device:
        if self.nccl is not None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------ training rank 0

    def open(self, header: dict | None) -> float:
        """Start a version: its ``header`` to every rollout rank on the control channel.
        First the oldest versions still on their way are waited for until fewer than
        ``depth`` are; returns the seconds that took (0 under the schedule)."""
        t0 = time.perf_counter()
        while len(self.in_flight) >= self.depth:
            self.bridge.flush(what=WHAT, outbox=self.in_flight.popleft())
        waited = time.perf_counter() - t0
        self.in_flight.append(Outbox())
        if header is not None:
            for r in self.receivers:
                self._post_object(header, r, Channel.CONTROL)
            if self.held:
                self.bridge.flush(what=WHAT, outbox=self.in_flight[-1])
        return waited

    def post_manifest(self, manifest: object) -> float:
        """One bucket's manifest to every rollout rank. Over NCCL, waits until every rollout
        rank takes it (the broadcast needs them all) and returns the seconds waited."""
        for r in self.receivers:
            self._post_object(manifest, r, Channel.WEIGHTS)
        if not self.lockstep:
            return 0.0
        t0 = time.perf_counter()
        self.bridge.flush(what=WHAT, outbox=self.in_flight[-1])
        return time.perf_counter() - t0

    def send(self, payload: torch.Tensor) -> None:
        """One bucket's payload to every rollout rank (after its manifest)."""
        if self.nccl is not None:
            self._broadcast(payload)
            return
        payload = payload.cpu()
        for r in self.receivers:
            self.bridge.isend([payload], r, Channel.WEIGHTS, WHAT, outbox=self.in_flight[-1])
        if self.held:
            self.bridge.flush(what=WHAT, outbox=self.in_flight[-1])

    def wait_delivered(self, wait_s: float | None = None) -> None:
        """Wait until every rollout rank took every version posted."""
        while self.in_flight:
            self.bridge.flush(what=WHAT, wait_s=wait_s, outbox=self.in_flight.popleft())

    def abandon(self) -> None:
        """Stop waiting for the versions on their way (the job ends; buffers stay alive)."""
        while self.in_flight:
            self.bridge.abandon_sends(self.in_flight.popleft())

    def _post_object(self, obj: object, dst: int, channel: Channel) -> None:
        outbox = self.in_flight[-1]
        self.bridge.send_object(obj, dst, channel, wait=False, what=WHAT, outbox=outbox)

    # ------------------------------------------------------------ a rollout rank

    def recv(self, payload: torch.Tensor) -> torch.Tensor:
        if self.nccl is not None:
            self._broadcast(payload)
            return payload
        return self.bridge.recv(payload, 0, Channel.WEIGHTS, "receiving new weights")

    def _broadcast(self, payload: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.nccl.broadcast([payload], opts).wait()


def publish(
    link: WeightLink,
    stream: Iterable[tuple[str, torch.Tensor]],
    *,
    sender: bool,
    header: dict | None = None,
    bucket_bytes: int | None = None,
) -> PublishStats:
    """Send one full set of weights to every rollout rank (``sender``: training rank 0),
    after ``header`` on the control channel (what the rollout ranks read to know a version
    is coming).

    Collective over the training ranks: each must consume ``stream`` (its gathers) in step;
    the others drop the tensors. Each rollout rank receives it (:func:`receive`) when it is
    ready; over gloo nothing here waits for that (module docstring).
    """
    t0 = time.perf_counter()
    device_type = "cuda" if link.nccl is not None else "cpu"
    size = bucket_bytes or GATHER_BUCKET_BYTES[device_type]
    sent, waited = 0, link.open(header) if sender else 0.0
    for i, bucket in enumerate(buckets(stream, size)):
        if not sender:
            continue
        manifest, payload = pack(bucket)
        took = link.post_manifest(manifest)
        if i == 0:  # over NCCL (or lock-step): every rollout rank starts receiving
            waited += took
        link.send(payload.to(link.device))
        sent += payload.numel()
    if sender:
        link.post_manifest({"end": True})
    return PublishStats(sent, time.perf_counter() - t0, waited)


def publish_delta(
    link: WeightLink,
    deltas: Iterable[tuple[int, BucketLayout, BucketDelta]],
    *,
    sender: bool,
    aliases: dict[str, str],
    header: dict | None = None,
    stats: DeltaStats | None = None,
) -> PublishStats:
    """Send one delta sync (:meth:`~fsdp_rlhf.distributed.delta_sync.DeltaSender.deltas`) to
    every rollout rank after ``header``; ``aliases``: ``{name: second name}`` of a tensor also
    loaded under another name (the tied LM head). Collective over the training ranks like
    :func:`publish`, and like it waiting for no rollout rank over gloo."""
    t0 = time.perf_counter()
    sent, waited = 0, link.open(header) if sender else 0.0
    for n, (index, layout, delta) in enumerate(deltas):
        if not sender:
            continue
        manifest = {
            "delta": index,
            "layout": layout.to_dict(),  # plain values: the bridge unpickles weights-only
            "aliases": {k: v for k, v in aliases.items() if k in layout.names},
            **delta.manifest(),
        }
        took = link.post_manifest(manifest)
        if n == 0:  # over NCCL: every rollout rank starts receiving
            waited += took
        link.send(delta.payload.reshape(-1).to(link.device))
        sent += delta.payload.numel()
    if sender:
        link.post_manifest({"end": True})
    return PublishStats(sent, time.perf_counter() - t0, waited, stats)


def receive(link: WeightLink, mirror: Mirror | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights training rank 0 is publishing, bucket by bucket (each bucket's tensors
    are views of one buffer, valid until the next bucket arrives). Delta buckets update
    ``mirror`` and come from it."""
    while True:
        manifest = link.bridge.recv_object(0, Channel.WEIGHTS, "receiving new weights")
        if isinstance(manifest, dict) and manifest.get("end"):
            return
        if isinstance(manifest, dict):
            if mirror is None:
                raise RuntimeError("a delta weight update reached a rank that keeps no mirror")
            layout = BucketLayout.from_dict(manifest["layout"])
            world, section = len(manifest["counts"]), manifest["section"]
            payload = torch.empty(world * section, dtype=torch.uint8, device=link.device)
            delta = BucketDelta.from_manifest(manifest, link.recv(payload).cpu())
            for name, tensor in mirror.apply(manifest["delta"], layout, delta):
                yield name, tensor
                if name in manifest["aliases"]:
                    yield manifest["aliases"][name], tensor
            continue
        payload = torch.empty(payload_bytes(manifest), dtype=torch.uint8, device=link.device)
        yield from unpack(manifest, link.recv(payload))
