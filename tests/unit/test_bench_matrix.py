"""The bench matrix's pure parts: cell names, per-cell environments, medians, ratios and MFU."""

from __future__ import annotations

import pytest

from scripts.benchkit import matrix, peak
from scripts.benchkit.render import matrix_rows


def test_parse_cell():
    assert matrix.parse_cell("fp32+glibc") == ("fp32", "glibc")
    for bad in ("fp16+glibc", "bf16", "bf16+jemalloc", "glibc+bf16"):
        with pytest.raises(ValueError, match="expected <bf16|fp32>"):
            matrix.parse_cell(bad)


def test_cell_env_takes_fast_allocators_out_of_glibc_cells(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4:/opt/libfoo.so")
    env = matrix.cell_env("fp32+glibc", "tcmalloc (/usr/lib/libtcmalloc_minimal.so.4)")
    assert env["LD_PRELOAD"] == "/opt/libfoo.so" and env["FSDP_RLHF_TCMALLOC"] == "0"
    assert matrix.cell_env("bf16+tcmalloc", "tcmalloc (x) preloaded into both sides") == {}
    # without tcmalloc installed, the tcmalloc cells cannot run (and are reported as skipped)
    assert matrix.cell_env("bf16+tcmalloc", "glibc malloc (no tcmalloc installed)") is None


def _rep(rm_ours, rm_trl, rl_ours, rl_trl, update_tps):
    phases = {"all": 2.0, "update": 1.0, "rollout": 0.5}
    return (
        {"ours": {"pairs_per_s": rm_ours, "tokens_per_s": 100 * rm_ours},
         "trl": {"pairs_per_s": rm_trl, "tokens_per_s": 100 * rm_trl}},
        {"ours": {"e2e_tps": rl_ours, "update_tokens_per_s": update_tps, "phases_s": phases,
                  "response_len": 60.0, "prompt_len": 40.0},
         "trl": {"e2e_tps": rl_trl}},
    )  # fmt: skip


def test_summarize_cell_medians_ratios_and_mfu():
    reps = [_rep(3.0, 2.0, 100.0, 40.0, 1000.0), _rep(2.0, 1.0, 120.0, 60.0, 3000.0),
            _rep(4.0, 2.5, 90.0, 50.0, 2000.0)]  # fmt: skip
    runs = {"cell": "fp32+glibc", "rm_runs": [r for r, _ in reps], "rl_runs": [r for _, r in reps]}
    peaks = {"bf16": 4e11, "fp32": 1e11}
    c = matrix.summarize_cell(runs, params_m=10.0, peak_1t=peaks, nproc=2, group_size=4,
                              workload="qwen2")  # fmt: skip
    assert c["rm_ratio"] == pytest.approx(3.0 / 2.0)  # ratio of the medians
    assert c["rl_ratio"] == pytest.approx(100.0 / 50.0)
    assert c["rm_met"] is True and c["rl_met"] is True
    # 6 x 10M params x 300 tokens/s (median) over 2 ranks x 1e11 FLOP/s (fp32 peak)
    assert c["rm_ours_mfu"] == pytest.approx(6 * 10e6 * 300 / 2e11)
    # GRPO tokens/s are per rank: the whole machine trains nproc times as many
    assert c["rl_trl_mfu"] == pytest.approx(6 * 10e6 * 50 * 2 / 2e11)
    assert c["rl_ours_update_mfu"] == pytest.approx(6 * 10e6 * 2000 / 2e11)
    assert c["rl_ours_phases_s"] == {"all": 2.0, "update": 1.0, "rollout": 0.5}
    # at the 1e11 peak, per 100 counted tokens (40 prompt, 60 response, groups of 4): update +
    # reference forward, 8 x 10M over the 10 + 60 distinct tokens, decode 2 x 10M over the 60
    assert c["rl_ceiling_tps"] == pytest.approx(1e11 * 100 / (10e6 * (8 * 70 + 2 * 60)))
    assert c["rl_ratio_at_peak"] == pytest.approx(c["rl_ceiling_tps"] / 50.0)  # TRL's median
    rows = matrix_rows({"matrix": [c]})
    assert rows[0][3] == "3.00 [2.00-4.00]" and rows[0][6] == ">= 1.5x: met"
    assert rows[1][5] == "2.00x" and rows[1][7] == f"{c['rl_ratio_at_peak']:.2f}x"
    assert rows[0][7] == "-"  # no ratio at peak for the RM


def test_summarize_cell_without_trl_has_no_verdict():
    rm_run, rl_run = _rep(3.0, 2.0, 100.0, 40.0, 1000.0)
    del rm_run["trl"], rl_run["trl"]
    runs = {"cell": "bf16+tcmalloc", "rm_runs": [rm_run], "rl_runs": [rl_run]}
    c = matrix.summarize_cell(runs, params_m=1.0, peak_1t={"bf16": 1e11, "fp32": 1e11},
                              nproc=1, group_size=4, workload="qwen2")  # fmt: skip
    assert c["rm_met"] is None and c["rl_met"] is None
    assert matrix_rows({"matrix": [c]})[0][6] == ">= 1.5x: -"


def test_training_flops():
    assert peak.training_flops(34.0, 1000.0) == pytest.approx(6 * 34e6 * 1000)


def test_peak_is_the_fastest_reading(monkeypatch):
    """Load only slows a matmul down: the probe keeps its fastest repetition, and the bench
    the faster of its probes before and after the runs."""
    start, end = {"bf16": 1e9, "fp32": 5.4e10}, {"bf16": 0.8e9, "fp32": 8.1e10}
    assert peak.best(start, end) == {"bf16": 1e9, "fp32": 8.1e10}
    ticks = iter([0.0, 0.0, 0.5, 0.5, 0.6, 0.6, 1.6, 1.6, 1.9])  # reps of 0.5, 0.1, 1.0 s

    monkeypatch.setattr(peak.time, "perf_counter", lambda: next(ticks))
    assert peak.matmul_flops("fp32", n=8, min_reps=3, budget_s=1.0) == pytest.approx(2 * 8**3 / 0.1)


def test_bf16_cells_are_skipped_where_bf16_matmuls_are_emulated():
    native = {"bf16": 4.37e11, "fp32": 9.6e10}  # AVX512-BF16 (the earlier bench machines)
    emulated = {"bf16": 0.9e9, "fp32": 6.3e10}  # AMD Zen 3: AVX2 only
    tcmalloc = "tcmalloc (x) preloaded into both sides"
    assert peak.bf16_blocker(native) is None
    why = peak.bf16_blocker(emulated)
    assert why.startswith("no native bf16 matmul") and "bf16 0.9 vs fp32 63 GFLOP/s" in why
    assert matrix.skip_reason("bf16+tcmalloc", tcmalloc, native) is None
    assert matrix.skip_reason("bf16+glibc", tcmalloc, emulated) == why
    assert matrix.skip_reason("fp32+tcmalloc", tcmalloc, emulated) is None
    # a missing allocator is said first: it is what the user can fix
    assert matrix.skip_reason("bf16+tcmalloc", "glibc malloc", emulated) == matrix.NO_TCMALLOC
    rows = matrix_rows({"matrix": [], "skipped_cells": {"bf16+glibc": why}})
    assert rows == [("qwen2", "bf16+glibc", f"skipped: {why}", *["-"] * 7)]


def test_shared_prefix_bench_times_each_case_and_tabulates_pairs(tmp_path):
    """bench.py --more: the on/off micro-benchmark runs every case and pairs them up."""
    from scripts.benchkit import prefix
    from scripts.benchkit.workload import SMOKE, build_workload

    w = build_workload(tmp_path, SMOKE)
    result = prefix.measure(w, SMOKE, reps=1, warmup=1, compile=False)
    assert len(result) == 6 and all(r["median_s"] > 0 for r in result.values())
    header, rows = prefix.table(result)
    assert len(header) == 4 and [r[0] for r in rows] == list(result)[0::2]
    assert all(r[3].endswith("x") for r in rows)
