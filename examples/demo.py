"""`make demo`: the whole pipeline on 2 CPU ranks in a few minutes, nothing downloaded.

1. build a small Qwen2 model and BPE tokenizer locally, warm it up on the synthetic texts
   (`fsdp-rlhf sft`),
2. train a reward model on synthetic preference pairs (`fsdp-rlhf train-rm`),
3. run PPO against it with vLLM rollouts (`fsdp-rlhf ppo`),
4. print a summary table and write a PNG of score and KL per step next to the TensorBoard logs.

Run: `make demo` (or `.venv/bin/python examples/demo.py --out demo_out`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_rlhf.allocator import find_tcmalloc, tcmalloc_preload  # noqa: E402
from fsdp_rlhf.testing.launch import local_torchrun  # noqa: E402
from fsdp_rlhf.testing.synthetic import preference_rows, prompt_rows, write_jsonl  # noqa: E402
from fsdp_rlhf.testing.tiny import build_model  # noqa: E402


def _ld_preload() -> str:
    """tcmalloc first when installed: CPU runs are faster with it (fsdp_rlhf.allocator)."""
    return tcmalloc_preload(os.environ.get("LD_PRELOAD", ""), find_tcmalloc())


def torchrun(args: list[str], log_file: Path, nproc: int) -> float:
    """Run the CLI under torchrun; stream its log to a file; return seconds taken."""
    port = int(os.environ.get("MASTER_PORT", "29531"))
    cmd = local_torchrun(nproc, ["-m", "fsdp_rlhf.cli", *args], port=port)
    print("$ " + " ".join(cmd[2:]), flush=True)
    start = time.perf_counter()
    with open(log_file, "w") as log:
        proc = subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "LD_PRELOAD": _ld_preload()},
        )
    if proc.returncode != 0:
        tail = log_file.read_text().splitlines()[-30:]
        sys.exit(f"demo step failed (log: {log_file}):\n" + "\n".join(tail))
    return time.perf_counter() - start


def sft_rows(pairs: list[dict]) -> list[dict]:
    """Both replies of every pair as prompt -> response samples for the SFT warm-up."""
    return [
        {"input": r["prompt"], "output": r[k]}
        for r in pairs
        for k in ("chosen_reply", "rejected_reply")
    ]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


WINDOW = 10  # steps per rolling mean: one step's score is 64 samples of 16 prompts, noisy


def rolling(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1)
            for i in range(len(values))]  # fmt: skip


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    scores, kls = [r["critic/score/mean"] for r in rows], [r["actor/kl"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, scores, marker=".", alpha=0.35, label="per step")
    a.plot(steps, rolling(scores), label=f"mean of {WINDOW} steps")
    a.set(title="reward-model score (mean)", xlabel="PPO step", ylabel="score")
    a.legend(loc="lower right")
    b.plot(steps, kls, marker=".", color="tab:red")
    b.set(title="KL(actor || reference)", xlabel="PPO step", ylabel="nats per token (k1)")
    b.set_ylim(bottom=0, top=max(1.0, 1.1 * max(kls)))
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(png)


def what_it_shows(ppo_rows: list[dict], kl_coef: float) -> str:
    """The plot in one sentence, from the numbers it draws."""
    scores, kls = [r["critic/score/mean"] for r in ppo_rows], [r["actor/kl"] for r in ppo_rows]
    k = min(WINDOW, len(scores) // 2)
    first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
    trend = "rose" if last > first else "did not rise"
    bound = "stayed under" if max(kls) < 1.0 else "reached"
    return (
        f"The reward model's score {trend} from {first:+.2f} (first {k} steps) to {last:+.2f} "
        f"(last {k}) while the KL to the reference {bound} {max(kls):.2f} nats per token (its "
        f"largest step; {kls[-1]:.2f} at the end): the KL loss (coefficient {kl_coef:g}) holds "
        "the policy near the SFT model it started from while it learns what the reward model "
        "rewards."
    )


def summary(rm_rows, ppo_rows, times) -> list[tuple[str, str]]:
    k = min(WINDOW, len(ppo_rows) // 2)
    before = sum(r["critic/score/mean"] for r in ppo_rows[:k]) / k
    after = sum(r["critic/score/mean"] for r in ppo_rows[-k:]) / k
    evals = [r for r in rm_rows if "eval/acc" in r]
    phases = [
        "rollout",
        "resharding_to_infer",
        "reward_model",
        "old_log_p",
        "reference_model",
        "adv",
        "update",
        "all",
    ]
    kls = [r["actor/kl"] for r in ppo_rows]
    out = [
        ("reward model eval accuracy", f"{evals[-1]['eval/acc']:.3f}" if evals else "-"),
        ("PPO steps", str(len(ppo_rows))),
        (f"RM score, first {k} steps (mean)", f"{before:+.3f}"),
        (f"RM score, last {k} steps (mean)", f"{after:+.3f}"),
        ("KL to reference: largest / final", f"{max(kls):.3f} / {kls[-1]:.3f}"),
        (
            "wall time: sft / train-rm / ppo",
            f"{times.get('sft', 0):.0f} s / {times['rm']:.0f} s / {times['ppo']:.0f} s",
        ),
    ]
    for p in phases:
        vals = [r[f"timing/{p}"] for r in ppo_rows[1:] if f"timing/{p}" in r]
        if vals:
            out.append((f"time per step: {p}", f"{1e3 * sum(vals) / len(vals):.0f} ms"))
    return out


def kl_coef_of(config: Path) -> float:
    import yaml

    return float(yaml.safe_load(config.read_text())["algo"]["init_kl_coef"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "demo_out"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--ppo_steps", type=int, default=None, help="override max_steps")
    ap.add_argument("--sft_epochs", type=int, default=2, help="SFT warm-up epochs (0: none)")
    args = ap.parse_args()
    out = Path(args.out)
    for d in ("models", "data", "logs"):
        (out / d).mkdir(parents=True, exist_ok=True)
    print("building a small Qwen2 model + tokenizer (random weights, no download)", flush=True)
    base = build_model(
        out / "models" / "base", "qwen2", hidden_size=128, num_layers=2, num_heads=2, seed=1
    )
    pairs = preference_rows(1024, seed=1)
    write_jsonl(pairs, out / "data" / "pairs.jsonl")
    write_jsonl(sft_rows(pairs), out / "data" / "sft.jsonl")
    sft, times = base, {}
    if args.sft_epochs > 0:
        sft = out / "sft"
        times["sft"] = torchrun(
            [
                "sft",
                "--config",
                str(REPO / "configs" / "demo_sft.yaml"),
                "--pretrain",
                str(base),
                "--dataset",
                str(out / "data" / "sft.jsonl"),
                "--save_path",
                str(sft),
                "--max_epochs",
                str(args.sft_epochs),
            ],
            out / "logs" / "sft.log",
            args.nproc,
        )
        losses = [r["loss"] for r in read_metrics(sft / "metrics.jsonl") if "loss" in r]
        print(f"SFT warm-up: {args.sft_epochs} epochs, final response loss {losses[-1]:.2f}")
    write_jsonl(prompt_rows(1024, seed=1), out / "data" / "prompts.jsonl")
    times["rm"] = torchrun(
        [
            "train-rm",
            "--config",
            str(REPO / "configs" / "demo_rm.yaml"),
            "--pretrain",
            str(sft),
            "--dataset",
            str(out / "data" / "pairs.jsonl"),
            "--save_path",
            str(out / "rm"),
        ],
        out / "logs" / "train_rm.log",
        args.nproc,
    )
    extra = ["--max_steps", str(args.ppo_steps)] if args.ppo_steps else []
    times["ppo"] = torchrun(
        [
            "ppo",
            "--config",
            str(REPO / "configs" / "demo_ppo.yaml"),
            "--pretrain",
            str(sft),
            "--reward_pretrain",
            str(out / "rm"),
            "--prompt_data",
            str(out / "data" / "prompts.jsonl"),
            "--save_path",
            str(out / "ppo"),
            "--tensorboard",
            str(out / "ppo" / "tensorboard"),
            *extra,
        ],
        out / "logs" / "ppo.log",
        args.nproc,
    )
    rm_rows, ppo_rows = (
        read_metrics(out / "rm" / "metrics.jsonl"),
        read_metrics(out / "ppo" / "metrics.jsonl"),
    )
    png = out / "ppo" / "tensorboard" / "score_kl.png"
    plot(ppo_rows, png)
    from rich.console import Console
    from rich.table import Table

    table = Table("fsdp-rlhf demo", "", title="summary")
    for k, v in summary(rm_rows, ppo_rows, times):
        table.add_row(k, v)
    Console().print(table)
    print(what_it_shows(ppo_rows, kl_coef_of(REPO / "configs" / "demo_ppo.yaml")))
    print(f"plot: {png}\nlogs: {out / 'logs'}\nTensorBoard: tensorboard --logdir {out}")


if __name__ == "__main__":
    main()
