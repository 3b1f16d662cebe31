"""The GPU MFU ladder (scripts/gpu_mfu_ladder.py) runs every rung's code on CPU (--dry-run):
the kernel check, each rung (compiled with aot_eager, the varlen kernel the CPU reference op),
the JSON the GPU run returns, with ``datasets`` and vLLM hidden as on the bare GPU box."""

from __future__ import annotations

import json
import sys

from tests.dist_utils import run_distributed

HIDDEN = ("datasets", "vllm")


class _Hide:
    """A meta-path finder that hides ``HIDDEN`` from imports (the bare box has neither)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


def _dry_run(rank: int, world: int, out: str) -> int:
    sys.meta_path.insert(0, _Hide())
    from scripts.gpu_mfu_ladder import main

    return main(["--dry-run", "--out", out])


def test_ladder_dry_run_runs_every_rung(tmp_path):
    out = tmp_path / "ladder.json"
    (code,) = run_distributed(_dry_run, 1, str(out))
    report = json.loads(out.read_text())
    assert code == 0
    names = [r["name"] for r in report["rungs"]]
    assert names == [
        "baseline",
        "varlen",
        "+compiled layers",
        "+FSDP/head/clipping",
        "+selective checkpointing",
        "+float8",
        "grpo shared-prompt",
    ]
    assert report["rungs"][5]["skipped"] == "torchao is not installed"
    for row in report["rungs"][:5] + report["rungs"][6:]:
        assert "error" not in row and "skipped" not in row, row
        assert row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["hfu"] >= row["mfu"]
        assert row["tokens_per_step"] == 2 * 3 * 24  # TINY: 2 micro-batches of 3 x 24 tokens
    assert report["rungs"][0]["kernel_launches_per_step"] > 0  # the profiled step
    assert [c["name"] for c in report["checks"]] == [
        "packed row (GQA, K/V unrepeated)",
        "shared-prompt rows",
    ]
    assert all(c["pass"] for c in report["checks"])
    assert {"device", "torch", "varlen_kernels", "shape"} <= report.keys()
