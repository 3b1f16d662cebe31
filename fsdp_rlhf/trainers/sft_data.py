"""Everything `sft` checks and prepares before the process group and the model exist (every
rank alike, no communication): flags, paths, every row of every source, tokenization."""

from __future__ import annotations

import logging
from functools import partial

from fsdp_rlhf.config import RMBatchPlan, SFTConfig
from fsdp_rlhf.data.sft import row_problem, tokenize_samples
from fsdp_rlhf.trainers.offline import TrainData, steps_per_epoch
from fsdp_rlhf.trainers.rm_data import check_paths, load_raw

log = logging.getLogger(__name__)


def prepare_sft_data(cfg: SFTConfig, plan: RMBatchPlan) -> TrainData:
    """Validate flags and every row, then tokenize train (and eval) samples once."""
    check_paths(cfg)
    d = cfg.data
    columns = {"--input_key": d.input_key}
    if d.output_key is not None:
        columns["--output_key"] = d.output_key
    train_raw, eval_raw, tokenizer = load_raw(cfg, columns, partial(row_problem, cfg=d))
    train, _ = tokenize_samples(train_raw, tokenizer, d, what="train")
    eval_samples = None
    if eval_raw is not None:
        eval_samples, _ = tokenize_samples(eval_raw, tokenizer, d, what="eval")
    n_eval = len(eval_samples) if eval_samples is not None else 0
    steps = steps_per_epoch(len(train), cfg, plan, n_eval, "samples")
    return TrainData(tokenizer, train, eval_samples, steps)
