"""``--torch_compile`` of the transformer blocks.

A decoder layer's norms, MLP and attention projections are chains of small elementwise ops
(RMSNorm's square/mean/rsqrt/scale, rotary's rotate-half and multiply-adds, SiLU times the up
projection, residual adds). Eager PyTorch runs each as its own kernel; compiled, each chain
becomes one fused kernel. On a GPU the eager chains are most of a step's kernel launches (the
H200 profile: about 47 kernels per layer forward, the GPU waiting on the host half the step).

On CUDA each whole layer is one graph (``fullgraph=True``, as torchtitan compiles its blocks):
the attention traces with it, as one op (a varlen kernel for packed and shared-prompt rows,
``models.varlen``; SDPA for padded ones), and a selective checkpoint
(``models.checkpointing``) is traced inside it. That needs an attention that traces:
:func:`whole_layer_problem` names what keeps a model on the children below (MoE routers,
sequence parallelism, recurrent or sliding layers, packed rows without a varlen kernel).
Whether it pays is measured by the GPU ladder (``scripts/gpu_mfu_ladder.py``, rung
``+compiled layers``), so ``--torch_compile`` stays off by default.

On CPU (and where a layer cannot be traced whole) each direct child of a decoder layer is
compiled on its own, while the attention kernel the child calls stays eager: the packed loop is
marked ``torch.compiler.disable`` (models.attention). On CPU this was measured: compiling the
norms and MLP, then the attention block too, each made a layer's forward + backward faster;
compiling the whole layer with the per-sequence loop took far longer to compile and ran no
faster (benchmarks/grpo_rm_vs_trl_intel-xeon-amx-2core_2026-11-22.md).

Shapes are dynamic in the sequence dimension from the first call (sequence lengths change every
batch); a packed row's longest length (a host int the varlen kernels take) becomes dynamic at
its first change, one recompile. Compilation happens at the first forward (seconds per graph:
train, no-grad, and per dtype) and is cached on disk by inductor for later runs.
"""

from __future__ import annotations

import dataclasses
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


def compile_blocks(model: nn.Module, whole_layers: bool = False, backend: str = "inductor") -> int:
    """Compile the decoder layers in place; returns how many modules were compiled.

    ``whole_layers``: each layer's forward as one graph, ``fullgraph=True`` (a graph break is
    an error, not a silent split): norms, rotary, SwiGLU and residual adds fused around the
    matmuls and the attention kernel, and a selective checkpoint (``models.checkpointing``)
    traced with it. Only for layers whose attention traces whole (:func:`whole_layer_problem`).
    Otherwise every direct child of every layer on its own, the attention kernel left eager.
    ``backend``: inductor; ``aot_eager`` traces the same graphs without generating code (the
    GPU ladder's CPU dry run).

    Call before ``fully_shard``: FSDP2's hooks sit on the layer, outside the compiled code,
    so it sees ordinary (unsharded) parameters during forward and backward.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to compile")
    if whole_layers:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, fullgraph=True, backend=backend)
            layer.register_forward_pre_hook(_sequence_dim_dynamic, with_kwargs=True)
        log.info("torch.compile: %d whole decoder layers (fullgraph)", len(layers))
        return len(layers)
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
            child.forward = torch.compile(child.forward, backend=backend)
            child.register_forward_pre_hook(_sequence_dim_dynamic, with_kwargs=True)
            count += 1
    log.info(
        "torch.compile: %d modules in %d decoder layers%s",
        count,
        len(layers),
        f" ({skipped} MoE blocks left eager)" if skipped else "",
    )
    return count


def whole_layer_problem(
    model: nn.Module, device_type: str, bf16: bool, packed: bool, sequence_parallel: int = 1
) -> str | None:
    """Why ``model``'s decoder layers cannot be compiled whole (then each layer's children
    are), or None when they can: on CUDA, a dense model with full attention in every layer,
    no sequence parallelism, and packed rows only where a varlen kernel takes them (bf16;
    ``models.varlen``), since the per-sequence loop is not traceable. On CPU the children:
    what was measured faster there (benchmarks/)."""
    from fsdp_rlhf.models.moe import is_router
    from fsdp_rlhf.models.varlen import resolve_kernels

    if device_type != "cuda":
        return "on CPU each layer's children compile (measured faster there)"
    if sequence_parallel > 1:
        return "Ulysses' all-to-alls sit inside the attention"
    if any(is_router(m) for m in model.modules()):
        return "an MoE model's router hooks act per forward"
    if getattr(model.config, "vision_config", None) is not None:
        return "a vision-language model's vision blocks (not traced whole yet)"
    if any("lora_" in name for name, _ in model.named_parameters()):
        return "LoRA adapters (not traced whole yet)"
    text = model.config.get_text_config()
    if set(getattr(text, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
        return "layers other than full attention (sliding windows, recurrent layers)"
    if packed and not (bf16 and resolve_kernels()):
        return "packed rows without a varlen kernel (fp32, or no varlen_attn / flash-attn)"
    return None


def _sequence_dim_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Compile for any sequence length from the first call.

    Left to itself, dynamo compiles each child for the first batch's length and again, dynamic,
    at the first other length; each rank meets that second length at its own step, so the
    recompile of one rank stalled step 2 and the other's step 3. Only the sequence dimension
    is marked: ``dynamic=True`` made every dimension symbolic and the update slower (both
    measured in benchmarks/). The sequence dimension is every dimension
    after the first of size L (hidden states, rotary cos/sin, a (B, 1, L, L) mask, position
    ids) but the last of a 2-3 dimensional floating input, which is a feature dimension.
    1-D inputs (a packed row's offsets, a varlen layout's key index: one entry per sequence
    or key) are marked too, and the tensors of a varlen layout passed as one object.
    """
    tensors = _flat(args) + _flat(list(kwargs.values()))
    rows = [t for t in tensors if t.dim() >= 2]
    for t in tensors:
        if t.dim() == 1 and t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    if not rows:
        return
    seq = rows[0].shape[1]
    if seq <= 1:
        return
    for t in rows:
        feature_last = t.dim() <= 3 and t.is_floating_point()
        last = t.dim() - 1 if feature_last else t.dim()
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
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out.extend(_flat([getattr(v, f.name) for f in dataclasses.fields(v)]))
    return out
