"""The warm launcher (fsdp_rlhf/testing/warm_launch.py) gives a case's ranks what torchrun gives
them: the same script runs under both and reports its environment, arguments, thread count,
random state and process group; a failing rank ends the case the same way; a timeout kills it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

from fsdp_rlhf.testing import warm_launch
from fsdp_rlhf.testing.launch import local_torchrun
from tests.e2e.helpers import REPO, _env

# What a rank sees: printed as one JSON line per rank.
PROBE = r"""
import json, os, random, signal, sys
import numpy as np
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
store = dist.distributed_c10d._get_default_store()
store.set(f"seen/{dist.get_rank()}", "1")
keys = sorted(k for k in os.environ if k not in json.loads(os.environ["PROBE_BASE_KEYS"]))
sys.stdout.write(json.dumps({
    "rank": dist.get_rank(),
    "env": {k: os.environ[k] for k in keys},
    "argv": sys.argv[1:],
    "argv0": os.path.basename(sys.argv[0]),
    "cwd": os.getcwd(),
    "threads": torch.get_num_threads(),
    "torch_seed": torch.initial_seed(),
    "draw": [random.random(), float(np.random.rand())],
    "sum": t.item(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "main": __name__,
}) + "\n")  # one write: the ranks share the file (print writes the newline apart when unbuffered)
sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
"""

# Rank 1 fails at once; rank 0 waits until it is stopped and says how.
FAILING = r"""
import os, signal, sys, time
if os.environ["RANK"] == "1":
    print("rank 1 fails", file=sys.stderr, flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *a: (print("rank 0 got SIGTERM", flush=True), sys.exit(0)))
time.sleep(60)
"""

# Differences that are the launchers' own: paths and ports chosen per run.
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID"}
# What the warm path adds by design: the CLI's settings before its imports (a CLI process under
# torchrun sets them itself when it starts: fsdp_rlhf.cli.quiet_libraries, allocator.reexec_env),
# and what the server's imports set (vLLM's inductor settings: a rank that imports vLLM has them)
CLI_SETTINGS = {
    "LD_PRELOAD",
    "FSDP_RLHF_TCMALLOC",
    "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD",
    "HF_DATASETS_DISABLE_PROGRESS_BARS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "TRANSFORMERS_VERBOSITY",
    "TOKENIZERS_PARALLELISM",
}

pytestmark = pytest.mark.skipif(warm_launch.mode() != "warm", reason="the warm launcher is off")


def _both(script: str, tmp_path, timeout: float = 300):
    """The script under real torchrun and under the warm launcher, 2 ranks each."""
    path = tmp_path / "probe.py"
    path.write_text(script)
    env = _env({"PROBE_BASE_KEYS": json.dumps(sorted(os.environ))})
    real = subprocess.run(
        local_torchrun(2, [str(path), "--flag", "x"]),
        capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout,
    )  # fmt: skip
    with tempfile.TemporaryFile("a+b") as out, tempfile.TemporaryFile("a+b") as err:
        code = warm_launch.launch(
            "torchrun", [str(path), "--flag", "x"], env, str(REPO), 2, timeout,
            out.fileno(), err.fileno(),
        )  # fmt: skip
        out.seek(0)
        err.seek(0)
        warm = subprocess.CompletedProcess([], code, out.read().decode(), err.read().decode())
    return real, warm


def _ranks(stdout: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in rows}


def test_a_warm_rank_sees_what_a_torchrun_rank_sees(tmp_path):
    real, warm = _both(PROBE, tmp_path)
    assert real.returncode == 0 and warm.returncode == 0, (real.stderr[-2000:], warm.stderr)
    real_ranks, warm_ranks = _ranks(real.stdout), _ranks(warm.stdout)
    by_design = CLI_SETTINGS | set(warm_launch.imports_added())
    assert sorted(real_ranks) == sorted(warm_ranks) == [0, 1]
    for rank in (0, 1):
        a, b = real_ranks[rank], warm_ranks[rank]
        ours = {k: v for k, v in a["env"].items() if k not in PER_RUN}
        theirs = {k: v for k, v in b["env"].items() if k not in PER_RUN | by_design}
        assert ours == theirs, (rank, ours, theirs)
        for key in ("argv", "argv0", "cwd", "threads", "sum", "sigint", "sigterm"):
            assert a[key] == b[key], (rank, key, a[key], b[key])
        assert b["main"] == "__main__" and b["sum"] == 3.0 and b["threads"] == 1
    # each rank and each case draws its own random numbers, as fresh processes do
    ranks = [*warm_ranks.values(), *real_ranks.values()]
    for draw in ([r["draw"][0] for r in ranks], [r["draw"][1] for r in ranks]):
        assert len(set(draw)) == 4, draw
    assert len({r["torch_seed"] for r in ranks}) == 4, ranks


def test_a_failing_rank_ends_the_case_as_under_torchrun(tmp_path):
    real, warm = _both(FAILING, tmp_path)
    for proc in (real, warm):
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "rank 1 fails" in proc.stderr
        assert "rank 0 got SIGTERM" in proc.stdout, proc.stdout
        # torchrun's report of the failed rank, the form the resume tests read
        report = r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: 3 \(pid: \d+\)"
        assert re.search(report, proc.stderr), proc.stderr[-2000:]
        assert "Root Cause (first observed failure)" in proc.stderr


def test_a_timeout_kills_the_case(tmp_path):
    path = tmp_path / "sleep.py"
    pidfile = tmp_path / "pids"
    record = f"open({str(pidfile)!r}, 'a').write(f'{{os.getpid()}}\\n')"
    path.write_text(f"import os, time\n{record}\ntime.sleep(120)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_launch.launch(
            "torchrun", [str(path)], _env(None), str(REPO), 2, 5,
            sys.stdout.fileno(), sys.stderr.fileno(),
        )  # fmt: skip
    assert time.monotonic() - start < 60
    deadline = time.monotonic() + 10
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_a_case_that_changes_import_time_settings_falls_back(tmp_path):
    with pytest.raises(warm_launch.Fallback, match="VLLM_LOGGING_LEVEL"):
        warm_launch.launch(
            "single", ["-c", "pass"], _env({"VLLM_LOGGING_LEVEL": "DEBUG"}), str(REPO), 1, 60,
            sys.stdout.fileno(), sys.stderr.fileno(),
        )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def test_one_process_exits_with_its_own_code(tmp_path):
    """A CLI's usage error is exit 2 as a plain process, and no torchrun report follows."""
    argv = ["-c", "import sys; print('error: bad flag', file=sys.stderr); sys.exit(2)"]
    real = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=_env(None), cwd=REPO
    )
    with tempfile.TemporaryFile("a+b") as err:
        code = warm_launch.launch(
            "single", argv, _env(None), str(REPO), 1, 60, sys.stdout.fileno(), err.fileno()
        )
        err.seek(0)
        stderr = err.read().decode()
    assert real.returncode == code == 2, (real.returncode, code, stderr)
    assert stderr == real.stderr == "error: bad flag\n", stderr
