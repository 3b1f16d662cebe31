"""`fsdp-rlhf sft`: supervised fine-tuning of a causal LM on FSDP2.

Table of contents, in call order (the loop is :func:`fsdp_rlhf.trainers.common.fit`, the step
bookkeeping :class:`fsdp_rlhf.trainers.offline.trainer.OfflineTrainer`)::

    prepare         check every row, tokenize with the mask of learned tokens (no communication)
    SFTTrainer      policy (full or LoRA) -> fully_shard -> AdamW + schedule -> resume
    update          one optimizer step: token-mean NLL over the whole global batch
    evaluate        eval loss (with --eval_dataset)
    finish          final evaluate, then the HF model (atomic export)

The loss is the mean negative log-likelihood over every learned token of the global batch
(all ranks, all micro-batches): each micro-batch's NLL sum is divided by that global count and
gradients are summed over ranks, so a long sample weighs by its tokens whatever rank and
micro-batch it lands in.
"""

from __future__ import annotations

import logging

import torch

from fsdp_rlhf.config import OfflineBatchPlan, SFTConfig
from fsdp_rlhf.data.sft import SFTBatch
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.fsdp import accumulate
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.stats import global_token_count, to_host
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.offline.data import prepare_sft_data
from fsdp_rlhf.trainers.offline.sft_steps import build_sft_policy, sft_evaluate, sft_forward
from fsdp_rlhf.trainers.offline.trainer import OfflineTrainer, TrainData, prepare_command

log = logging.getLogger(__name__)

TRAIN_KEYS = ["loss", "tokens", "lr", "grad_norm"]


def main(cfg: SFTConfig, debug: bool = False) -> int:
    """Fine-tune a causal LM; returns the process exit code (0, also after a graceful stop)."""
    return common.launch(cfg, debug, prepare, SFTTrainer)


def prepare(cfg: SFTConfig, world_size: int) -> tuple[OfflineBatchPlan, TrainData]:
    return prepare_command("sft", cfg, world_size, prepare_sft_data)


class SFTTrainer(OfflineTrainer):
    """One causal LM, its optimizer and schedule; ``step`` counts finished optimizer steps."""

    command = "sft"
    model_name = "policy"
    train_keys = TRAIN_KEYS

    def __init__(
        self,
        cfg: SFTConfig,
        env: DistEnv,
        prepared: tuple[OfflineBatchPlan, TrainData],
        parallel: ParallelLayout,
    ):
        plan, data = prepared
        model, self.inputs, collate = build_sft_policy(cfg, env, data, parallel)
        super().__init__(
            cfg, env, plan, data, model, parallel, collate=collate, guard_name="policy"
        )

    def update(self, batches: list[SFTBatch]) -> dict[str, float]:
        """Forward/backward over this rank's micro-batches, then the optimizer step.

        The model sums gradients over ranks (``grad_reduce="sum"``). Returns this rank's share
        of the global token-mean ``loss`` (its mean over ranks is the global mean), its learned
        ``tokens``, the global ``grad_norm`` and the ``lr`` this step used. (The ranks of a
        sequence-parallel group hold the same rows: the shares are per data-parallel rank.)
        """
        masks = [b.loss_mask for b in batches]
        n_global = global_token_count(masks, self.parallel.data_group)  # one all-reduce
        nll: float | torch.Tensor = 0.0
        for i, batch in enumerate(batches):
            accumulate(self.model, i == len(batches) - 1, self.cfg.fsdp.zero_stage, self.gathered)
            logprobs, _ = sft_forward(self.model, batch, self.env.device, self.inputs)
            loss = -logprobs.sum() / n_global
            loss.backward()
            nll += loss.detach().double()  # on the device: one host copy per step
        tokens = float(sum(int(b.loss_mask.sum()) for b in batches))  # host masks: no copy
        share = to_host({"loss": nll})["loss"]
        stats = {"loss": share * self.parallel.dp_size, "tokens": tokens}
        return {**stats, **self.optimizer_step()}

    def evaluate(self) -> dict[str, float] | None:
        if self.data.eval is None:
            return None
        return sft_evaluate(
            self.model, self.eval_batches(), self.env.device, self.inputs, self.parallel
        )
