"""Expert weight bytes, bytes moved per MoE layer forward and step time, EP=1 against EP=2 and EP=4
on 4 gloo ranks (issue #50), beside the memory model's formulas.

Each case is a fresh 4-rank gloo job (``torch.distributed.run``, one thread per rank) that shards
a Qwen3-MoE-shaped model with ``--expert_parallel_size E`` as the trainer does
(``distributed.fsdp.shard_model``) and runs the actor update's forward and backward
(``models.forward.response_logprobs``, the loss's backward) on each rank's own rows. Per rank it
measures:

- the expert weights it holds (its shards) and what one MoE layer's forward gathers of them
  (the unsharded expert tensors of its expert group, read in a forward hook);
- the bytes one MoE layer's forward moves: FSDP2's all-gathers inside a decoder layer's
  forward (its own and, under EP, its expert unit's; what a rank receives, its own shard not
  counted; counted around ``dist.all_gather_single``) and the token exchange (the rows
  sent and received by both all-to-alls, around ``distributed.expert_parallel._all_to_all``);
- the step time (median and min of ``--steps``) and the peak RSS growth during a step (VmHWM
  after ``/proc/self/clear_refs``; glibc's mmap threshold pinned at 1 MiB, no tcmalloc).

The model: 4 layers, hidden 256, 4 query / 2 KV heads of 64, 32 experts of intermediate 256, top
4, vocabulary 1024, fp32; 2 rows of 512 tokens per rank.

    python -m scripts.benchkit.expert_parallel --rounds 2 --json out.json   # A B C, then C B A
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
WORLD = 4
SHAPE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
ROWS, LENGTH, PROMPT = 2, 512, 64


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def formulas(ep: int) -> dict[str, float]:
    """The memory model's numbers for this shape (``distributed.memory``), fp32 bytes."""
    from fsdp_rlhf.distributed.memory import JobFlags, ModelShape, all_to_all_bytes

    m = ModelShape.from_hf_config(SHAPE)
    per_layer = m.experts // m.layers
    f = JobFlags(world=WORLD, device_bytes=1 << 40, bf16=False, seq_len=LENGTH,
                 expert_parallel=ep)  # fmt: skip
    dense = m.layer_params - per_layer  # attention, norms, router
    return {
        "expert_held_bytes": 4 * m.experts / WORLD,
        "expert_gathered_per_layer_bytes": 4 * per_layer / ep,
        # what the all-gathers bring: the dense part from the other W - 1 ranks, the experts
        # from the other W / E - 1 ranks holding the same ones
        "all_gather_per_layer_bytes": 4
        * (dense * (1 - 1 / WORLD) + per_layer / ep * (1 - ep / WORLD)),
        # bf16 in the model (2 bytes per value): fp32 here
        "all_to_all_per_layer_bytes": 2 * all_to_all_bytes(f, m, ROWS),
    }


def worker(ep_size: int, steps: int) -> dict:
    """One rank of one case (under torch.distributed.run); returns this rank's row."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed import expert_parallel
    from fsdp_rlhf.distributed.fsdp import build_mesh, decoder_layers, shard_model
    from fsdp_rlhf.models.attention import PADDED_ATTENTION, register_attention
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ep = expert_parallel.new_expert_parallel_groups(ep_size, "cpu")
    register_attention()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE)).float()
    model.set_attn_implementation(PADDED_ATTENTION)
    mesh = build_mesh(torch.device("cpu"), dist.get_world_size())
    layers = decoder_layers(model)  # before fully_shard renames their classes
    shard_model(model, mesh, FSDPConfig(zero_stage=3), bf16=False, grad_reduce="sum", ep=ep)
    model.train()
    units = expert_parallel.routed_experts(model)
    moved = {"all_gather": 0, "all_to_all": 0}
    counting = [False]
    all_gather = dist.all_gather_single

    def counted_all_gather(output_tensor, input_tensor, *args, **kwargs):
        if counting[0]:  # received: the whole output minus this rank's own shard
            mine = input_tensor.numel() * input_tensor.element_size()
            moved["all_gather"] += output_tensor.numel() * output_tensor.element_size() - mine
        return all_gather(output_tensor, input_tensor, *args, **kwargs)

    dist.all_gather_single = counted_all_gather  # FSDP2's default all-gather calls it
    counted = [False]  # the one forward that is measured

    def enter(module, args):  # before FSDP2's pre-forward: its all-gathers are counted
        counting[0] = counted[0]

    def leave(module, args, output):
        counting[0] = False

    for layer in layers:
        layer.register_forward_pre_hook(enter, prepend=True)
        layer.register_forward_hook(leave)
    gathered = []

    def hook(module, args):  # after FSDP2's pre-forward: the experts as the forward sees them
        if counting[0]:
            local = [p.to_local() if isinstance(p, DTensor) else p
                     for p in module.parameters(recurse=False)]  # fmt: skip
            gathered.append(sum(t.numel() * t.element_size() for t in local))

    for unit in units:
        unit.register_forward_pre_hook(hook)
    exchange = expert_parallel._all_to_all

    def counted_exchange(x, recv, send, group):
        out = exchange(x, recv, send, group)
        if counting[0]:
            moved["all_to_all"] += (x.numel() + out.numel()) * x.element_size()
        return out

    expert_parallel._all_to_all = counted_exchange
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, SHAPE["vocab_size"], (ROWS, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    T = LENGTH - PROMPT  # response tokens

    def step() -> float:
        start = time.perf_counter()
        lp, _ = response_logprobs(model, forward_inputs(ids, mask, response_len=T), T)
        (-lp.mean()).backward()
        return time.perf_counter() - start

    step()  # warm-up: kernels, thread pools, gloo buffers, the gradient shards
    with torch.no_grad():  # one forward, counted inside its decoder layers
        counted[0] = True
        response_logprobs(model, forward_inputs(ids, mask, response_len=T), T)
        counted[0] = False
    n_layers = len(layers)
    held = sum(
        p.to_local().numel() * p.element_size() for u in units for p in u.parameters(recurse=False)
    )
    gc.collect()
    base = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
    times = [step() for _ in range(steps)]
    peak = _status_kib("VmHWM")
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": rank,
        "ep": ep_size,
        "expert_held_bytes": held,
        "expert_gathered_per_layer_bytes": statistics.mean(gathered),
        "all_gather_per_layer_bytes": moved["all_gather"] / n_layers,
        "all_to_all_per_layer_bytes": moved["all_to_all"] / n_layers,
        "model": formulas(ep_size),
        "step_activation_mib": round((peak - base) / 1024, 1),
        "step_s": [round(t, 3) for t in times],
        "median_step_s": round(statistics.median(times), 3),
        "min_step_s": round(min(times), 3),
        "load_1min": round(os.getloadavg()[0], 2),
    }


def run_case(ep_size: int, steps: int) -> list[dict]:
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
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "scripts.benchkit.expert_parallel", "--worker", "--ep", str(ep_size),
        "--steps", str(steps),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as rows_dir:  # one file per rank: no interleaved lines
        out = subprocess.run(
            [*cmd, "--rows", rows_dir], capture_output=True, text=True, env=env, cwd=REPO
        )
        if out.returncode != 0:
            raise RuntimeError(f"EP={ep_size} failed:\n{out.stderr[-3000:]}")
        rows = [json.loads(f.read_text()) for f in sorted(Path(rows_dir).glob("rank*.json"))]
    return sorted(rows, key=lambda r: r["rank"])


def _kib(n: float) -> str:
    return f"{n / 1024:.0f} KiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--rounds", type=int, default=1, help="repeat every case, EP order reversed each round"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args()
    if a.worker:
        row = worker(a.ep[0], a.steps)
        (a.rows / f"rank{row['rank']}.json").write_text(json.dumps(row))
        return 0
    rows = []
    for round_ in range(a.rounds):
        for ep_size in a.ep if round_ % 2 == 0 else a.ep[::-1]:
            case = run_case(ep_size, a.steps)
            for r in case:
                r["round"] = round_
                m = r["model"]
                print(
                    f"round {round_} EP={ep_size} rank {r['rank']}: experts held "
                    f"{_kib(r['expert_held_bytes'])} (model {_kib(m['expert_held_bytes'])}), "
                    f"gathered/layer {_kib(r['expert_gathered_per_layer_bytes'])} (model "
                    f"{_kib(m['expert_gathered_per_layer_bytes'])}), all-gather in/layer "
                    f"{_kib(r['all_gather_per_layer_bytes'])} (model "
                    f"{_kib(m['all_gather_per_layer_bytes'])}), all-to-all/layer "
                    f"{_kib(r['all_to_all_per_layer_bytes'])} (model "
                    f"{_kib(m['all_to_all_per_layer_bytes'])}), step {r['median_step_s']:.2f} s "
                    f"median / {r['min_step_s']:.2f} s min, +{r['step_activation_mib']:.0f} MiB, "
                    f"load {r['load_1min']}",
                    flush=True,
                )
            rows += case
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
