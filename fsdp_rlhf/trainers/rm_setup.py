"""`train-rm`'s model, built after the process group exists."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_rlhf.config import RMConfig
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.models.load import load_scalar_model
from fsdp_rlhf.models.lora import add_lora
from fsdp_rlhf.trainers.common import load_and_prepare, log_startup


def build_model(cfg: RMConfig, env: DistEnv, pad_token_id: int) -> nn.Module:
    """Load the SFT model with a scalar head and shard it over all ranks."""
    log_startup(env, cfg.fsdp.zero_stage, cfg.backend.bf16)
    # A freshly initialised head is rank 0's (the others receive its values); the seed makes
    # it the same from run to run.
    torch.manual_seed(cfg.seed)

    def load(weights: bool) -> nn.Module:
        model = load_scalar_model(
            cfg.model.pretrain,
            cfg.backend,
            env.device,
            value_head_prefix=cfg.model.value_head_prefix,
            weights=weights,
        )
        # HF (and vLLM) score the last token that is not pad_token_id: use the tokenizer's pad.
        model.config.pad_token_id = pad_token_id
        if cfg.lora.enabled:  # adapters on the decoder; the head is trained in full
            add_lora(model, cfg.lora, head="score", quiet=not weights)
        return model

    model = load_and_prepare(
        load,
        env,
        cfg.fsdp,
        cfg.backend,
        what="--pretrain",
        packed=cfg.batch.packing_samples,
        trainable=True,
    )
    # Different dropout masks per rank from here on.
    torch.manual_seed(cfg.seed + env.rank)
    return model
