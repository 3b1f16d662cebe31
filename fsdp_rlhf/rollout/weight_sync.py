"""Stream the FSDP2 actor's weights into a rollout engine, bucket by bucket.

Every rank gathers every parameter and feeds the full tensors to its own engine slice, which
keeps only its TP shard. The shards are gathered in buckets (one all-gather per bucket of up to
``GATHER_BUCKET_BYTES``, cast to the engine's dtype first: see
:func:`fsdp_rlhf.distributed.fsdp.iter_full_params`), so no full state dict is ever
materialised: peak extra memory is about two buckets, or one parameter larger than a bucket
(the embedding or LM head). Must be called on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_rlhf.distributed.fsdp import iter_full_params
from fsdp_rlhf.models.lora import (
    adapter_file_name,
    is_adapter_param,
    merged_weight,
    strip_wrappers,
)
from fsdp_rlhf.rollout.engine import AdapterSpec, RolloutEngine


@dataclass(frozen=True)
class SyncStats:
    """One weight sync: bytes sent into the engine and wall time (gathers included)."""

    bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


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


def _kept(skip: Callable[[str], bool] | None) -> Callable[[str], bool] | None:
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
    alias = tied_head_alias(actor)
    for name, tensor in iter_full_params(actor, dtype, include=_kept(skip)):
        hf_name = hf_param_name(name)
        yield hf_name, tensor
        if hf_name in alias:
            yield alias[hf_name], tensor


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
    for name, tensor in iter_full_params(actor, dtype, include=_kept(skip)):
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
) -> SyncStats:
    """Wake the engine's weights, stream the actor into it (with its LoRA adapters merged in
    when ``lora_scaling`` is given; without the parameters ``skip`` names, which never
    change), then wake its KV cache.

    The KV cache comes back only after the sync so it never coexists with the gathered tensors
    (the colocated OOM pattern). Returns bytes and seconds of the whole step.
    """
    if lora_scaling is None:
        weights = stream_actor_weights(actor, dtype, skip)
    else:
        weights = stream_merged_weights(actor, dtype, lora_scaling, skip)
    return _timed_load(engine, lambda: engine.update_weights(weights))


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
