"""`make bench`: fsdp-rlhf against TRL on this machine, side by side (issue #8).

Builds a ~34M-parameter Qwen2 model and synthetic data locally, then runs, interleaved
(A B A B) with medians: reward-model training (ours with --packing_samples --torch_compile vs
TRL RewardTrainer) and a GRPO step (ours with vLLM and --torch_compile vs TRL GRPOTrainer);
then single runs: RM ours without packing and without compile, RM TRL with torch_compile=True,
RM and GRPO pairs with both sides on glibc malloc, and ours alone: HF rollouts, PPO with
critic + RM, 1 rank, and 2x response length. Every run of both sides gets tcmalloc in
LD_PRELOAD when one is installed (vLLM's CPU setup; see fsdp_rlhf/allocator.py). Writes
``bench/results/bench-<time>.json`` (+ ``latest.json``) and ``bench/results/summary.md``, and
prints the table.

    .venv/bin/python cmd/bench.py            # full run, under 20 minutes on 2 CPU cores
    .venv/bin/python cmd/bench.py --smoke    # tiny sizes, one repetition, about a minute

Installs nothing: `make bench` installs TRL first. Without TRL, --smoke runs our side only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "cmd"))  # benchkit/ lives beside this script

from benchkit import machine, rl, rm  # noqa: E402
from benchkit.launch import glibc_env, use_tcmalloc  # noqa: E402
from benchkit.memcpy import memcpy_reference  # noqa: E402
from benchkit.render import console_table  # noqa: E402
from benchkit.report import headline, targets, write_json  # noqa: E402
from benchkit.summary import summary_md  # noqa: E402
from benchkit.workload import FULL, SMOKE, Sizes, Workload, build_workload  # noqa: E402

TRL_MISSING = "trl is not installed: run `make bench` (it installs trl==1.16.0 first)"


class Clock:
    def __init__(self) -> None:
        self.start = time.time()

    def say(self, what: str) -> None:
        print(f"[{time.time() - self.start:6.0f} s] {what}", flush=True)


def run_rm(w: Workload, s: Sizes, work: Path, with_trl: bool, clock: Clock) -> list[dict]:
    runs = []
    for rep in range(s.reps):
        runs.append(rm.run_pair(w, s, work, rep, with_trl))
        got = {k: f"{v['pairs_per_s']:.2f} pairs/s" for k, v in runs[-1].items()}
        clock.say(f"RM rep {rep}: {got}")
    return runs


def run_rl(w: Workload, s: Sizes, work: Path, with_trl: bool, clock: Clock) -> list[dict]:
    runs = []
    for rep in range(s.reps):
        run = {"ours": rl.run_ours(f"grpo_ours_{rep}", w, s, work, s.nproc)}
        clock.say(f"GRPO ours rep {rep}: {run['ours']['e2e_tps']:.1f} tokens/s/rank")
        if with_trl:
            run["trl"] = rl.run_trl(f"grpo_trl_{rep}", w, s, work, s.nproc)
            clock.say(f"GRPO TRL rep {rep}: {run['trl']['e2e_tps']:.1f} tokens/s/rank")
        runs.append(run)
    return runs


def run_rm_single(
    w: Workload, s: Sizes, work: Path, with_trl: bool, clock: Clock
) -> dict[str, dict]:
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


def run_glibc(w: Workload, s: Sizes, work: Path, clock: Clock) -> dict[str, dict]:
    """One RM pair and one GRPO pair with both sides on glibc malloc (no tcmalloc preload)."""
    env = glibc_env()
    rm_pair = {
        "ours": rm.run_ours("rm_ours_glibc", w, s, work, env=env),
        "trl": rm.run_trl("rm_trl_glibc", w, s, work, env=env),
    }
    rl_pair = {
        "ours": rl.run_ours("grpo_ours_glibc", w, s, work, s.nproc, env=env),
        "trl": rl.run_trl("grpo_trl_glibc", w, s, work, s.nproc, env=env),
    }
    clock.say(
        f"glibc malloc: RM ours {rm_pair['ours']['pairs_per_s']:.2f} vs TRL "
        f"{rm_pair['trl']['pairs_per_s']:.2f} pairs/s; GRPO ours {rl_pair['ours']['e2e_tps']:.1f}"
        f" vs TRL {rl_pair['trl']['e2e_tps']:.1f} tokens/s/rank"
    )
    return {"rm": rm_pair, "rl": rl_pair}


def run_extra(w: Workload, s: Sizes, work: Path, clock: Clock) -> dict[str, dict]:
    """Ours only: HF rollouts, PPO with critic and RM (the RM trained in RM rep 0), scaling.

    The 1-rank run gets one thread, like each of the 2 ranks: 1 core vs 2 cores.
    """
    jobs = {
        "hf rollouts": dict(nproc=s.nproc, engine="hf"),
        "ppo critic+rm": dict(nproc=s.nproc, rm=work / "rm_ours_0"),
        "1 rank": dict(nproc=1, env={"OMP_NUM_THREADS": "1"}),
        "2x response": dict(nproc=s.nproc, resp_len=2 * s.rl_resp_len),
    }
    out = {}
    for name, kw in jobs.items():
        out[name] = rl.run_ours(name.replace(" ", "_").replace("+", "_"), w, s, work, **kw)
        clock.say(f"ours {name}: {out[name]['e2e_tps']:.1f} tokens/s/rank")
    return out


def measure(s: Sizes, work: Path, with_trl: bool, allocator: str, clock: Clock) -> dict:
    w = build_workload(work / "data", s)
    clock.say(f"workload built: {w.params_m:.1f}M parameters in {work}; allocator: {allocator}")
    raw = {
        "allocator": allocator,
        "sizes": s.to_dict(),
        "params_m": w.params_m,
        "with_trl": with_trl,
        "rm_tokens_per_pair": rm.tokens_per_pair(w),
        "memcpy": memcpy_reference(int(w.params_m * 1e6) * 2),
    }  # bf16 sync bytes
    raw["rm_runs"] = run_rm(w, s, work, with_trl, clock)
    raw["rl_runs"] = run_rl(w, s, work, with_trl, clock)
    if s.extra_runs:
        raw["rm_single"] = run_rm_single(w, s, work, with_trl, clock)
        if with_trl and raw["allocator"].startswith("tcmalloc"):
            raw["glibc"] = run_glibc(w, s, work, clock)
        raw["extra"] = run_extra(w, s, work, clock)
    return raw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--work", type=Path, help="keep run folders here (default: a temp dir)")
    p.add_argument(
        "--malloc",
        choices=("tcmalloc", "glibc"),
        default="tcmalloc",
        help="allocator of every run, both sides (tcmalloc when installed; default)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with_trl = importlib.util.find_spec("trl") is not None
    if not with_trl and not args.smoke:
        print(TRL_MISSING)
        return 2
    clock, sizes = Clock(), SMOKE if args.smoke else FULL
    work = args.work or Path(tempfile.mkdtemp(prefix="fsdp_rlhf_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    if not with_trl:
        clock.say(f"{TRL_MISSING}; --smoke measures our side only")
    raw = {
        "machine": machine.describe(),
        "command": " ".join(["cmd/bench.py", *sys.argv[1:]]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        **measure(sizes, work, with_trl, use_tcmalloc(args.malloc == "tcmalloc"), clock),
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
