"""`fsdp-rlhf dpo`: direct preference optimization (DPO, IPO, cDPO) of a causal LM on FSDP2.

Table of contents, in call order (the loop is :func:`fsdp_rlhf.trainers.common.fit`, the step
bookkeeping :class:`fsdp_rlhf.trainers.offline.trainer.OfflineTrainer`)::

    prepare         check every pair, tokenize with prompt lengths (no communication)
    DPOTrainer      policy (full or LoRA) and frozen reference -> fully_shard -> AdamW
    update          reference log-probs of the step's pairs (no grad), then the policy's
                    forward/backward per micro-batch and one optimizer step
    evaluate        the same metrics on --eval_dataset
    finish          final evaluate, then the HF model (atomic export)

Chosen and rejected sequences of a micro-batch go through one forward; with
``--packing_samples`` (the default) each pair's common prefix (the prompt) runs once, as in
``train-rm``. Only response tokens (after the prompt) are scored. The reference is a separate
frozen model, or under ``--lora_rank`` the policy with its adapters disabled.
Metric names are TRL's and OpenRLHF's: ``rewards/chosen`` ... ``logps/rejected``.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from fsdp_rlhf.algorithms import preference_loss
from fsdp_rlhf.config import DPOConfig, OfflineBatchPlan
from fsdp_rlhf.data.preference import PairBatch, collate_pairs
from fsdp_rlhf.distributed.env import DistEnv, all_reduce_scalars
from fsdp_rlhf.distributed.fsdp import accumulate
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.offload import offload_model, onload_model
from fsdp_rlhf.distributed.stats import to_host
from fsdp_rlhf.models.inputs import InputSpec
from fsdp_rlhf.models.label_logprobs import sequence_logprobs
from fsdp_rlhf.models.lora import adapters_disabled
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.offline.data import prepare_dpo_data
from fsdp_rlhf.trainers.offline.models import build_policy, build_reference, pair_layout
from fsdp_rlhf.trainers.offline.trainer import OfflineTrainer, TrainData, prepare_command

log = logging.getLogger(__name__)

TRAIN_KEYS = ["loss", "rewards/accuracies", "rewards/margins", "lr", "grad_norm"]
PAIR_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
)


def main(cfg: DPOConfig, debug: bool = False) -> int:
    """Train a policy on preference pairs; returns the process exit code."""
    return common.launch(cfg, debug, prepare, DPOTrainer)


def prepare(cfg: DPOConfig, world_size: int) -> tuple[OfflineBatchPlan, TrainData]:
    return prepare_command("dpo", cfg, world_size, prepare_dpo_data)


def response_mask(batch: PairBatch) -> torch.Tensor:
    """(2B, L) bool: the tokens after each pair's prompt, on both sides."""
    cols = torch.arange(batch.input_ids.shape[1])
    starts = batch.prompt_lens.repeat(2)
    return (cols[None, :] >= starts[:, None]) & batch.attention_mask.bool()


def pair_logps(
    model: nn.Module, batch: PairBatch, device: torch.device, spec: InputSpec
) -> torch.Tensor:
    """(2B,) summed response log-probs, B chosen then B rejected (fp32); the forward built by
    ``spec`` (``models.inputs``)."""
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    learned = response_mask(batch).to(device)
    return sequence_logprobs(model, spec.build(ids, mask, images=batch.images), learned)


class DPOTrainer(OfflineTrainer):
    """The policy, its frozen reference, optimizer and schedule."""

    command = "dpo"
    model_name = "policy"
    train_keys = TRAIN_KEYS

    def __init__(
        self,
        cfg: DPOConfig,
        env: DistEnv,
        prepared: tuple[OfflineBatchPlan, TrainData],
        parallel: ParallelLayout,
    ):
        plan, data = prepared
        common.write_run_config(cfg, env)
        model = build_policy(cfg, env, parallel)
        self.ref = build_reference(cfg, env, parallel)
        if self.ref is not None and cfg.model.ref_offload:
            offload_model(self.ref, env.device)
        vision = data.vision.tokens if data.vision is not None else None
        rows = pair_layout(model, cfg.batch, data.model)
        self.inputs = InputSpec(rows, vision=vision, sp=parallel.sp)
        collate = partial(collate_pairs, vision=data.vision)
        super().__init__(
            cfg, env, plan, data, model, parallel, collate=collate, guard_name="policy"
        )

    @torch.no_grad()
    def reference_logps(self, batches: list[PairBatch]) -> list[torch.Tensor]:
        """(2B,) reference log-probs of every micro-batch of a step, in one go, so that an
        offloaded reference comes to the device once per step."""
        dev = self.env.device
        if self.ref is None:
            with adapters_disabled(self.model):
                return [self._logps(self.model, b) for b in batches]
        offloaded = self.cfg.model.ref_offload
        if offloaded:
            onload_model(self.ref, dev)
        try:
            return [self._logps(self.ref, b) for b in batches]
        finally:
            if offloaded:
                offload_model(self.ref, dev)

    def _logps(self, model: nn.Module, batch: PairBatch) -> torch.Tensor:
        return pair_logps(model, batch, self.env.device, self.inputs)

    def _pair_stats(
        self, logps: torch.Tensor, ref: torch.Tensor, batch: PairBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair loss (B,) and per-pair metrics, (B,) each."""
        B, loss_cfg = batch.num_pairs, self.cfg.loss
        chosen_tokens = response_mask(batch)[:B].sum(-1).to(logps.device)
        out = preference_loss(
            logps[:B],
            logps[B:],
            ref[:B],
            ref[B:],
            chosen_tokens,
            beta=loss_cfg.beta,
            ipo=loss_cfg.ipo,
            label_smoothing=loss_cfg.label_smoothing,
            nll_loss_coef=loss_cfg.nll_loss_coef,
        )
        c, r = out.chosen_rewards, out.rejected_rewards
        stats = {
            "loss": out.loss.detach(),
            "rewards/chosen": c,
            "rewards/rejected": r,
            "rewards/accuracies": (c > r).float(),
            "rewards/margins": c - r,
            "logps/chosen": logps[:B].detach(),
            "logps/rejected": logps[B:].detach(),
            "nll_loss": out.nll,
        }
        return out.loss, stats

    def update(self, batches: list[PairBatch]) -> dict[str, float]:
        """Reference log-probs, then forward/backward per micro-batch (each loss divided by
        their count: the update uses the step's mean), clip, optimizer and scheduler step."""
        refs = self.reference_logps(batches)
        sums: dict[str, float | torch.Tensor] = dict.fromkeys(PAIR_METRICS, 0.0)
        for i, (batch, ref) in enumerate(zip(batches, refs, strict=True)):
            accumulate(self.model, i == len(batches) - 1, self.cfg.fsdp.zero_stage, self.gathered)
            logps = self._logps(self.model, batch)
            loss, stats = self._pair_stats(logps, ref, batch)
            (loss.mean() / len(batches)).backward()
            # on the device: one host copy per step below, not one per metric and micro-batch
            for k, v in stats.items():
                sums[k] += v.double().mean() / len(batches)
        if not self.cfg.loss.nll_loss_coef:
            sums.pop("nll_loss")
        return {**to_host(sums), **self.optimizer_step()}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Pair means of every metric over the eval set (a collective), as ``eval/...``."""
        if self.data.eval is None:
            return None
        batches = self.eval_batches()
        refs = self.reference_logps(batches)
        self.model.eval()
        sums: dict[str, float | torch.Tensor] = dict.fromkeys(PAIR_METRICS, 0.0) | {"pairs": 0.0}
        for batch, ref in zip(batches, refs, strict=True):
            logps = self._logps(self.model, batch)
            _, stats = self._pair_stats(logps, ref, batch)
            n = batch.num_valid
            for k, v in stats.items():
                sums[k] += v[:n].double().sum()
            sums["pairs"] += n
        self.model.train()
        tot = all_reduce_scalars(to_host(sums), op="sum", group=self.parallel.data_group)
        return {f"eval/{k}": tot[k] / max(tot["pairs"], 1.0) for k in PAIR_METRICS}
