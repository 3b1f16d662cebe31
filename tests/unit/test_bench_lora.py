"""The bench's LoRA row: medians of full and LoRA runs, ratios, the table."""

from __future__ import annotations

import math

from scripts.benchkit import lora


def _run(step: float, update: float, sync_s: float, sync_bytes: float, tps: float) -> dict:
    phases = {"update": update, "resharding_to_infer": sync_s, "rollout": 0.5}
    return {"step_s": step, "phases_s": phases, "weight_sync_bytes": sync_bytes, "e2e_tps": tps}


def test_summary_takes_medians_and_lora_over_full_ratios():
    cell = {
        "cell": "bf16+tcmalloc",
        "rl_runs": [
            {"ours": _run(4.0, 2.0, 0.1, 60e6, 500)},
            {"ours": _run(6.0, 3.0, 0.3, 60e6, 300)},
        ],  # fmt: skip
        "lora_runs": [_run(3.0, 1.5, 0.01, 3e6, 600), _run(5.0, 2.5, 0.03, 3e6, 400)],
    }
    s = lora.summarize(cell, rank=16)
    rows = {r["name"]: r for r in s["rows"]}
    assert s["rank"] == 16 and s["cell"] == "bf16+tcmalloc"
    assert rows["step (s)"]["full"] == 5.0 and rows["step (s)"]["lora"] == 4.0
    assert math.isclose(rows["weight sync (s)"]["ratio"], 0.1)
    assert math.isclose(rows["weight sync (MB per step)"]["lora"], 3.0)
    assert math.isclose(rows["e2e tokens/s/rank"]["ratio"], 1.25)
    # a phase neither side logged is NaN, not an error
    assert math.isnan(rows["reference forward (s)"]["full"])
    header, body = lora.table(s)
    assert header[2] == "LoRA r=16" and ("step (s)", "5.00", "4.00", "0.80x") in body


def test_no_lora_runs_means_no_row():
    assert lora.summarize({"cell": "fp32+glibc", "rl_runs": [], "lora_runs": []}, rank=16) is None
    assert lora.summarize({"cell": "fp32+glibc", "rl_runs": []}, rank=0) is None
