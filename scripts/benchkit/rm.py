"""Reward-model training: `fsdp-rlhf train-rm` against TRL's `RewardTrainer`, interleaved.

Same model, pairs file, pairs per step, micro-batch per rank, ranks, bf16, learning rate and
max length. Ours runs packed and with ``--torch_compile``; TRL with its defaults (eager, padded
to the longest sequence of the micro-batch), and once more with its own ``torch_compile=True``
for reference. Both concatenate chosen and rejected into one forward. The pairs file holds
exactly the steps' worth of pairs (plus our eval hold-out), so both runs read nearly the same
tokens whatever their shuffling.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from fsdp_rlhf.testing.launch import local_torchrun
from scripts.benchkit.launch import REPO, Job, bench_env, cli, run_job
from scripts.benchkit.rates import steady_window
from scripts.benchkit.workload import Sizes, Workload

MAX_LEN = 512  # longer than any generated text: neither side truncates or filters
LR = 1e-5
SEED = 42


def _grad_accum(s: Sizes, nproc: int) -> int:
    per_rank, rem = divmod(s.rm_pairs_per_step, nproc * s.rm_micro)
    if rem or per_rank == 0:
        raise ValueError("rm_pairs_per_step must be a multiple of nproc * rm_micro")
    return per_rank


def ours_cmd(
    w: Workload,
    s: Sizes,
    out: Path,
    nproc: int,
    packing: bool = True,
    compile: bool = True,
    bf16: bool = True,
) -> list[str]:
    """``train-rm`` as we would run it: ``--packing_samples --torch_compile`` unless asked
    for padded batches or eager blocks; fp32 (the CLI default) unless ``bf16``."""
    flags = dict(
        pretrain=w.model, dataset=w.pairs, save_path=out, ckpt_path=out / "ckpt",
        train_batch_size=s.rm_pairs_per_step, micro_train_batch_size=s.rm_micro,
        max_len=MAX_LEN, learning_rate=LR, bf16=bf16, logging_steps=1, seed=SEED,
        packing_samples=packing, torch_compile=compile,
    )  # fmt: skip
    return local_torchrun(nproc, cli("train-rm", **flags))


def trl_cmd(
    w: Workload, s: Sizes, out: Path, nproc: int, compile: bool = False, bf16: bool = True
) -> list[str]:
    """TRL with its defaults, or (``compile``) with ``torch_compile=True``."""
    cfg = dict(
        model=str(w.model),
        data=str(w.pairs),
        out=str(out),
        micro=s.rm_micro,
        grad_accum=_grad_accum(s, nproc),
        steps=s.rm_steps,
        lr=LR,
        bf16=bf16,
        max_length=MAX_LEN,
        seed=SEED,
        torch_compile=compile,
    )
    return local_torchrun(
        nproc, [str(REPO / "scripts" / "benchkit" / "trl_rm_worker.py"), json.dumps(cfg)]
    )


def tokens_per_pair(w: Workload) -> float:
    """Mean tokens of chosen + rejected, EOS included (both trainers append one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(w.model))
    rows = [json.loads(line) for line in w.pairs.read_text().splitlines()]
    ids = tok([r["chosen"] for r in rows] + [r["rejected"] for r in rows])["input_ids"]
    return 2 * (statistics.mean(len(x) for x in ids) + 1)


def summarize(job: Job, s: Sizes, tokens_pair: float, key: str | None) -> dict:
    rows, seconds = steady_window(job, s.rm_warmup, key)
    pairs_per_s = len(rows) * s.rm_pairs_per_step / seconds
    return {
        "pairs_per_s": pairs_per_s,
        "tokens_per_s": pairs_per_s * tokens_pair,
        "steps_measured": len(rows),
        "window_s": seconds,
        "wall_s": job.wall_s,
        "peak_rss_gib": job.peak_rss_gib,
    }


def run_ours(
    name: str, w: Workload, s: Sizes, work: Path, env: dict[str, str] | None = None, **kw
) -> dict:
    save = work / name
    job = run_job(
        name,
        ours_cmd(w, s, save, s.nproc, **kw),
        work / f"{name}.log",
        save / "metrics.jsonl",
        {**bench_env(work), **(env or {})},
    )
    return summarize(job, s, tokens_per_pair(w), key="loss")


def run_trl(
    name: str,
    w: Workload,
    s: Sizes,
    work: Path,
    compile: bool = False,
    env: dict[str, str] | None = None,
    bf16: bool = True,
) -> dict:
    save = work / name
    save.mkdir(parents=True, exist_ok=True)
    job = run_job(
        name,
        trl_cmd(w, s, save, s.nproc, compile, bf16),
        work / f"{name}.log",
        save / "steps.jsonl",
        {**bench_env(work), **(env or {})},
    )
    return summarize(job, s, tokens_per_pair(w), key=None)


def run_pair(
    w: Workload,
    s: Sizes,
    work: Path,
    tag: str,
    with_trl: bool,
    *,
    bf16: bool = True,
    env: dict[str, str] | None = None,
) -> dict[str, dict]:
    """One interleaved repetition: ours, then TRL (when installed); run folders ``rm_*_<tag>``."""
    out = {"ours": run_ours(f"rm_ours_{tag}", w, s, work, env=env, bf16=bf16)}
    if with_trl:
        out["trl"] = run_trl(f"rm_trl_{tag}", w, s, work, env=env, bf16=bf16)
    return out
