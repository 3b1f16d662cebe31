"""The LoRA row (issue #18): our GRPO step with LoRA adapters against our full fine-tuning, in
the matrix's primary cell, interleaved with that cell's GRPO runs.

What LoRA changes in a step: the weight sync pushes the adapters (megabytes) instead of the
whole model, the reference forward is the base with the adapters disabled (no second model),
and the optimizer steps only the adapters; the forward and backward through the frozen base
still run at full size (the backward still needs the activation gradients of every layer).
"""

from __future__ import annotations

from scripts.benchkit.rates import median, ratio

SYNC_PHASE = "resharding_to_infer"
# (label, key in our run summary or phases_s, format); seconds per step unless named
ROWS = (
    ("step (s)", "step_s", "{:.2f}"),
    ("update (s)", "update", "{:.2f}"),
    ("reference forward (s)", "reference_model", "{:.2f}"),
    ("rollout (s)", "rollout", "{:.2f}"),
    ("weight sync (s)", SYNC_PHASE, "{:.3f}"),
    ("weight sync (MB per step)", "weight_sync_mb", "{:.2f}"),
    ("e2e tokens/s/rank", "e2e_tps", "{:.1f}"),
)


def _value(run: dict, key: str) -> float:
    if key == "weight_sync_mb":
        return run.get("weight_sync_bytes", float("nan")) / 1e6
    return run[key] if key in run else run["phases_s"].get(key, float("nan"))


def summarize(cell: dict, rank: int) -> dict | None:
    """Medians of the full fine-tuning and LoRA runs of one cell, and LoRA / full ratios;
    None when the cell ran no LoRA runs."""
    lora_runs = cell.get("lora_runs") or []
    if not lora_runs:
        return None
    full_runs = [r["ours"] for r in cell["rl_runs"]]
    out = {"cell": cell["cell"], "rank": rank, "rows": []}
    for label, key, fmt in ROWS:
        full = median([_value(r, key) for r in full_runs])
        lora = median([_value(r, key) for r in lora_runs])
        out["rows"].append(
            {"name": label, "full": full, "lora": lora, "ratio": ratio(lora, full), "fmt": fmt}
        )
    return out


def table(summary: dict) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Header and rows: quantity, full fine-tuning, LoRA, LoRA / full."""
    header = ("ours GRPO, " + summary["cell"], "full fine-tuning", f"LoRA r={summary['rank']}",
              "LoRA / full")  # fmt: skip
    rows = []
    for r in summary["rows"]:
        cells = (r["fmt"].format(r["full"]), r["fmt"].format(r["lora"]), f"{r['ratio']:.2f}x")
        rows.append((r["name"], *cells))
    return header, rows
