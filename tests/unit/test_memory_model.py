"""The per-device memory model (distributed.memory) and vLLM's start-up budget, with fake
numbers: no GPU needed."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_rlhf.distributed.memory import GIB, JobFlags, ModelShape, plan_phases, verdict
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.rollout.memory_budget import vllm_memory_utilization

LLAMA_7B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=11008,
    vocab_size=32000,
    num_attention_heads=32,
)
# examples/ppo.sh and slurm/ppo.sbatch: 8 GPUs of 80 GB per node, vLLM TP 1
LAUNCHER = JobFlags(
    world=8,
    device_bytes=80 * GIB,
    zero_stage=3,
    bf16=True,
    adam_offload=True,
    ref_reward_offload=True,
    gpu_memory_utilization=0.9,
    micro_train_batch_size=8,
    micro_rollout_batch_size=16,
    seq_len=1024 + 1024,
    gradient_checkpointing=True,
)


def _plan(**changes):
    m = ModelShape.from_hf_config(LLAMA_7B)
    return verdict(plan_phases(dataclasses.replace(LAUNCHER, **changes), m, m, [m, m]))


def test_shape_from_config_counts_llama_7b():
    m = ModelShape.from_hf_config(LLAMA_7B)
    assert m.params == 6_738_149_376  # Llama-2-7B's published count (q,k,v,o,gate,up,down,emb)
    assert m.layers * m.layer_params + m.root_params == m.params


@pytest.mark.parametrize(
    "changes,fits,flag",
    [
        # the launchers' flags: every phase fits under this model (see docs/memory_and_offload.md)
        ({}, True, None),
        # no offload at all: the trainer's shards + vLLM's 90% overflow the rollout
        (
            dict(adam_offload=False, ref_reward_offload=False),
            False,
            "--vllm_gpu_memory_utilization",
        ),
        (
            dict(adam_offload=False, ref_reward_offload=False, gpu_memory_utilization=0.85),
            True,
            None,
        ),
        # activations of 32 layers x 16 x 2048 tokens without recomputation (at 8, 68 GiB fit
        # since the logits are read chunk by chunk: no fp32 copy of them)
        (dict(gradient_checkpointing=False, micro_train_batch_size=16), False, "--micro_train"),
        (dict(gradient_checkpointing=False, micro_train_batch_size=4), True, None),
        # ZeRO-2 without offload: full bf16 params + unsharded fp32 grads (38 GiB) still fit
        (dict(zero_stage=2, adam_offload=False, micro_train_batch_size=16), True, None),
        # ... but not with twice the micro-batch
        (
            dict(zero_stage=2, adam_offload=False, micro_train_batch_size=32),
            False,
            "--adam_offload",
        ),
        # vLLM kept awake while training
        (dict(vllm_sleep=False), False, "--vllm_enable_sleep"),
        # scoring keeps b x 1024 x 32000 bf16 logits (plus one fp32 chunk)
        (dict(micro_rollout_batch_size=2048), False, "--micro_rollout_batch_size"),
    ],
)
def test_7b_ppo_on_8x80gb_table(changes, fits, flag):
    ok, line = _plan(**changes)
    assert ok == fits, line
    if flag:
        assert flag in line and "DOES NOT FIT" in line, line


def test_vllm_utilization_fits_or_names_the_flag():
    total = 80 * GIB
    util, line = vllm_memory_utilization(78 * GIB, total, 0.9)
    assert util == 0.9 and "fits" in line
    with pytest.raises(UserError) as e:
        vllm_memory_utilization(70 * GIB, total, 0.9)  # 10 GiB of shards resident
    msg = str(e.value)
    assert "--vllm_gpu_memory_utilization 0.9" in msg and "70.0 GiB free of 80.0" in msg
    assert "at most 0.86" in msg  # (70 - 1) / 80
    util, _ = vllm_memory_utilization(70 * GIB, total, 0.86)
    assert util == 0.86
    with pytest.raises(UserError):
        vllm_memory_utilization(70 * GIB, total, 1.5)


def test_device_budget_reads_the_device_it_is_given(monkeypatch):
    import torch

    from fsdp_rlhf.rollout.memory_budget import check_device_budget

    seen = []

    def fake_mem_get_info(device):
        seen.append(device)
        return 78 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", fake_mem_get_info)
    line = check_device_budget(torch.device("cuda", 3), 0.9)
    assert seen == [torch.device("cuda", 3)] and "78.0 GiB free of 80.0 GiB" in line
    assert line.endswith("fits")
    with pytest.raises(UserError, match="--vllm_gpu_memory_utilization 0.99"):
        check_device_budget(torch.device("cuda", 3), 0.99)


def test_lora_drops_the_reference_and_the_base_adam_state():
    """ZeRO-2 without offload at micro-batch 32 does not fit full fine-tuning (see the table);
    with LoRA the base has no grads or Adam state and there is no reference copy."""
    from fsdp_rlhf.distributed.memory import lora_reference_savings

    m = ModelShape.from_hf_config(LLAMA_7B)
    flags = dataclasses.replace(
        LAUNCHER, zero_stage=2, adam_offload=False, micro_train_batch_size=32, lora=True
    )
    full = plan_phases(dataclasses.replace(flags, lora=False), m, m, [m, m])
    lora = plan_phases(flags, m, m, [m])  # reward only: no reference model
    assert not verdict(full)[0] and verdict(lora)[0], verdict(lora)[1]
    update = {p.name: p for p in lora}["actor update"]
    assert update.parts["params+grads+adam shards"] == 4 * m.params // 8
    assert "unsharded grads" not in update.parts
    assert lora_reference_savings(flags, m) == 2 * m.params // 8  # bf16 reference shards


def test_the_hf_engine_has_no_pool_and_a_resident_copy():
    """--rollout_engine hf (the GPU box without vLLM): no start-up/wake phase, the unsharded bf16
    copy of the actor in every phase, HF's KV cache and per-step scores while it generates."""
    m = ModelShape.from_hf_config(LLAMA_7B)
    flags = dataclasses.replace(LAUNCHER, engine="hf", rollout_seqs=4, world=1)
    phases = {p.name: p for p in plan_phases(flags, m, m, [m, m])}
    assert "vllm start-up/wake" not in phases
    assert "vllm pool" not in phases["rollout"].parts
    for name in ("rollout", "scoring (no-grad)", "actor update", "critic update"):
        assert phases[name].parts["hf engine copy"] == 2 * m.params, name
    # 2 (k, v) x 32 layers x 4096 x bf16 per token, 4 sequences of 2048 tokens
    assert phases["rollout"].parts["hf kv cache"] == 2 * 32 * 4096 * 2 * 2048 * 4
    assert phases["actor update"].parts["vllm"] == 0
