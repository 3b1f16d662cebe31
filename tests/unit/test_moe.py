"""MoE actors (models.moe): router replay in every forward layout, the load-balancing loss,
routing statistics, the preflight of MoE flags; on a tiny Qwen3-MoE shaped like Qwen3-30B-A3B."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.attention import use_varlen_attention
from fsdp_rlhf.models.forward import response_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.load import load_causal_lm
from fsdp_rlhf.models.moe import (
    MoEHooks,
    active_parameters,
    expert_parameter_names,
    moe_routers,
    routing_scope,
)
from fsdp_rlhf.models.packing import pack_rows
from fsdp_rlhf.models.shared_prefix import share_prompts
from tests.unit.test_shared_prefix import S, T, grouped_batch


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny import build_family

    return str(build_family(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=4))


@pytest.fixture(scope="module")
def moe_model(tiny_qwen3_moe):
    return load_causal_lm(tiny_qwen3_moe, BackendConfig(), torch.device("cpu"))


def own_routing(model, ids, mask) -> torch.Tensor:
    """(B, L, Lm, k) the experts the model picks itself in a padded forward, as uint8."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    k = model.config.num_experts_per_tok
    picks = [torch.topk(lg.softmax(-1), k).indices for lg in out.router_logits]
    return torch.stack(picks, 1).view(*ids.shape, len(picks), k).to(torch.uint8)


def shifted(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Another valid routing: each token's first expert moved to the next id not chosen."""
    out = routing.long().clone()
    first = out[..., 0]
    for step in range(1, num_experts):
        cand = (first + step) % num_experts
        free = ~(cand.unsqueeze(-1) == out[..., 1:]).any(-1)
        first = torch.where(free & (first == out[..., 0]), cand, first)
    out[..., 0] = first
    return out.to(torch.uint8)


def test_layouts_follow_the_packed_and_shared_forwards():
    ids, mask, _ = grouped_batch(100)
    packed = forward_inputs(ids, mask, packed=True).arrange(ids)
    assert torch.equal(packed, pack_rows(ids, mask).input_ids)
    shared_inputs = forward_inputs(ids, mask, group_size=S, response_len=T)
    shared = shared_inputs.arrange(ids)
    assert torch.equal(shared, share_prompts(ids, mask, T, S).input_ids)
    # trailing dimensions (layers, experts) travel along with their token
    where = torch.arange(ids.numel()).view(*ids.shape, 1, 1).expand(*ids.shape, 2, 3)
    laid = shared_inputs.arrange(where)
    assert torch.equal(ids.flatten()[laid[..., 1, 2]], shared)


def test_replaying_the_models_own_routing_changes_nothing(moe_model):
    model = moe_model
    hooks = MoEHooks.attach(model)
    ids, mask, _ = grouped_batch(model.config.vocab_size)
    routing = own_routing(model, ids, mask)
    with torch.no_grad():
        ref, _ = response_logprobs(model, forward_inputs(ids, mask), T)
        with routing_scope(hooks, routing, forward_inputs(ids, mask), collect=True):
            got, _ = response_logprobs(model, forward_inputs(ids, mask), T)
    assert torch.equal(got, ref)
    assert hooks.pop_metrics()["moe/router_replay_agreement"] == 1.0


@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_replay_gives_the_padded_forwards_logprobs_in_every_layout(moe_model, layout):
    """A replayed routing other than the model's own: the packed and shared-prompt forwards
    replay it token for token as the padded one does."""
    model = copy.deepcopy(moe_model)
    hooks = MoEHooks.attach(model)
    ids, mask, rmask = grouped_batch(model.config.vocab_size, seed=1)
    routing = shifted(own_routing(model, ids, mask), model.config.num_experts)
    with torch.no_grad():
        plain, _ = response_logprobs(model, forward_inputs(ids, mask), T)
        with routing_scope(hooks, routing, forward_inputs(ids, mask)):
            padded, _ = response_logprobs(model, forward_inputs(ids, mask), T)
        packed = layout == "packed"
        group = S if layout == "shared" else 1
        if packed:
            use_varlen_attention(model, "cpu")
        inputs = forward_inputs(ids, mask, packed=packed, group_size=group, response_len=T)
        with routing_scope(hooks, routing, inputs):
            got, _ = response_logprobs(model, inputs, T)
    on = rmask.bool()
    assert (padded[on] - plain[on]).abs().max() > 1e-3  # the replay is not the model's routing
    torch.testing.assert_close(got[on], padded[on], rtol=1e-5, atol=1e-5)


def test_replayed_weights_train_the_router_and_unrouted_tokens_route_themselves(moe_model):
    model = copy.deepcopy(moe_model)
    hooks = MoEHooks.attach(model)
    ids, mask, rmask = grouped_batch(model.config.vocab_size, seed=2)
    own = own_routing(model, ids, mask)
    routing = shifted(own, model.config.num_experts)
    routing[:, :] = 255  # no routing anywhere ...
    with torch.no_grad():
        ref, _ = response_logprobs(model, forward_inputs(ids, mask), T)
        with routing_scope(hooks, routing, forward_inputs(ids, mask)):
            got, _ = response_logprobs(model, forward_inputs(ids, mask), T)
    torch.testing.assert_close(got, ref)  # ... is the model's own routing
    routing = shifted(own, model.config.num_experts)
    model.zero_grad()
    with routing_scope(hooks, routing, forward_inputs(ids, mask)):
        lp, _ = response_logprobs(model, forward_inputs(ids, mask), T)
        (lp * rmask).sum().backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_aux_loss_is_transformers_load_balancing_loss(moe_model):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = moe_model
    hooks = MoEHooks.attach(model)
    ids, mask, _ = grouped_batch(model.config.vocab_size, seed=5)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with routing_scope(hooks, None, forward_inputs(ids, mask), collect=False):
        out = model(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        ours = hooks.aux_loss()
    ref = load_balancing_loss_func(
        out.router_logits, model.config.num_experts, model.config.num_experts_per_tok, mask
    )
    torch.testing.assert_close(ours, ref)
    assert ours.requires_grad
    assert hooks.pop_metrics() == {}  # collect=False: nothing counted


def test_metrics_count_what_was_routed(moe_model):
    model = moe_model
    hooks = MoEHooks.attach(model)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    ids, mask, _ = grouped_batch(model.config.vocab_size, seed=6)
    routing = own_routing(model, ids, mask)
    routing[..., :] = torch.arange(k, dtype=torch.uint8)  # every token to experts 0..k-1
    with torch.no_grad(), routing_scope(hooks, routing, forward_inputs(ids, mask)):
        response_logprobs(model, forward_inputs(ids, mask), T)
    m = hooks.pop_metrics()
    # k of E experts take all the load: max share = 1/k, mean share = 1/E
    assert m["moe/expert_load_max_mean/layer_0"] == pytest.approx(E / k)
    assert m["moe/expert_load_max_mean"] == pytest.approx(E / k)
    assert 0 < m["moe/router_entropy"] <= torch.log(torch.tensor(float(E))).item() + 1e-6
    assert m["moe/router_replay_agreement"] < 1.0


def test_parameter_counts_and_expert_names(moe_model):
    total, active = active_parameters(moe_model)
    cfg = moe_model.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = cfg.num_hidden_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
    assert total - active == idle
    names = expert_parameter_names(moe_model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert not any("gate.weight" in n for n in names)


def _ppo(*argv: str):
    """A critic-free PPO config (the rules table's critic row stays quiet)."""
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config

    return build_config(PPOConfig, ["--advantage_estimator", "reinforce++", *argv])[0]


def test_moe_flags_need_an_moe_model_with_a_known_router(tiny_qwen2, tiny_qwen3_moe):
    """The rules table reads the router from the model's config (a meta-device build)."""
    from fsdp_rlhf.rules import check_command

    kinds = check_command("ppo", _ppo("--pretrain", tiny_qwen3_moe, "--router_replay"))
    assert kinds["--pretrain"].router == "Qwen3MoeTopKRouter"
    with pytest.raises(UserError, match=r"--router_replay: .* is a dense model \(Qwen2ForCausalLM"):
        check_command("ppo", _ppo("--pretrain", tiny_qwen2, "--router_replay"))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_lora_adapts_attention_and_dense_parts_never_experts_or_gates(family, tmp_path):
    import transformers

    from fsdp_rlhf.config import LoraConfig
    from fsdp_rlhf.models.lora import add_lora, target_module_names
    from fsdp_rlhf.testing.tiny import FAMILIES

    fam = FAMILIES[family]
    config_cls = getattr(transformers, fam.config_class)
    config = config_cls(vocab_size=64, num_hidden_layers=1, **fam.config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    add_lora(model, LoraConfig(lora_rank=4), quiet=True)
    targets = set(target_module_names(model))
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= targets
    if family == "qwen2_moe":  # its shared expert is a dense MLP
        assert {"gate_proj", "up_proj", "down_proj"} <= targets
    assert "shared_expert_gate" not in targets and "gate" not in targets
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and not any(".experts." in n or ".gate." in n for n in trained)


def test_lora_adapter_sync_of_an_moe_model_is_refused_on_cpu(tiny_qwen3_moe):
    from fsdp_rlhf.rules import check_command

    cfg = _ppo("--pretrain", tiny_qwen3_moe, "--lora_rank", "8")
    with pytest.raises(UserError, match="use --lora_sync merged"):
        check_command("ppo", cfg, cuda=False)
    check_command("ppo", cfg, cuda=True)  # vLLM's LoRA MoE layers run on CUDA
    check_command("ppo", _ppo("--pretrain", tiny_qwen3_moe, "--lora_rank", "8", "--lora_sync",
                              "merged"), cuda=False)  # fmt: skip


def test_sequence_parallelism_takes_router_replay_and_the_aux_loss_not_linear_attention(
    tiny_qwen3_moe, tmp_path
):
    """Ulysses gives each rank a slice of every sequence: the hooks slice the replayed routing
    and sum the balancing loss's counts over the group (tests/distributed/
    test_moe_sequence_parallel.py); Qwen3.5's gated delta nets are split by heads
    (tests/distributed/test_hybrid_sequence_parallel.py), Qwen3-Next's fused ones are not."""
    from fsdp_rlhf.rules import check_command
    from fsdp_rlhf.testing.tiny import build_family

    base = ["--sequence_parallel_size", "2", "--bf16"]
    cfg = _ppo("--pretrain", tiny_qwen3_moe, *base, "--router_replay", "--aux_loss_coef", "0.01")
    assert cfg.moe.router_replay and cfg.moe.aux_loss_coef == 0.01
    check_command("ppo", cfg)
    hybrid = str(build_family(tmp_path / "qwen3_5", "qwen3_5"))
    check_command("ppo", _ppo("--pretrain", hybrid, *base))
    fused = str(build_family(tmp_path / "qwen3_next", "qwen3_next"))
    with pytest.raises(UserError, match="recurrent layers other than Qwen3.5's gated delta nets"):
        check_command("ppo", _ppo("--pretrain", fused, *base))


def test_metrics_live_where_the_routers_run_not_where_the_parameters_are(moe_model):
    """Issue #45, finding 4: under --adam_offload (CPUOffloadPolicy) the parameters' device is the
    host while the routers run on the GPU; the step's totals must follow the routers. Here the
    parameters' device is stood in for by a meta parameter (the routers run on the host)."""
    model = moe_model

    class Offloaded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, device="meta"))

    hooks = MoEHooks(Offloaded(), moe_routers(model))
    ids, mask, _ = grouped_batch(model.config.vocab_size, seed=6)
    routing = own_routing(model, ids, mask)
    with torch.no_grad(), routing_scope(hooks, routing, forward_inputs(ids, mask)):
        response_logprobs(model, forward_inputs(ids, mask), T)
    m = hooks.pop_metrics()
    assert m["moe/router_replay_agreement"] == pytest.approx(1.0)
    assert m["moe/expert_load_max_mean"] >= 1.0


def test_router_replay_with_vllm_tensor_parallelism_passes_the_checks_on_cpu_and_cuda(
    tiny_qwen3_moe,
):
    """Refused on CUDA before #60 (vLLM's own capture keeps the rows on its first TP rank);
    the first rank now serves the others (tests/distributed/test_routed_capture.py). On CPU
    every rank records them itself (tests/e2e/test_sequence_parallel_cli.py)."""
    from fsdp_rlhf.rules import check_command

    argv = ["--pretrain", tiny_qwen3_moe, "--router_replay", "--vllm_tensor_parallel_size", "2"]
    for cuda in (False, True):
        check_command("ppo", _ppo(*argv), cuda=cuda)


def test_expert_parallel_preflight_names_the_numbers(tiny_qwen2, tiny_qwen3_moe):
    from fsdp_rlhf.models.load import check_expert_parallel

    both = {"--pretrain": tiny_qwen3_moe, "--reward_pretrain": tiny_qwen2}
    check_expert_parallel(1, 3, both)  # off: nothing to check
    check_expert_parallel(2, 4, both)  # the dense reward model shards as before
    check_expert_parallel(16, 16, both)
    with pytest.raises(UserError, match="--expert_parallel_size 2 must divide the world size 3"):
        check_expert_parallel(2, 3, both)
    with pytest.raises(UserError, match=r"does not divide the model's 16 experts .*--pretrain"):
        check_expert_parallel(3, 6, both)
    check_expert_parallel(2, 2, {"--pretrain": tiny_qwen2})  # no MoE at all: the rules table's


def test_expert_group_load_counts_each_groups_share_of_the_assignments():
    from fsdp_rlhf.models.moe import expert_group_load

    counts = torch.tensor([[4.0, 4, 4, 4], [6, 2, 0, 0]])  # 2 layers, 4 experts
    even = expert_group_load(counts[:1], 2)
    assert even == {"moe/ep_group_tokens_max": 8.0, "moe/ep_group_load_max_mean": 1.0}
    skewed = expert_group_load(counts, 2)  # layer 1: group 0 ran all 8 assignments
    assert skewed["moe/ep_group_load_max_mean"] == 2.0
    assert skewed["moe/ep_group_tokens_max"] == 8.0
    assert expert_group_load(counts, 4)["moe/ep_group_load_max_mean"] == 3.0  # 6 / mean 2


def test_unsupported_fused_experts_are_named():
    from fsdp_rlhf.distributed.expert_parallel import expert_parallel_problem, unsupported_experts

    class BiasedExperts(torch.nn.Module):  # gpt-oss-like: biases beside the fused weights
        num_experts = 4

        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 8, 4))
            self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(4, 8))
            self.down_proj = torch.nn.Parameter(torch.zeros(4, 4, 4))
            self.act_fn = torch.nn.SiLU()

    assert "gate_up_proj_bias" in unsupported_experts(BiasedExperts())
    assert expert_parallel_problem(0, 4, 8) == "--expert_parallel_size 0: must be at least 1"
    assert expert_parallel_problem(2, 4, 0).endswith(
        "the model is dense (no routed experts to split)"
    )
    assert expert_parallel_problem(4, 8, 16) is None
