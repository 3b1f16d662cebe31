"""``--torch_compile`` of the parts of each transformer block.

A decoder layer's norms, MLP and attention projections are chains of small elementwise ops
(RMSNorm's square/mean/rsqrt/scale, rotary's rotate-half and multiply-adds, SiLU times the up
projection, residual adds). Eager PyTorch runs each as its own pass over memory; compiled, each
chain becomes one fused kernel: compiling the norms and MLP, then the attention block too, each
made a layer's forward + backward faster, and the no-grad forward faster too. Compiling the
whole layer instead took far longer to compile (the per-sequence attention loop specialises on
every length) and ran no faster. Timings:
benchmarks/grpo_rm_vs_trl_intel-xeon-amx-2core_2026-11-22.md.

So each direct child of a decoder layer is compiled on its own, with dynamic shapes (sequence
lengths change every batch), while the attention kernel the child calls stays eager: the packed
one is marked ``torch.compiler.disable`` (models.attention), HF's SDPA/flash kernels are single
ops that compile as such. Compilation happens at the first forward (seconds per graph: train,
no-grad, and per dtype) and is cached on disk by inductor for later runs.
"""

from __future__ import annotations

import logging
import shutil

import torch
from torch import nn

from fsdp_rlhf.distributed.fsdp import decoder_layers
from fsdp_rlhf.errors import UserError

log = logging.getLogger(__name__)


def check_compile_toolchain() -> None:
    """``--torch_compile`` on CPU generates C++: fail before loading anything without a compiler.

    On CUDA inductor emits Triton kernels; Triton ships with the CUDA builds of torch.
    """
    on_cpu = not torch.cuda.is_available()
    if on_cpu and shutil.which("g++") is None and shutil.which("c++") is None:
        raise UserError("--torch_compile on CPU needs a C++ compiler (g++) on PATH")


def compile_blocks(model: nn.Module) -> int:
    """Compile every direct child of every decoder layer in place; returns how many.

    Call before ``fully_shard``: FSDP2's hooks sit on the layer, outside the compiled children,
    so the compiled code sees ordinary (unsharded) parameters during forward and backward.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to compile")
    from fsdp_rlhf.models.moe import is_router

    count = skipped = 0
    for layer in layers:
        for child in layer.children():
            if any(is_router(m) for m in child.modules()):
                # MoE blocks stay eager: their router hooks (models.moe) act per forward, which
                # a graph traced once would not see; the expert loop is data-dependent anyway
                skipped += 1
                continue
            # the forward alone: the hook must run eagerly, before dynamo sees the inputs
            child.forward = torch.compile(child.forward)
            child.register_forward_pre_hook(_sequence_dim_dynamic, with_kwargs=True)
            count += 1
    log.info(
        "torch.compile: %d modules in %d decoder layers%s",
        count,
        len(layers),
        f" ({skipped} MoE blocks left eager)" if skipped else "",
    )
    return count


def _sequence_dim_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Compile for any sequence length from the first call.

    Left to itself, dynamo compiles each child for the first batch's length and again, dynamic,
    at the first other length; each rank meets that second length at its own step, so the
    recompile of one rank stalled step 2 and the other's step 3. Only the sequence dimension
    is marked: ``dynamic=True`` made every dimension symbolic and the update slower (both
    measured in benchmarks/). The sequence dimension is every dimension
    after the first of size L (hidden states, rotary cos/sin, a (B, 1, L, L) mask) but the
    last of a 2-3 dimensional input, which is a feature dimension.
    """
    tensors = [t for t in _flat(args) + _flat(list(kwargs.values())) if t.dim() >= 2]
    if not tensors:
        return
    seq = tensors[0].shape[1]
    if seq <= 1:
        return
    for t in tensors:
        last = t.dim() if t.dim() >= 4 else t.dim() - 1
        for d in range(1, last):
            if t.shape[d] == seq:
                torch._dynamo.maybe_mark_dynamic(t, d)


def _flat(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, tuple | list):
            out.extend(_flat(v))
    return out
