"""MoE routers as pure functions: how each router transformers ships turns its scores into the
mixing weights of the experts it chose, so that router replay can give it other experts (the
rollout engine's) and recompute their weights by the model's own rule, and so that the
load-balancing loss has each router's probabilities.

transformers 5's routers return ``(scores, weights, experts)`` for a block's flattened tokens
(some in another order), the experts chosen by a rule that may differ from the one that weighs
them: DeepSeek-V3 and GLM-4.5 choose by sigmoid score plus a correction bias within the best
expert groups, and weigh by the plain sigmoid score, renormalised and scaled. Replay needs the
weighing rule only (the choice is the engine's); :class:`RouterRule` states it per router class
(:data:`ROUTER_RULES`), as the parameters of a few rules:

- ``softmax``: softmax over all experts at the chosen ones (Qwen2/3-MoE, OLMoE, Mixtral,
  Qwen3.5-MoE, Qwen3-Next, ERNIE-4.5, DeepSeek-V2, Mistral 4);
- ``softmax_chosen``: softmax over the chosen experts' logits (gpt-oss, whose logits include
  the router's bias; Granite-MoE; Aria);
- ``sigmoid``: each expert's sigmoid score (DeepSeek-V3, GLM-4.5, Nemotron-H, MiniMax-M2,
  LFM2-MoE, Step-3.7 ...);
- ``probs``: the router returns probabilities (Gemma 4);

then renormalised over the chosen experts (always, or as the router's ``norm_topk_prob``
says; with the router's own epsilon or floor), times a scaling factor and per-expert scales
where the router has them, cast to the dtype of the router's own weights. Every rule is
checked against the router's own output in tests/unit/test_routers.py: given the experts it
chose itself, the recomputed weights are its weights.

Routers with other structures (Llama 4's dense scores, DBRX's and PhiMoE's, DeepSeek-V4's hash
and sqrt-softplus routing, LongCat-Flash's zero experts, Cohere2-MoE's configurable selection,
routers returning a fourth output (Inkling, Zaya), ...) have no rule here and are refused by
name where replay or the balancing loss is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Score = Literal["softmax", "softmax_chosen", "sigmoid", "probs"]


@dataclass(frozen=True)
class RouterRule:
    """How a router class weighs the experts it routes to (see the module docstring).

    ``normalize``: True, False, or the name of the router's attribute saying it
    (``norm_topk_prob``). ``eps`` is added to the renormalising sum; ``floor`` names the
    attribute clamping it from below (ERNIE's ``norm_min``). ``scale`` names the router's
    scaling-factor attribute, ``expert_scale`` its per-expert scale parameter (Gemma 4).
    ``fp32``: scores computed in float32 whatever the logits' dtype. ``order``: the router's
    outputs, as positions of (scores, weights, experts).
    """

    score: Score
    normalize: bool | str = False
    eps: float = 0.0
    floor: str | None = None
    scale: str | None = None
    expert_scale: str | None = None
    fp32: bool = True
    order: tuple[int, int, int] = (0, 1, 2)


_SOFTMAX_NORM = RouterRule("softmax", normalize="norm_topk_prob")
_SIGMOID_GROUPED = RouterRule("sigmoid", "norm_topk_prob", eps=1e-20, scale="routed_scaling_factor")
_SIGMOID_NORM = RouterRule("sigmoid", normalize=True)
_GRANITE = RouterRule("softmax_chosen", order=(2, 1, 0))

ROUTER_RULES: dict[str, RouterRule] = {
    # softmax over all experts, top k, renormalised as norm_topk_prob says
    **dict.fromkeys(
        (
            "Qwen2MoeTopKRouter",
            "Qwen3MoeTopKRouter",
            "Qwen3NextTopKRouter",
            "OlmoeTopKRouter",
            "FlexOlmoTopKRouter",
            "MellumTopKRouter",
            "Qwen3OmniMoeThinkerTextTopKRouter",
            "Qwen3OmniMoeTalkerTextTopKRouter",
            "Qwen4ExpTextTopKRouter",
        ),
        _SOFTMAX_NORM,
    ),
    # softmax, always renormalised
    **dict.fromkeys(
        ("Qwen3_5MoeTopKRouter", "Qwen3VLMoeTextTopKRouter", "Qwen3OmniMoeTextTopKRouter"),
        RouterRule("softmax", normalize=True),
    ),
    **dict.fromkeys(("MixtralTopKRouter", "MiniMaxTopKRouter"), RouterRule("softmax", True)),
    # ERNIE-4.5: chosen with the correction bias of moe_statics, renormalised with a floor
    **dict.fromkeys(
        ("Ernie4_5_MoeTopKRouter", "Ernie4_5_VLMoeMoeTopKRouter"),
        RouterRule("softmax", normalize=True, floor="norm_min"),
    ),
    # DeepSeek-V2: softmax (greedy or group-limited), scaled, not renormalised
    **dict.fromkeys(
        ("DeepseekV2TopkRouter", "DeepseekOcr2TextTopkRouter"),
        RouterRule("softmax", scale="routed_scaling_factor"),
    ),
    "Mistral4TopkRouter": RouterRule(
        "softmax", "norm_topk_prob", eps=1e-20, scale="routed_scaling_factor", fp32=False
    ),
    # softmax over the chosen experts' logits
    "GptOssTopKRouter": RouterRule("softmax_chosen", fp32=False),
    "GraniteMoeSWATopKRouter": RouterRule("softmax_chosen"),
    **dict.fromkeys(
        ("GraniteMoeTopKRouter", "GraniteMoeHybridTopKRouter", "GraniteMoeSharedTopKRouter"),
        _GRANITE,
    ),
    "AriaTextTopKRouter": RouterRule("softmax_chosen", fp32=False, order=(2, 1, 0)),
    # sigmoid scores chosen with a correction bias (within the best groups), renormalised as
    # norm_topk_prob says, scaled: DeepSeek-V3's router and its copies
    **dict.fromkeys(
        (
            "DeepseekV3TopkRouter",
            "DeepseekV32TopkRouter",
            "Glm4MoeTopkRouter",
            "Glm4MoeLiteTopkRouter",
            "Glm4vMoeTextTopkRouter",
            "Glm5NextTextTopkRouter",
            "GlmMoeDsaTopkRouter",
            "NemotronHTopkRouter",
            "KimiLinearTopkRouter",
            "Dots1TopkRouter",
            "ExaoneMoeTopkRouter",
            "SolarOpenTopkRouter",
            "MiMoV2FlashTopkRouter",
            "HYV4TopkRouter",
            "AXK1TopkRouter",
            "AXK2TopkRouter",
        ),
        _SIGMOID_GROUPED,
    ),
    **dict.fromkeys(
        ("MiniMaxM2TopKRouter", "Step3p7TopKRouter", "MiniMaxM3VLTopKRouter", "LagunaTopKRouter"),
        _SIGMOID_NORM,
    ),
    "Lfm2MoeTopKRouter": RouterRule(
        "sigmoid", "norm_topk_prob", eps=1e-6, scale="routed_scaling_factor", fp32=False
    ),
    "HYV3TopKRouter": RouterRule("sigmoid", True, eps=1e-20, scale="router_scaling_factor"),
    "AfmoeTokenChoiceRouter": RouterRule("sigmoid", True, eps=1e-20, scale="route_scale"),
    # Gemma 4: probabilities returned, renormalised, times each expert's learned scale
    **dict.fromkeys(
        ("Gemma4TextRouter", "DiffusionGemmaTextRouter"),
        RouterRule("probs", normalize=True, expert_scale="per_expert_scale"),
    ),
}


def rule_of(module: nn.Module) -> RouterRule | None:
    return ROUTER_RULES.get(type(module).__name__)


def split_output(rule: RouterRule, output: tuple) -> tuple[torch.Tensor, ...]:
    """(scores, weights, experts) of a router's output tuple."""
    s, w, e = rule.order
    return output[s], output[w], output[e]


def join_output(
    rule: RouterRule, output: tuple, weights: torch.Tensor, experts: torch.Tensor
) -> tuple:
    """The router's output tuple with ``weights`` and ``experts`` put in their places."""
    out = list(output)
    _, w, e = rule.order
    out[w], out[e] = weights, experts
    return tuple(out)


def _attr(module: nn.Module, name: str):
    value = getattr(module, name, None)
    if value is None and getattr(module, "config", None) is not None:
        value = getattr(module.config, name, None)
    return value


def expert_probs(rule: RouterRule, scores: torch.Tensor) -> torch.Tensor:
    """(T, E) float32 probability of each expert, from the router's scores: what the
    load-balancing loss and the entropy metric read. Softmax routers: the softmax of their
    logits (Switch Transformer's P); sigmoid routers: the sigmoid scores normalised over the
    experts (DeepSeek-V3's balance loss); Gemma 4: its probabilities."""
    if rule.score == "probs":
        return scores.float()
    if rule.score == "sigmoid":
        s = torch.sigmoid(scores.float())
        return s / s.sum(-1, keepdim=True)
    return torch.softmax(scores, dim=-1, dtype=torch.float32)


def replay_weights(
    rule: RouterRule,
    module: nn.Module,
    scores: torch.Tensor,
    experts: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Mixing weights (T, k) the router ``module`` gives ``experts`` (T, k), computed from its
    ``scores`` (T, E: the first of its outputs, logits or probabilities) by its own rule, in
    ``dtype`` (its weights' dtype). Differentiable through ``scores``."""
    if rule.score == "softmax":
        probs = torch.softmax(scores.float(), dim=-1) if rule.fp32 else scores.softmax(-1)
        w = probs.gather(1, experts)
    elif rule.score == "softmax_chosen":
        chosen = scores.gather(1, experts)
        w = torch.softmax(chosen.float() if rule.fp32 else chosen, dim=-1)
    elif rule.score == "sigmoid":
        w = torch.sigmoid(scores.float() if rule.fp32 else scores).gather(1, experts)
    else:  # probs
        w = scores.gather(1, experts)
    normalize = rule.normalize
    if isinstance(normalize, str):
        normalize = bool(_attr(module, normalize))
    if normalize:
        total = w.sum(-1, keepdim=True)
        if rule.floor is not None:
            total = total.clamp(min=_attr(module, rule.floor))
        w = w / (total + rule.eps) if rule.eps else w / total
    if rule.scale is not None:
        w = w * _attr(module, rule.scale)
    if rule.expert_scale is not None:
        w = w * getattr(module, rule.expert_scale)[experts]
    return w.to(dtype)


def router_top_k(module: nn.Module) -> int:
    """Experts each token is routed to by this router."""
    for name in ("top_k", "top_k_experts", "num_experts_per_tok", "moe_k"):
        value = _attr(module, name)
        if value:
            return int(value)
    raise ValueError(f"{type(module).__name__}: no top_k found")


def router_num_experts(module: nn.Module) -> int:
    """Routed experts this router chooses among."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = _attr(module, name)
        if value:
            return int(value)
    weight = getattr(module, "weight", None)
    if weight is None and hasattr(module, "proj"):
        weight = module.proj.weight
    if weight is None:
        raise ValueError(f"{type(module).__name__}: no expert count found")
    return int(weight.shape[0])
