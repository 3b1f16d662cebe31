"""Peak memory per rank and step time of one long sequence's update, SP=1 against SP=2 (issue #38).

Each case is a fresh 2-rank gloo job (``torch.distributed.run``, one thread per rank) that runs
the actor update's forward and backward (``models.forward.response_logprobs`` with grad, the
loss's backward) on one sequence of ``L`` tokens per micro-batch:

- SP=1: two data-parallel ranks, each with its own sequence of L tokens;
- SP=2: one sequence-parallel group, each rank holding L/2 tokens of the one sequence.

Per rank it reports the resident memory before the step (model shards, gradients, optimizer-
free), the peak during it (Linux's VmHWM after resetting it through ``/proc/self/clear_refs``;
glibc's mmap threshold pinned at 1 MiB and no tcmalloc, so freed tensors leave the RSS) and the
difference, which is the step's activations (and its attention and all-to-all buffers). The
model is built in memory with a small hidden size so that 16k tokens fit a laptop's RAM: a
4-layer Qwen2, hidden 256, 4 query / 2 KV heads of 64, MLP 768, vocabulary 1024, fp32.

    python -m scripts.benchkit.sequence_parallel                  # 2k, 8k, 16k x SP 1, 2
    python -m scripts.benchkit.sequence_parallel --rounds 2 --json out.json  # A B, then B A
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
SHAPE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=65536,
    tie_word_embeddings=False,
)
PROMPT = 64


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def worker(length: int, sp_size: int, steps: int) -> dict:
    """One rank of one case (under torch.distributed.run); returns this rank's row."""
    import gc

    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.distributed.layout import build_layout
    from fsdp_rlhf.models.attention import PADDED_ATTENTION, register_attention
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.ulysses import use_ulysses_attention

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parallel = build_layout(sp_size)
    sp = parallel.sp
    register_attention()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE)).float()
    model.set_attn_implementation(PADDED_ATTENTION)
    if sp.enabled:
        use_ulysses_attention(model)
    mesh = build_mesh(torch.device("cpu"), dist.get_world_size())
    shard_model(model, mesh, FSDPConfig(), bf16=False, grad_reduce="sum", dp_size=parallel.dp_size)
    model.train()
    # SP=1: each rank its own sequence; SP=2: the group's one sequence on both ranks
    g = torch.Generator().manual_seed(100 + parallel.dp_rank)

    def batch(n: int):
        ids = torch.randint(3, SHAPE["vocab_size"], (1, n), generator=g)
        return ids, torch.ones_like(ids)

    def step(ids, mask) -> float:
        start = time.perf_counter()
        lp, _ = response_logprobs(model, forward_inputs(ids, mask, sp=sp), ids.shape[1] - PROMPT)
        (-lp.mean()).backward()
        return time.perf_counter() - start

    step(*batch(1024))  # warm-up: kernels, thread pools, gloo buffers, the gradient shards
    ids, mask = batch(length)
    gc.collect()
    base = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    times = [step(ids, mask) for _ in range(steps)]
    peak = _status_kib("VmHWM")
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "length": length,
        "sp": sp_size,
        "tokens_per_rank": -(-length // sp_size),
        "base_mib": round(base / 1024, 1),
        "peak_mib": round(peak / 1024, 1),
        "activation_mib": round((peak - base) / 1024, 1),
        "step_s": [round(t, 3) for t in times],
        "median_step_s": round(statistics.median(times), 3),
        # other jobs only ever slow a step down: the fastest is the least disturbed
        "min_step_s": round(min(times), 3),
        "load_1min": round(os.getloadavg()[0], 2),
    }


def run_case(length: int, sp_size: int, steps: int) -> list[dict]:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
        "LD_PRELOAD": "",
        "FSDP_RLHF_TCMALLOC": "0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }
    from fsdp_rlhf.distributed.env import free_port

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "scripts.benchkit.sequence_parallel", "--worker",
        "--lengths", str(length), "--sp", str(sp_size), "--steps", str(steps),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as rows_dir:  # one file per rank: no interleaved lines
        out = subprocess.run(
            [*cmd, "--rows", rows_dir], capture_output=True, text=True, env=env, cwd=REPO
        )
        if out.returncode != 0:
            raise RuntimeError(f"L={length} SP={sp_size} failed:\n{out.stderr[-3000:]}")
        rows = [json.loads(f.read_text()) for f in sorted(Path(rows_dir).glob("rank*.json"))]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat every case, SP order reversed each round"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args()
    if a.worker:
        row = worker(a.lengths[0], a.sp[0], a.steps)
        (a.rows / f"rank{row['rank']}.json").write_text(json.dumps(row))
        return 0
    rows = []
    for round_ in range(a.rounds):
        for length in a.lengths:
            for sp_size in a.sp if round_ % 2 == 0 else a.sp[::-1]:
                case = run_case(length, sp_size, a.steps)
                for r in case:
                    r["round"] = round_
                    print(
                        f"round {round_} L={length:6d} SP={sp_size} rank {r['rank']}: base "
                        f"{r['base_mib']:.0f} MiB, peak {r['peak_mib']:.0f} MiB, activations "
                        f"+{r['activation_mib']:.0f} MiB, step {r['median_step_s']:.2f} s median "
                        f"/ {r['min_step_s']:.2f} s min of {a.steps}, load {r['load_1min']}",
                        flush=True,
                    )
                rows += case
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
