"""Everything `dpo` checks and prepares before the process group and the models exist (every
rank alike, no communication): flags, paths, every pair of every source, tokenization with
each pair's prompt length."""

from __future__ import annotations

import logging

from fsdp_rlhf.config import DPOConfig, RMBatchPlan
from fsdp_rlhf.data.preference import tokenize_pairs
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.load import check_model_path
from fsdp_rlhf.trainers.offline import TrainData, steps_per_epoch
from fsdp_rlhf.trainers.rm_data import check_paths, load_raw, pair_columns

log = logging.getLogger(__name__)


def pair_problem(row: dict, chosen_key: str, rejected_key: str) -> str | None:
    """Why one raw pair cannot be trained on (empty side, identical sides), or None."""
    chosen, rejected = row[chosen_key], row[rejected_key]
    for key, value in ((chosen_key, chosen), (rejected_key, rejected)):
        if value is None or (isinstance(value, str | list) and not value):
            return f"{key!r} is empty"
    if chosen == rejected:
        return f"{chosen_key!r} and {rejected_key!r} are identical (the pair prefers nothing)"
    return None


def prepare_dpo_data(cfg: DPOConfig, plan: RMBatchPlan) -> TrainData:
    """Validate flags and every pair, then tokenize train (and eval) pairs once."""
    check_paths(cfg)
    if cfg.model.ref_pretrain:
        check_model_path(cfg.model.ref_pretrain, "--ref_pretrain")
    d = cfg.data

    def check(row: dict) -> str | None:
        return pair_problem(row, d.chosen_key, d.rejected_key)

    train_raw, eval_raw, tokenizer = load_raw(cfg, pair_columns(cfg), check)
    train, _ = tokenize_pairs(train_raw, tokenizer, d, what="train", with_prompt_len=True)
    eval_pairs = None
    if eval_raw is not None:
        eval_pairs, _ = tokenize_pairs(eval_raw, tokenizer, d, what="eval", with_prompt_len=True)
        if len(eval_pairs) == 0:
            raise UserError("--eval_dataset: no pair left after truncation to --max_len")
    n_eval = len(eval_pairs) if eval_pairs is not None else 0
    steps = steps_per_epoch(len(train), cfg, plan, n_eval, "pairs")
    return TrainData(tokenizer, train, eval_pairs, steps)
