"""TRL ``SFTTrainer`` or ``DPOTrainer`` on the benchmark model and data; run under torchrun by
scripts/benchkit/offline.py.

Usage: ``torchrun --nproc_per_node N scripts/benchkit/trl_offline_worker.py '<json settings>'``,
with ``kind`` ``sft`` or ``dpo``. Settings are the ones ours gets (batch, micro-batch, steps,
precision, max length, seed); everything else is TRL's default, except gradient checkpointing,
which is off as in ours (TRL turns it on by default). Rank 0 appends one line per optimizer
step to ``<out>/steps.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts.benchkit.trl_rm_worker import step_logger, trainer_args
from scripts.benchkit.worker_exit import exit_after_training


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from datasets import load_dataset

    if cfg["kind"] == "sft":
        from trl import SFTConfig as Config
        from trl import SFTTrainer as Trainer
    else:
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer

    out = Path(cfg["out"])
    args = Config(**trainer_args(cfg))
    rows = load_dataset("json", data_files=cfg["data"], split="train")
    trainer = Trainer(model=cfg["model"], args=args, train_dataset=rows)
    trainer.add_callback(step_logger(out / "steps.jsonl"))
    trainer.train()
    exit_after_training()


if __name__ == "__main__":
    main()
