"""Everything `train-rm` checks and prepares before the process group and the model exist.

Every rank runs this identically and without communication, so bad input (missing path,
malformed JSON, missing key, too little data) fails on all ranks with the same one-line error
before any collective could leave a rank waiting, and before any model is loaded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the GPU box runs without `datasets`
    import datasets

from fsdp_rlhf.config import RMBatchPlan, RMConfig
from fsdp_rlhf.data.preference import hold_out, tokenize_pairs
from fsdp_rlhf.data.prompts import check_chat_template
from fsdp_rlhf.data.sources import RowCheck, load_sources
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.compile import check_compile_toolchain
from fsdp_rlhf.models.load import check_model_path, load_tokenizer
from fsdp_rlhf.models.save import check_save_path, recover_interrupted_export
from fsdp_rlhf.trainers.offline import TrainData, steps_per_epoch

log = logging.getLogger(__name__)


# Tokenized train and eval pairs (columns ``chosen_ids``, ``rejected_ids``[, ``margin``]).
RMData = TrainData


def pair_columns(cfg: RMConfig) -> dict[str, str]:
    """Flag -> dataset column this run reads."""
    d = cfg.data
    cols = {"--chosen_key": d.chosen_key, "--rejected_key": d.rejected_key}
    if d.prompt_key is not None:
        cols["--prompt_key"] = d.prompt_key
    if d.margin_key is not None:
        cols["--margin_key"] = d.margin_key
    return cols


def check_paths(cfg: RMConfig) -> None:
    """Cheap checks of paths given by flags (also of `sft` and `dpo`: same sections)."""
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


def load_raw(
    cfg: RMConfig, columns: dict[str, str], check: RowCheck | None = None
) -> tuple[datasets.Dataset, datasets.Dataset | None, Any]:
    """The raw train rows (sources mixed by ``--dataset_probs``), the raw eval rows of
    ``--eval_dataset`` (None without it) and the tokenizer, chat template checked; every
    source is checked for ``columns`` (flag -> key) and, with ``check``, row by row.
    Shared by train-rm, sft and dpo (same data flags)."""
    d = cfg.data
    common = dict(max_samples=d.max_samples, seed=cfg.seed, columns=columns, check=check)
    train_raw = load_sources(
        d.dataset, d.dataset_probs, flag_name="--dataset", split=d.dataset_split, **common
    )
    eval_raw = None
    if d.eval_dataset:
        eval_raw = load_sources(
            d.eval_dataset, None, flag_name="--eval_dataset", split=d.eval_split, **common
        )
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.backend, d.tokenizer_chat_template)
    if d.apply_chat_template:
        check_chat_template(tokenizer, cfg.model.pretrain)
    return train_raw, eval_raw, tokenizer


def prepare_rm_data(cfg: RMConfig, plan: RMBatchPlan) -> RMData:
    """Validate flags and data, then tokenize train and eval pairs once.

    The eval set is ``--eval_dataset`` or, without it, pairs held out from the training data
    (1%, at least 8); its rewards also give the mean/std written next to the model.
    """
    check_paths(cfg)
    d = cfg.data
    train_raw, eval_raw, tokenizer = load_raw(cfg, pair_columns(cfg))
    train, _ = tokenize_pairs(train_raw, tokenizer, d, what="train")
    if eval_raw is None:
        train, eval_pairs = hold_out(train, cfg.seed)
        log.info("eval set: %d pairs held out from the training data", len(eval_pairs))
    else:
        eval_pairs, _ = tokenize_pairs(eval_raw, tokenizer, d, what="eval")
    if len(eval_pairs) == 0:
        raise UserError("the eval set is empty (after dropping identical pairs)")
    steps = steps_per_epoch(len(train), cfg, plan, len(eval_pairs), "pairs")
    return RMData(tokenizer, train, eval_pairs, steps)
