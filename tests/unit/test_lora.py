"""LoRA pieces without a process group: config checks, injection and freezing, the adapter
file names vLLM and peft read, the merge, and the reference policy (adapters disabled)."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_rlhf.config import LoraConfig, PPOConfig, RMConfig
from fsdp_rlhf.config_base import ConfigError, build_config
from fsdp_rlhf.models import lora
from fsdp_rlhf.testing.tiny import build_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("m"), "qwen2")


def _causal(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


def _randomize_b(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def test_flags_are_openrlhf_names_for_both_commands():
    for cls in (RMConfig, PPOConfig):
        cfg, _ = build_config(
            cls,
            ["--lora_rank", "8", "--lora_alpha", "32", "--target_modules", "q_proj", "v_proj",
             "--lora_dropout", "0.05", "--merge_lora"],
        )  # fmt: skip
        assert cfg.lora == LoraConfig(
            lora_rank=8,
            lora_alpha=32,
            target_modules=("q_proj", "v_proj"),
            lora_dropout=0.05,
            merge_lora=True,
        )
    assert not build_config(PPOConfig, [])[0].lora.enabled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lora_rank=-1), "lora_rank must be >= 0"),
        (dict(lora_rank=8, lora_alpha=0), "lora_alpha must be > 0"),
        (dict(lora_rank=8, lora_dropout=1.0), "lora_dropout must be in"),
        (dict(lora_rank=8, target_modules=("all-linear", "q_proj")), "all-linear stands alone"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LoraConfig(**kwargs)


def test_add_lora_freezes_the_base_and_keeps_the_head_trainable(tiny):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(tiny), num_labels=1)
    lora.add_lora(model, LoraConfig(lora_rank=4), head="score")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable
    assert all(lora.is_adapter_param(n) for n in trainable - {"score.weight"})
    assert lora.target_module_names(model) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"
    ]  # fmt: skip
    assert not any(n.startswith("score.") and "lora" in n for n, _ in model.named_parameters())


def test_unknown_target_module_is_one_line_before_loading(tiny):
    from fsdp_rlhf.errors import UserError

    bad = LoraConfig(lora_rank=4, target_modules=("nope",))
    with pytest.raises(UserError, match="--target_modules nope"):
        lora.check_target_modules(str(tiny), bad)  # on an empty meta-device copy
    with pytest.raises(UserError, match="--target_modules nope"):
        lora.add_lora(_causal(tiny), bad)
    lora.check_target_modules(str(tiny), LoraConfig(lora_rank=4, target_modules=("q_proj",)))


def test_adapter_file_names():
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert lora.adapter_file_name(name) == (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    wrapped = "model.layers.0._checkpoint_wrapped_module.mlp.up_proj.lora_B.default.weight"
    want = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    assert lora.adapter_file_name(wrapped) == want
    assert not lora.is_adapter_param("model.layers.0.self_attn.q_proj.base_layer.weight")
    with pytest.raises(ValueError):
        lora.adapter_file_name("model.layers.0.self_attn.q_proj.base_layer.weight")


def test_adapter_files_load_in_peft_and_merge_matches_peft(tiny, tmp_path):
    """What the export writes (adapter config + tensors, merged weights) is what peft itself
    computes from the same adapters."""
    from peft import PeftModel
    from safetensors.torch import save_file

    cfg = LoraConfig(lora_rank=4, lora_alpha=8)
    model = lora.add_lora(_causal(tiny), cfg)
    _randomize_b(model)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_config.json").write_text(
        json.dumps(lora.adapter_config(model, cfg, str(tiny), head=None))
    )
    save_file(lora.adapter_state_dict(state, head=None), str(out / "adapter_model.safetensors"))

    ids = torch.tensor([[5, 17, 33, 9, 41, 2]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        peft_model = PeftModel.from_pretrained(_causal(tiny), str(out))
        assert torch.allclose(peft_model(input_ids=ids).logits, want, atol=1e-5)
        merged = _causal(tiny)
        merged.load_state_dict(lora.merge_lora_state_dict(state, cfg))
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)
        # the adapters changed the model: the comparisons above can fail
        assert not torch.allclose(_causal(tiny)(input_ids=ids).logits, want, atol=1e-3)


def test_adapters_disabled_is_the_base_model_and_keeps_trainable_flags(tiny):
    model = lora.add_lora(_causal(tiny), LoraConfig(lora_rank=4))
    _randomize_b(model)
    ids = torch.tensor([[5, 17, 33, 9]])
    flags = [p.requires_grad for p in model.parameters()]
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with lora.adapters_disabled(model):
            base = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
        reference = _causal(tiny)(input_ids=ids).logits
    assert torch.allclose(base, reference, atol=1e-5)
    assert torch.equal(again, adapted)
    assert not torch.allclose(base, adapted, atol=1e-3)
    assert [p.requires_grad for p in model.parameters()] == flags
