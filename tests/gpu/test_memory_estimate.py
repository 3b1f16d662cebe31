"""The doctor's per-phase estimate (``distributed.memory``) beside the peaks two PPO steps
measure on a 1.5 B model (Qwen2.5-1.5B's shape, random weights built on the GPU): FAIL where
the estimate's tensors differ from ``max_memory_allocated`` by more than 10%. A failure here
calibrates the model (its ASSUMED constants first) or says why the difference is expected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.suite import (
    HAVE,
    MEMORY_TOLERANCE,
    cli,
    compare_phases,
    device_bytes,
    format_rows,
    metrics,
    ppo_flags,
)

pytestmark = pytest.mark.gpu


def build_big_model(out: Path) -> str:
    """Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12/2 heads, 151,936 vocabulary, tied
    embeddings; no head_dim key), random bf16 weights, initialised on the GPU: big enough that
    fixed costs do not dominate the phases' memory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fsdp_rlhf.testing.tiny import _drop_config_keys, build_tokenizer, write_generation_config

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    cfg = Qwen2Config(
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    _drop_config_keys(out, ("head_dim",))
    write_generation_config(out, tok)
    return str(out)


def test_estimate_beside_measured_peaks_1_5b(tmp_path, detail):
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.memory_plan import plan_job

    model = build_big_model(tmp_path / "big")
    sizes = dict(micro=4, prompt=128, response=256)
    extra = ["--bf16", "--zero_stage", "3", "--gradient_checkpointing"]
    flags = [*ppo_flags(model, tmp_path / "run", sizes), *extra]
    if HAVE["vllm"]:
        flags += ["--vllm_gpu_memory_utilization", "0.3"]
    phases = plan_job(build_config(PPOConfig, flags)[0], 1, device_bytes(), cuda=True)
    cli(["ppo", *flags], nproc=1, timeout=360)
    table = compare_phases(phases, metrics(tmp_path / "run" / "out")[-1])
    detail("\n".join(format_rows(table)))
    off = [r["phase"] for r in table if abs(r["error"]) > MEMORY_TOLERANCE]
    assert table and not off, f"estimate off by more than 10% in {off or 'every phase'}"
