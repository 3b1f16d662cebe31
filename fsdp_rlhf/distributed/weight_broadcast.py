"""New actor weights from the training ranks to the rollout ranks of an asynchronous job.

Every training rank consumes the gathered weight stream (``rollout.weight_sync``'s: each
bucket of FSDP2 shards is an all-gather over the training ranks); training rank 0 packs the
full tensors into buckets of up to ``bucket_bytes`` and sends each bucket to every rollout
rank, which unpacks it into ``(name, tensor)`` pairs for its engine (each engine keeps its
tensor-parallel shard). On the wire, per bucket::

    manifest (object, over the bridge)   [(name, dtype, shape) | (name, "alias", other)]
    payload  (one flat byte tensor)      gloo over the bridge on CPU, an NCCL broadcast on GPU

and a final ``{"end": True}`` manifest. A tied LM head is sent once and named twice (an
``alias`` entry). Peak extra memory on either side is about one bucket.

With delta sync (:mod:`fsdp_rlhf.distributed.delta_sync`) a bucket is one gather bucket's
changes instead: its manifest is a dict (``{"delta": index, "layout": ..., "encoding": ...}``),
its payload every training rank's encoded changes, and each rollout rank writes them into its
mirror of the synced weights (checked by checksum) and loads the bucket's full tensors from it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_rlhf.distributed.bridge import Bridge, Channel
from fsdp_rlhf.distributed.delta_sync import BucketDelta, BucketLayout, DeltaStats, Mirror
from fsdp_rlhf.distributed.fsdp import GATHER_BUCKET_BYTES

Entry = tuple  # (name, dtype name, shape) or (name, "alias", other name)
WHAT = "sending new weights"
ALIGN = 16  # bytes: every tensor starts at a multiple, so its view has an aligned start


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class PublishStats:
    """One publication: bytes sent to each rollout rank, wall time (gathers included), and
    how much of it went to waiting for the rollout ranks to start receiving (they take new
    weights between two engine steps, or when a batch that needs them starts)."""

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
    """How a bucket's payload travels: gloo sends over the bridge (CPU), or an NCCL broadcast
    from training rank 0 to the rollout ranks (GPU)."""

    def __init__(self, bridge: Bridge, receivers: list[int], nccl=None) -> None:
        self.bridge, self.receivers, self.nccl = bridge, receivers, nccl

    @classmethod
    def build(
        cls,
        bridge: Bridge,
        store: dist.Store,
        receivers: list[int],
        device: torch.device,
        timeout_min: int,
    ) -> WeightLink:
        """On CUDA, training rank 0 and the rollout ranks build an NCCL group of their own
        (rank 0 is its root); everyone else, and CPU jobs, send over the bridge."""
        members = [0, *receivers]
        if device.type != "cuda" or bridge.rank not in members:
            return cls(bridge, receivers)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(minutes=timeout_min)
        nccl = dist.ProcessGroupNCCL(
            dist.PrefixStore("fsdp_rlhf/weights", store),
            members.index(bridge.rank),
            len(members),
            opts,
        )
        return cls(bridge, receivers, nccl)

    @property
    def device(self) -> torch.device:
        if self.nccl is not None:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def send(self, payload: torch.Tensor) -> None:
        if self.nccl is not None:
            self._broadcast(payload)
            return
        payload = payload.cpu()
        for r in self.receivers:
            self.bridge.isend([payload], r, Channel.WEIGHTS, WHAT)
        self.bridge.flush(what=WHAT)

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
    bucket_bytes: int | None = None,
) -> PublishStats:
    """Send one full set of weights to every rollout rank (``sender``: training rank 0).

    Collective over the training ranks: each must consume ``stream`` (its gathers) in step;
    the others drop the tensors. The rollout ranks must be receiving (:func:`receive`).
    """
    t0 = time.perf_counter()
    device_type = "cuda" if link.nccl is not None else "cpu"
    size = bucket_bytes or GATHER_BUCKET_BYTES[device_type]
    sent, waited = 0, 0.0
    for i, bucket in enumerate(buckets(stream, size)):
        if not sender:
            continue
        manifest, payload = pack(bucket)
        t_wait = time.perf_counter()
        for r in link.receivers:
            link.bridge.send_object(manifest, r, Channel.WEIGHTS, wait=False, what=WHAT)
        link.bridge.flush(what=WHAT)
        if i == 0:  # the first manifest is taken when the rollout ranks start receiving
            waited = time.perf_counter() - t_wait
        link.send(payload.to(link.device))
        sent += payload.numel()
    if sender:
        for r in link.receivers:
            link.bridge.send_object({"end": True}, r, Channel.WEIGHTS, wait=False, what=WHAT)
        link.bridge.flush(what=WHAT)
    return PublishStats(sent, time.perf_counter() - t0, waited)


def publish_delta(
    link: WeightLink,
    deltas: Iterable[tuple[int, BucketLayout, BucketDelta]],
    *,
    sender: bool,
    aliases: dict[str, str],
    stats: DeltaStats | None = None,
) -> PublishStats:
    """Send one delta sync (:meth:`~fsdp_rlhf.distributed.delta_sync.DeltaSender.deltas`) to
    every rollout rank; ``aliases``: ``{name: second name}`` of a tensor also loaded under
    another name (the tied LM head). Collective over the training ranks like :func:`publish`."""
    t0 = time.perf_counter()
    sent, waited = 0, 0.0
    for n, (index, layout, delta) in enumerate(deltas):
        if not sender:
            continue
        manifest = {
            "delta": index,
            "layout": layout.to_dict(),  # plain values: the bridge unpickles weights-only
            "aliases": {k: v for k, v in aliases.items() if k in layout.names},
            **delta.manifest(),
        }
        t_wait = time.perf_counter()
        for r in link.receivers:
            link.bridge.send_object(manifest, r, Channel.WEIGHTS, wait=False, what=WHAT)
        link.bridge.flush(what=WHAT)
        if n == 0:
            waited = time.perf_counter() - t_wait
        link.send(delta.payload.reshape(-1).to(link.device))
        sent += delta.payload.numel()
    if sender:
        for r in link.receivers:
            link.bridge.send_object({"end": True}, r, Channel.WEIGHTS, wait=False, what=WHAT)
        link.bridge.flush(what=WHAT)
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
