"""`fsdp-rlhf train-rm`: pairwise (Bradley-Terry) reward-model training on FSDP2.

Table of contents, in call order (the loop itself is :func:`fsdp_rlhf.trainers.common.fit`,
the step bookkeeping :class:`fsdp_rlhf.trainers.offline.trainer.OfflineTrainer`)::

    prepare         validate and tokenize (no communication), before the process group
    RMTrainer       model -> fully_shard -> AdamW + schedule -> resume from a checkpoint
    update          one optimizer step (then the base logs, evaluates every eval_steps)
    finish          final evaluate, then the HF model with reward mean/std in config.json

Chosen and rejected sequences go through one forward as a (2B, L) batch. Every collective
(FSDP forward/backward, metric reductions, the stop vote) is reached by every rank in the
same order: branch conditions depend only on the step counter and agreed values.
"""

from __future__ import annotations

import logging
from functools import partial

from fsdp_rlhf.config import OfflineBatchPlan, RMConfig
from fsdp_rlhf.data.preference import PairBatch, collate_pairs
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.models.inputs import InputSpec
from fsdp_rlhf.models.save import save_model
from fsdp_rlhf.trainers import common
from fsdp_rlhf.trainers.offline.data import prepare_rm_data
from fsdp_rlhf.trainers.offline.models import build_reward_model, pair_layout
from fsdp_rlhf.trainers.offline.rm_steps import evaluate, train_step
from fsdp_rlhf.trainers.offline.trainer import OfflineTrainer, TrainData, prepare_command

log = logging.getLogger(__name__)

TRAIN_KEYS = ["loss", "acc", "chosen_reward", "reject_reward", "margin", "lr", "grad_norm"]


def main(cfg: RMConfig, debug: bool = False) -> int:
    """Train a reward model; returns the process exit code (0, also after a graceful stop)."""
    return common.launch(cfg, debug, prepare, RMTrainer)


def prepare(cfg: RMConfig, world_size: int) -> tuple[OfflineBatchPlan, TrainData]:
    return prepare_command("train-rm", cfg, world_size, prepare_rm_data)


class RMTrainer(OfflineTrainer):
    """One reward model, its optimizer and schedule; ``step`` counts finished optimizer steps."""

    command = "train-rm"
    model_name = "rm"
    train_keys = TRAIN_KEYS

    def __init__(
        self,
        cfg: RMConfig,
        env: DistEnv,
        prepared: tuple[OfflineBatchPlan, TrainData],
        parallel: ParallelLayout,
    ):
        plan, data = prepared
        common.write_run_config(cfg, env)
        model = build_reward_model(cfg, env, data.tokenizer.pad_token_id, parallel)
        # a VLM's pairs: padded or packed, with images
        rows = pair_layout(model, cfg.batch, data.model)
        self.inputs = InputSpec(rows, vision=data.model.vision, sp=parallel.sp)
        collate = partial(collate_pairs, vision=data.vision)
        super().__init__(
            cfg, env, plan, data, model, parallel, collate=collate, guard_name="reward model"
        )

    def update(self, batches: list[PairBatch]) -> dict[str, float]:
        return train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batches,
            self.cfg,
            self.env.device,
            self.guard,
            self.step,
            self.inputs,
            self.gathered,
        )

    def evaluate(self) -> dict[str, float]:
        return evaluate(
            self.model, self.eval_batches(), self.cfg, self.env.device, self.inputs, self.parallel
        )

    def finish(self) -> None:
        """Final eval, then the HF model (atomically) with the eval reward mean/std.

        ``normalize_reward`` is deliberately not written: whether to normalise is the PPO
        run's choice (``--normalize_reward``), made with the mean/std stored here.
        """
        stats = self.evaluate()
        self.metrics.log(self.step, stats)
        extra = {"reward_mean": stats["eval/reward_mean"], "reward_std": stats["eval/reward_std"]}
        path = self.export(self.cfg.ckpt.save_path, extra)
        if self.cfg.lora.enabled and not self.cfg.lora.merge_lora:
            log.warning(
                "%s holds the LoRA adapter only (adapter/); ppo --reward_pretrain needs a full "
                "model: train with --merge_lora",
                path,
            )
        log.info(
            "reward model saved to %s (reward_mean=%.4g, reward_std=%.4g)",
            path,
            extra["reward_mean"],
            extra["reward_std"],
        )

    def export(self, path, extra: dict | None = None):
        """The HF reward model (collective): the final one, or a checkpoint's with
        --save_hf_ckpt (no eval statistics there: they come from the final evaluation)."""
        return save_model(
            self.model,
            self.data.saved_processor,  # a VLM's processor: the folder loads its images
            path,
            self.cfg.lora,
            base_path=self.cfg.model.pretrain,
            head="score",
            # OpenRLHF's loaders look the head up under this name; ours is always `score`.
            extra_config={**(extra or {}), "value_head_prefix": "score"},
        )
