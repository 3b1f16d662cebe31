"""Medians, ratios and targets from the raw runs; the JSON file, markdown summary and table."""

from __future__ import annotations

import json
import math
from pathlib import Path

from scripts.benchkit.rates import median, ratio

# Issue #8's targets.
RM_TARGET, RL_TARGET, OVERHEAD_TARGET, SYNC_TARGET = 1.5, 2.0, 0.05, 0.5


def _medians(runs: list[dict], side: str, key: str) -> float:
    return median([r[side][key] for r in runs if side in r])


def _target(name: str, value: float, goal: float, higher_is_better: bool = True) -> dict:
    met = value >= goal if higher_is_better else value < goal
    if math.isnan(value):
        met = None
    miss = None if met or met is None else (goal / value if higher_is_better else value / goal)
    return {"name": name, "value": value, "goal": goal, "met": met, "miss_factor": miss}


def headline(raw: dict) -> dict:
    """The numbers the table and the targets are made of (medians over repetitions)."""
    rm, rl = raw["rm_runs"], raw["rl_runs"]
    h = {
        "rm_ours_pairs_s": _medians(rm, "ours", "pairs_per_s"),
        "rm_trl_pairs_s": _medians(rm, "trl", "pairs_per_s"),
        "rm_ours_tokens_s": _medians(rm, "ours", "tokens_per_s"),
        "rm_trl_tokens_s": _medians(rm, "trl", "tokens_per_s"),
        "rl_ours_tps": _medians(rl, "ours", "e2e_tps"),
        "rl_ours_tps_logged": _medians(rl, "ours", "e2e_tps_logged"),
        "rl_trl_tps": _medians(rl, "trl", "e2e_tps"),
        "overhead_frac": _medians(rl, "ours", "overhead_frac"),
        "wall_overhead_frac": _medians(rl, "ours", "wall_overhead_frac"),
        "sync_gbps": _medians(rl, "ours", "weight_sync_gbps"),
    }
    h["rm_ratio"] = ratio(h["rm_ours_pairs_s"], h["rm_trl_pairs_s"])
    h["rl_ratio"] = ratio(h["rl_ours_tps"], h["rl_trl_tps"])
    h["sync_frac_1t"] = ratio(h["sync_gbps"], raw["memcpy"]["gbps_1_thread"])
    h["sync_frac_all"] = ratio(h["sync_gbps"], raw["memcpy"]["gbps_all_threads"])
    return h


def targets(h: dict) -> list[dict]:
    return [
        _target("RM pairs/s vs TRL RewardTrainer", h["rm_ratio"], RM_TARGET),
        _target("GRPO e2e tokens/s vs TRL GRPOTrainer", h["rl_ratio"], RL_TARGET),
        _target("PPO overhead fraction of step", h["overhead_frac"], OVERHEAD_TARGET, False),
        _target("weight sync vs memcpy (1 thread)", h["sync_frac_1t"], SYNC_TARGET),
    ]


def phase_table(raw: dict) -> dict[str, dict[str, float]]:
    """Median seconds per phase of each of our PPO-style runs."""
    out = {"grpo (vLLM)": _phase_medians([r["ours"] for r in raw["rl_runs"]])}
    for name, run in raw.get("extra", {}).items():
        out[name] = run["phases_s"]
    return out


def _phase_medians(runs: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r["phases_s"]})
    return {k: median([r["phases_s"][k] for r in runs if k in r["phases_s"]]) for k in keys}


def write_json(results: dict, out_dir: Path, stamp: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench-{stamp}.json"
    text = json.dumps(results, indent=1, default=float)
    path.write_text(text)
    (out_dir / "latest.json").write_text(text)
    return path
