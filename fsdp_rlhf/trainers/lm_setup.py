"""The causal LMs of `sft` and `dpo`, built after the process group exists: the trained
policy (full or LoRA) and DPO's frozen reference."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.models.load import load_causal_lm
from fsdp_rlhf.models.lora import add_lora
from fsdp_rlhf.trainers.common import load_and_prepare, log_startup

log = logging.getLogger("fsdp_rlhf")


def build_policy(cfg: Any, env: DistEnv, *, grad_reduce: str = "mean") -> nn.Module:
    """Load ``--pretrain`` as a causal LM (with adapters under ``--lora_rank``) and shard it.

    ``grad_reduce``: ``"sum"`` when the loss is normalised by a global token count (SFT).
    """
    log_startup(env, cfg.fsdp.zero_stage, cfg.backend.bf16)
    torch.manual_seed(cfg.seed)  # the adapters' init (rank 0's reaches every rank)

    def load(weights: bool) -> nn.Module:
        model = load_causal_lm(cfg.model.pretrain, cfg.backend, env.device, weights=weights)
        if cfg.lora.enabled:
            add_lora(model, cfg.lora, quiet=not weights)
        return model

    model = load_and_prepare(
        load,
        env,
        cfg.fsdp,
        cfg.backend,
        what="--pretrain",
        packed=cfg.batch.packing_samples,
        trainable=True,
        grad_reduce=grad_reduce,
    )
    torch.manual_seed(cfg.seed + env.rank)  # different dropout masks per rank from here on
    return model


def reference_path(cfg: Any) -> str | None:
    """The folder of a separate frozen reference, or None when the policy's own base serves
    (LoRA without another ``--ref_pretrain``: the actor with its adapters disabled)."""
    path = cfg.model.ref_pretrain or cfg.model.pretrain
    if cfg.lora.enabled and path == cfg.model.pretrain:
        return None
    return path


def build_reference(cfg: Any, env: DistEnv) -> nn.Module | None:
    """The frozen reference (bf16 weights under ``--bf16``: no master copy to keep), or None
    (see :func:`reference_path`)."""
    path = reference_path(cfg)
    if path is None:
        log.info("reference: the policy with its LoRA adapters disabled")
        return None
    # a frozen model never runs backward: recomputation would only cost time
    backend = dataclasses.replace(cfg.backend, gradient_checkpointing=False)
    dtype = torch.bfloat16 if backend.bf16 else torch.float32
    return load_and_prepare(
        lambda weights: load_causal_lm(path, backend, env.device, dtype=dtype, weights=weights),
        env,
        cfg.fsdp,
        backend,
        what="the reference model",
        packed=cfg.batch.packing_samples,
        trainable=False,
    )
