"""The {bf16, fp32} x {tcmalloc, glibc} matrix: the RM and GRPO comparisons in every cell.

Runs are interleaved across repetitions and cells (rep 0: every cell's RM pair and GRPO pair,
then rep 1, ...), so a slow spell on the shared machine hits several cells a little rather than
one cell a lot; each cell reports medians over repetitions with their spread, and ratios of
medians. MFU is 6 x parameters x trained tokens/s over ``nproc`` one-thread matmul peaks of the
cell's dtype (``benchkit.peak``); for our GRPO it is also given over the update phase alone.
Beside the GRPO ratio, the ratio at peak: what ours would reach against the same TRL runs with
every matmul of its step at that peak and nothing else costing time (``peak.grpo_ceiling_tps``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from scripts.benchkit import peak, rl, rm
from scripts.benchkit.launch import glibc_env
from scripts.benchkit.rates import median, ratio
from scripts.benchkit.report import RL_TARGET, RM_TARGET
from scripts.benchkit.workload import Sizes, Workload

NO_TCMALLOC = "no tcmalloc installed (`make tcmalloc`)"


def parse_cell(cell: str) -> tuple[str, str]:
    """``"bf16+glibc"`` -> ``("bf16", "glibc")``; anything else is a ValueError."""
    precision, _, malloc = cell.partition("+")
    if precision not in peak.DTYPES or malloc not in ("tcmalloc", "glibc"):
        raise ValueError(f"bench cell {cell!r}: expected <bf16|fp32>+<tcmalloc|glibc>")
    return precision, malloc


def cell_env(cell: str, allocator: str) -> dict[str, str] | None:
    """Environment override of a cell's runs, or None when the cell cannot run here.

    ``allocator`` is what ``launch.use_tcmalloc(True)`` put into this process's environment;
    the tcmalloc cells use that, the glibc cells take every fast allocator out."""
    _, malloc = parse_cell(cell)
    if malloc == "glibc":
        return glibc_env()
    return None if allocator.startswith("glibc") else {}


def skip_reason(cell: str, allocator: str, peaks: dict[str, float] | None) -> str | None:
    """Why a cell cannot run (or would measure nothing) on this machine, else None."""
    if cell_env(cell, allocator) is None:
        return NO_TCMALLOC
    if parse_cell(cell)[0] == "bf16" and peaks is not None:
        return peak.bf16_blocker(peaks)
    return None


def tag(cell: str, rep: int) -> str:
    return f"{cell.replace('+', '_')}_{rep}"


def run_cells(
    w: Workload,
    s: Sizes,
    work: Path,
    with_trl: bool,
    allocator: str,
    say: Callable[[str], None],
    cells: tuple[str, ...] | None = None,
    keep: Callable[[dict], None] = lambda runs: None,
    lora: bool = True,
    peaks: dict[str, float] | None = None,
) -> dict[str, dict]:
    """``{cell: {"rm_runs": [...], "rl_runs": [...]}}`` (or ``{"skipped": why}``); ``keep``
    gets that dict after every repetition of a cell, so a late failure loses nothing. With
    ``lora`` and ``s.lora_rank``, the first cell that runs also holds ``"lora_runs"``: our GRPO
    with LoRA adapters, run after the cell's GRPO pair in each repetition. ``peaks`` (the
    one-thread matmul probe) skips the bf16 cells where bf16 matmuls are emulated."""
    cells = cells or s.cells
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, dict] = {}
    for cell in cells:
        if (why := skip_reason(cell, allocator, peaks)) is not None:
            out[cell] = {"skipped": why}
            say(f"{cell}: skipped, {why}")
        else:
            out[cell] = {"rm_runs": [], "rl_runs": []}
    primary = next((c for c, runs in out.items() if "skipped" not in runs), None)
    if lora and s.lora_rank and primary is not None:
        out[primary]["lora_runs"] = []
    for rep in range(s.reps):
        for cell, runs in out.items():
            if "skipped" in runs:
                continue
            bf16 = parse_cell(cell)[0] == "bf16"
            kw = dict(bf16=bf16, env=cell_env(cell, allocator))
            runs["rm_runs"].append(rm.run_pair(w, s, work, tag(cell, rep), with_trl, **kw))
            runs["rl_runs"].append(rl.run_pair(w, s, work, tag(cell, rep), with_trl, **kw))
            if "lora_runs" in runs:
                name = f"grpo_lora_{tag(cell, rep)}"
                lora_run = rl.run_ours(name, w, s, work, s.nproc, lora_rank=s.lora_rank, **kw)
                runs["lora_runs"].append(lora_run)
            last = runs.get("lora_runs", [None])[-1]
            say(f"{cell} rep {rep}: {_brief(runs['rm_runs'][-1], runs['rl_runs'][-1], last)}")
            keep(out)
    return out


def _brief(rm_run: dict, rl_run: dict, lora_run: dict | None) -> str:
    got = [f"RM {side} {r['pairs_per_s']:.2f} pairs/s" for side, r in rm_run.items()]
    got += [f"GRPO {side} {r['e2e_tps']:.1f} tokens/s/rank" for side, r in rl_run.items()]
    if lora_run is not None:
        got.append(f"GRPO ours LoRA {lora_run['e2e_tps']:.1f} tokens/s/rank")
    return "; ".join(got)


def _side(runs: list[dict], side: str, key: str) -> list[float]:
    return [r[side][key] for r in runs if side in r]


def summarize_cell(
    runs: dict,
    *,
    params_m: float,
    peak_1t: dict[str, float],
    nproc: int,
    group_size: int,
    workload: str,
) -> dict:
    """Medians, spreads, ratios, MFU and targets of one cell's repetitions."""
    precision, _ = parse_cell(runs["cell"])
    top = peak_1t[precision]

    def util(tokens_per_s: float) -> float:
        return peak.mfu(params_m, tokens_per_s, top, nproc)

    rm_runs, rl_runs = runs["rm_runs"], runs["rl_runs"]
    out = {"cell": runs["cell"], "workload": workload}
    for side in ("ours", "trl"):
        pairs, rm_tok = _side(rm_runs, side, "pairs_per_s"), _side(rm_runs, side, "tokens_per_s")
        tps = _side(rl_runs, side, "e2e_tps")
        out[f"rm_{side}"], out[f"rl_{side}"] = pairs, tps
        out[f"rm_{side}_mfu"] = util(median(rm_tok))
        out[f"rl_{side}_mfu"] = util(median(tps) * nproc)
    out["rl_ours_update_mfu"] = util(median(_side(rl_runs, "ours", "update_tokens_per_s")))
    # the GRPO ratio ours would reach with every matmul at the probed peak and nothing else
    # costing (none for the RM: its shared prompt prefix makes the arithmetic data-dependent)
    share = _response_share(rl_runs)
    out["rl_ceiling_tps"] = peak.grpo_ceiling_tps(params_m, share, group_size, top)
    out["rl_ratio_at_peak"] = ratio(out["rl_ceiling_tps"], median(out["rl_trl"]))
    out["rm_ratio"] = ratio(median(out["rm_ours"]), median(out["rm_trl"]))
    out["rl_ratio"] = ratio(median(out["rl_ours"]), median(out["rl_trl"]))
    out["rm_met"] = _met(out["rm_ratio"], RM_TARGET)
    out["rl_met"] = _met(out["rl_ratio"], RL_TARGET)
    out["rl_ours_phases_s"] = _phases(rl_runs)
    return out


def _response_share(rl_runs: list[dict]) -> float:
    """Median share of response tokens in our GRPO samples (prompt + response)."""
    resp = median(_side(rl_runs, "ours", "response_len"))
    return resp / (resp + median(_side(rl_runs, "ours", "prompt_len")))


def _met(value: float, goal: float) -> bool | None:
    return None if value != value else value >= goal  # NaN: TRL did not run


def _phases(rl_runs: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in rl_runs for k in r["ours"]["phases_s"]})
    return {k: median([r["ours"]["phases_s"].get(k, 0.0) for r in rl_runs]) for k in keys}


def skipped(raw: dict) -> dict[str, str]:
    """``{cell: reason}`` of the cells that did not run."""
    return {cell: runs["skipped"] for cell, runs in raw["cells"].items() if "skipped" in runs}


def summarize(raw: dict) -> list[dict]:
    """One summary per cell that ran, the Llama-shaped row last."""
    sizes = raw["sizes"]
    kw = dict(peak_1t=raw["peak_flops_1t"], nproc=sizes["nproc"], group_size=sizes["rl_n"])
    out = [
        summarize_cell({**runs, "cell": cell}, params_m=raw["params_m"], workload="qwen2", **kw)
        for cell, runs in raw["cells"].items()
        if "skipped" not in runs
    ]
    real = raw.get("real_shaped")
    if real:
        name = "llama (GQA 9/3, tied)"
        out.append(summarize_cell(real, params_m=real["params_m"], workload=name, **kw))
    return out
