"""`python -m scripts.bench --smoke`: every measurement path runs and writes sane numbers (not
speed)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from fsdp_rlhf.allocator import find_tcmalloc, preloaded_allocator
from scripts.benchkit.peak import bf16_blocker
from tests.e2e.helpers import REPO, _env

pytestmark = pytest.mark.slow

HAS_TRL = importlib.util.find_spec("trl") is not None


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "--smoke", "--out", str(out), "--work",
         str(out / "w")],
        capture_output=True, text=True, cwd=REPO, env=_env(None), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    raw = json.loads((out / "latest.json").read_text())
    summary = (out / "summary.md").read_text()
    return {"raw": raw, "summary": summary, "stdout": proc.stdout, "work": out / "w"}


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_our_side_is_measured_and_written(smoke):
    raw, h = smoke["raw"], smoke["raw"]["headline"]
    for key in ("rm_ours_pairs_s", "rm_ours_tokens_s", "rl_ours_tps", "sync_gbps"):
        assert _positive(h[key]), (key, h[key])
    assert 0 <= h["overhead_frac"] < 1
    assert _positive(raw["memcpy"]["gbps_1_thread"])
    ours = raw["rl_runs"][0]["ours"]
    assert _positive(ours["phases_s"]["rollout"]) and _positive(ours["phases_s"]["update"])
    assert ours["phases_s"]["all"] >= ours["phases_s"]["update"]
    assert _positive(ours["peak_rss_gib"]) and ours["peak_rss_gib_by_phase"]
    assert raw["machine"]["cores"] >= 1 and raw["machine"]["versions"]["torch"]
    # tcmalloc goes into every run when installed (both sides), and the summary says which
    want = "tcmalloc" if find_tcmalloc() else "glibc malloc"
    if preloaded_allocator(os.environ.get("LD_PRELOAD", "")):
        want = "preloaded by the caller"
    assert raw["allocator"].startswith(want), raw["allocator"]
    assert f"host allocator: {raw['allocator']}" in smoke["summary"]
    for section in ("## Machine", "## Results", "## Targets", "## Phase breakdown", "## Fairness"):
        assert section in smoke["summary"]
    assert "RM training pairs/s" in smoke["stdout"]  # the console table


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (`make bench` installs it)")
def test_trl_side_is_measured(smoke):
    h = smoke["raw"]["headline"]
    for key in ("rm_trl_pairs_s", "rl_trl_tps", "rm_ratio", "rl_ratio"):
        assert _positive(h[key]), (key, h[key])


def test_matrix_cells_are_measured_with_mfu(smoke):
    raw, summary = smoke["raw"], smoke["summary"]
    peaks, (start, end) = raw["peak_flops_1t"], raw["peak_probes"]
    assert _positive(peaks["bf16"]) and _positive(peaks["fp32"])
    # MFU divides by the faster of the probes before and after the runs
    assert all(peaks[k] == max(start[k], end[k]) for k in ("bf16", "fp32")), raw["peak_probes"]
    ran = [c for c, r in raw["cells"].items() if "skipped" not in r]
    # the fp32 glibc cell runs everywhere; the bf16 tcmalloc cell wherever tcmalloc is
    # installed and bf16 matmuls are native (else the tables say why it was skipped); cells
    # are chosen by the probe taken before them
    native_bf16 = bf16_blocker(start) is None
    assert "fp32+glibc" in ran
    assert ("bf16+tcmalloc" in ran) == (bool(find_tcmalloc()) and native_bf16)
    if not native_bf16:
        assert raw["skipped_cells"]["bf16+tcmalloc"] == bf16_blocker(start)
        assert (
            "skipped: no native bf16 matmul" in summary and "skipped: no native" in smoke["stdout"]
        )
    assert [c["cell"] for c in raw["matrix"]] == ran
    for cell in raw["matrix"]:
        assert all(_positive(x) for x in cell["rm_ours"] + cell["rl_ours"]), cell
        for key in ("rm_ours_mfu", "rl_ours_mfu", "rl_ours_update_mfu"):
            assert 0 < cell[key] < 1.5, (key, cell[key])  # a fraction of the probed peak
        # the update alone is at least as efficient as the whole step it is part of
        assert cell["rl_ours_update_mfu"] > cell["rl_ours_mfu"]
        # the arithmetic limit at the probed peak is above what ours measured
        assert max(cell["rl_ours"]) < cell["rl_ceiling_tps"], cell
    # each cell's runs got its allocator: our start-up log names glibc malloc only there
    glibc = "CPU run with glibc malloc"
    for run in ("rm_ours_fp32_glibc_0", "grpo_ours_fp32_glibc_0"):
        assert glibc in (smoke["work"] / f"{run}.log").read_text(), run
    if "bf16+tcmalloc" in ran:
        assert glibc not in (smoke["work"] / "grpo_ours_bf16_tcmalloc_0.log").read_text()
    assert "## Matrix: precision x host allocator" in summary
    assert "fp32+glibc" in summary and "MFU" in summary
    assert "fp32+glibc" in smoke["stdout"]  # the console matrix


def test_lora_row_syncs_the_adapters_only(smoke):
    raw = smoke["raw"]
    primary = raw["primary_cell"]
    lora_runs = raw["cells"][primary]["lora_runs"]
    assert len(lora_runs) == raw["sizes"]["reps"]
    rows = {r["name"]: r for r in raw["lora"]["rows"]}
    assert raw["lora"]["cell"] == primary and raw["lora"]["rank"] == raw["sizes"]["lora_rank"]
    for name in ("step (s)", "update (s)", "weight sync (s)", "e2e tokens/s/rank"):
        assert _positive(rows[name]["full"]) and _positive(rows[name]["lora"]), rows[name]
    # rank-4 adapters of a 0.5M-parameter model: a few percent of the full model's bytes
    sync = rows["weight sync (MB per step)"]
    assert _positive(sync["lora"]) and sync["lora"] < 0.2 * sync["full"], sync
    assert "## LoRA against full fine-tuning" in smoke["summary"]
    assert "LoRA r=" in smoke["stdout"]
