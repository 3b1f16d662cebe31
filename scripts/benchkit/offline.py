"""SFT and DPO: `fsdp-rlhf sft` against TRL's `SFTTrainer`, `fsdp-rlhf dpo` against TRL's
`DPOTrainer`, interleaved (ours, TRL, ours, TRL ...).

Same model, data files, samples (pairs) per step, micro-batch per rank, ranks, precision,
learning rate, max length and seed on both sides. Ours runs in the CLI's default configuration
(packed micro-batches; DPO with each pair's prompt run once; eager blocks), TRL with its own
defaults (padded to the longest sequence of the micro-batch; DPO with a reference model copy
and chosen + rejected concatenated into one forward), gradient checkpointing off on both sides
as in the RM and GRPO rows. SFT learns the completion only (TRL's default for prompt-completion
data, ours with --output_key); DPO's beta is 0.1 on both sides (both defaults). The data files
hold exactly the steps' worth of rows (no eval set), so both sides read the same tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from fsdp_rlhf.testing.launch import local_torchrun
from fsdp_rlhf.testing.synthetic import NEGATIVE, NEUTRAL, POSITIVE, write_jsonl
from scripts.benchkit.launch import REPO, Job, bench_env, cli, run_job
from scripts.benchkit.rates import median, ratio, spread, steady_window
from scripts.benchkit.workload import Sizes, Workload, _words

MAX_LEN = 512  # longer than any generated text: neither side truncates
LR = 1e-5
SEED = 42
TARGET = 1.5
KINDS = ("sft", "dpo")
UNIT = {"sft": "samples", "dpo": "pairs"}


def write_data(w: Workload, s: Sizes, root: Path) -> dict[str, Path]:
    """``sft.jsonl`` (prompt, completion) and ``dpo.jsonl`` (prompt, chosen, rejected) with
    ``rm_steps`` steps' worth of rows, replies as long as the RM rows'."""
    rng = random.Random(SEED)
    lo, hi = s.rm_reply_words
    n = s.rm_steps * s.rm_pairs_per_step
    sft, dpo = [], []
    for _ in range(n):
        prompt = f"Human: {_words(rng, NEUTRAL, *s.prompt_words)}\nAssistant:"
        chosen, rejected = _words(rng, POSITIVE, lo, hi), _words(rng, NEGATIVE, lo, hi)
        sft.append({"prompt": prompt, "completion": " " + chosen})
        dpo.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return {
        "sft": write_jsonl(sft, root / "sft.jsonl"),
        "dpo": write_jsonl(dpo, root / "dpo.jsonl"),
    }


def tokens_per_row(w: Workload, data: dict[str, Path]) -> dict[str, float]:
    """Mean tokens a step processes per row: prompt + completion (+ EOS) for SFT, both
    sequences of a pair for DPO (the prompt counted twice, as a padded forward runs it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(w.model))

    def mean_len(texts: list[str]) -> float:
        return sum(len(x) + 1 for x in tok(texts)["input_ids"]) / len(texts)

    sft = [json.loads(line) for line in data["sft"].read_text().splitlines()]
    dpo = [json.loads(line) for line in data["dpo"].read_text().splitlines()]
    return {
        "sft": mean_len([r["prompt"] + r["completion"] for r in sft]),
        "dpo": mean_len([r["prompt"] + r[k] for r in dpo for k in ("chosen", "rejected")]) * 2,
    }


def ours_cmd(kind: str, w: Workload, s: Sizes, data: Path, out: Path, bf16: bool) -> list[str]:
    """`sft` / `dpo` with only the workload's flags: everything else is the CLI default."""
    flags = dict(
        pretrain=w.model, dataset=data, save_path=out, ckpt_path=out / "ckpt",
        train_batch_size=s.rm_pairs_per_step, micro_train_batch_size=s.rm_micro, max_epochs=1,
        max_len=MAX_LEN, learning_rate=LR, bf16=bf16, logging_steps=1, seed=SEED,
    )  # fmt: skip
    if kind == "sft":
        flags.update(input_key="prompt", output_key="completion", input_template="none")
    else:
        flags.update(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected")
    return local_torchrun(s.nproc, cli(kind, **flags))


def trl_cmd(kind: str, w: Workload, s: Sizes, data: Path, out: Path, bf16: bool) -> list[str]:
    per_rank, rem = divmod(s.rm_pairs_per_step, s.nproc * s.rm_micro)
    if rem or per_rank == 0:
        raise ValueError("rm_pairs_per_step must be a multiple of nproc * rm_micro")
    cfg = dict(
        kind=kind, model=str(w.model), data=str(data), out=str(out), micro=s.rm_micro,
        grad_accum=per_rank, steps=s.rm_steps, lr=LR, bf16=bf16, max_length=MAX_LEN, seed=SEED,
    )  # fmt: skip
    worker = REPO / "scripts" / "benchkit" / "trl_offline_worker.py"
    return local_torchrun(s.nproc, [str(worker), json.dumps(cfg)])


def _summarize(job: Job, s: Sizes, tokens: float, key: str | None) -> dict:
    rows, seconds = steady_window(job, s.rm_warmup, key)
    per_s = len(rows) * s.rm_pairs_per_step / seconds
    return {
        "rows_per_s": per_s,
        "tokens_per_s": per_s * tokens,
        "steps_measured": len(rows),
        "window_s": seconds,
        "wall_s": job.wall_s,
        "peak_rss_gib": job.peak_rss_gib,
    }


def run_one(kind, side, w, s, data, work, tag, tokens, bf16, env) -> dict:
    name = f"{kind}_{side}_{tag}"
    save = work / name
    save.mkdir(parents=True, exist_ok=True)
    make = ours_cmd if side == "ours" else trl_cmd
    steps_file = save / ("metrics.jsonl" if side == "ours" else "steps.jsonl")
    job = run_job(
        name,
        make(kind, w, s, data, save, bf16),
        work / f"{name}.log",
        steps_file,
        {**bench_env(work), **(env or {})},
    )
    return _summarize(job, s, tokens, "loss" if side == "ours" else None)


def measure(
    w: Workload,
    s: Sizes,
    work: Path,
    with_trl: bool,
    cell: str,
    env: dict[str, str] | None,
    say,
) -> dict:
    """``{"cell", "tokens_per_row", "runs": {kind: [{"ours": ..., "trl": ...}, ...]}}``, the
    repetitions interleaved across both comparisons."""
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(w, s, work / "offline_data")
    tokens = tokens_per_row(w, data)
    bf16 = cell.startswith("bf16")
    runs: dict[str, list] = {kind: [] for kind in KINDS}
    sides = ("ours", "trl") if with_trl else ("ours",)
    for rep in range(s.reps):
        tag = f"{cell.replace('+', '_')}_{rep}"
        for kind in KINDS:
            got = {
                side: run_one(kind, side, w, s, data[kind], work, tag, tokens[kind], bf16, env)
                for side in sides
            }
            runs[kind].append(got)
            rates = [f"{side} {r['rows_per_s']:.2f} {UNIT[kind]}/s" for side, r in got.items()]
            say(f"{kind} rep {rep}: " + "; ".join(rates))
    return {"cell": cell, "tokens_per_row": tokens, "runs": runs, "summary": summarize(runs)}


def summarize(runs: dict[str, list]) -> dict[str, dict]:
    out = {}
    for kind, reps in runs.items():
        ours = [r["ours"]["rows_per_s"] for r in reps]
        trl = [r["trl"]["rows_per_s"] for r in reps if "trl" in r]
        r = ratio(median(ours), median(trl))
        out[kind] = {
            "ours": ours,
            "trl": trl,
            "ratio": r,
            "met": None if r != r else r >= TARGET,
        }
    return out


HEADER = ("comparison", "cell", "ours [min-max]", "TRL [min-max]", "ratio", "target")
LABEL = {"sft": "SFT samples/s (vs SFTTrainer)", "dpo": "DPO pairs/s (vs DPOTrainer)"}


def table(offline: dict) -> tuple[tuple, list[tuple]]:
    rows = []
    for kind, summ in offline["summary"].items():
        met = "-" if summ["met"] is None else ("met" if summ["met"] else "MISSED")
        r = summ["ratio"]
        rows.append((
            LABEL[kind], offline["cell"], spread(summ["ours"], "{:.2f}"),
            spread(summ["trl"], "{:.2f}"), "-" if r != r else f"{r:.2f}x", f">= 1.5x: {met}",
        ))  # fmt: skip
    return HEADER, rows
