"""The GPU MFU ladder (issue #58): the actor update on Qwen2.5-1.5B's shape, one lever at a time.

One command for a lent GPU (the bare box: torch 2.11, no flash-attn, vLLM or ``datasets``; the
exact ``run`` call is in docs/gpu.md), at most about 6 minutes:

1. prints the installed ``varlen_attn``'s signature and how it is called
   (``models.varlen``), and checks the chosen kernel against the per-sequence loop in bf16:
   outputs and dq/dk/dv of a packed row (GQA, K/V unrepeated) and of shared-prompt rows
   (segments with more keys than queries, left-padded prompts), each against an fp32 loop;
2. runs the rungs, each cumulative on the one before, on a model built on the GPU with random
   weights (28 layers, hidden 1536, 12 / 2 heads, vocabulary 151,936, tied embeddings), bf16
   with fp32 master weights under FSDP2 ZeRO-3, 4 micro-batches of 4 x 1,024-token sequences
   (256 prompt + 768 response) packed into one 4,096-token row, log-probs of the responses, a
   PPO-clip-shaped loss, clipping, AdamW; 1 warm-up step and 3 timed:

   - ``baseline``: the code before issue #58 (per-sequence attention loop, transformers' full
     recompute, FSDP2 resharding and reducing at every micro-batch with its layer input casts,
     the head's fixed CPU-sized blocks, clipping one gradient at a time);
   - ``varlen``: one varlen kernel call per layer;
   - ``+compiled layers``: whole decoder layers compiled, ``fullgraph=True``;
   - ``+FSDP/head/clipping``: one all-gather and one reduce-scatter per layer per step
     (``--accumulate_gathered``), no layer input casts, the head's blocks sized from free
     memory, foreach clipping with one host read;
   - ``+selective checkpointing``: matmul and attention outputs kept, no recomputed matmul;
   - ``+float8``: torchao's rowwise float8 (only where torchao is installed);
   - ``grpo shared-prompt``: the last rung's levers on GRPO's default layout (each group's
     prompt computed once, its 4 responses as varlen segments), the same 16,384 tokens.

   Per rung: tokens/s, MFU and HFU (against 989 TFLOP/s bf16 dense), peak allocated GiB, the
   first step's extra time (compilation), kernel launches per step and the GPU's busy time
   over the step (a profiled step), and host syncs per step (``set_sync_debug_mode``).
   The JSON ``{"rungs": [...], "checks": [...], "device", "torch", ...}`` is rewritten after
   every rung, so a command cut short still returns the rungs done.

``--dry-run`` runs every rung's code on CPU at a tiny size (the varlen kernel replaced by the
CPU reference op, ``fsdp_rlhf.testing.varlen_reference``; compiled with ``aot_eager``, which
traces the same graphs without generating code): the figures mean nothing there, the code
paths are the GPU's.

Model FLOPs count what the update needs (6 x the body's parameters per token, causal
attention's pairs, the head on the response positions); hardware FLOPs add a recomputed
forward under full recompute (selective checkpointing recomputes no matmul).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

PEAK_BF16 = 989e12  # H100 SXM / H200 dense bf16 (shared/research/roofline.py)


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rows: int  # sequences per micro-batch (one GRPO group in the shared-prompt rung)
    row_len: int  # tokens per sequence
    response: int  # the last ``response`` tokens of each are the response
    micro: int  # micro-batches per optimizer step


FULL = Shape(1536, 8960, 28, 12, 2, 151_936, rows=4, row_len=1024, response=768, micro=4)
TINY = Shape(64, 128, 2, 4, 2, 256, rows=3, row_len=24, response=16, micro=2)


@dataclass(frozen=True)
class Rung:
    name: str
    varlen: bool = False
    compiled: bool = False
    fsdp_head_clip: bool = False
    selective: bool = False
    float8: bool = False
    shared_prompts: bool = False


BASELINE = Rung("baseline")
VARLEN = replace(BASELINE, name="varlen", varlen=True)
COMPILED = replace(VARLEN, name="+compiled layers", compiled=True)
FSDP = replace(COMPILED, name="+FSDP/head/clipping", fsdp_head_clip=True)
SELECTIVE = replace(FSDP, name="+selective checkpointing", selective=True)
FLOAT8 = replace(SELECTIVE, name="+float8", float8=True)
RUNGS = [BASELINE, VARLEN, COMPILED, FSDP, SELECTIVE, FLOAT8]


def grpo_rung(last: Rung) -> Rung:
    return replace(last, name="grpo shared-prompt", shared_prompts=True)


# ---------------------------------------------------------------- FLOPs


def model_flops(s: Shape, shared: bool) -> float:
    """Model FLOPs of one optimizer step (forward + backward = 3 x forward)."""
    d = s.hidden // s.heads
    per_layer = 2 * s.hidden * s.heads * d + 2 * s.hidden * s.kv_heads * d
    per_layer += 3 * s.hidden * s.intermediate
    P, T = s.row_len - s.response, s.response
    if shared:  # one prompt per group, then its responses
        tokens = s.micro * (P + s.rows * T)
        pairs = s.micro * (P * P / 2 + s.rows * (T * P + T * T / 2))
    else:
        tokens = s.micro * s.rows * s.row_len
        pairs = s.micro * s.rows * s.row_len**2 / 2
    head_positions = s.micro * s.rows * T
    fwd = 2 * s.layers * per_layer * tokens + 2 * s.vocab * s.hidden * head_positions
    fwd += 4 * s.layers * s.heads * d * pairs  # QK^T and AV over the attended pairs
    return 3 * fwd


# ---------------------------------------------------------------- the checks


def kernel_checks(device: torch.device, dry_run: bool) -> list[dict]:
    """The chosen varlen kernel against the loop, bf16, each against an fp32 loop."""
    from fsdp_rlhf.models.attention import shared_prompt_attention, shared_prompt_varlen
    from fsdp_rlhf.models.varlen import select_kernel, shared_prompt_segments

    g = torch.Generator(device="cpu").manual_seed(0)
    D = 16 if dry_run else 128
    H, KV = (4, 2) if dry_run else (12, 2)
    lengths = [9, 5, 14] if dry_run else [1024, 700, 300, 2072]
    out = []
    probe = torch.empty(1, dtype=torch.bfloat16, device=device)
    kernel = select_kernel(probe)
    if kernel is None:
        return [{"name": "varlen kernel", "pass": False, "error": "no varlen kernel here"}]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    # packed row: q (1, H, T, D), k/v (1, KV, T, D)
    T = sum(lengths)
    q, k, v, grad = rand(1, H, T, D), rand(1, KV, T, D), rand(1, KV, T, D), rand(1, T, H, D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    cu = cu.to(torch.int32)

    def packed(qq, kk, vv, use_kernel: bool):
        from fsdp_rlhf.models.attention import varlen_loop

        if use_kernel:
            a, b, c = (x[0].transpose(0, 1) for x in (qq, kk, vv))
            return kernel.call(a, b, c, cu, cu, max(lengths), max(lengths), None, None)[None]
        return varlen_loop(qq, kk, vv, 0.0, None, cu)

    out.append(_compare("packed row (GQA, K/V unrepeated)", packed, (q, k, v), grad))

    # shared-prompt rows: G groups, s responses, left-padded prompts
    G, s = 2, 3
    P, Tr = (7, 5) if dry_run else (300, 500)
    plens = [P, P - 3]
    L = P + s * Tr
    q, k, v, grad = rand(G, H, L, D), rand(G, KV, L, D), rand(G, KV, L, D), rand(G, L, H, D)
    prompt_mask = torch.zeros(G, 1, 1, P, dtype=torch.bool, device=device)
    for i, n in enumerate(plens):
        prompt_mask[i, ..., P - n :] = True
    response_mask = torch.ones(G * s, 1, 1, Tr, dtype=torch.bool, device=device)
    lens = torch.tensor(plens, device=device)
    segments = shared_prompt_segments(lens, plens, P, s, Tr)

    def shared(qq, kk, vv, use_kernel: bool):
        if use_kernel:
            return shared_prompt_varlen(kernel, qq, kk, vv, segments)
        return shared_prompt_attention(qq, kk, vv, prompt_mask, response_mask)

    real = torch.ones(G, L, dtype=torch.bool, device=device)
    for i, n in enumerate(plens):
        real[i, : P - n] = False  # left padding: not compared (the kernel gives zeros)
    out.append(_compare("shared-prompt rows", shared, (q, k, v), grad, real))
    for c in out:
        c["kernel"] = kernel.name
    return out


def _compare(name, fn, inputs, grad, keep=None) -> dict:
    """bf16 kernel and bf16 loop, each against the fp32 loop: output and dq/dk/dv."""
    results = {}
    runs = (("kernel", torch.bfloat16, True), ("loop", torch.bfloat16, False),
            ("fp32", torch.float32, False))  # fmt: skip
    for label, dtype, use_kernel in runs:
        leaves = [x.to(dtype).requires_grad_() for x in inputs]
        o = fn(*leaves, use_kernel)
        g = grad.to(dtype)
        if keep is not None:
            g = g * keep[..., None, None]
        o.backward(g)
        o = o.detach().float()
        if keep is not None:
            o = o * keep[..., None, None]
        results[label] = [o] + [x.grad.float() for x in leaves]
    names = ["out", "dq", "dk", "dv"]
    row: dict = {"name": name}
    ok = True
    for i, n in enumerate(names):
        ref = results["fp32"][i]
        scale = ref.abs().max().item() or 1.0
        k_err = (results["kernel"][i] - ref).abs().max().item() / scale
        l_err = (results["loop"][i] - ref).abs().max().item() / scale
        row[f"{n}_kernel_err"], row[f"{n}_loop_err"] = k_err, l_err
        ok &= k_err <= max(2 * l_err, 2e-2)
    row["pass"] = bool(ok)
    return row


# ---------------------------------------------------------------- one rung


def build(rung: Rung, s: Shape, device: torch.device, compile_backend: str):
    """The actor as the trainer prepares it (``trainers.common.prepare_model``'s order):
    built on the device, checkpointing, attention, float8, compiled layers, FSDP2 shards."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.config import BackendConfig, FSDPConfig, OptimConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.attention import (
        PADDED_ATTENTION,
        register_attention,
        use_varlen_attention,
    )
    from fsdp_rlhf.models.compile import compile_blocks
    from fsdp_rlhf.models.load import enable_checkpointing
    from fsdp_rlhf.optim import build_optimizer

    config = Qwen2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
        use_cache=False,
    )  # fmt: skip
    register_attention()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(
            config, attn_implementation=PADDED_ATTENTION, dtype=torch.float32
        )
    policy = "selective" if rung.selective else "full"
    backend = BackendConfig(
        bf16=True, gradient_checkpointing=True, gradient_checkpointing_policy=policy
    )
    enable_checkpointing(model, backend)
    if not rung.shared_prompts:
        use_varlen_attention(model, device.type)
    if rung.float8:
        from fsdp_rlhf.models.float8 import use_float8

        use_float8(model)
    if rung.compiled:
        compile_blocks(model, whole_layers=True, backend=compile_backend)
    mesh = build_mesh(device, 1)
    shard_model(
        model, mesh, FSDPConfig(zero_stage=3), bf16=True,
        layer_input_casts=not rung.fsdp_head_clip,
    )  # fmt: skip
    model.train()
    return model, build_optimizer(model, OptimConfig(lr=1e-6))


def batches(rung: Rung, s: Shape, device: torch.device):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(s.micro):
        ids = torch.randint(10, s.vocab, (s.rows, s.row_len), generator=g)
        if rung.shared_prompts:  # one group: the rows share their prompt
            ids[:, : s.row_len - s.response] = ids[0, : s.row_len - s.response]
        out.append(ids.to(device))
    mask = torch.ones(s.rows, s.row_len, dtype=torch.long, device=device)
    adv = torch.randn(s.rows, s.response, generator=g).to(device)
    return out, mask, adv


def _clip_one_at_a_time(params, max_norm: float) -> float:
    """The clipping before issue #58 (the baseline's): one square-sum per gradient."""
    from fsdp_rlhf.distributed.fsdp import _local

    grads = [_local(p.grad) for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    total = float(sq) ** 0.5
    if total > max_norm:
        for g in grads:
            g.mul_(max_norm / (total + 1e-6))
    return total


@contextlib.contextmanager
def rung_levers(rung: Rung, kernel_for_dry_run):
    """The rung's attention kernel and, below ``+FSDP/head/clipping``, the head's fixed
    blocks (as before issue #58)."""
    from fsdp_rlhf.models import head
    from fsdp_rlhf.models.varlen import kernel_override

    saved = head.head_block_size
    if not rung.fsdp_head_clip:
        head.head_block_size = lambda *a: None
    if not rung.varlen:
        override = kernel_override(None)  # the per-sequence loop (masked SDPA: shared rows)
    elif kernel_for_dry_run is not None:
        override = kernel_override(kernel_for_dry_run)
    else:
        override = contextlib.nullcontext()  # the kernel models.varlen chooses
    try:
        with override:
            yield
    finally:
        head.head_block_size = saved


def run_rung(rung: Rung, s: Shape, device: torch.device, args, reference) -> dict:
    from fsdp_rlhf.distributed.fsdp import accumulate, clip_grad_norm_
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs

    cuda = device.type == "cuda"
    gc.collect()  # the previous rung's model and optimizer (reference cycles through hooks)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, optim = build(rung, s, device, args.compile_backend)
    build_s = time.perf_counter() - t0
    ids_list, mask, adv = batches(rung, s, device)
    gathered = rung.fsdp_head_clip
    group = s.rows if rung.shared_prompts else 1

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step() -> float:
        sync()
        t = time.perf_counter()
        for i, ids in enumerate(ids_list):
            accumulate(model, i == len(ids_list) - 1, 3, gathered)
            inputs = forward_inputs(
                ids, mask, packed=not rung.shared_prompts, group_size=group,
                response_len=s.response,
            )  # fmt: skip
            lp, _ = response_logprobs(model, inputs, s.response)
            ratio = torch.exp(lp - lp.detach())
            loss = -(torch.clamp(ratio, 0.8, 1.2) * adv).mean() / len(ids_list)
            loss.backward()
        if rung.fsdp_head_clip:
            clip_grad_norm_(list(model.parameters()), 1.0)
        else:
            _clip_one_at_a_time(list(model.parameters()), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t

    with rung_levers(rung, reference):
        warmup = step()
        times = [step() for _ in range(args.steps)]
        # the dry run profiles its first rung only (the CPU profiler is slow; the code is one)
        profile = cuda or rung is BASELINE
        launches, busy = profiled(step, cuda) if profile else (None, None)
        syncs = count_syncs(step) if cuda else None
    seconds = statistics.median(times)
    tokens = s.micro * s.rows * s.row_len
    flops = model_flops(s, rung.shared_prompts)
    hardware = flops * (1.0 if rung.selective else 4 / 3)
    peak = PEAK_BF16 if cuda else 1e12  # dry run: a nominal peak, the figures mean nothing
    row = dict(
        name=rung.name,
        tokens_per_s=tokens / seconds,
        mfu=flops / seconds / peak,
        hfu=hardware / seconds / peak,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        step_s=seconds,
        steps_s=times,
        first_step_extra_s=max(0.0, warmup - seconds),
        build_s=build_s,
        kernel_launches_per_step=launches,
        gpu_busy_fraction=busy / seconds if busy is not None else None,
        host_syncs_per_step=syncs,
        tokens_per_step=tokens,
        model_tflop_per_step=flops / 1e12,
        memory_model_gathers=memory_model_gathers(rung, s, device),
        levers=asdict(rung),
    )
    return row


def memory_model_gathers(rung: Rung, s: Shape, device: torch.device) -> bool | None:
    """What ``--accumulate_gathered auto`` would choose for this rung's update on this device
    (the rungs from ``+FSDP/head/clipping`` on gather once per step regardless); None on CPU."""
    if device.type != "cuda":
        return None
    from fsdp_rlhf.distributed.memory import JobFlags, ModelShape, gathered_update_fits

    config = dict(
        hidden_size=s.hidden, num_hidden_layers=s.layers, intermediate_size=s.intermediate,
        vocab_size=s.vocab, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        tie_word_embeddings=True,
    )  # fmt: skip
    flags = JobFlags(
        world=1, device_bytes=torch.cuda.mem_get_info(device)[1], zero_stage=3,
        micro_train_batch_size=s.rows, seq_len=s.row_len, response_len=s.response,
        gradient_checkpointing=True, checkpointing_policy="selective" if rung.selective else "full",
        critic=False, reward=False, engine="none", packing=True,
    )  # fmt: skip
    return gathered_update_fits(flags, ModelShape.from_hf_config(config), None, [])


def profiled(step, cuda: bool) -> tuple[int | None, float | None]:
    """One step under the profiler: kernels launched and the GPU's kernel time (s); on CPU the
    ops run (the dry run's stand-in) and None."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
    events = prof.key_averages()
    if not cuda:
        return sum(e.count for e in events), None
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    time_us = sum(
        getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        for e in kernels
    )
    return sum(e.count for e in kernels), time_us / 1e6


def count_syncs(step) -> int:
    """Host syncs of one step, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


# ---------------------------------------------------------------- the command


def environment(device: torch.device) -> dict:
    import importlib.util

    from fsdp_rlhf.models.varlen import describe_kernels, resolve_kernels

    resolve_kernels()
    return dict(
        date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        torch=torch.__version__,
        python=platform.python_version(),
        flash_attn=importlib.util.find_spec("flash_attn") is not None,
        torchao=importlib.util.find_spec("torchao") is not None,
        varlen_kernels=describe_kernels(),
    )


def write(path: Path, report: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)


def out_path(arg: str | None) -> Path:
    name = f"{datetime.date.today().isoformat()}-gpu-ladder.json"
    if arg is None:
        return Path(__file__).resolve().parent.parent / "benchmarks" / name
    p = Path(arg)
    return p / name if p.is_dir() else p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, every rung")
    parser.add_argument("--out", default=None, help="JSON file or folder (default benchmarks/)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per rung (3)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no rung after this")
    parser.add_argument("--rungs", default=None, help="comma-separated rung names (default all)")
    parser.add_argument("--compile-backend", default=None, help="inductor (GPU), aot_eager (dry)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (1 if args.dry_run else 3)
    args.compile_backend = args.compile_backend or ("aot_eager" if args.dry_run else "inductor")
    start = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_mfu_ladder: no CUDA device here; --dry-run runs the rungs' code on CPU")
        return 2
    from fsdp_rlhf.distributed.env import init_distributed

    env = init_distributed()
    device, shape = env.device, (TINY if args.dry_run else FULL)
    reference = None
    if args.dry_run:
        from fsdp_rlhf.testing.varlen_reference import reference_kernel

        reference = reference_kernel()
    path = out_path(args.out)
    report = {**environment(device), "shape": asdict(shape), "rungs": [], "checks": []}
    print(json.dumps({k: v for k, v in report.items() if k not in ("rungs", "checks")}, indent=1))
    sys.stdout.flush()
    from fsdp_rlhf.models.varlen import kernel_override

    with kernel_override(reference) if reference is not None else contextlib.nullcontext():
        report["checks"] = kernel_checks(device, args.dry_run)
    for c in report["checks"]:
        print("check", json.dumps(c))
    write(path, report)
    # GRPO's layout with the last rung's levers (float8's only where torchao runs it)
    rungs = [*RUNGS, grpo_rung(FLOAT8 if report["torchao"] else SELECTIVE)]
    if args.rungs:
        wanted = {n.strip() for n in args.rungs.split(",")}
        rungs = [r for r in rungs if r.name in wanted]
    for rung in rungs:
        elapsed = time.perf_counter() - start
        if rung.float8 and not rung.shared_prompts and not report["torchao"]:
            row = {"name": rung.name, "skipped": "torchao is not installed"}
        elif elapsed > args.budget_s:
            row = {"name": rung.name, "skipped": f"time budget ({elapsed:.0f} s elapsed)"}
        else:
            try:
                row = run_rung(rung, shape, device, args, reference)
            except Exception as e:  # noqa: BLE001 - a failed rung is reported, the rest run
                row = {"name": rung.name, "error": f"{type(e).__name__}: {e}"[:2000]}
        report["rungs"].append(row)
        report["elapsed_s"] = time.perf_counter() - start
        write(path, report)
        print("rung", json.dumps({k: v for k, v in row.items() if k not in ("levers", "steps_s")}))
        sys.stdout.flush()
    print(f"written {path} in {time.perf_counter() - start:.0f} s")
    failed = [r["name"] for r in report["rungs"] if "error" in r]
    failed += [c["name"] for c in report["checks"] if not c.get("pass")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
