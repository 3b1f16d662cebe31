"""Peak memory a real vocabulary adds to a GRPO step, phase by phase (issue #45, finding 9).

The same bf16 GRPO run (2 ranks, 8 prompts x 4 samples per step, micro-batches of 8 rows,
responses up to 128 tokens, the KL loss on so the reference model runs, 2 steps) on tiny models
that differ only in their vocabulary: 400 tokens, against 151,936 (Qwen2/2.5/3) and 248,320
(Qwen3.5/3.6). The models share one 400-token tokenizer; the larger ones have more rows in
their embeddings and output layer (ids the tokenizer lacks decode to nothing), as published
checkpoints pad theirs. What the large vocabulary adds to a rank's peak is the difference of
the two runs.

Each run goes through ``scripts/benchkit/phase_peaks.py`` (the CLI with per-phase peaks of
anonymous memory, and VmHWM); the row keeps the larger of the two ranks. ``--checkout
NAME=PATH`` (repeatable) names another checkout (e.g. ``git archive <commit> | tar -x -C
PATH``) whose ``fsdp_rlhf`` runs the same workload, interleaved with this tree's ("after"):
before/after side by side on one machine.

Model: Qwen2 as ``testing.tiny.FAMILIES["qwen2"]`` (hidden 128, 2 layers, untied head, no
head_dim key), and Qwen3.5's hybrid text model (``--families qwen3_5``).

    python -m scripts.benchkit.vocab_memory --checkout before=/tmp/before --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WRAPPER = REPO / "scripts" / "benchkit" / "phase_peaks.py"
SMALL = 400
VOCABS = {"qwen2": (SMALL, 151_936, 248_320), "qwen3_5": (SMALL, 248_320)}
MICRO = 8
REWARD_PY = (
    "def reward_func(queries, prompts, labels):\n    return [float(len(q) % 3) for q in queries]\n"
)


def build_model(root: Path, family: str, vocab: int) -> Path:
    """A tiny ``family`` model with a 400-token tokenizer and ``vocab`` embedding rows."""
    from fsdp_rlhf.testing.tiny import FAMILIES, _drop_config_keys, build_family

    out = root / f"{family}-{vocab}"
    if (out / "config.json").exists():
        return out
    build_family(out, family, vocab_size=SMALL)
    if vocab > SMALL:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        model.resize_token_embeddings(vocab, mean_resizing=False)
        model.save_pretrained(str(out))
        _drop_config_keys(out, FAMILIES[family].drop_keys)
    return out


def grpo_flags(model: Path, data: Path, out: Path, response_len: int) -> list[str]:
    flags = dict(
        pretrain=model, remote_rm_url=data / "reward.py", prompt_data=data / "prompts.jsonl",
        input_key="input", rollout_batch_size=8, n_samples_per_prompt=4,
        advantage_estimator="grpo", train_batch_size=32, micro_train_batch_size=MICRO,
        micro_rollout_batch_size=MICRO, generate_max_len=response_len, prompt_max_len=64,
        max_steps=2, actor_learning_rate=1e-5, lr_warmup_ratio=0, init_kl_coef=0.001,
        save_path=out / "save", ckpt_path=out / "ckpt", save_steps=-1, seed=7, logging_steps=1,
    )  # fmt: skip
    args = ["--apply_chat_template", "--use_kl_loss", "--bf16"]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args


def run(repo: Path, model: Path, data: Path, out: Path, response_len: int, glibc: bool) -> dict:
    """One GRPO run of ``repo``'s trainer; the per-phase peaks (max over ranks) in GiB."""
    from fsdp_rlhf.testing.launch import local_torchrun

    peaks = out / "peaks"
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "PHASE_PEAKS_DIR": str(peaks),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_DATASETS_CACHE": str(out.parent / "hf_datasets"),
    }
    if glibc:  # freed tensors leave the RSS at once: peaks are those of live memory
        env.update(FSDP_RLHF_TCMALLOC="0", MALLOC_MMAP_THRESHOLD_=str(1 << 20), LD_PRELOAD="")
    cmd = local_torchrun(2, [str(WRAPPER), "ppo", *grpo_flags(model, data, out, response_len)])
    start = time.time()
    with open(out / "log", "w") as log:
        proc = subprocess.run(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = (out / "log").read_text(errors="replace").splitlines()[-20:]
        raise RuntimeError(f"{out.name}: exit {proc.returncode}\n" + "\n".join(tail))
    ranks = [json.loads((peaks / f"rank{r}.json").read_text()) for r in (0, 1)]
    metrics = (out / "save" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in metrics]
    return {
        "anon": {k: max(r["anon"].get(k, 0.0) for r in ranks) for k in ranks[0]["anon"]},
        "hwm": {k: max(r["hwm"].get(k, 0.0) for r in ranks) for k in ranks[0]["hwm"]},
        "prompt_max": max(s["prompt_length/max"] for s in steps),
        "response_max": max(s["response_length/max"] for s in steps),
        "wall_s": round(time.time() - start, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--checkout", action="append", default=[], help="NAME=PATH: a checkout run beside this"
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/vocab_memory"))
    p.add_argument("--families", nargs="+", default=["qwen2"], choices=sorted(VOCABS))
    p.add_argument("--vocabs", nargs="+", type=int, help="a subset of each family's vocabularies")
    p.add_argument("--response_lens", nargs="+", type=int, default=[128])
    p.add_argument("--tcmalloc", action="store_true", help="the CLI's default allocator")
    p.add_argument("--json", type=Path, help="the rows so far, rewritten after every run")
    a = p.parse_args()
    from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl

    data = a.work / "data"
    write_jsonl(prompt_rows(256, chat=True), data / "prompts.jsonl")
    (data / "reward.py").write_text(REWARD_PY)
    sides = {name: Path(path) for name, path in (c.split("=", 1) for c in a.checkout)}
    sides["after"] = REPO
    rows = []
    for family in a.families:
        for vocab in [v for v in VOCABS[family] if not a.vocabs or v in a.vocabs]:
            model = build_model(a.work / "models", family, vocab)
            for response_len in a.response_lens:
                for side, repo in sides.items():  # interleaved: before, after, before, ...
                    allocator = "tcmalloc" if a.tcmalloc else "glibc"
                    name = f"{side}-{family}-{vocab}-T{response_len}-{allocator}"
                    out = a.work / "runs" / name
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir(parents=True)
                    r = run(repo.resolve(), model, data, out, response_len, not a.tcmalloc)
                    row = dict(side=side, family=family, vocab=vocab, response_len=response_len,
                               allocator=allocator, **r)  # fmt: skip
                    rows.append(row)
                    phases = " ".join(f"{k}={v:.3f}" for k, v in sorted(r["anon"].items()))
                    print(f"{name}: anon GiB {phases} | VmHWM {r['hwm']['overall']:.3f}",
                          flush=True)  # fmt: skip
                    if a.json:
                        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
