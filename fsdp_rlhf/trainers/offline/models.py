"""The models of `train-rm`, `sft` and `dpo`, built after the process group exists: the
reward model (a scalar head on the SFT model), the trained policy (full or LoRA), DPO's frozen
reference; and how a pair's two sequences go through a model (:func:`pair_layout`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from fsdp_rlhf.config import PairBatchConfig, RMConfig
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.models.attention import VARLEN_ATTENTION
from fsdp_rlhf.models.inputs import RowLayout
from fsdp_rlhf.models.kind import ModelKind
from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model
from fsdp_rlhf.models.lora import add_lora
from fsdp_rlhf.models.ulysses import base_attention
from fsdp_rlhf.models.vision import freeze_vision_tower, prepare_policy
from fsdp_rlhf.trainers.common import load_and_prepare, log_startup

log = logging.getLogger("fsdp_rlhf")


def build_reward_model(
    cfg: RMConfig, env: DistEnv, pad_token_id: int, parallel: ParallelLayout
) -> nn.Module:
    """Load the SFT model with a scalar head and shard it over all ranks (a VLM's head on its
    language model, ``models.vision_head``; ``--freeze_visual_encoder`` freezes its tower)."""
    log_startup(env, cfg.fsdp.zero_stage, cfg.backend.bf16)
    # A freshly initialised head is rank 0's (the others receive its values); the seed makes
    # it the same from run to run.
    torch.manual_seed(cfg.seed)
    packed = cfg.batch.packing_samples  # a VLM's too (models.inputs)

    def load(weights: bool) -> nn.Module:
        model = load_scalar_model(
            cfg.model.pretrain,
            cfg.backend,
            env.device,
            value_head_prefix=cfg.model.value_head_prefix,
            weights=weights,
        )
        # HF (and vLLM) score the last token that is not pad_token_id: use the tokenizer's pad
        # (a VLM's: in its text config, which its classification head reads)
        model.config.pad_token_id = pad_token_id
        model.config.get_text_config().pad_token_id = pad_token_id
        if cfg.vision.freeze_visual_encoder:
            freeze_vision_tower(model)
        if cfg.lora.enabled:  # adapters on the decoder; the head is trained in full
            add_lora(model, cfg.lora, head="score", quiet=not weights)
        return model

    model = load_and_prepare(
        load,
        env,
        cfg.fsdp,
        cfg.backend,
        parallel=parallel,
        what="--pretrain",
        packed=packed,
        trainable=True,
    )
    # Different dropout masks per rank from here on.
    torch.manual_seed(cfg.seed + env.rank)
    return model


def build_policy(
    cfg: Any,
    env: DistEnv,
    parallel: ParallelLayout,
    *,
    grad_reduce: str = "mean",
) -> nn.Module:
    """Load ``--pretrain`` as a causal LM (with adapters under ``--lora_rank``) and shard it.
    A VLM's placeholders are suppressed and, with ``--freeze_visual_encoder``, its vision
    tower frozen.

    ``grad_reduce``: ``"sum"`` when the loss is normalised by a global token count (SFT).
    """
    log_startup(env, cfg.fsdp.zero_stage, cfg.backend.bf16)
    torch.manual_seed(cfg.seed)  # the adapters' init (rank 0's reaches every rank)
    vision = getattr(cfg, "vision", None)
    freeze = vision is not None and vision.freeze_visual_encoder
    packed = cfg.batch.packing_samples  # a VLM's too (models.inputs)

    def load(weights: bool) -> nn.Module:
        model = load_causal_lm(cfg.model.pretrain, cfg.backend, env.device, weights=weights)
        prepare_policy(model, freeze_tower=freeze)  # a VLM: placeholders suppressed
        if cfg.lora.enabled:
            add_lora(model, cfg.lora, quiet=not weights)
        return model

    model = load_and_prepare(
        load,
        env,
        cfg.fsdp,
        cfg.backend,
        parallel=parallel,
        what="--pretrain",
        packed=packed,
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


def build_reference(cfg: Any, env: DistEnv, parallel: ParallelLayout) -> nn.Module | None:
    """The frozen reference (bf16 weights under ``--bf16``: no master copy to keep), or None
    (see :func:`reference_path`)."""
    path = reference_path(cfg)
    if path is None:
        log.info("reference: the policy with its LoRA adapters disabled")
        return None
    # a frozen model never runs backward: recomputation would only cost time
    backend = dataclasses.replace(cfg.backend, gradient_checkpointing=False)
    dtype = torch.bfloat16 if backend.bf16 else torch.float32

    def load(weights: bool) -> nn.Module:
        model = load_causal_lm(path, backend, env.device, dtype=dtype, weights=weights)
        prepare_policy(model)  # a VLM: placeholders suppressed, as in the policy
        return model

    return load_and_prepare(
        load,
        env,
        cfg.fsdp,
        backend,
        parallel=parallel,
        what="the reference model",
        packed=cfg.batch.packing_samples,
        trainable=False,
    )


def pair_layout(model: nn.Module, batch: PairBatchConfig, kind: ModelKind) -> RowLayout:
    """The rows part of the pairs' forwards through ``model`` (``models.inputs``): padded,
    packed into one row, or packed with each pair's shared prefix once
    (``--share_prompt_prefix``, needs the varlen attention of ``--packing_samples``;
    flash-attn's kernels take no shared prefix; nor a VLM's pairs, whose rejected rest would
    need the M-RoPE positions of the chosen segment's images)."""
    if not batch.packing_samples:
        return "padded"
    if kind.is_vlm:
        if batch.share_prompt_prefix:
            log.info("shared prompt prefix: off for a vision-language model's pairs (packed)")
        return "packed"
    impl = base_attention(model)  # inside Ulysses when the model is sequence-parallel
    if batch.share_prompt_prefix and impl == VARLEN_ATTENTION:
        log.info("shared prompt prefix: each pair's common prefix runs once")
        return "shared_pairs"
    if batch.share_prompt_prefix:
        log.info("shared prompt prefix: off, the model's attention is %s", impl)
    return "packed"
