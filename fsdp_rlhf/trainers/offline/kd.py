"""`fsdp-rlhf kd`: offline knowledge distillation (OpenRLHF's ``train_kd``) on FSDP2.

SFT's data and step with a frozen teacher beside the student: on each learned token of the
dataset's responses the loss is ``(1 - kd_coef) * NLL + kd_coef * KL(teacher || student)``
over the vocabulary (Hinton et al. 2015; docs/distillation.md). Table of contents, in call
order (the loop is :func:`fsdp_rlhf.trainers.common.fit`)::

    prepare         SFT's checks and tokenization, the teacher's context against --max_len
                    (the rules table compares the two tokenizers)
    KDTrainer       SFT's student, and the teacher sharded like DPO's reference
    update          per micro-batch: the teacher's final hidden states at the learned
                    positions (no grad), then the student's forward and backward, where both
                    models' logits are made a chunk of positions at a time, never whole
    evaluate        SFT's eval loss (the NLL)
    finish          final evaluate, then the HF model (atomic export)

Both models score the same token ids, rendered once with the student's template; they share
a tokenizer, and the KL runs over its ids (two checkpoints of one tokenizer may pad their
embeddings to different sizes). OpenRLHF logs the cross-entropy ``-sum p_T log p_S`` as its
distillation loss: the KL plus the teacher's entropy (the same gradient).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from fsdp_rlhf.algorithms import kd_loss
from fsdp_rlhf.config import KDConfig, OfflineBatchPlan
from fsdp_rlhf.data.sft import SFTBatch
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.fsdp import accumulate
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.offload import offload_model, onload_model
from fsdp_rlhf.distributed.stats import global_token_count, to_host
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.forward import head_inputs_at, kd_at
from fsdp_rlhf.models.inputs import ForwardInputs
from fsdp_rlhf.models.load import load_causal_lm, text_config
from fsdp_rlhf.models.vision import prepare_policy
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.common import load_and_prepare
from fsdp_rlhf.trainers.offline.data import prepare_sft_data
from fsdp_rlhf.trainers.offline.sft_steps import build_sft_policy, sft_evaluate
from fsdp_rlhf.trainers.offline.trainer import OfflineTrainer, TrainData, prepare_command

log = logging.getLogger(__name__)

TRAIN_KEYS = ["loss", "nll", "forward_kl", "lr", "grad_norm"]


def main(cfg: KDConfig, debug: bool = False) -> int:
    """Distil a teacher into a student on a dataset; returns the process exit code."""
    return common.launch(cfg, debug, prepare, KDTrainer)


def prepare(cfg: KDConfig, world_size: int) -> tuple[OfflineBatchPlan, TrainData]:
    if not cfg.model.teacher_pretrain:
        raise UserError("--teacher_pretrain is required (OpenRLHF's --teacher_model)")
    plan, data = prepare_command("kd", cfg, world_size, prepare_sft_data)
    trust = cfg.backend.trust_remote_code
    teacher = text_config(cfg.model.teacher_pretrain, trust)
    context = getattr(teacher, "max_position_embeddings", None)
    if context and cfg.data.max_len > context:
        raise UserError(
            f"--teacher_pretrain {cfg.model.teacher_pretrain}: its context is {context} tokens "
            f"(max_position_embeddings), less than --max_len {cfg.data.max_len}; lower --max_len "
            "or use a teacher with a longer context"
        )
    return plan, data


def shared_vocab(cfg: KDConfig, tokenizer) -> int:
    """The token ids both models are scored over: the tokenizer's, within both embeddings."""
    trust = cfg.backend.trust_remote_code
    sizes = [len(tokenizer)]
    for path in (cfg.model.pretrain, cfg.model.teacher_pretrain):
        size = getattr(text_config(path, trust), "vocab_size", None)
        sizes += [size] if size else []
    return min(sizes)


def build_teacher(cfg: KDConfig, env: DistEnv, parallel: ParallelLayout) -> nn.Module:
    """The frozen teacher, sharded over the ranks (bf16 under --bf16), never adapted by LoRA."""
    backend = dataclasses.replace(cfg.backend, gradient_checkpointing=False)
    dtype = torch.bfloat16 if backend.bf16 else torch.float32

    def load(weights: bool) -> nn.Module:
        model = load_causal_lm(
            cfg.model.teacher_pretrain, backend, env.device, dtype, weights=weights
        )
        prepare_policy(model)
        return model

    return load_and_prepare(
        load,
        env,
        cfg.fsdp,
        backend,
        parallel=parallel,
        what="--teacher_pretrain",
        packed=cfg.batch.packing_samples,
        trainable=False,
    )


class KDTrainer(OfflineTrainer):
    """SFT's student, optimizer and schedule, and a frozen teacher."""

    command = "kd"
    model_name = "policy"
    train_keys = TRAIN_KEYS

    def __init__(
        self,
        cfg: KDConfig,
        env: DistEnv,
        prepared: tuple[OfflineBatchPlan, TrainData],
        parallel: ParallelLayout,
    ):
        plan, data = prepared
        model, self.inputs, collate = build_sft_policy(cfg, env, data, parallel)
        super().__init__(
            cfg, env, plan, data, model, parallel, collate=collate, guard_name="policy"
        )
        self.teacher = build_teacher(cfg, env, parallel)
        if cfg.model.teacher_offload:
            offload_model(self.teacher, env.device)
        self.vocab = shared_vocab(cfg, self.data.tokenizer)
        log.info("kd: kd_coef %g over %d token ids", cfg.loss.kd_coef, self.vocab)

    def _positions(self, batch: SFTBatch) -> tuple[ForwardInputs, torch.Tensor, torch.Tensor]:
        """The micro-batch's forward, and the model-row position predicting each learned token
        (row-major) with that token."""
        dev = self.env.device
        ids, mask = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        learned = batch.loss_mask.to(dev).bool() & mask.bool()
        learned[:, 0] = False  # nothing predicts a row's first token
        inputs = self.inputs.build(ids, mask, images=batch.images)
        rows, cols = learned.nonzero(as_tuple=True)
        return inputs, inputs.where[rows, cols - 1], ids[rows, cols]

    def update(self, batches: list[SFTBatch]) -> dict[str, float]:
        """Per micro-batch the teacher's side, then the student's forward and backward; one
        optimizer step. ``loss`` is this rank's share of the global token mean (as SFT's),
        ``nll`` and ``forward_kl`` this rank's token means."""
        masks = [b.loss_mask for b in batches]
        n_global = global_token_count(masks, self.parallel.data_group)  # one all-reduce
        coef, dev = self.cfg.loss.kd_coef, self.env.device
        sums: dict[str, float | torch.Tensor] = {"loss": 0.0, "nll": 0.0, "kl": 0.0, "n": 0.0}
        onload_model(self.teacher, dev)
        try:
            for i, batch in enumerate(batches):
                inputs, index, labels = self._positions(batch)
                teacher = head_inputs_at(self.teacher, inputs, index, self.vocab)
                accumulate(
                    self.model, i == len(batches) - 1, self.cfg.fsdp.zero_stage, self.gathered
                )
                logp, kl = kd_at(self.model, inputs, index, labels, teacher, self.vocab)
                loss = kd_loss(logp, kl, coef, n_global)
                loss.backward()
                del teacher
                sums["loss"] += loss.detach().double()
                sums["nll"] -= logp.detach().double().sum()
                sums["kl"] += kl.detach().double().sum()
                sums["n"] += float(labels.numel())
        finally:
            if self.cfg.model.teacher_offload:
                offload_model(self.teacher, dev)
        host = to_host(sums)
        n = max(host["n"], 1.0)
        stats = {
            "loss": host["loss"] * self.parallel.dp_size,
            "nll": host["nll"] / n,
            "forward_kl": host["kl"] / n,
            "tokens": host["n"],
        }
        return {**stats, **self.optimizer_step()}

    def evaluate(self) -> dict[str, float] | None:
        """SFT's eval loss: the student's NLL over the eval set's learned tokens."""
        if self.data.eval is None:
            return None
        return sft_evaluate(
            self.model, self.eval_batches(), self.env.device, self.inputs, self.parallel
        )
