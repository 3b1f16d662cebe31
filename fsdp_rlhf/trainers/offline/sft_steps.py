"""What `sft` and `kd` share: the policy and its forwards' parts, the forward of an SFT
micro-batch, and the eval loss (the NLL over every learned token)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from fsdp_rlhf.data.sft import SFTBatch, collate_samples
from fsdp_rlhf.distributed.env import DistEnv, all_reduce_scalars
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.stats import to_host
from fsdp_rlhf.models.inputs import InputSpec
from fsdp_rlhf.models.label_logprobs import label_logprobs
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.offline.models import build_policy


def build_sft_policy(cfg: Any, env: DistEnv, data: Any, parallel: ParallelLayout):
    """The run's config written, the policy loaded and sharded (gradients summed over ranks:
    the loss is normalised by the global token count), its forwards' parts and the collate
    function of its micro-batches."""
    common.write_run_config(cfg, env)
    model = build_policy(cfg, env, parallel, grad_reduce="sum")
    vision = data.vision.tokens if data.vision is not None else None
    rows = "packed" if cfg.batch.packing_samples else "padded"
    inputs = InputSpec(rows, vision=vision, sp=parallel.sp)
    return model, inputs, partial(collate_samples, vision=data.vision)


def sft_forward(model: nn.Module, batch: SFTBatch, device: torch.device, spec: InputSpec):
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    learned = batch.loss_mask.to(device)
    inputs = spec.build(ids, mask, images=batch.images)
    return label_logprobs(model, inputs, learned), learned


@torch.no_grad()
def sft_evaluate(
    model: nn.Module,
    batches: list[SFTBatch],
    device: torch.device,
    spec: InputSpec,
    parallel: ParallelLayout | None = None,
) -> dict[str, float]:
    """Token-mean NLL over every learned token of the eval set (a collective over
    ``parallel``'s data group; None: every rank), the forwards built by ``spec``."""
    data_group = parallel.data_group if parallel is not None else None
    model.eval()
    sums: dict[str, float | torch.Tensor] = {"nll": 0.0, "tokens": 0.0}
    for batch in batches:
        logprobs, learned = sft_forward(model, batch, device, spec)
        learned[batch.num_valid :] = False  # rows padding an uneven shard
        # on the device: one host copy below, not a synchronisation per batch
        sums["nll"] -= logprobs[learned].double().sum()
        sums["tokens"] += learned.sum()
    model.train()
    tot = all_reduce_scalars(to_host(sums), op="sum", group=data_group)
    return {"eval/loss": tot["nll"] / max(tot["tokens"], 1.0)}
