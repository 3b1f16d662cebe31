"""LoRA adapters for the in-process vLLM engine, from tensors in memory (no files).

Only :mod:`fsdp_rlhf.rollout.vllm.engine` imports this module; like it, it touches vLLM
internals, all checked by :func:`check_lora_internals` when an engine with LoRA is built.

vLLM loads adapters by path: a request names ``(lora_name, lora_int_id, lora_path)`` and the
worker reads ``adapter_config.json`` and the tensors from ``lora_path`` unless an adapter with
that id is already in its cache. So each sync builds the ``LoRAModel`` itself, from the
gathered tensors, and registers it in the worker's cache under a new id before any request
names it; the request's path is a placeholder the worker never opens. The previous id is
removed, so the cache (``max_loras = max_cpu_loras = 1``) holds exactly the actor's adapter.
Each rank's worker builds the full adapter and vLLM's LoRA layers keep this rank's TP slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, get_args

import torch
from vllm.config.lora import MaxLoRARanks
from vllm.lora.lora_model import LoRAModel
from vllm.lora.model_manager import LoRAModelManager
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.worker_manager import WorkerLoRAManager

from fsdp_rlhf.errors import UserError
from fsdp_rlhf.rollout.vllm.api import LORA_CALLS, check_calls

# Never opened (see the module docstring); LoRARequest refuses an empty path.
IN_MEMORY_PATH = "fsdp-rlhf://in-memory-adapter"


def max_lora_rank(rank: int) -> int:
    """vLLM sizes its adapter slots for one of a few ranks: the smallest that holds ``rank``."""
    allowed = sorted(get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise UserError(f"--lora_rank {rank}: vLLM serves ranks up to {allowed[-1]}")
    return fits[0]


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments for serving one adapter of ``rank`` at a time."""
    return dict(enable_lora=True, max_lora_rank=max_lora_rank(rank), max_loras=1, max_cpu_loras=1)


def check_lora_internals() -> list[str]:
    """Problems with the vLLM LoRA APIs used here (empty when all are as expected)."""
    return check_calls(LORA_CALLS)


def request(lora_id: int) -> LoRARequest:
    """The request naming adapter ``lora_id`` (already in the worker's cache)."""
    return LoRARequest(f"fsdp-rlhf-actor-{lora_id}", lora_id, IN_MEMORY_PATH)


def install_adapter(
    worker,
    lora_id: int,
    tensors: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    previous: int | None,
) -> int:
    """Runs on the worker (``LLM.collective_rpc``, in this process): build ``LoRAModel``
    ``lora_id`` from peft-named ``tensors``, drop adapter ``previous``, register the new one.

    Returns the number of adapted vLLM modules. Raises when a tensor names a module vLLM
    has no LoRA layer for (vLLM itself would ignore it silently).
    """
    manager: WorkerLoRAManager | None = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:  # both runners (V1, V2) get it from LoRAModelRunnerMixin
        raise RuntimeError(f"{type(worker.model_runner).__name__} has no LoRA manager")
    adapters: LoRAModelManager = manager._adapter_manager
    helper = PEFTHelper.from_dict(
        {**config, "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    helper.validate_legal(manager.lora_config)
    # a VLM's checkpoint names (``model.language_model.layers...``) are not its vLLM module
    # names: vLLM's own adapter loader renames them by the model's mapper, and so do we
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "get_rename_mapper"):
        mapper = mapper.get_rename_mapper()
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=dict(tensors),
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
    )
    if previous is not None:
        manager.remove_adapter(previous)
    adapters.add_adapter(lora)  # packs q/k/v and gate/up into vLLM's merged layers in place
    unknown = sorted(set(lora.loras) - set(adapters.modules))
    if unknown:
        manager.remove_adapter(lora_id)
        raise RuntimeError(f"vLLM has no LoRA layer for adapter modules {unknown[:4]}")
    return len(lora.loras)
