"""Router rules (models/routers.py) against the routers transformers ships: given the experts a
router chose itself, the weights its rule recomputes from its scores are the weights it
returned; given other experts (a replay), they are the rule's formula on hand-made tensors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
import transformers.models
from transformers import PreTrainedConfig

from fsdp_rlhf.models.routers import (
    ROUTER_RULES,
    RouterRule,
    expert_probs,
    join_output,
    replay_weights,
    router_num_experts,
    router_top_k,
    split_output,
)

E, K, H, T = 8, 2, 32, 24


def _router_classes() -> dict[str, tuple[type, list[type]]]:
    """Router class name -> (class, the config classes of its modeling module)."""
    found = {}
    for mod in pkgutil.iter_modules(transformers.models.__path__):
        try:
            m = importlib.import_module(f"transformers.models.{mod.name}.modeling_{mod.name}")
        except Exception:  # noqa: BLE001 - a model module needing an absent package
            continue
        configs = [
            c
            for c in vars(m).values()
            if inspect.isclass(c) and issubclass(c, PreTrainedConfig) and c is not PreTrainedConfig
        ]
        for name in ROUTER_RULES:
            cls = getattr(m, name, None)
            if cls is not None and cls.__module__ == m.__name__:
                found[name] = (cls, configs)
    return found


ROUTER_CLASSES = _router_classes()

_SMALL = dict(
    hidden_size=H,
    num_experts=E,
    num_local_experts=E,
    n_routed_experts=E,
    moe_num_experts=E,
    num_experts_per_tok=K,
    moe_k=K,
    top_k_experts=K,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    enable_moe_block=True,
    moe_intermediate_size=16,
)


def _small_config(configs: list[type]):
    for cls in configs:
        try:
            config = cls().get_text_config()
        except Exception:  # noqa: BLE001 - composite configs that need arguments
            continue
        for key, value in _SMALL.items():
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001 - a read-only or validated attribute
                pass
        yield config


def build_router(name: str) -> torch.nn.Module:
    cls, configs = ROUTER_CLASSES[name]
    errors = []
    for config in _small_config(configs):
        try:
            router = cls(config)
        except Exception as e:  # noqa: BLE001 - try the module's next config class
            errors.append(f"{type(config).__name__}: {e}")
            continue
        torch.manual_seed(0)
        with torch.no_grad():
            for p in [*router.parameters(), *router.buffers()]:
                if p.is_floating_point():
                    p.copy_(torch.randn_like(p) * 0.5)
        return router.eval()
    raise RuntimeError(f"{name}: no config builds it: {errors}")


def run_router(router: torch.nn.Module, hidden: torch.Tensor) -> tuple:
    """The router's own forward; routers taking a bias argument (LFM2-MoE, MiniMax-M2, ...)
    get a random one, as their MoE block would pass its buffer."""
    extra = len(inspect.signature(router.forward).parameters) - 1
    args = [torch.randn(router_num_experts(router)) * 0.1] * extra
    try:
        return router(hidden, *args)
    except ValueError:  # routers reading (B, L, H)
        out = router(hidden.unsqueeze(0), *args)
        return tuple(o.reshape(-1, o.shape[-1]) for o in out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ROUTER_CLASSES))
def test_rule_recomputes_the_routers_own_weights(name, dtype):
    router = build_router(name).to(dtype)
    rule = ROUTER_RULES[name]
    hidden = torch.randn(T, H, dtype=dtype)
    with torch.no_grad():
        output = run_router(router, hidden)
    scores, weights, experts = split_output(rule, output)
    assert router_top_k(router) == experts.shape[-1] == K
    assert scores.shape == (T, router_num_experts(router))
    ours = replay_weights(rule, router, scores, experts, weights.dtype)
    assert ours.dtype == weights.dtype
    torch.testing.assert_close(ours, weights, rtol=0, atol=0)
    probs = expert_probs(rule, scores)
    torch.testing.assert_close(probs.sum(-1), torch.ones(T), rtol=0, atol=1e-5)
    replayed = experts.flip(-1)  # the same experts in another order: the same weights
    again = join_output(
        rule, output, replay_weights(rule, router, scores, replayed, ours.dtype), replayed
    )
    assert split_output(rule, again)[0] is scores and split_output(rule, again)[2] is replayed
    torch.testing.assert_close(split_output(rule, again)[1], ours.flip(-1))


def test_every_family_of_the_matrix_has_a_rule():
    """Every router of every MoE family has a rule, and the kind the rules table reads (its
    router, found on a meta-device build) names a router with one."""
    from fsdp_rlhf.models.kind import kind_from_config
    from fsdp_rlhf.models.moe import ROUTERS, is_moe
    from fsdp_rlhf.testing.tiny import FAMILIES

    for fam in FAMILIES.values():
        if not fam.moe:
            continue
        import transformers

        config = getattr(transformers, fam.config_class)(
            vocab_size=64, num_hidden_layers=fam.num_layers or 2, **fam.config
        )
        with torch.device("meta"):
            model = getattr(transformers, fam.model_class)(config)
        assert is_moe(model), fam.name
        routers = {type(m).__name__ for m in model.modules()}
        routers = {name for name in routers if name.lower().endswith("router")}
        assert routers and routers <= set(ROUTERS), (fam.name, routers)
        config.architectures = [fam.model_class]
        kind = kind_from_config(fam.name, config)
        assert kind.moe and kind.router in ROUTERS, (fam.name, kind.router)


# ---------------------------------------------------------------- replayed experts


def test_sigmoid_grouped_rule_weighs_replayed_experts_by_plain_scores():
    """DeepSeek-V3's rule: the correction bias and the groups choose; the weights are the
    plain sigmoid scores at the (replayed) experts, renormalised, times the scaling factor."""
    router = build_router("DeepseekV3TopkRouter")
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5, -0.5, 3.0, -2.0]])
    replay = torch.tensor([[2, 5]])  # experts the router itself would not pick
    w = replay_weights(ROUTER_RULES["DeepseekV3TopkRouter"], router, logits, replay, torch.float32)
    s = torch.sigmoid(torch.tensor([-1.0, -0.5]))
    torch.testing.assert_close(w[0], s / (s.sum() + 1e-20) * 2.5)


def test_gpt_oss_rule_softmaxes_the_replayed_logits_bias_included():
    """gpt-oss's router adds its bias to the logits (part of the scores it returns) and
    softmaxes the chosen experts' logits only."""
    router = build_router("GptOssTopKRouter")
    rule = ROUTER_RULES["GptOssTopKRouter"]
    hidden = torch.randn(T, H)
    with torch.no_grad():
        scores, _, _ = split_output(rule, run_router(router, hidden))
        expected_scores = hidden @ router.weight.T + router.bias
    torch.testing.assert_close(scores, expected_scores)
    replay = torch.tensor([[7, 0]] * T)
    w = replay_weights(rule, router, scores, replay, torch.float32)
    torch.testing.assert_close(w, torch.softmax(scores[:, [7, 0]], -1))


def test_gemma4_rule_applies_the_per_expert_scales_of_the_replayed_experts():
    router = build_router("Gemma4TextRouter")
    rule = ROUTER_RULES["Gemma4TextRouter"]
    probs = torch.softmax(torch.randn(3, E), -1)
    replay = torch.tensor([[1, 4], [0, 7], [3, 2]])
    w = replay_weights(rule, router, probs, replay, torch.float32)
    picked = probs.gather(1, replay)
    expected = picked / picked.sum(-1, keepdim=True) * router.per_expert_scale[replay]
    torch.testing.assert_close(w, expected)


def test_normalisation_follows_the_routers_flag_epsilon_and_floor():
    class Stub(torch.nn.Module):
        norm_topk_prob = False
        norm_min = 10.0
        routed_scaling_factor = 3.0

    logits = torch.randn(4, E)
    experts = torch.tensor([[0, 1]] * 4)
    probs = torch.softmax(logits, -1).gather(1, experts)
    off = RouterRule("softmax", normalize="norm_topk_prob", scale="routed_scaling_factor")
    torch.testing.assert_close(
        replay_weights(off, Stub(), logits, experts, torch.float32), probs * 3
    )
    floored = RouterRule("softmax", normalize=True, floor="norm_min")
    torch.testing.assert_close(
        replay_weights(floored, Stub(), logits, experts, torch.float32), probs / 10.0
    )
    s = torch.sigmoid(logits).gather(1, experts)
    eps = RouterRule("sigmoid", normalize=True, eps=1e-6)
    torch.testing.assert_close(
        replay_weights(eps, Stub(), logits, experts, torch.float32), s / (s.sum(-1, True) + 1e-6)
    )


def test_sigmoid_probabilities_for_the_balancing_loss_are_normalised_scores():
    logits = torch.randn(5, E)
    s = torch.sigmoid(logits)
    torch.testing.assert_close(
        expert_probs(RouterRule("sigmoid"), logits), s / s.sum(-1, keepdim=True)
    )
    torch.testing.assert_close(expert_probs(RouterRule("softmax"), logits), logits.softmax(-1))
