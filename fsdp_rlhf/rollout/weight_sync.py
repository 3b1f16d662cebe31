"""Stream the FSDP2 actor's weights into a rollout engine, bucket by bucket.

Every rank gathers every parameter and feeds the full tensors to its own engine slice, which
keeps only its TP shard. The shards are gathered in buckets (one all-gather per bucket of up to
``GATHER_BUCKET_BYTES``, cast to the engine's dtype first: see
:func:`fsdp_rlhf.distributed.fsdp.iter_full_params`), so no full state dict is ever
materialised: peak extra memory is about two buckets, or one parameter larger than a bucket
(the embedding or LM head). Must be called on every rank.

With a :class:`~fsdp_rlhf.distributed.delta_sync.DeltaSync` (``--weight_sync delta``) the
buckets carry only what changed since the last sync and the full tensors come from the rank's
mirror of the synced weights. With ``overlap`` the next bucket is gathered while the engine
loads this one (:mod:`fsdp_rlhf.distributed.prefetch`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_rlhf.distributed.delta_sync import DeltaStats, DeltaSync
from fsdp_rlhf.distributed.fsdp import iter_full_buckets, iter_full_params
from fsdp_rlhf.distributed.prefetch import StageTimes, staged
from fsdp_rlhf.models.lora import (
    adapter_file_name,
    is_adapter_param,
    merged_weight,
    strip_wrappers,
)
from fsdp_rlhf.rollout.engine import AdapterSpec, RolloutEngine


@dataclass(frozen=True)
class SyncStats:
    """One weight sync: bytes sent into the engine and wall time (gathers included).

    ``wire_bytes``: what this rank's gathers received (a full sync: the full tensors; a delta
    sync: the encoded changes of every rank); ``changed_frac``: the share of elements that
    differ from the last sync (None: not compared, as in a full sync); ``gather_s``: time
    spent making the buckets (gathers, or comparing, exchanging, applying and checking);
    ``wait_s``: time the engine waited for the next bucket (all of ``gather_s`` without
    overlap, what the overlap did not hide with it).
    """

    bytes: int
    seconds: float
    wire_bytes: int = 0
    changed_frac: float | None = None
    gather_s: float = 0.0
    wait_s: float = 0.0
    delta: DeltaStats | None = None

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")

    def metrics(self, prefix: str) -> dict[str, float]:
        """The sync's metrics, ``{prefix}/weight_sync_*``."""
        out = {
            f"{prefix}/weight_sync_gbps": self.bytes_per_s / 1e9,
            f"{prefix}/weight_sync_bytes": float(self.bytes),
            f"{prefix}/weight_sync_wire_bytes": float(self.wire_bytes),
            f"{prefix}/weight_sync_s": self.seconds,
            f"{prefix}/weight_sync_gather_s": self.gather_s,
            f"{prefix}/weight_sync_wait_s": self.wait_s,
        }
        if self.changed_frac is not None:
            out[f"{prefix}/weight_sync_changed_frac"] = self.changed_frac
        if self.delta is not None:  # only with delta_sync.measure_blocks() (benchmarks)
            for size, n in self.delta.blocks.items():
                total = self.delta.block_total[size]
                out[f"{prefix}/weight_sync_blocks{size}_frac"] = n / total if total else 0.0
        return out


def hf_param_name(name: str) -> str:
    """The checkpoint (HF) name of an actor parameter: wrapper segments removed."""
    return strip_wrappers(name)


def _module_name(actor: nn.Module, module: nn.Module) -> str:
    return next(hf_param_name(n) for n, m in actor.named_modules() if m is module)


def tied_head_alias(actor: nn.Module) -> dict[str, str]:
    """``{input-embedding weight name: LM-head weight name}`` when they are tied, else ``{}``.

    ``named_parameters()`` lists a tied weight once (as the embedding). vLLM 0.32's in-place
    reload must still receive it under the head's name too: on CPU the LM head keeps a repacked
    copy of the weight that is refreshed only when the head itself is loaded (measured: without
    it greedy outputs keep following the old head).
    """
    if not actor.config.tie_word_embeddings:
        return {}
    embed = _module_name(actor, actor.get_input_embeddings())
    head = _module_name(actor, actor.get_output_embeddings())
    return {f"{embed}.weight": f"{head}.weight"}


def kept_params(skip: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
    """``iter_full_params``' filter from a predicate on HF names (None: every parameter)."""
    if skip is None:
        return None
    return lambda name: not skip(hf_param_name(name))


def stream_actor_weights(
    actor: nn.Module, dtype: torch.dtype, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor in dtype)`` for every actor parameter (gathered bucket by
    bucket), but those whose HF name ``skip`` accepts (a frozen vision tower: the engine keeps
    the copy it loaded); a tied embedding is yielded a second time under the LM head's name
    (same tensor, no copy).

    Collective: every rank must consume the whole iterator, in step.
    """
    for bucket in actor_buckets(actor, dtype, skip):
        yield from bucket


def actor_buckets(
    actor: nn.Module,
    dtype: torch.dtype,
    skip: Callable[[str], bool] | None = None,
    delta: DeltaSync | None = None,
    stats: DeltaStats | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:func:`stream_actor_weights` one gather bucket at a time; with ``delta``, the buckets
    synced by delta (their full tensors from the rank's mirror; ``stats`` filled)."""
    alias = tied_head_alias(actor)
    if delta is None:
        source = iter_full_buckets(actor, dtype, include=kept_params(skip))
    else:
        source = delta.buckets(actor, dtype, kept_params(skip), stats=stats)
    for bucket in source:
        named = []
        for name, tensor in bucket:
            hf_name = hf_param_name(name)
            named.append((hf_name, tensor))
            if hf_name in alias:
                named.append((alias[hf_name], tensor))
        yield named


def stream_merged_weights(
    actor: nn.Module,
    dtype: torch.dtype,
    lora_scaling: float,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream_actor_weights`` of a LoRA actor with its adapters merged in: each adapted weight
    is yielded once, as ``W + lora_scaling * B @ A`` (computed in fp32) under its HF name, and
    the adapter tensors themselves are not. Holds one module's W, A and B at a time.

    Collective, like ``stream_actor_weights``.
    """
    alias = tied_head_alias(actor)
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_full_params(actor, dtype, include=kept_params(skip)):
        hf_name = hf_param_name(name)
        part = _lora_part(hf_name)
        if part is None:
            hf_name = hf_name.replace(".base_layer.", ".")  # an adapted layer's bias
            yield hf_name, tensor
            if hf_name in alias:
                yield alias[hf_name], tensor
            continue
        module, key = part
        parts = held.setdefault(module, {})
        parts[key] = tensor
        if len(parts) == 3:
            yield (
                f"{module}.weight",
                merged_weight(parts["W"], parts["A"], parts["B"], lora_scaling),
            )
            del held[module]
    if held:
        raise RuntimeError(f"LoRA merge: incomplete adapted weights {sorted(held)}")


def _lora_part(hf_name: str) -> tuple[str, str] | None:
    """``(module, "W" | "A" | "B")`` for an adapted layer's base weight or adapter weight."""
    if hf_name.endswith(".base_layer.weight"):
        return hf_name.removesuffix(".base_layer.weight"), "W"
    if is_adapter_param(hf_name):
        module, _, rest = hf_name.partition(".lora_")
        return module, rest[0]  # "A.default.weight" -> "A"
    return None


def sync_weights(
    actor: nn.Module,
    engine: RolloutEngine,
    dtype: torch.dtype,
    lora_scaling: float | None = None,
    skip: Callable[[str], bool] | None = None,
    *,
    delta: DeltaSync | None = None,
    overlap: bool = False,
) -> SyncStats:
    """Wake the engine's weights, stream the actor into it (with its LoRA adapters merged in
    when ``lora_scaling`` is given; without the parameters ``skip`` names, which never
    change), then wake its KV cache.

    ``delta``: sync by delta (not with ``lora_scaling``); ``overlap``: gather the next bucket
    while the engine loads this one. The KV cache comes back only after the sync so it never
    coexists with the gathered tensors (the colocated OOM pattern). Returns bytes and seconds
    of the whole step.
    """
    stats = DeltaStats()
    if lora_scaling is not None:
        if delta is not None:
            raise ValueError("delta sync of merged LoRA weights is not supported")
        buckets = ([w] for w in stream_merged_weights(actor, dtype, lora_scaling, skip))
    else:
        buckets = actor_buckets(actor, dtype, skip, delta, stats)
    times = StageTimes()
    device = _param_device(actor)
    wire = [0]

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in staged(buckets, times, overlap=overlap, device=device):
            if delta is None:
                wire[0] += _unique_bytes(bucket)
            yield from bucket

    out = _timed_load(engine, lambda: engine.update_weights(weights()))
    return SyncStats(
        bytes=out.bytes,
        seconds=out.seconds,
        wire_bytes=wire[0] if delta is None else stats.gathered_bytes,
        changed_frac=stats.changed_frac if stats.elements else None,
        gather_s=times.produce_s,
        wait_s=times.wait_s,
        delta=stats if delta is not None else None,
    )


def _unique_bytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes of a bucket's tensors, a tensor named twice (the tied head) counted once."""
    unique = {id(t): t for _, t in bucket}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _param_device(model: nn.Module) -> torch.device:
    """Where the weight sync's gathers put their tensors (the mesh's device)."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return p.device


def stream_adapter_weights(
    actor: nn.Module, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(peft adapter-file name, full tensor in dtype)`` for the LoRA adapters only; the
    frozen base never moves. Collective, like :func:`stream_actor_weights`."""
    for name, tensor in iter_full_params(actor, dtype, include=is_adapter_param):
        yield adapter_file_name(name), tensor


def sync_adapter(
    actor: nn.Module, engine: RolloutEngine, dtype: torch.dtype, spec: AdapterSpec
) -> SyncStats:
    """Stream the actor's LoRA adapters into the engine (which keeps its base weights)."""
    weights = stream_adapter_weights(actor, dtype)
    return _timed_load(engine, lambda: engine.update_adapter(weights, spec))


def _timed_load(engine: RolloutEngine, load: Callable[[], int]) -> SyncStats:
    """Wake the engine's weights, ``load`` (returns bytes), then wake its KV cache."""
    t0 = time.perf_counter()
    engine.wake_up(["weights"])
    nbytes = load()
    engine.wake_up(["kv_cache"])
    return SyncStats(bytes=nbytes, seconds=time.perf_counter() - t0)
