"""Label log-probs computed inside a causal LM's output layer: no (..., V) logits.

A policy forward's logits are its largest tensor: (B, T, V) with V = 151,936 (Qwen2/3) or
248,320 (Qwen3.5), and the update keeps them for backward and then allocates their gradient,
the same size again. Here the model runs as a whole (FSDP2 gathers the output layer's weight
around the root's forward, as for any forward) while its output layer, for the length of one
call, computes the label log-probs (and entropies) from the final hidden states it receives
(``algorithms.head_logprobs``: vocabulary blocks, nothing vocabulary-sized kept for backward).
The layer returns them stacked as (2, n) in place of logits and the model passes them out as
its ``logits``: the results are the root's output, so FSDP2's pre-backward hook sees them.

Models that change the logits after the output layer (Gemma's soft-capping, Cohere's and
Granite's scaling, a cut padded vocabulary, a forward hook on the output layer such as a VLM
policy's suppressed placeholder tokens) and output layers that are not a plain bias-free
``nn.Linear`` (LoRA on ``lm_head``) take the materialised path
(``algorithms.gathered_logprobs``: the logits once, read chunk by chunk).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from fsdp_rlhf.algorithms import gathered_logprobs, head_logprobs

# config keys of transformers models whose forward transforms the output layer's logits
LOGITS_POST_PROCESSING = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "logits_soft_cap",
    "output_multiplier",
    "unpadded_vocab_size",
)


def fusable_head(model: nn.Module) -> nn.Linear | None:
    """The output layer whose input the label log-probs can be computed from, or None when the
    model's logits must be materialised (see the module docstring)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    # a forward hook on the output layer reads its logits (a VLM policy's suppressed
    # placeholder tokens, models.vision.suppress_tokens): those logits must exist
    if head._forward_hooks:
        return None
    config = getattr(model, "config", None)
    configs = [config]
    if config is not None and hasattr(config, "get_text_config"):
        configs.append(config.get_text_config())
    for cfg in configs:
        if any(getattr(cfg, key, None) is not None for key in LOGITS_POST_PROCESSING):
            return None
    return head


# On CUDA the vocabulary blocks are sized from free memory (each block's kernels are launches
# of their own: the fixed CPU budget cuts a 151,936 vocabulary into 56 blocks for 3,072
# positions), up to this fraction of what is free for one block's fp32 temporaries (about 4
# of (n, block))...
HEAD_FREE_FRACTION = 1 / 16
# ...and never fewer than this many blocks: the (n, V) logits are never made.
HEAD_MIN_BLOCKS = 4


def head_block_size(positions: int, vocab: int, device: torch.device) -> int | None:
    """Vocabulary columns per block of the fused head for ``positions`` rows: on CUDA as
    many as ``HEAD_FREE_FRACTION`` of the free memory holds (the caching allocator's free
    blocks included), at least the CPU's budget and at most ``vocab / HEAD_MIN_BLOCKS``;
    None elsewhere (``algorithms.head_logprobs``' fixed ``CHUNK_ELEMENTS`` budget)."""
    if device.type != "cuda" or positions <= 0:
        return None
    from fsdp_rlhf.algorithms.logprobs import CHUNK_ELEMENTS

    free = torch.cuda.mem_get_info(device)[0]
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    elements = int(free * HEAD_FREE_FRACTION) // (4 * 4)
    cols = max(CHUNK_ELEMENTS // positions, elements // positions, 1)
    return min(cols, -(-vocab // HEAD_MIN_BLOCKS))


def model_logprobs(
    model: nn.Module,
    inputs: dict,
    labels: torch.Tensor,
    index: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    extra: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs (and entropies) of ``labels`` under ``model(**inputs)``, predicted at rows
    ``index`` of its flattened logits (None: the logits are (B, T, V), aligned with the labels).

    The same as ``gathered_logprobs(model(**inputs).logits, labels, index, ...)`` up to float
    rounding; see the module docstring for when the logits are never made.

    ``extra(hidden, weight)``: a further differentiable result of the same forward, from the
    hidden states the output layer receives and its weight (or ``(logits, None)`` when the
    logits are made), returned third (on-policy distillation's top-k log-probs).
    """
    head = fusable_head(model)
    if head is None:
        logits = model(**inputs).logits
        out = gathered_logprobs(
            logits,
            labels,
            index,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )
        return out if extra is None else (*out, extra(logits, None))
    made: list[torch.Tensor] = []
    # read before the model runs: nothing inside the forward asks the device anything
    block = head_block_size(labels.numel(), head.weight.shape[0], head.weight.device)
    shapes: list[torch.Size] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        lp, ent = head_logprobs(
            hidden,
            head.weight,
            labels,
            index,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            block_size=block,
        )
        out = torch.stack([lp, ent if ent is not None else torch.zeros_like(lp)])
        if extra is not None:  # one root output: FSDP2's backward hooks see both parts
            more = extra(hidden, head.weight)
            shapes.append(more.shape)
            out = torch.cat([out.reshape(-1), more.reshape(-1).to(out.dtype)])
        made.append(out)
        return made[-1]

    with _forward_replaced(head, forward):
        out = model(**inputs).logits
    if len(made) != 1 or out is not made[0]:
        raise RuntimeError(
            f"{type(model).__name__} changes its output layer's logits before returning them; "
            "add the config key that makes it do so to models.head.LOGITS_POST_PROCESSING"
        )
    if extra is not None:
        n = labels.numel()
        more = out[2 * n :].view(shapes[0])
        lp, ent = _parts(out[: 2 * n].view(2, *labels.shape), with_entropy, entropy_grad)
        return lp, ent, more
    return _parts(out, with_entropy, entropy_grad)


def _parts(out: torch.Tensor, with_entropy: bool, entropy_grad: bool):
    """(2, ...) stacked log-probs and entropies -> the pair ``model_logprobs`` returns."""
    if not with_entropy:
        return out[0], None
    return out[0], out[1] if entropy_grad else out[1].detach()


def head_call(model: nn.Module, inputs: dict, on_hidden, on_logits) -> torch.Tensor:
    """``on_hidden(hidden, weight)`` on the final hidden states the output layer receives and
    its weight, inside the model's forward (FSDP2 has the weight gathered there; the result is
    the root's output, so a backward through it reaches every layer), or ``on_logits(logits)``
    on the model's logits when its output layer is not fusable (see the module docstring).
    ``hidden`` / ``logits`` are (R, c, H) / (R, c, V); the result may be any tensor."""
    head = fusable_head(model)
    if head is None:
        return on_logits(model(**inputs).logits)
    made: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        made.append(on_hidden(hidden, head.weight))
        return made[-1]

    with _forward_replaced(head, forward):
        out = model(**inputs).logits
    if len(made) != 1 or out is not made[0]:
        raise RuntimeError(
            f"{type(model).__name__} changes its output layer's logits before returning them; "
            "add the config key that makes it do so to models.head.LOGITS_POST_PROCESSING"
        )
    return out


@contextmanager
def _forward_replaced(module: nn.Module, forward):
    """``module``'s forward is ``forward`` for the duration (an instance attribute)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward
