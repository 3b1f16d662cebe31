"""Everything `train-rm` checks and prepares before the process group and the model exist.

Every rank runs this identically and without communication, so bad input (missing path,
malformed JSON, missing key, too little data) fails on all ranks with the same one-line error
before any collective could leave a rank waiting, and before any model is loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the GPU box runs without `datasets`
    import datasets

from fsdp_rlhf.config import RMBatchPlan, RMConfig
from fsdp_rlhf.data.preference import hold_out, tokenize_pairs
from fsdp_rlhf.data.prompts import check_chat_template
from fsdp_rlhf.data.sources import load_sources
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.compile import check_compile_toolchain
from fsdp_rlhf.models.load import check_model_path, load_tokenizer
from fsdp_rlhf.models.save import check_save_path, recover_interrupted_export

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RMData:
    """Tokenized train and eval pairs (columns ``chosen_ids``, ``rejected_ids``[, ``margin``])."""

    tokenizer: Any
    train: datasets.Dataset
    eval: datasets.Dataset
    steps_per_epoch: int


def _columns(cfg: RMConfig) -> dict[str, str]:
    """Flag -> dataset column this run reads."""
    d = cfg.data
    cols = {"--chosen_key": d.chosen_key, "--rejected_key": d.rejected_key}
    if d.prompt_key is not None:
        cols["--prompt_key"] = d.prompt_key
    if d.margin_key is not None:
        cols["--margin_key"] = d.margin_key
    return cols


def check_paths(cfg: RMConfig) -> None:
    """Cheap checks of paths given by flags."""
    check_model_path(cfg.model.pretrain, "--pretrain")
    if cfg.backend.torch_compile:
        check_compile_toolchain()
    if not cfg.ckpt.save_path:
        raise UserError("--save_path is required")
    if Path(cfg.ckpt.save_path).is_file():
        raise UserError(f"--save_path {cfg.ckpt.save_path}: is a file, expected a folder")
    # The final export renames into save_path: fail now, not after training, if it cannot.
    check_save_path(cfg.ckpt.save_path, other_paths={"--pretrain": cfg.model.pretrain})
    if os.environ.get("RANK", "0") == "0":  # before any rank looks for checkpoints
        recover_interrupted_export(cfg.ckpt.save_path)
    d = cfg.data
    if d.input_template is not None and "{}" not in d.input_template:
        raise UserError(f"--input_template {d.input_template!r}: must contain {{}} for the prompt")


def prepare_rm_data(cfg: RMConfig, plan: RMBatchPlan) -> RMData:
    """Validate flags and data, then tokenize train and eval pairs once.

    The eval set is ``--eval_dataset`` or, without it, pairs held out from the training data
    (1%, at least 8); its rewards also give the mean/std written next to the model.
    """
    check_paths(cfg)
    d = cfg.data
    columns = _columns(cfg)
    common = dict(max_samples=d.max_samples, seed=cfg.seed, columns=columns)
    train_raw = load_sources(d.dataset, d.dataset_probs, flag_name="--dataset", **common)
    eval_raw = None
    if d.eval_dataset:
        eval_raw = load_sources(
            d.eval_dataset, None, flag_name="--eval_dataset", split="test", **common
        )
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.backend.trust_remote_code)
    if d.apply_chat_template:
        check_chat_template(tokenizer, cfg.model.pretrain)
    train, _ = tokenize_pairs(train_raw, tokenizer, d, what="train")
    if eval_raw is None:
        train, eval_pairs = hold_out(train, cfg.seed)
        log.info("eval set: %d pairs held out from the training data", len(eval_pairs))
    else:
        eval_pairs, _ = tokenize_pairs(eval_raw, tokenizer, d, what="eval")
    if len(eval_pairs) == 0:
        raise UserError("the eval set is empty (after dropping identical pairs)")
    steps_per_epoch = len(train) // cfg.batch.train_batch_size
    if steps_per_epoch == 0:
        raise UserError(
            f"only {len(train)} training pairs (after dropping identical pairs and holding out "
            f"the eval set), fewer than --train_batch_size {cfg.batch.train_batch_size}"
        )
    log.info(
        "data: %d train pairs, %d eval pairs; %d steps/epoch x %d epochs; %d pairs per rank "
        "per step in %d micro-batches of %d",
        len(train),
        len(eval_pairs),
        steps_per_epoch,
        cfg.batch.max_epochs,
        plan.batch_size_per_rank,
        plan.grad_accum_steps,
        plan.micro_batch_size_per_rank,
    )
    return RMData(tokenizer, train, eval_pairs, steps_per_epoch)
