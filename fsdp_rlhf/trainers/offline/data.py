"""Everything `train-rm`, `sft` and `dpo` check and prepare before the process group and the
models exist: flags, paths, every row of every source, tokenization.

Every rank runs this identically and without communication, so bad input (missing path,
malformed JSON, missing key, too little data) fails on all ranks with the same one-line error
before any collective could leave a rank waiting, and before any model is loaded.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the GPU box runs without `datasets`
    import datasets

from fsdp_rlhf.config import DPOConfig, OfflineBatchPlan, RMConfig, SFTConfig
from fsdp_rlhf.data.preference import hold_out, tokenize_pairs
from fsdp_rlhf.data.prompts import check_chat_template
from fsdp_rlhf.data.sft import row_problem, tokenize_samples
from fsdp_rlhf.data.sources import RowCheck, load_sources
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.compile import check_compile_toolchain
from fsdp_rlhf.models.kind import ModelKind
from fsdp_rlhf.models.load import check_model_path, load_tokenizer
from fsdp_rlhf.models.save import check_save_path, recover_interrupted_export
from fsdp_rlhf.trainers.offline.trainer import TrainData, steps_per_epoch

log = logging.getLogger(__name__)


def pair_columns(cfg: RMConfig | DPOConfig) -> dict[str, str]:
    """Flag -> dataset column this run reads."""
    d = cfg.data
    cols = {"--chosen_key": d.chosen_key, "--rejected_key": d.rejected_key}
    if d.prompt_key is not None:
        cols["--prompt_key"] = d.prompt_key
    if d.margin_key is not None:
        cols["--margin_key"] = d.margin_key
    return cols


def check_paths(cfg: RMConfig | SFTConfig | DPOConfig) -> None:
    """Cheap checks of the paths the three commands' flags name (same sections)."""
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


def vision_processor(cfg: RMConfig | SFTConfig | DPOConfig, model: ModelKind):
    """A VLM's processor (None for a text model; ``model``: ``--pretrain``'s kind)."""
    from fsdp_rlhf.data.vision import VisionProcessor

    path, trust = cfg.model.pretrain, cfg.backend.trust_remote_code
    if not model.is_vlm:
        return None
    vision = VisionProcessor.from_pretrained(path, trust)
    if cfg.data.tokenizer_chat_template is not None:
        vision.processor.chat_template = cfg.data.tokenizer_chat_template
    return vision


def with_images(
    check: RowCheck | None, cfg: RMConfig | SFTConfig | DPOConfig, prompt_key: str | None, vlm: bool
) -> RowCheck:
    """``check`` plus each row's images against the placeholders of its ``prompt_key``
    messages (a text model: no images at all)."""
    from fsdp_rlhf.data.images import image_problem

    v = cfg.vision

    def both(row: dict) -> str | None:
        problem = check(row) if check is not None else None
        if problem or prompt_key is None:
            return problem
        return image_problem(
            row.get(prompt_key),
            row.get(v.image_key),
            v.image_key,
            v.max_images_per_prompt,
            text_only=not vlm,
        )

    return both


def load_raw(
    cfg: RMConfig | SFTConfig | DPOConfig,
    columns: dict[str, str],
    check: RowCheck | None = None,
    vision=None,
    optional: tuple[str, ...] = (),
) -> tuple[datasets.Dataset, datasets.Dataset | None, Any]:
    """The raw train rows (sources mixed by ``--dataset_probs``), the raw eval rows of
    ``--eval_dataset`` (None without it) and the tokenizer, chat template checked; every
    source is checked for ``columns`` (flag -> key) and, with ``check``, row by row. A VLM's
    tokenizer (``vision``) renders with the processor's chat template when it has none."""
    d = cfg.data
    common = dict(
        max_samples=d.max_samples,
        seed=cfg.seed,
        columns=columns,
        check=check,
        optional_columns=optional,
    )
    train_raw = load_sources(
        d.dataset, d.dataset_probs, flag_name="--dataset", split=d.dataset_split, **common
    )
    eval_raw = None
    if d.eval_dataset:
        eval_raw = load_sources(
            d.eval_dataset, None, flag_name="--eval_dataset", split=d.eval_split, **common
        )
    tokenizer = load_tokenizer(cfg.model.pretrain, cfg.backend, d.tokenizer_chat_template)
    if vision is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = vision.chat_template
    if d.apply_chat_template:
        check_chat_template(tokenizer, cfg.model.pretrain)
    return train_raw, eval_raw, tokenizer


def prepare_rm_data(
    cfg: RMConfig, plan: OfflineBatchPlan, kinds: dict[str, ModelKind]
) -> TrainData:
    """Validate flags and data, then tokenize train and eval pairs once (columns
    ``chosen_ids``, ``rejected_ids``[, ``margin``]).

    The eval set is ``--eval_dataset`` or, without it, pairs held out from the training data
    (1%, at least 8); its rewards also give the mean/std written next to the model.
    """
    check_paths(cfg)
    d = cfg.data
    vision = vision_processor(cfg, kinds["--pretrain"])  # a VLM: the head on its LM
    # a pair's images belong to its prompt (or, without one, to the chosen conversation)
    check = with_images(None, cfg, d.prompt_key or d.chosen_key, vision is not None)
    optional = (cfg.vision.image_key,)
    train_raw, eval_raw, tokenizer = load_raw(cfg, pair_columns(cfg), check, vision, optional)
    images = dict(vision=vision, image_key=cfg.vision.image_key)
    train, _ = tokenize_pairs(train_raw, tokenizer, d, what="train", **images)
    if eval_raw is None:
        train, eval_pairs = hold_out(train, cfg.seed)
        log.info("eval set: %d pairs held out from the training data", len(eval_pairs))
    else:
        eval_pairs, _ = tokenize_pairs(eval_raw, tokenizer, d, what="eval", **images)
    if len(eval_pairs) == 0:
        raise UserError("the eval set is empty (after dropping identical pairs)")
    steps = steps_per_epoch(len(train), cfg, plan, len(eval_pairs), "pairs")
    return TrainData(tokenizer, train, eval_pairs, steps, vision, kinds)


def prepare_sft_data(
    cfg: SFTConfig, plan: OfflineBatchPlan, kinds: dict[str, ModelKind]
) -> TrainData:
    """Validate flags and every row, then tokenize train (and eval) samples once."""
    check_paths(cfg)
    d = cfg.data
    vision = vision_processor(cfg, kinds["--pretrain"])
    columns = {"--input_key": d.input_key}
    if d.output_key is not None:
        columns["--output_key"] = d.output_key
    check = with_images(partial(row_problem, cfg=d), cfg, d.input_key, vision is not None)
    train_raw, eval_raw, tokenizer = load_raw(
        cfg, columns, check, vision, optional=(cfg.vision.image_key,)
    )
    images = dict(vision=vision, image_key=cfg.vision.image_key)
    train, _ = tokenize_samples(train_raw, tokenizer, d, what="train", **images)
    eval_samples = None
    if eval_raw is not None:
        eval_samples, _ = tokenize_samples(eval_raw, tokenizer, d, what="eval", **images)
    n_eval = len(eval_samples) if eval_samples is not None else 0
    steps = steps_per_epoch(len(train), cfg, plan, n_eval, "samples")
    return TrainData(tokenizer, train, eval_samples, steps, vision, kinds)


def pair_problem(row: dict, chosen_key: str, rejected_key: str) -> str | None:
    """Why one raw pair cannot be trained on (empty side, identical sides), or None."""
    chosen, rejected = row[chosen_key], row[rejected_key]
    for key, value in ((chosen_key, chosen), (rejected_key, rejected)):
        if value is None or (isinstance(value, str | list) and not value):
            return f"{key!r} is empty"
    if chosen == rejected:
        return f"{chosen_key!r} and {rejected_key!r} are identical (the pair prefers nothing)"
    return None


def prepare_dpo_data(
    cfg: DPOConfig, plan: OfflineBatchPlan, kinds: dict[str, ModelKind]
) -> TrainData:
    """Validate flags and every pair, then tokenize train (and eval) pairs once, with each
    pair's prompt length."""
    check_paths(cfg)
    d = cfg.data
    vision = vision_processor(cfg, kinds["--pretrain"])

    def pair_check(row: dict) -> str | None:
        return pair_problem(row, d.chosen_key, d.rejected_key)

    # a pair's images belong to its prompt (or, without one, to the chosen conversation)
    check = with_images(pair_check, cfg, d.prompt_key or d.chosen_key, vision is not None)
    optional = (cfg.vision.image_key,)
    train_raw, eval_raw, tokenizer = load_raw(cfg, pair_columns(cfg), check, vision, optional)
    tokenize = partial(
        tokenize_pairs,
        tokenizer=tokenizer,
        cfg=d,
        with_prompt_len=True,
        vision=vision,
        image_key=cfg.vision.image_key,
        template_ends_turns=True,  # as sft: no EOS after a chat template's end of turn
    )
    train, _ = tokenize(train_raw, what="train")
    eval_pairs = None
    if eval_raw is not None:
        eval_pairs, _ = tokenize(eval_raw, what="eval")
        if len(eval_pairs) == 0:
            raise UserError("--eval_dataset: no pair left after truncation to --max_len")
    n_eval = len(eval_pairs) if eval_pairs is not None else 0
    steps = steps_per_epoch(len(train), cfg, plan, n_eval, "pairs")
    return TrainData(tokenizer, train, eval_pairs, steps, vision, kinds)
