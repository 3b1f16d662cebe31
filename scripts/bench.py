"""`make bench`: fsdp-rlhf against TRL on this machine, side by side (issues #8, #15).

Builds a ~34M-parameter Qwen2 model and synthetic data locally, then runs the matrix
{bf16, fp32} x {tcmalloc, glibc}: in every cell reward-model training (ours with
--packing_samples --torch_compile vs TRL RewardTrainer) and a GRPO step (ours with vLLM and
--torch_compile vs TRL GRPOTrainer), both sides in the cell's precision and host allocator,
interleaved (A B A B) with medians and spreads, and MFU against a one-thread matmul probe per
dtype. The first cell runs again on a Llama-shaped model (GQA 9/3, tied embeddings). `--more`
adds single runs: ours with PPO (critic + RM), HF rollouts, 1 rank, 2x response length, RM
without packing / without compile, and TRL's RM with torch_compile. After the matrix, the
primary cell also compares `fsdp-rlhf sft` with TRL's SFTTrainer and `fsdp-rlhf dpo` with its
DPOTrainer (`--offline`: those rows alone). Writes
``bench/results/bench-<time>.json`` (+ ``latest.json``) and ``bench/results/summary.md``, and
prints the tables.

    .venv/bin/python -m scripts.bench                     # full run, about 31 minutes on 2 cores
    .venv/bin/python -m scripts.bench --cells fp32+glibc  # one cell of the matrix
    .venv/bin/python -m scripts.bench --smoke             # tiny sizes, one repetition, 2 cells

Installs nothing: `make bench` installs TRL first. Without TRL, --smoke runs our side only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from scripts.benchkit import dynamic_batch, lora, machine, matrix, offline, peak, prefix, rl, rm
from scripts.benchkit.launch import use_tcmalloc
from scripts.benchkit.memcpy import memcpy_reference
from scripts.benchkit.render import console_table
from scripts.benchkit.report import headline, targets, write_json
from scripts.benchkit.summary import summary_md
from scripts.benchkit.workload import FULL, SMOKE, Sizes, Workload, build_workload

REPO = Path(__file__).resolve().parents[1]

TRL_MISSING = "trl is not installed: run `make bench` (it installs trl==1.16.0 first)"


class Clock:
    def __init__(self) -> None:
        self.start = time.time()

    def say(self, what: str) -> None:
        print(f"[{time.time() - self.start:6.0f} s] {what}", flush=True)


def run_rm_single(w: Workload, s: Sizes, work: Path, with_trl: bool, clock: Clock) -> dict:
    """One run each: ours without packing, ours without compile, TRL with torch_compile."""
    out = {
        "ours without packing": rm.run_ours("rm_padded", w, s, work, packing=False),
        "ours without compile": rm.run_ours("rm_eager", w, s, work, compile=False),
    }
    if with_trl:
        out["TRL with torch_compile"] = rm.run_trl("rm_trl_compiled", w, s, work, compile=True)
    for name, run in out.items():
        clock.say(f"RM {name}: {run['pairs_per_s']:.2f} pairs/s")
    return out


def run_extra(w: Workload, s: Sizes, work: Path, rm_dir: Path, clock: Clock) -> dict:
    """Ours only: PPO with critic and RM (the RM of the first RM run), HF rollouts and the
    scaling runs. The 1-rank run gets one thread, like each of the 2 ranks."""
    jobs = {
        "ppo critic+rm": dict(nproc=s.nproc, rm=rm_dir),
        "hf rollouts": dict(nproc=s.nproc, engine="hf"),
        "1 rank": dict(nproc=1, env={"OMP_NUM_THREADS": "1"}),
        "2x response": dict(nproc=s.nproc, resp_len=2 * s.rl_resp_len),
    }
    out = {}
    for name, kw in jobs.items():
        out[name] = rl.run_ours(name.replace(" ", "_").replace("+", "_"), w, s, work, **kw)
        clock.say(f"ours {name}: {out[name]['e2e_tps']:.1f} tokens/s/rank")
    return out


def run_real_shaped(s: Sizes, work: Path, with_trl: bool, cell: str, allocator: str, clock, keep):
    """The primary cell again on the Llama-shaped model (GQA 9/3, tied embeddings)."""
    w = build_workload(work / "data_llama", s, "llama")
    clock.say(f"Llama-shaped workload: {w.params_m:.1f}M parameters")
    runs = matrix.run_cells(
        w, s, work / "llama", with_trl, allocator, clock.say, (cell,), keep, lora=False
    )
    return {**runs[cell], "cell": cell, "params_m": w.params_m}


def measure(
    s: Sizes, work: Path, with_trl: bool, allocator: str, clock: Clock, more: bool, out: Path
):
    w = build_workload(work / "data", s)
    clock.say(f"workload built: {w.params_m:.1f}M parameters in {work}; allocator: {allocator}")
    raw = {
        "allocator": allocator,
        "sizes": s.to_dict(),
        "params_m": w.params_m,
        "with_trl": with_trl,
        "rm_tokens_per_pair": rm.tokens_per_pair(w),
        "memcpy": memcpy_reference(int(w.params_m * 1e6) * 2),  # bf16 sync bytes
        "peak_flops_1t": peak.probe(),
    }
    clock.say("one-thread matmul peak: " + ", ".join(
        f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in raw["peak_flops_1t"].items()))  # fmt: skip
    partial = out / "partial.json"  # the runs so far, should a later one fail

    def keep(key: str):
        return lambda runs: write_partial(partial, {**raw, key: runs})

    raw["cells"] = matrix.run_cells(
        w, s, work, with_trl, allocator, clock.say, keep=keep("cells"), peaks=raw["peak_flops_1t"]
    )
    primary = next(c for c, r in raw["cells"].items() if "skipped" not in r)
    # the headline table, targets and notes read the primary cell under these names
    raw["primary_cell"] = primary
    raw["rm_runs"], raw["rl_runs"] = (raw["cells"][primary][k] for k in ("rm_runs", "rl_runs"))
    raw["lora"] = lora.summarize({**raw["cells"][primary], "cell": primary}, s.lora_rank)
    if s.real_shaped:
        raw["real_shaped"] = run_real_shaped(
            s, work, with_trl, primary, allocator, clock, keep("real_shaped")
        )
    # probed again after the runs: the limit is the faster reading (load only lowers it)
    raw["peak_probes"] = [raw["peak_flops_1t"], peak.probe()]
    raw["peak_flops_1t"] = peak.best(*raw["peak_probes"])
    start, end = raw["peak_probes"]
    clock.say("one-thread matmul peak, start / end: " + ", ".join(
        f"{k} {start[k] / 1e9:.0f} / {end[k] / 1e9:.0f} GFLOP/s" for k in start))  # fmt: skip
    if s.extra_runs and more:
        raw["shared_prefix"] = prefix.measure(w, s)
        clock.say("shared prompt prefix on/off: measured")
        raw["dynamic_batch"] = dynamic_batch.measure(w, s)
        clock.say("token-budget micro-batches against fixed ones: measured")
        raw["rm_single"] = run_rm_single(w, s, work, with_trl, clock)
        rm_dir = work / f"rm_ours_{matrix.tag(primary, 0)}"
        raw["extra"] = run_extra(w, s, work, rm_dir, clock)
    if s.offline_rows:  # --smoke leaves them to `--smoke --offline` (the test suite's time)
        env = matrix.cell_env(primary, allocator)
        raw["offline"] = offline.measure(w, s, work / "offline", with_trl, primary, env, clock.say)
    raw["matrix"] = matrix.summarize(raw)
    raw["skipped_cells"] = matrix.skipped(raw)
    partial.unlink(missing_ok=True)
    return raw


def write_partial(path: Path, raw: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(raw, indent=1, default=float))
    tmp.replace(path)


def run_offline_only(s: Sizes, work: Path, with_trl: bool, clock: Clock, args) -> int:
    """``--offline``: the SFT and DPO comparisons alone, in the first cell that runs here."""
    allocator = use_tcmalloc(True)
    peaks = peak.probe()
    runnable = [c for c in s.cells if matrix.skip_reason(c, allocator, peaks) is None]
    if not runnable:
        print("error: no cell of the matrix runs here")
        return 2
    cell = runnable[0]
    w = build_workload(work / "data", s)
    clock.say(f"workload built: {w.params_m:.1f}M parameters; cell {cell}; {allocator}")
    raw = {
        "machine": machine.describe(),
        "command": " ".join(["python -m scripts.bench", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sizes": s.to_dict(),
        "params_m": w.params_m,
        "allocator": allocator,
        "offline": offline.measure(
            w, s, work / "offline", with_trl, cell, matrix.cell_env(cell, allocator), clock.say
        ),
    }
    raw["machine"]["load_avg_end"] = os.getloadavg()
    raw["elapsed_s"] = time.time() - clock.start
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"offline-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(raw, indent=1, default=float))
    print(console_offline(raw["offline"]))
    print(f"\nraw numbers: {path}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def console_offline(result: dict) -> str:
    header, rows = offline.table(result)
    table = [header, *rows]
    widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(str(c).ljust(n) for c, n in zip(r, widths, strict=True)) for r in table
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--work", type=Path, help="keep run folders here (default: a temp dir)")
    p.add_argument(
        "--cells",
        help="comma-separated subset of the matrix, e.g. fp32+glibc (default: every cell)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="only the SFT and DPO rows (vs TRL's SFTTrainer / DPOTrainer), in the first cell "
        "that runs here; writes bench/results/offline-<time>.json",
    )
    p.add_argument(
        "--more",
        action="store_true",
        help="also (ours): PPO with critic + RM, HF rollouts, 1-rank and 2x-response scaling, "
        "RM without packing/compile; and TRL's RM with torch_compile",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with_trl = importlib.util.find_spec("trl") is not None
    if not with_trl and not args.smoke:
        print(TRL_MISSING)
        return 2
    clock, sizes = Clock(), SMOKE if args.smoke else FULL
    if args.cells:
        cells = tuple(c.strip() for c in args.cells.split(","))
        try:
            for cell in cells:
                matrix.parse_cell(cell)
        except ValueError as e:
            print(f"error: {e}")
            return 2
        sizes = replace(sizes, cells=cells)
    work = args.work or Path(tempfile.mkdtemp(prefix="fsdp_rlhf_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    if not with_trl:
        clock.say(f"{TRL_MISSING}; --smoke measures our side only")
    if args.offline:
        return run_offline_only(sizes, work, with_trl, clock, args)
    raw = {
        "machine": machine.describe(),
        "command": " ".join(["python -m scripts.bench", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        **measure(sizes, work, with_trl, use_tcmalloc(True), clock, args.more, args.out),
    }
    raw["machine"]["load_avg_end"] = os.getloadavg()
    raw["elapsed_s"] = time.time() - clock.start
    raw["headline"], raw["targets"] = headline(raw), targets(headline(raw))
    path = write_json(raw, args.out, time.strftime("%Y%m%d-%H%M%S"))
    (args.out / "summary.md").write_text(summary_md(raw))
    print(console_table(raw))
    print(f"\nraw numbers: {path}\nsummary: {args.out / 'summary.md'}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
