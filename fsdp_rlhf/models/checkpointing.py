"""``--gradient_checkpointing_policy``: what the decoder layers recompute in backward.

``full`` (transformers' own gradient checkpointing): each layer keeps its input only and runs
its whole forward again in backward, one more forward per step (hardware FLOPs 4/3 of the
model's). ``selective`` (torch's selective activation checkpointing,
``create_selective_checkpoint_contexts``): the outputs of each layer's matmuls and of its
attention are kept, everything else (norms, rotary, SiLU, residual adds, casts) is recomputed
from them: the backward recomputes no matmul and no attention, only elementwise work, for
about ``2 (4 h + 2 kv + 2 I)`` bytes per token and layer more than ``full`` keeps
(``distributed.memory.activation_bytes``).

The checkpoint sits inside the layer's own forward (FSDP2's hooks stay outside, so the
recompute runs while the backward hook holds the layer's gathered params), and
``--torch_compile`` compiles the checkpointed forward (``models.compile``): the policy is
traced with the layer, as torchtitan orders them. A VLM's vision blocks keep transformers'
full recompute.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fsdp_rlhf.distributed.fsdp import decoder_layers

_SAVED: set | None = None


def saved_ops() -> set:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention kernels
    (those this torch and the installed packages have)."""
    global _SAVED
    if _SAVED is None:
        aten = torch.ops.aten
        names = [
            (aten, "mm"),
            (aten, "addmm"),
            (aten, "bmm"),
            (aten, "_scaled_dot_product_flash_attention"),
            (aten, "_scaled_dot_product_efficient_attention"),
            (aten, "_scaled_dot_product_cudnn_attention"),
            (aten, "_scaled_dot_product_flash_attention_for_cpu"),
            (aten, "_flash_attention_forward"),
            (aten, "_efficient_attention_forward"),
        ]
        ops = {getattr(ns, name) for ns, name in names if hasattr(ns, name)}
        for ns, name in (
            ("torch_attn", "_varlen_attn"),  # torch.nn.attention.varlen
            ("flash_attn", "_flash_attn_varlen_forward"),  # flash-attn >= 2.6
            ("fsdp_rlhf", "varlen_attention_reference"),  # the tests' CPU kernel
        ):
            packet = getattr(getattr(torch.ops, ns), name, None)
            if packet is not None:
                ops.add(packet)
        _SAVED = ops
    return _SAVED


def _policy(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    if packet in saved_ops() or op in saved_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for the selective policy."""
    return create_selective_checkpoint_contexts(_policy)


def use_selective_checkpointing(model: nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` selectively (and not with transformers'
    full recompute); returns how many layers. Call after ``gradient_checkpointing_enable``
    (which a VLM's vision blocks keep) and before ``models.compile``."""
    saved_ops()  # resolved here, not while a compiled forward is traced
    layers = decoder_layers(model)
    for layer in layers:
        layer.gradient_checkpointing = False  # transformers' full recompute off here
        # a bound method: a deep copy of the model rebinds it to the copied layer
        layer.forward = types.MethodType(_selective_forward, layer)
    return len(layers)


def uses_selective_checkpointing(layer: nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _selective_forward


def _selective_forward(self: nn.Module, *args, **kwargs):
    """A decoder layer's forward, selectively checkpointed while it trains."""
    forward = functools.partial(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs)
