"""The tiny-model kit writes configs shaped like published checkpoints, and code that reads
attention sizes copes with them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fsdp_rlhf.hf_config import head_dim


def test_qwen2_config_has_no_head_dim_and_it_is_derived(tiny_qwen2):
    saved = json.loads((Path(tiny_qwen2) / "config.json").read_text())
    assert "head_dim" not in saved  # as in Qwen2/Qwen2.5 config.json files
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_qwen2)
    assert head_dim(cfg) == 64
    # the size transformers itself builds the projections with
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features == cfg.num_key_value_heads * head_dim(cfg)


def test_head_dim_prefers_an_explicit_value():
    # Gemma/Qwen3 style: head_dim set and not hidden_size // heads; null falls back
    assert head_dim(SimpleNamespace(head_dim=128, hidden_size=1024, num_attention_heads=16)) == 128
    assert head_dim(SimpleNamespace(head_dim=None, hidden_size=1024, num_attention_heads=16)) == 64


def test_llama_shape_is_odd_gqa_with_tied_embeddings(tiny_llama):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_llama)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)) == (9, 3, 64)
    assert cfg.tie_word_embeddings
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # tied: listed once, as the embedding
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_generation_config_lists_two_eos_ids(tiny_qwen2, tiny_llama):
    from transformers import AutoTokenizer

    for path in (tiny_qwen2, tiny_llama):
        gen = json.loads((Path(path) / "generation_config.json").read_text())
        tok = AutoTokenizer.from_pretrained(path)
        assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]


def test_cpu_kv_cache_size_without_head_dim_key(tiny_qwen2, tiny_llama):
    pytest.importorskip("vllm")  # the adapter imports vLLM (absent on the GPU box)
    from fsdp_rlhf.rollout.vllm.engine import CPU_KV_CONCURRENT_SEQS, cpu_kv_cache_bytes

    long = 1 << 15  # large enough to clear the 1 GiB floor
    for path, kv_heads in ((tiny_qwen2, 2), (tiny_llama, 3)):
        per_token = 2 * 2 * kv_heads * 64 * 4  # K and V, 2 layers, fp32
        got = cpu_kv_cache_bytes(path, long, 1, torch.float32, 0.0)
        assert got == per_token * long * CPU_KV_CONCURRENT_SEQS
    # 3 KV heads over TP 2: each rank holds 2 of them
    got = cpu_kv_cache_bytes(tiny_llama, long, 2, torch.float32, 0.0)
    assert got == 2 * 2 * 2 * 64 * 4 * long * CPU_KV_CONCURRENT_SEQS
