"""TRL ``RewardTrainer`` on the benchmark model and pairs; run under torchrun by
``scripts/benchkit/rm.py``.

Usage: ``torchrun --nproc_per_node N scripts/benchkit/trl_rm_worker.py '<json settings>'``.
Settings are the ones ours gets (batch, micro-batch, steps, precision, max length, seed) and
whether to ``torch_compile``; everything else is TRL's default, except gradient checkpointing,
which is off as in ours (TRL turns it on by default). Rank 0 appends one line per optimizer step
to ``<out>/steps.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts.benchkit.worker_exit import exit_after_training


def step_logger(path: Path):
    from transformers import TrainerCallback

    class StepLines(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                with open(path, "a") as f:
                    f.write(json.dumps({"step": state.global_step}) + "\n")

    return StepLines()


def trainer_args(cfg: dict) -> dict:
    """TRL config arguments every worker sets from the bench's settings (the rest: TRL's
    defaults, but gradient checkpointing off as in ours)."""
    import torch

    return dict(
        output_dir=cfg["out"],
        per_device_train_batch_size=cfg["micro"],
        gradient_accumulation_steps=cfg["grad_accum"],
        max_steps=cfg["steps"],
        learning_rate=cfg["lr"],
        bf16=cfg["bf16"],
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        max_length=cfg["max_length"],
        seed=cfg["seed"],
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    from datasets import load_dataset
    from trl import RewardConfig, RewardTrainer

    out = Path(cfg["out"])
    args = RewardConfig(**trainer_args(cfg), torch_compile=cfg["torch_compile"])
    pairs = load_dataset("json", data_files=cfg["data"], split="train")
    trainer = RewardTrainer(model=cfg["model"], args=args, train_dataset=pairs)
    trainer.add_callback(step_logger(out / "steps.jsonl"))
    trainer.train()
    exit_after_training()


if __name__ == "__main__":
    main()
