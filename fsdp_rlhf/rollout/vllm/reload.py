"""Model loaders whose weights vLLM's in-place reload (the weight sync) does not see, and how the
adapter gets the new weights to them anyway.

vLLM's ``reload_weights`` reruns the model's loader layer by layer: it wraps every parameter's
``weight_loader`` and processes a layer once its loaders have taken all of its elements; a
layer none of whose loaders ran is given its old tensors back ("Failed to load weights"). A
loader that copies into a parameter directly (``param.copy_``) is invisible to it.

vLLM 0.32's gpt-oss loader (unquantized checkpoints) does that for its fused experts and its
attention sinks, so the sync left both at their start-up values (and on CPU the experts without
their kernel: "assert self.moe_kernel is not None"). :class:`GptOssReload` streams the experts
one at a time under the names of the loader's per-expert path (``experts.{i}.w13_weight``,
which goes through ``weight_loader``) and copies the sinks into the engine's parameters itself
after the reload (:func:`copy_attention_sinks`, run in the worker).

Only :mod:`fsdp_rlhf.rollout.vllm.engine` imports this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# gpt-oss's fused expert tensors (transformers' names) -> the per-expert names of vLLM's loader
_GPT_OSS_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_GPT_OSS_SUFFIX = {
    ("gate_up_proj", None): "w13_weight",
    ("gate_up_proj", "_bias"): "w13_bias",
    ("down_proj", None): "w2_weight",
    ("down_proj", "_bias"): "w2_bias",
}
_SINKS = ".self_attn.sinks"


class GptOssReload:
    """The weight stream of a gpt-oss sync, made loadable by vLLM's in-place reload (see the
    module docstring). ``sinks`` fills while :meth:`stream` is consumed."""

    ARCHITECTURES = ("GptOssForCausalLM",)

    def __init__(self) -> None:
        self.sinks: dict[str, torch.Tensor] = {}

    def stream(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith(_SINKS):
                # vLLM's name: its mapper turns ".self_attn." into ".attn."
                self.sinks[name.replace(".self_attn.", ".attn.")] = tensor
                continue
            m = _GPT_OSS_EXPERTS.match(name)
            if m is None:
                yield name, tensor
                continue
            suffix = _GPT_OSS_SUFFIX[(m[2], m[3])]
            for i in range(tensor.shape[0]):
                yield f"{m[1]}.{i}.{suffix}", tensor[i]


def copy_attention_sinks(worker, sinks: dict[str, torch.Tensor]) -> int:
    """Run in the worker after a reload: copy each layer's sink logits (all heads, vLLM's
    parameter names) into the engine's, this TP rank's heads; returns how many were copied."""
    from vllm.distributed import get_tensor_model_parallel_rank

    params = dict(worker.model_runner.model.named_parameters())
    missing = sorted(set(sinks) - set(params))
    if missing:
        raise RuntimeError(
            f"weight sync: vLLM's model has no parameters {missing[:3]} (the attention sinks "
            "of this adapter's gpt-oss path were written for vLLM 0.32)"
        )
    rank = get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, tensor in sinks.items():
            param = params[name]
            heads = param.shape[0]
            param.data.copy_(tensor.narrow(0, rank * heads, heads).to(param.dtype))
    return len(sinks)


def reload_adapter(architectures: Iterable[str]) -> GptOssReload | None:
    """The reload adapter of a model's architectures, or None when vLLM's reload sees all of
    its weights."""
    archs = set(architectures)
    if archs & set(GptOssReload.ARCHITECTURES):
        return GptOssReload()
    return None
