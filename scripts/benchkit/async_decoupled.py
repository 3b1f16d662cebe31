"""Asynchronous PPO with 2 engines: weight versions delivered to each rollout rank on its own
(decoupled) against one delivery that waits for every rollout rank (lock-step).

``python -m scripts.benchkit.async_decoupled --out benchmarks/<f>.json`` runs the CLI under
torchrun on 3 local ranks (1 training rank, 2 engines of TP 1, ``--async_queue_size 1``) as it
is (decoupled) and with ``FSDP_RLHF_LOCKSTEP_WEIGHTS=1`` (lock-step: every header, manifest and
payload of a weight version waits until every rollout rank took it, as before; a measurement
hook of ``distributed.weight_broadcast``), in alternation, ``--repeats`` times each:

* ``varied_lengths``: GRPO whose responses stop at random lengths (the tiny model's generation
  config lists a dozen stop tokens: most responses are short, a few run to
  ``generate_max_len``), so in each step one engine's share of the batch takes longer than
  the other's, at random;
* ``engine_time``: the same, with each batch also holding its rollout rank for 15 ms per
  character of its longest response (a sleep in the rule reward, which runs on the rollout
  ranks): time per engine that, as on separate GPUs, the other engine cannot use (on this
  machine's shared cores, an idle engine's CPU goes to the busy one).

Per-step wall time is measured from outside, as in ``async_vs_sync`` (steps 3 onwards).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from scripts.benchkit.async_vs_sync import build, flags, run, summarise
from scripts.benchkit.machine import describe

FAST_REWARD = (
    "def reward_func(queries, prompts, labels):\n"
    "    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]\n"
)
# the rule reward runs on the rollout ranks: a batch holds its engine longer the longer its
# longest response (a sleep: time the other engine cannot use, as on a device of its own)
ENGINE_TIME_REWARD = (
    "import time\n\n\n"
    "def reward_func(queries, prompts, labels):\n"
    "    longest = max(len(q) - len(p) for q, p in zip(queries, prompts))\n"
    "    time.sleep({per_char} * longest)\n"
    "    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]\n"
)
ASYNC_2 = ["--async_train", "--vllm_num_engines", "2", "--async_queue_size", "1"]
KEYS = ("timing/rollout_wait", "timing/weight_load", "timing/weight_sync", "timing/rule_reward")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--per_char_s", type=float, default=0.015)
    p.add_argument("--scenarios", default="varied_lengths,engine_time")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="async_decoupled_"))
    paths = build(root)
    rewards = {
        "varied_lengths": root / "fast_reward.py",
        "engine_time": root / "engine_time_reward.py",
    }
    rewards["varied_lengths"].write_text(FAST_REWARD)
    rewards["engine_time"].write_text(ENGINE_TIME_REWARD.format(per_char=a.per_char_s))
    modes = {"lockstep": {"FSDP_RLHF_LOCKSTEP_WEIGHTS": "1"}, "decoupled": {}}
    results = {"machine": describe(), "steps": a.steps, "per_char_s": a.per_char_s}
    for name in a.scenarios.split(","):
        collected: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(a.repeats):
            for mode, env in modes.items():  # alternated: drift hits both alike
                save = root / f"{name}_{mode}_{i}"
                args = [*flags(paths, "varied", str(rewards[name]), save, a.steps, 192), *ASYNC_2]
                collected[mode].append(run(args, save, nproc=3, extra_env=env))
                print(name, mode, i, statistics.median(collected[mode][-1]["step_s"]), flush=True)
        results[name] = {m: summarise(r, 16 * 4) for m, r in collected.items()}
        for mode, runs in collected.items():
            for key in KEYS:
                values = [row[key] for r in runs for row in r["rows"][2:] if key in row]
                if values:
                    results[name][mode][key] = statistics.median(values)
            results[name][mode]["step_s_all"] = [r["step_s"] for r in runs]
        lock, dec = results[name]["lockstep"], results[name]["decoupled"]
        results[name]["speedup"] = lock["step_s_median"] / dec["step_s_median"]
        Path(a.out).write_text(json.dumps(results, indent=1))
    results["machine"]["load_avg_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
