"""Everything `sft` checks and prepares before the process group and the model exist (every
rank alike, no communication): flags, paths, every row of every source, tokenization."""

from __future__ import annotations

import logging
from functools import partial

from fsdp_rlhf.config import RMBatchPlan, SFTConfig
from fsdp_rlhf.data.prompts import check_chat_template
from fsdp_rlhf.data.sft import row_problem, tokenize_samples
from fsdp_rlhf.data.sources import load_sources
from fsdp_rlhf.models.load import load_tokenizer
from fsdp_rlhf.trainers.offline import TrainData, steps_per_epoch
from fsdp_rlhf.trainers.rm_data import check_paths

log = logging.getLogger(__name__)


def prepare_sft_data(cfg: SFTConfig, plan: RMBatchPlan) -> TrainData:
    """Validate flags and every row, then tokenize train (and eval) samples once."""
    check_paths(cfg)
    d = cfg.data
    columns = {"--input_key": d.input_key}
    if d.output_key is not None:
        columns["--output_key"] = d.output_key
    common = dict(
        max_samples=d.max_samples,
        seed=cfg.seed,
        columns=columns,
        check=partial(row_problem, cfg=d),
    )
    train_raw = load_sources(d.dataset, d.dataset_probs, flag_name="--dataset", **common)
    eval_raw = None
    if d.eval_dataset:
        eval_raw = load_sources(
            d.eval_dataset, None, flag_name="--eval_dataset", split="test", **common
        )
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.backend.trust_remote_code)
    if d.apply_chat_template:
        check_chat_template(tokenizer, cfg.model.pretrain)
    train, _ = tokenize_samples(train_raw, tokenizer, d, what="train")
    eval_samples = None
    if eval_raw is not None:
        eval_samples, _ = tokenize_samples(eval_raw, tokenizer, d, what="eval")
    n_eval = len(eval_samples) if eval_samples is not None else 0
    steps = steps_per_epoch(len(train), cfg, plan, n_eval, "samples")
    return TrainData(tokenizer, train, eval_samples, steps)
