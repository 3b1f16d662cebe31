"""Asynchronous against colocated PPO on the same 2 ranks: wall time per step and samples/s.

``python -m scripts.benchkit.async_vs_sync --out benchmarks/<file>.json`` (under ``heavy`` on
a shared machine). Each scenario runs the CLI under torchrun on 2 local ranks: colocated (both
ranks generate, score and train) and ``--async_train --vllm_num_engines 1`` (rank 0 trains,
rank 1 generates one step ahead), in alternation, ``--repeats`` times each:

* ``slow_reward``: GRPO with the rule reward behind an HTTP server that answers every request
  after a fixed delay (``--reward_delay_s``), as a remote verifier or an LLM judge would;
* ``varied_lengths``: GRPO whose responses stop at random lengths (the tiny model's generation
  config lists a dozen stop tokens: most responses are short, a few run to
  ``generate_max_len``), colocated, async, and async over-sampling 20 prompts for 16.

Per-step wall time is measured from outside: the time between consecutive rows appearing in
``metrics.jsonl`` (polled every 10 ms), steps 3 onwards (the first steps include start-up and
the async queue filling). Reported per scenario and mode: median and spread of step seconds,
samples (prompts x samples per prompt) per second, and the runs' medians of the phase timings
each mode logs (``timing/rollout``, ``timing/train_wait``, ``timing/rollout_wait``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from scripts.benchkit.machine import describe

REPO = Path(__file__).resolve().parents[2]
STOP_TOKENS = 12  # token ids listed as EOS in the varied-lengths model's generation config


def reward_server(delay_s: float) -> tuple[ThreadingHTTPServer, str]:
    """A rule reward over HTTP (prefers short answers, like the tests' task) that answers
    each request after ``delay_s`` seconds."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(delay_s)
            rewards = [
                max(0.0, 1.0 - len(q[len(p) :]) / 100.0)
                for q, p in zip(body["query"], body["prompts"], strict=True)
            ]
            data = json.dumps({"rewards": rewards}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/reward"


def build(root: Path) -> dict[str, str]:
    from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl
    from fsdp_rlhf.testing.tiny import build_model

    model = build_model(root / "model", "qwen2")
    varied = build_model(root / "varied", "qwen2")
    config_path = varied / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["eos_token_id"] = list(range(100, 100 + STOP_TOKENS))
    config_path.write_text(json.dumps(config))
    write_jsonl(prompt_rows(512, chat=True), root / "prompts.jsonl")
    return {"model": str(model), "varied": str(varied), "prompts": str(root / "prompts.jsonl")}


def flags(paths: dict[str, str], model: str, reward: str, save: Path, steps: int, gen: int):
    return [
        *("--pretrain", paths[model], "--remote_rm_url", reward),
        *("--prompt_data", paths["prompts"], "--input_key", "input"),
        *("--rollout_batch_size", "16", "--n_samples_per_prompt", "4"),
        *("--advantage_estimator", "grpo", "--train_batch_size", "64"),
        *("--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16"),
        *("--packing_samples", "--generate_max_len", str(gen), "--prompt_max_len", "32"),
        *("--max_steps", str(steps), "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0"),
        *("--use_kl_loss", "--init_kl_coef", "0.001", "--seed", "7"),
        *("--save_path", str(save), "--ckpt_path", str(save / "ckpt"), "--save_steps", "-1"),
    ]


def run(
    args: list[str],
    save: Path,
    timeout: float = 1800,
    nproc: int = 2,
    extra_env: dict[str, str] | None = None,
) -> dict:
    """One torchrun run on ``nproc`` ranks (``extra_env`` added); the wall time between
    consecutive metrics rows, and the rows."""
    from fsdp_rlhf.testing.launch import local_torchrun

    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    env["TOKENIZERS_PARALLELISM"] = "false"
    cmd = local_torchrun(nproc, ["-m", "fsdp_rlhf.cli", "ppo", *args])
    metrics = save / "metrics.jsonl"
    arrivals: list[float] = []
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    with open(save.parent / f"{save.name}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        while proc.poll() is None:
            if metrics.exists():
                rows = metrics.read_text().count("\n")
                arrivals += [time.monotonic()] * (rows - len(arrivals))
            if time.monotonic() - t0 > timeout:
                proc.kill()
            time.sleep(0.01)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}): see {save.parent / save.name}.log")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "wall_s": time.monotonic() - t0,
        "step_s": steps[1:],  # from step 3 on: steps[i] is step i+2
        "rows": rows,
        "load_avg_1m": [load, os.getloadavg()[0]],
    }


def summarise(runs: list[dict], samples: int) -> dict:
    steps = [s for r in runs for s in r["step_s"]]
    median = statistics.median(steps)
    out = {
        "step_s_median": median,
        "step_s_min": min(steps),
        "step_s_max": max(steps),
        "samples_per_s": samples / median,
        "runs": len(runs),
        "load_avg_1m": [r["load_avg_1m"] for r in runs],
    }
    for key in (
        "timing/all",
        "timing/rollout",
        "timing/train_wait",
        "timing/rollout_wait",
        "timing/rule_reward",
        "timing/update",
        "response_length/mean",
        "response_length/max",
        "async/staleness_mean",
        "critic/score/mean",
    ):
        values = [row[key] for r in runs for row in r["rows"][2:] if key in row]
        if values:
            out[key] = statistics.median(values)
    return out


SCENARIOS = {
    # name: (model, generate_max_len, reward over HTTP, {mode: extra flags})
    "slow_reward": (
        "model",
        16,
        True,
        {"colocated": [], "async": ["--async_train", "--vllm_num_engines", "1"]},
    ),
    "varied_lengths": (
        "varied",
        192,
        False,
        {
            "colocated": [],
            "async": ["--async_train", "--vllm_num_engines", "1"],
            "async_oversample_20": [
                *("--async_train", "--vllm_num_engines", "1"),
                *("--vllm_generate_batch_size", "20"),
            ],
        },
    ),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--reward_delay_s", type=float, default=1.0)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="async_bench_"))
    paths = build(root)
    server, url = reward_server(a.reward_delay_s)
    local_reward = root / "reward.py"
    local_reward.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return [max(0.0, 1.0 - len(q[len(p):]) / 100.0) for q, p in zip(queries, prompts)]\n"
    )
    results = {"machine": describe(), "steps": a.steps, "delay_s": a.reward_delay_s}
    try:
        for name in a.scenarios.split(","):
            model, gen, http, modes = SCENARIOS[name]
            reward = url if http else str(local_reward)
            collected: dict[str, list[dict]] = {m: [] for m in modes}
            for i in range(a.repeats):
                for mode, extra in modes.items():  # alternated: drift hits every mode alike
                    save = root / f"{name}_{mode}_{i}"
                    args = [*flags(paths, model, reward, save, a.steps, gen), *extra]
                    collected[mode].append(run(args, save))
                    print(name, mode, i, statistics.median(collected[mode][-1]["step_s"]))
            results[name] = {m: summarise(r, 16 * 4) for m, r in collected.items()}
            Path(a.out).write_text(json.dumps(results, indent=1))
    finally:
        server.shutdown()
    results["machine"]["load_avg_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
