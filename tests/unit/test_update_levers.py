"""The actor update's other levers of issue #58, on CPU: foreach clipping equals the loop with
one host read; selective checkpointing keeps the gradients and recomputes no matmul; the
fused head's CUDA block size from free memory; the memory model's selective and gathered
settings; where whole layers compile; --accumulate_gathered's resolution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.distributed.fsdp import clip_grad_norm_, resolve_accumulate_gathered
from fsdp_rlhf.distributed.memory import (
    GIB,
    JobFlags,
    ModelShape,
    activation_bytes,
    gathered_update_fits,
    update_phase,
)

# Qwen2.5-1.5B (config.json) and Qwen2.5-7B
QWEN_1_5B = ModelShape.from_hf_config(
    dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, vocab_size=151936,
         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
)  # fmt: skip
QWEN_7B = ModelShape.from_hf_config(
    dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, vocab_size=152064,
         num_attention_heads=28, num_key_value_heads=4)
)  # fmt: skip


def _loop_clip(grads, max_norm):
    total = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads))
    if total > max_norm:
        return total, [g * (max_norm / (total + 1e-6)) for g in grads]
    return total, grads


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_foreach_clipping_equals_the_loop_with_one_host_read(max_norm, monkeypatch):
    g = torch.Generator().manual_seed(0)
    params = []
    for shape, dtype in [((7, 3), torch.float32), ((11,), torch.bfloat16), ((4, 4), torch.float32)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.randn(shape, generator=g).to(dtype)
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no grad: skipped
    expected_norm, expected = _loop_clip([p.grad.clone() for p in params[:3]], max_norm)
    reads = []
    real = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or real(t))
    norm = clip_grad_norm_(params, max_norm)
    monkeypatch.undo()
    assert len(reads) == 1  # the step's one host read
    assert norm == pytest.approx(expected_norm, rel=1e-5)
    for p, want in zip(params[:3], expected, strict=True):
        tol = 1e-2 if p.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(p.grad.float(), want.float(), rtol=tol, atol=tol)


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_keeps_the_gradients_and_recomputes_no_matmul(tiny_qwen2):
    """Backward matmuls: selective = none (no forward matmul recomputed) < full; the
    gradients are those without checkpointing."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm

    ids = torch.randint(2, 300, (3, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    results = {}
    for policy in ("none", "full", "selective"):
        backend = BackendConfig(
            gradient_checkpointing=policy != "none",
            gradient_checkpointing_policy="full" if policy == "none" else policy,
        )
        model = load_causal_lm(tiny_qwen2, backend, "cpu")
        model.train()
        lp, _ = response_logprobs(model, forward_inputs(ids, mask), 6)
        with _Matmuls() as mm:
            lp.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[policy] = (mm.count, grads)
    assert results["selective"][0] == results["none"][0] < results["full"][0]
    for name, g in results["none"][1].items():
        torch.testing.assert_close(results["selective"][1][name], g, rtol=1e-5, atol=1e-6)


def test_head_block_size_from_free_memory(monkeypatch):
    from fsdp_rlhf.models.head import head_block_size

    assert head_block_size(3072, 151_936, torch.device("cpu")) is None
    free = {"bytes": 80 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free["bytes"], 141 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: GIB)
    cuda = torch.device("cuda", 0)
    block = head_block_size(3072, 151_936, cuda)
    assert block == -(-151_936 // 4)  # plenty free: 4 blocks, never the whole (n, V)
    free["bytes"] = 0  # nothing free: the CPU's budget (2^23 elements per block)
    assert head_block_size(3072, 151_936, cuda) == (1 << 23) // 3072


def test_memory_model_selective_and_gathered():
    f = JobFlags(world=1, device_bytes=141 * GIB, zero_stage=3, seq_len=1024,
                 micro_train_batch_size=4, gradient_checkpointing=True)  # fmt: skip
    full = activation_bytes(f, QWEN_1_5B, 4)
    selective = activation_bytes(
        dataclasses.replace(f, checkpointing_policy="selective"), QWEN_1_5B, 4
    )
    none = activation_bytes(dataclasses.replace(f, gradient_checkpointing=False), QWEN_1_5B, 4)
    assert full < selective < none
    gathered = dataclasses.replace(f, accumulate_gathered=True)
    zero2 = dataclasses.replace(f, zero_stage=2)
    parts = update_phase(gathered, "actor update", QWEN_1_5B, True, []).parts
    assert parts == update_phase(zero2, "actor update", QWEN_1_5B, True, []).parts
    assert "unsharded grads" in parts
    assert gathered_update_fits(f, QWEN_1_5B, None, [QWEN_1_5B])  # an H200, 1 rank
    # 7B on one 24 GiB device: the gathered model and its fp32 grads alone do not fit
    small = dataclasses.replace(f, device_bytes=24 * GIB, world=8)
    assert not gathered_update_fits(small, QWEN_7B, None, [])


@pytest.mark.parametrize(
    "setting,zero,device,fits,expected",
    [
        ("auto", 3, "cuda", True, True),
        ("auto", 3, "cuda", False, False),
        ("auto", 3, "cpu", True, False),  # CPU: ZeRO-3 is chosen for memory
        ("auto", 2, "cuda", True, False),  # below ZeRO-3 accumulation is gathered anyway
        ("on", 3, "cpu", False, True),
        ("off", 3, "cuda", True, False),
    ],
)
def test_accumulate_gathered_resolution(setting, zero, device, fits, expected):
    assert resolve_accumulate_gathered(setting, zero, device, lambda: fits) is expected


def test_whole_layers_compile_on_cuda_only_where_the_attention_traces(tiny_qwen2, monkeypatch):
    from fsdp_rlhf.models import varlen
    from fsdp_rlhf.models.compile import whole_layer_problem
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.testing.varlen_reference import reference_kernel

    model = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    assert "CPU" in whole_layer_problem(model, "cpu", True, packed=True)
    assert whole_layer_problem(model, "cuda", True, packed=False) is None
    assert "Ulysses" in whole_layer_problem(model, "cuda", True, False, sequence_parallel=2)
    monkeypatch.setattr(varlen, "_KERNELS", [])  # a torch without varlen_attn, no flash-attn
    assert "varlen kernel" in whole_layer_problem(model, "cuda", True, packed=True)
    monkeypatch.setattr(varlen, "_KERNELS", [reference_kernel()])
    assert whole_layer_problem(model, "cuda", True, packed=True) is None
    assert "varlen kernel" in whole_layer_problem(model, "cuda", False, packed=True)  # fp32
