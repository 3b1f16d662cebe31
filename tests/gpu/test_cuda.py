"""CUDA paths in this process, on one GPU under NCCL (world size 1): collectives fed host
tensors, resharding after no-grad passes, ``--adam_offload``, the phase offload of module
tensors, and packed against padded training (flash-attn's varlen kernel when installed, else
SDPA varlen; that one also runs on CPU)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from tests.gpu.suite import HAVE, SIZES, build_odd_model

GIB = 2**30


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_odd_model(tmp_path_factory.mktemp("cuda") / "model")


@pytest.fixture
def env():
    """The process group (re-made if a vLLM engine's shutdown destroyed it)."""
    from fsdp_rlhf.distributed.env import init_distributed

    yield init_distributed()
    if HAVE["cuda"]:
        torch.cuda.empty_cache()


def _cfg(model: str, *extra: str):
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config

    flags = ["--pretrain", model, "--bf16", "--prompt_max_len", "64", "--generate_max_len", "32"]
    return build_config(PPOConfig, [*flags, *extra])[0]


def _load(model: str, cfg, env, trainable: bool):
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.trainers.ppo.setup import load_ppo_model

    dtype = torch.float32 if trainable else torch.bfloat16

    def load(weights: bool):
        return load_causal_lm(model, cfg.backend, env.device, dtype, weights=weights)

    return load_ppo_model(load, cfg, env, trainable=trainable, what="test model")


@pytest.mark.gpu
def test_host_tensors_reduce_on_nccl(env, detail):
    """Issue #36, finding 1: `sft` counts tokens of host masks; NCCL has no host backend."""
    from fsdp_rlhf.distributed.env import all_reduce_scalars
    from fsdp_rlhf.distributed.fsdp import clip_grad_norm_
    from fsdp_rlhf.distributed.stats import global_masked_mean, global_token_count

    assert env.backend == "nccl"
    masks = [torch.ones(2, 5, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)]
    assert global_token_count(masks) == 15
    assert float(global_masked_mean(torch.full((2, 5), 3.0), masks[0])) == 3.0
    assert all_reduce_scalars({"x": 2.0}, "sum") == {"x": 2.0}
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 0.5)  # on the host, as under --adam_offload
    assert abs(clip_grad_norm_([p], 0.0) - 1.0) < 1e-6
    detail("token count, masked mean, scalar sums and the grad norm of host tensors: NCCL")


@pytest.mark.gpu
def test_no_grad_passes_leave_params_sharded(model, env, detail):
    """After a no-grad forward, allocated memory is back to the sharded size (ZeRO 2 and 3)."""
    lines = []
    for stage in ("2", "3"):
        cfg = _cfg(model, "--zero_stage", stage)
        for trainable in (True, False):
            m = _load(model, cfg, env, trainable)
            full = sum(p.numel() for p in m.parameters()) * 2  # a bf16 gathered copy
            before = torch.cuda.memory_allocated()
            with torch.no_grad():
                m(input_ids=torch.randint(2, 400, (4, 64), device="cuda"))
            torch.cuda.synchronize()
            extra = torch.cuda.memory_allocated() - before
            del m
            assert extra <= full // 4, f"zero {stage} trainable={trainable}: {extra} B kept"
            lines.append(f"z{stage}{'T' if trainable else 'F'} +{extra >> 20} MiB")
    detail(", ".join(lines))


@pytest.mark.gpu
def test_update_with_adam_offload(model, env, detail):
    """params and Adam state on the host (CPUOffloadPolicy), one optimizer step; the weight
    sync's buckets are sized for the GPU the gathers run on."""
    from fsdp_rlhf.distributed.fsdp import GATHER_BUCKET_BYTES, clip_grad_norm_, gather_bucket_bytes

    cfg = _cfg(model, "--adam_offload", "--zero_stage", "3")
    m = _load(model, cfg, env, trainable=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(2, 400, (4, 64), device="cuda")
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = clip_grad_norm_(list(m.parameters()), 1.0)
    opt.step()
    devices = {p.to_local().device.type for p in m.parameters()}
    state = {t.device.type for st in opt.state.values() for t in st.values() if t.ndim > 0}
    assert devices == {"cpu"} and state == {"cpu"}, (devices, state)
    assert gather_bucket_bytes(m) == GATHER_BUCKET_BYTES["cuda"]
    detail(f"loss {loss.item():.3f}, grad norm {norm:.3f}, params and Adam on the host")


class _ReadsAfterApply(torch.nn.Module):
    """Reads its tensor on the host right after ``_apply`` moved it, as FSDP2's re-pad of an
    uneven shard does (``reset_sharded_param``)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(n, dtype=torch.float32))
        self.seen: torch.Tensor | None = None

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.w.device.type == "cpu":
            self.seen = self.w.detach().clone()  # the host reads what arrived so far
        return out


@pytest.mark.gpu
def test_offload_returns_complete_host_tensors(detail):
    """Issue #36, finding 3, on the device: 256 MiB to pinned host memory, read at once."""
    from fsdp_rlhf.distributed.offload import move_module_, offload_model

    m = _ReadsAfterApply(64 << 20).cuda()
    expected = torch.arange(64 << 20, dtype=torch.float32)
    start = time.perf_counter()
    move_module_(m, torch.device("cpu"), pin=True)
    seconds = time.perf_counter() - start
    assert m.w.is_pinned() and torch.equal(m.seen, expected), "read before the copy ended"
    m.cuda()
    offload_model(m, torch.device("cuda", 0))
    assert torch.equal(m.seen, expected)
    detail(f"256 MiB device -> pinned host in {seconds * 1e3:.0f} ms, complete when read")


@pytest.mark.gpu
def test_phase_offload_frees_the_device(model, env, detail):
    """An FSDP2 model and its Adam state offloaded between phases leave nothing on the device,
    and come back to train. (``DTensor.from_local`` sent every host copy of a shard back to
    the GPU: no offload freed anything, the 1.5 B job held its critic and both Adam states in
    every phase.) The memory census sees the same as the allocator."""
    from fsdp_rlhf.distributed.memory_census import census, owners_of
    from fsdp_rlhf.distributed.offload import (
        offload_model,
        offload_optimizer,
        onload_model,
        onload_optimizer,
    )
    from fsdp_rlhf.optim import build_optimizer

    cfg = _cfg(model, "--zero_stage", "3")
    net = _load(model, cfg, env, trainable=True)
    opt = build_optimizer(net, cfg.actor_optim)
    ids = torch.randint(2, 400, (2, 16), device=env.device)

    def step() -> None:
        net(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam's state now exists, on the device

    def owners():
        return owners_of({"model": net}, {"model": opt})

    torch.cuda.synchronize()
    before = census(env.device, owners()).owners
    held = before["model params"] + before["model optimizer"]
    allocated = torch.cuda.memory_allocated(env.device)
    offload_optimizer(opt, env.device)
    offload_model(net, env.device)
    freed = allocated - torch.cuda.memory_allocated(env.device)
    after = census(env.device, owners()).owners
    steps = 4 * len(opt.state)  # fused AdamW's step counts stay beside the params' device
    assert after["model params"] == 0 and after["model optimizer"] <= steps, after
    assert freed >= held - steps - (1 << 20), (freed, held)
    assert {p.to_local().device.type for p in net.parameters()} == {"cpu"}
    onload_model(net, env.device)
    onload_optimizer(opt, env.device)
    assert {p.to_local().device.type for p in net.parameters()} == {"cuda"}
    step()  # trains again where it was
    detail(
        f"{held / 2**20:.0f} MiB of params and Adam state on the device; offload freed "
        f"{freed / 2**20:.0f} MiB; back and one more step"
    )


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def test_packed_vs_padded_training(model, detail):
    """One packed row against the padded batch, forward and backward: flash-attn's varlen
    kernel when it is installed (CUDA), else our per-sequence SDPA; same log-probs and grads."""
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm

    cuda = HAVE["cuda"]
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    flash = HAVE["flash_attn"] and cuda
    backend = BackendConfig(flash_attn=flash, bf16=flash)  # flash-attn has no fp32 kernels
    padded = load_causal_lm(model, backend, dev, dtype=dtype).to(dev)
    padded.set_attn_implementation("sdpa")
    packed = copy.deepcopy(padded)
    if flash:
        packed.set_attn_implementation("flash_attention_2")
    use_varlen_attention(packed, dev.type)
    kernel = packed.config._attn_implementation
    batch, length, response = SIZES["batch"], SIZES["length"], SIZES["response"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 400, (batch, length), generator=g).to(dev)
    mask = torch.ones_like(ids)
    for i in range(batch):  # left-padded prompts of varying length, like rollouts
        mask[i, : (length - response) * i // batch] = 0
    out = {}
    for m, is_packed in ((padded, False), (packed, True)):
        for _ in range(2):  # warm-up, then timed
            m.zero_grad(set_to_none=True)
            _sync(dev)
            t0 = time.perf_counter()
            lp, _ = response_logprobs(m, forward_inputs(ids, mask, packed=is_packed), response)
            (-lp.float().mean()).backward()
            _sync(dev)
        grad = torch.cat([p.grad.float().flatten() for p in m.parameters()])
        out[is_packed] = (lp.detach().float(), grad, time.perf_counter() - t0)
    lp_gap = (out[True][0] - out[False][0]).abs().max().item()
    grad_gap = ((out[True][1] - out[False][1]).norm() / out[False][1].norm()).item()
    tol = 5e-2 if cuda else 1e-4  # bf16 kernels on the GPU, fp32 on CPU
    assert lp_gap < tol * 10 and grad_gap < tol, (kernel, lp_gap, grad_gap)
    detail(
        f"{kernel}: max |log-prob diff| {lp_gap:.2e}, grad rel diff {grad_gap:.2e}; fwd+bwd "
        f"padded {out[False][2] * 1e3:.1f} ms, packed {out[True][2] * 1e3:.1f} ms"
    )


@pytest.mark.gpu
def test_step_statistics_on_the_gpu_and_the_host_reach_the_host(detail):
    """Seen on the first lent GPU (an H200): PPO's metric reduction stacked GPU and host
    statistics in one ``torch.stack`` ("Expected all tensors to be on the same device")."""
    from fsdp_rlhf.distributed.stats import to_host

    values = {"a": torch.tensor(1.5, device="cuda"), "b": torch.tensor(2.0), "c": 3}
    assert to_host(values) == {"a": 1.5, "b": 2.0, "c": 3.0}
    detail("GPU and host 0-dim statistics, one copy per device")


def _sync_into(engine: dict, buckets) -> None:
    """What an engine's loader does at the least: copy each full tensor into its own weight
    (here plain bf16 tensors on the GPU)."""
    for bucket in buckets:
        for name, t in bucket:
            engine[name].copy_(t, non_blocking=True)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_delta_sync_and_overlap_on_cuda(env, detail):
    """Delta sync and the overlapped gathers on CUDA (one rank, NCCL): the engine's copy equals
    a full gather bit for bit, first synced dense, then after 2% of the bf16 weights moved;
    times of the four modes into GPU-resident weights (a lower bound of an engine's load), on
    a Qwen2.5-1.5B-shaped model (random weights, built on the GPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.delta_sync import DeltaStats, DeltaSync
    from fsdp_rlhf.distributed.fsdp import build_mesh, iter_full_buckets, shard_model
    from fsdp_rlhf.distributed.prefetch import StageTimes, staged

    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).float()
    model = shard_model(model, build_mesh(env.device, 1), FSDPConfig(), bf16=True)
    dtype, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    reference = {n: t.clone() for b in iter_full_buckets(model, dtype) for n, t in b}
    engine = {n: torch.empty_like(t) for n, t in reference.items()}
    gen = torch.Generator(device="cuda").manual_seed(0)

    def perturb(frac: float) -> None:
        with torch.no_grad():
            for p in model.parameters():
                flat = p.to_local().view(-1)
                pick = torch.rand(flat.numel(), generator=gen, device=flat.device) < frac
                bits = flat[pick].to(dtype).view(torch.int16) + 1
                flat[pick] = bits.view(dtype).float()

    def equal() -> bool:
        full = {n: t for b in iter_full_buckets(model, dtype) for n, t in b}
        return all(
            torch.equal(engine[n].view(torch.int16), full[n].view(torch.int16)) for n in full
        )

    delta = DeltaSync()
    times: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}
    for r in range(4):
        for mode, overlap in (("full", False), ("full", True), ("delta", False), ("delta", True)):
            if mode == "delta":
                perturb(0.02)
            stats, stage = DeltaStats(), StageTimes()
            source = (
                delta.buckets(model, dtype, stats=stats)
                if mode == "delta"
                else iter_full_buckets(model, dtype)
            )
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _sync_into(engine, staged(source, stage, overlap=overlap, device=dev))
            seconds = time.perf_counter() - t0
            assert equal(), (r, mode, overlap)
            if r:  # round 0: the mirror's first (dense) sync, allocations
                key = f"{mode}{'+overlap' if overlap else ''}"
                times.setdefault(key, []).append(seconds)
                if mode == "delta":
                    for part in ("diff_s", "exchange_s", "apply_s", "check_s"):
                        parts.setdefault(part, []).append(getattr(stats, part))
                    assert 0.01 < stats.changed_frac < 0.03, stats.changed_frac
                    assert stats.gathered_bytes < stats.full_bytes / 5
    line = ", ".join(f"{k} {sorted(v)[len(v) // 2]:.3f} s" for k, v in times.items())
    gib = sum(t.numel() * 2 for t in reference.values()) / GIB
    detail(f"{gib:.2f} GiB bf16, 2% changed: {line}")
    detail(
        "delta's parts (median over its syncs): "
        + ", ".join(f"{k} {sorted(v)[len(v) // 2]:.3f}" for k, v in parts.items())
    )
