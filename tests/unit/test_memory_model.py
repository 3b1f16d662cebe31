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


# Qwen2.5-7B's config.json (no head_dim key), its published parameter count, an H100's memory
QWEN25_7B = dict(
    hidden_size=3584,
    num_hidden_layers=28,
    intermediate_size=18944,
    vocab_size=152064,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
QWEN25_7B_PARAMS = 7_615_616_512
H100 = int(79.19 * GIB)  # torch.cuda.mem_get_info()[1] of an H100 80GB


def test_default_flags_overflow_the_wake_for_7b_on_8_h100s():
    """The review's number (79.9 of 79.2 GiB before this model counted the allocator's slack):
    default flags (ZeRO-2, no offload, vLLM at 0.9) do not fit beside the resident shards."""
    m = ModelShape.from_hf_config(QWEN25_7B, QWEN25_7B_PARAMS)
    f = JobFlags(world=8, device_bytes=H100, zero_stage=2, bf16=True, seq_len=2048)
    wake = plan_phases(f, m, m, [m, m])[0]
    assert wake.name == "vllm start-up/wake" and not wake.fits, wake.line()
    slack = wake.parts["allocator slack"]
    assert (wake.total - slack) / GIB == pytest.approx(79.9, abs=0.05), wake.line()


@pytest.mark.parametrize("head_dim", [None, 128])
def test_head_dim_null_or_missing_follows_transformers(head_dim):
    """Qwen2/2.5 configs have no head_dim; others carry "head_dim": null (doctor raised a
    TypeError on those)."""
    missing = ModelShape.from_hf_config(QWEN25_7B)
    given = ModelShape.from_hf_config({**QWEN25_7B, "head_dim": head_dim})
    assert given == missing and missing.kv_dim == 4 * 128


def test_tied_embeddings_are_one_matrix_at_the_root():
    tied = ModelShape.from_hf_config({**LLAMA_7B, "tie_word_embeddings": True})
    untied = ModelShape.from_hf_config(LLAMA_7B)
    vh = 32000 * 4096
    assert tied.params == untied.params - vh
    assert tied.root_params == vh and untied.root_params == 2 * vh
    assert tied.layer_params == untied.layer_params  # the layers keep all of theirs
    # a checkpoint's count with its LM head tied (no lm_head.weight): same split
    counted = ModelShape.from_hf_config(LLAMA_7B, untied.params - vh, embeddings=1)
    assert counted.layer_params == untied.layer_params


def test_zero3_update_holds_the_roots_grads_and_fp32_reduce_scatter_input():
    """The root group (embeddings + LM head) is reduced last: its bf16 grads and the fp32 copy
    FSDP2 reduce-scatters, about 6.5 GB at 7B."""
    m = ModelShape.from_hf_config(QWEN25_7B, QWEN25_7B_PARAMS)
    phases = {p.name: p for p in plan_phases(LAUNCHER, m, m, [m, m])}
    term = phases["actor update"].parts["root grads + fp32 reduce-scatter input"]
    assert term == (2 + 4) * m.root_params
    assert term / 1e9 == pytest.approx(6.5, abs=0.1)
    zero2 = dataclasses.replace(LAUNCHER, zero_stage=2)
    parts = {p.name: p for p in plan_phases(zero2, m, m, [m, m])}["actor update"].parts
    assert parts["fp32 reduce-scatter input"] == 4 * m.root_params


def test_ema_stays_on_the_device_unless_an_offload_flag_moves_it():
    m = ModelShape.from_hf_config(LLAMA_7B)
    on_device = dataclasses.replace(
        LAUNCHER, adam_offload=False, ref_reward_offload=False, ema=True
    )
    for phase in plan_phases(on_device, m, m, [m, m]):
        assert phase.parts["actor EMA shard"] == 4 * m.params // 8, phase.name
    for phase in plan_phases(dataclasses.replace(LAUNCHER, ema=True), m, m, [m, m]):
        assert "actor EMA shard" not in phase.parts, phase.name  # on the host


def test_awake_phases_count_allocator_slack_and_asleep_vllm_its_cuda_graphs():
    from fsdp_rlhf.distributed.memory import (
        ALLOCATOR_SLACK,
        VLLM_ASLEEP_BYTES,
        VLLM_CUDA_GRAPH_BYTES,
    )

    m = ModelShape.from_hf_config(LLAMA_7B)
    f = dataclasses.replace(LAUNCHER, adam_offload=False, ref_reward_offload=False)
    phases = {p.name: p for p in plan_phases(f, m, m, [m, m])}
    wake = phases["vllm start-up/wake"].parts
    trainer = wake["actor fp32 shard"] + wake["ref/reward shards"]
    assert wake["allocator slack"] == int(ALLOCATOR_SLACK * trainer)
    assert phases["actor update"].parts["vllm"] == VLLM_ASLEEP_BYTES + VLLM_CUDA_GRAPH_BYTES
    eager = dataclasses.replace(f, cuda_graphs=False)
    parts = {p.name: p for p in plan_phases(eager, m, m, [m, m])}["actor update"].parts
    assert parts["vllm"] == VLLM_ASLEEP_BYTES


def _qwen7b_job(tmp_path, *flags: str):
    import json

    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config

    folder = tmp_path / "qwen2.5-7b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**QWEN25_7B, "head_dim": None}))
    base = ["--pretrain", str(folder), "--reward_pretrain", str(folder), "--bf16"]
    return build_config(PPOConfig, [*base, *flags])[0]


def test_vllm_fraction_is_chosen_or_refused_from_the_plan(tmp_path):
    from fsdp_rlhf.distributed.memory_plan import resolve_vllm_utilization

    util, line = resolve_vllm_utilization(_qwen7b_job(tmp_path), 8, H100)
    assert util == 0.88 and "chosen" in line and "of 79.2 GiB" in line, line
    cfg = _qwen7b_job(tmp_path, "--vllm_gpu_memory_utilization", "0.9")
    with pytest.raises(UserError) as e:
        resolve_vllm_utilization(cfg, 8, H100)
    msg = str(e.value)
    assert msg.startswith("--vllm_gpu_memory_utilization 0.9 does not fit") and "\n" not in msg
    assert "vLLM pool 71.3 GiB (0.9 x 79.2)" in msg and "of 79.2 GiB" in msg, msg
    assert "at most 0.88" in msg and "actor fp32 shard 3.5" in msg, msg
    # the launchers' offloads leave the whole device but the context to vLLM: 0.9 fits
    offload = ["--adam_offload", "--ref_reward_offload", "--zero_stage", "3"]
    cfg = _qwen7b_job(tmp_path, *offload, "--vllm_gpu_memory_utilization", "0.9")
    assert resolve_vllm_utilization(cfg, 8, H100)[0] == 0.9
    # a pool too small for the weights of its TP slice and a KV cache
    cfg = _qwen7b_job(tmp_path, *offload, "--vllm_gpu_memory_utilization", "0.15")
    with pytest.raises(UserError, match="cannot hold the engine's weights"):
        resolve_vllm_utilization(cfg, 8, H100)


def test_the_job_refuses_the_fraction_before_any_model_loads(tmp_path, monkeypatch):
    """ppo.setup.cuda_pool runs first in build_engine (the job builds the engine before the
    models): a device as an H100 reports it, nothing resident yet."""
    import torch

    from fsdp_rlhf.distributed.env import DistEnv
    from fsdp_rlhf.trainers.ppo.setup import cuda_pool

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (H100 - GIB // 2, H100))
    env = DistEnv(0, 8, 0, 8, torch.device("cuda", 0), "nccl")
    assert cuda_pool(_qwen7b_job(tmp_path), env) == 0.88
    with pytest.raises(UserError, match="does not fit beside what stays resident"):
        cuda_pool(_qwen7b_job(tmp_path, "--vllm_gpu_memory_utilization", "0.9"), env)


# Qwen2.5-14B's shape with 40 layers instead of 48: ~12.5B parameters
QWEN_12B = dict(
    hidden_size=5120,
    num_hidden_layers=40,
    intermediate_size=13824,
    vocab_size=152064,
    num_attention_heads=40,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


def _async_job(tmp_path, shape: dict, *flags: str):
    """An --async_train job (2 engines of TP 1) on a model folder of ``shape`` (no weights)."""
    import json

    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config

    folder = tmp_path / f"model{shape['num_hidden_layers']}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**shape, "model_type": "qwen2"}))
    argv = ["--pretrain", str(folder), "--remote_rm_url", "r.py", "--bf16", "--async_train"]
    return build_config(PPOConfig, [*argv, "--vllm_num_engines", "2", *flags])[0]


def test_a_rollout_rank_plans_its_engine_only(tmp_path):
    """An async rollout rank holds no trainer model: its pool takes the cap (0.9) where the
    colocated plan of a 1-rank world (its engine's TP size) left 7B 0.41 and refused ~12B."""
    from fsdp_rlhf.distributed.memory_plan import model_shape, resolve_vllm_utilization

    seven = _async_job(tmp_path, QWEN25_7B)
    colocated = resolve_vllm_utilization(seven, 1, H100)[0]
    assert colocated == pytest.approx(0.41, abs=0.02)  # what a rollout rank got before
    util, line = resolve_vllm_utilization(seven, 1, H100, engine_only=True)
    assert util == 0.9, line
    assert "rollout rank (vLLM only): vLLM pool 71.3 GiB (0.9 x 79.2)" in line, line
    assert "fits up to 0.97" in line and "actor" not in line, line
    twelve = _async_job(tmp_path, QWEN_12B)
    assert model_shape(twelve.models.pretrain).params / 1e9 == pytest.approx(12.5, abs=0.1)
    with pytest.raises(UserError, match="cannot hold the engine's weights"):
        resolve_vllm_utilization(twelve, 1, H100)  # the colocated plan: refused
    assert resolve_vllm_utilization(twelve, 1, H100, engine_only=True)[0] == 0.9
    # a set fraction is checked against the same engine-only plan
    too_much = _async_job(tmp_path, QWEN25_7B, "--vllm_gpu_memory_utilization", "0.99")
    with pytest.raises(UserError) as e:
        resolve_vllm_utilization(too_much, 1, H100, engine_only=True)
    msg = str(e.value)
    assert "0.99 does not fit beside the CUDA context and the weight buckets" in msg, msg
    assert "at most 0.97" in msg and "--adam_offload" not in msg, msg


def test_a_rollout_ranks_engine_is_its_worlds_only_never_sleeps_and_takes_the_cap(
    tmp_path, monkeypatch
):
    """ppo.setup.build_engine on an async rollout rank of a 2-engine job (a device reporting
    as an H100): the engine gets a config for a world of its own (not the job's 2 engines),
    sleep off, and the engine-only pool fraction. The engine itself is a recorder here; the
    real one runs in tests/e2e/test_ppo_async.py."""
    import sys
    import types

    import torch

    from fsdp_rlhf.distributed.env import DistEnv
    from fsdp_rlhf.rollout.groups import RolloutGroups
    from fsdp_rlhf.trainers.ppo import setup

    seen = {}
    fake = types.ModuleType("fsdp_rlhf.rollout.vllm.engine")
    fake.VLLMEngine = lambda path, rollout, **kw: seen.setdefault("rollout", rollout)
    monkeypatch.setitem(sys.modules, "fsdp_rlhf.rollout.vllm.engine", fake)
    monkeypatch.setattr(setup, "build_rollout_groups", lambda tp: RolloutGroups(tp, 1, 0, None))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (H100 - GIB // 2, H100))
    env = DistEnv(0, 1, 0, 1, torch.device("cuda", 0), "nccl")  # the engine's own group
    tokenizer = types.SimpleNamespace(pad_token_id=0)
    cfg = _async_job(tmp_path, QWEN25_7B)
    setup.build_engine(cfg, env, tokenizer, vision=None, streaming=True, engine_id=1)
    rollout = seen["rollout"]
    assert rollout.vllm_num_engines is None and not rollout.vllm_enable_sleep
    assert rollout.vllm_gpu_memory_utilization == 0.9


# Qwen/Qwen3-30B-A3B's config.json (the memory-relevant keys)
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    num_hidden_layers=48,
    vocab_size=151936,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
)


def test_expert_parallelism_divides_the_gathered_experts_and_adds_the_all_to_all():
    from fsdp_rlhf.distributed.memory import (
        ModelShape,
        activation_bytes,
        all_to_all_bytes,
        expert_parallel_options,
        update_phase,
    )

    m = ModelShape.from_hf_config(QWEN3_30B_A3B)
    per_layer = 128 * 3 * 2048 * 768  # routed expert values of one layer
    assert m.experts == 48 * per_layer and m.params / 1e9 == pytest.approx(30.5, abs=0.2)
    for e in (1, 2, 8):
        assert m.gathered_layer_params(e) == m.layer_params - per_layer + per_layer // e
    f = JobFlags(world=8, device_bytes=H100, zero_stage=3, micro_train_batch_size=2, seq_len=4096)
    f8 = dataclasses.replace(f, expert_parallel=8)
    one = update_phase(f, "actor update", m, logits=True, frozen=[])
    eight = update_phase(f8, "actor update", m, logits=True, frozen=[])
    saved = one.parts["gathered layers"] - eight.parts["gathered layers"]
    assert saved == 2 * 2 * (per_layer - per_layer // 8)  # bf16, current + prefetched layer
    assert all_to_all_bytes(f, m, 2) == 0
    assert all_to_all_bytes(f8, m, 2) == 2 * 4 * 2 * 4096 * 8 * 2048  # b s k h, 4 buffers
    assert activation_bytes(f8, m, 2) - activation_bytes(f, m, 2) == all_to_all_bytes(f8, m, 2)
    assert expert_parallel_options(8, 128) == [1, 2, 4, 8]
    assert expert_parallel_options(6, 128) == [1, 2]
    assert expert_parallel_options(8, 0) == [1]


def test_the_smallest_expert_parallel_size_that_fits_is_found(tmp_path):
    """Qwen3-30B-A3B on 8 H100s at ZeRO-2 (every weight gathered, gradients unsharded):
    the gathered experts do not fit at E=1; the memory model names the smallest E that does,
    and every smaller E does not fit."""
    import json

    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.memory_plan import expert_parallel_fit, plan_job, plan_job_at

    folder = tmp_path / "qwen3_30b_a3b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "model_type": "qwen3_moe"}))
    argv = ["--pretrain", str(folder), "--remote_rm_url", "r.py", "--bf16", "--adam_offload"]
    argv += ["--zero_stage", "2", "--vllm_gpu_memory_utilization", "0.3"]
    argv += ["--gradient_checkpointing", "--micro_train_batch_size", "1"]
    cfg = build_config(PPOConfig, [*argv, "--generate_max_len", "512"])[0]
    device = H100
    assert not verdict(plan_job(cfg, 8, device, cuda=True))[0]
    e, gathered = expert_parallel_fit(cfg, 8, device, cuda=True)
    assert sorted(gathered) == [1, 2, 4, 8]
    assert gathered[1] == 2 * 128 * 3 * 2048 * 768 and gathered[8] == gathered[1] // 8
    assert e is not None and e > 1, (e, verdict(plan_job(cfg, 8, device, cuda=True))[1])
    for x in gathered:
        phases = plan_job_at(cfg, 8, device, True, 1, expert_parallel=x)
        assert verdict(phases)[0] == (x >= e), (x, verdict(phases)[1])


# Qwen2.5-1.5B's shape (tied embeddings), as the GPU suite's memory check builds it
QWEN25_1_5B = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    intermediate_size=8960,
    vocab_size=151936,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
# the GPU suite's 1.5B PPO job on one H200: --bf16 --zero_stage 3 --gradient_checkpointing, HF
# engine, 8 prompts x 2 samples, micro-batches of 4, 128 + 256 tokens
H200_1_5B = JobFlags(
    world=1,
    device_bytes=int(139.8 * GIB),
    zero_stage=3,
    micro_train_batch_size=4,
    micro_rollout_batch_size=4,
    seq_len=128 + 256,
    response_len=256,
    gradient_checkpointing=True,
    reward=False,
    engine="hf",
    rollout_seqs=16,
)


def test_the_critic_update_holds_the_actor_fp32_shard_and_not_its_adam_state():
    """The actor's params never leave the device; its Adam state leaves at the engine's wake
    and comes back for the actor's update only (PPOTrainer.update)."""
    m = ModelShape.from_hf_config(QWEN25_1_5B)
    phases = {p.name: p for p in plan_phases(H200_1_5B, m, m, [m])}
    critic = phases["critic update"].parts
    assert critic["actor fp32 shard"] == 4 * m.params
    assert critic["params+grads+adam shards"] == 16 * m.params  # the critic's own
    assert "actor fp32 shard" not in phases["actor update"].parts  # counted in its states
    offloaded = dataclasses.replace(H200_1_5B, adam_offload=True)
    parts = {p.name: p for p in plan_phases(offloaded, m, m, [m])}["critic update"].parts
    assert "actor fp32 shard" not in parts  # CPUOffloadPolicy keeps it on the host


def test_scoring_holds_the_larger_of_a_policy_pass_and_the_critic_pass():
    """The critic comes onto the device for its values and stays until its update; the policy
    passes hold the logits instead. Neither holds an Adam state."""
    m = ModelShape.from_hf_config(QWEN25_1_5B)
    scoring = {p.name: p for p in plan_phases(H200_1_5B, m, m, [m])}["scoring (no-grad)"]
    assert scoring.parts["critic fp32 shard"] == 4 * m.params and "logits" not in scoring.parts
    assert scoring.parts["actor fp32 shard"] == 4 * m.params
    assert not any("adam" in k for k in scoring.parts), scoring.parts
    no_critic = {p.name: p for p in plan_phases(H200_1_5B, m, None, [m])}["scoring (no-grad)"]
    assert "logits" in no_critic.parts and "critic fp32 shard" not in no_critic.parts
    # the critic's pass is the larger here: its fp32 shard outweighs 4 x 256 bf16 logits rows
    assert scoring.total > no_critic.total
    assert no_critic.parts["logits"] < 4 * m.params


def test_the_hf_rollout_holds_the_sync_or_the_generation_not_both():
    """The sync into the HF copy ends before generation starts. Its buckets are never larger
    than the model; generation keeps every step's fp32 scores (2.3 GiB for 16 rows x 256 steps
    x 151,936) and the KV cache."""
    from fsdp_rlhf.distributed.memory import SYNC_BUCKET_BYTES, hf_generation, hf_sync_bytes

    m = ModelShape.from_hf_config(QWEN25_1_5B)
    rollout = plan_phases(H200_1_5B, m, m, [m])[0]
    assert rollout.name == "rollout" and "sync buckets" not in rollout.parts
    assert rollout.parts["hf scores"] == 4 * 16 * 256 * 151936
    gen = hf_generation(H200_1_5B, m)
    assert {k: rollout.parts[k] for k in gen} == gen
    assert hf_sync_bytes(H200_1_5B, m) == 3 * SYNC_BUCKET_BYTES  # one rank: 2 + 1/1 buckets
    tiny = ModelShape(params=1_000_000, layers=2, hidden=64, intermediate=128, vocab=100)
    short = dataclasses.replace(H200_1_5B, response_len=8, seq_len=16, rollout_seqs=1)
    phase = plan_phases(short, tiny, None, [tiny])[0]
    assert phase.parts["sync buckets"] == 3 * 2 * tiny.params  # capped by the bf16 model
    assert not any(k.startswith("hf ") and k != "hf engine copy" for k in phase.parts)


def test_logprob_chunks_are_no_larger_than_the_logits():
    from fsdp_rlhf.distributed.memory import LOGPROB_CHUNK_BYTES, logprob_chunk_bytes

    assert logprob_chunk_bytes(4 * 32, 499) == 4 * 4 * 4 * 32 * 499  # the whole of them
    assert logprob_chunk_bytes(4 * 256, 151936) <= LOGPROB_CHUNK_BYTES
    assert logprob_chunk_bytes(4 * 256, 151936) == 4 * 4 * (2**23 // 151936) * 151936


def test_a_cpu_jobs_delta_sync_mirror_is_resident_in_every_phase(tmp_path):
    """Delta sync keeps the synced weights (engine dtype) on every rank: host memory, which is
    what a CPU job's phases count; a CUDA job's phases do not hold it, nor does a job synced
    in full. auto: delta over several hosts, but colocated on CUDA."""
    from fsdp_rlhf.distributed.memory_plan import model_shape, plan_job

    cfg = _qwen7b_job(tmp_path)
    actor = model_shape(cfg.models.pretrain)
    assert cfg.weight_sync_mode("cpu", hosts=2) == "delta"
    assert cfg.weight_sync_mode("cpu", hosts=1) == cfg.weight_sync_mode("cuda", 2) == "full"
    for phase in plan_job(cfg, 4, 512 * GIB, cuda=False, hosts=2):
        assert phase.parts["weight-sync mirror"] == 2 * actor.params, phase.name  # bf16
    for phase in plan_job(cfg, 8, H100, cuda=True, hosts=2):
        assert "weight-sync mirror" not in phase.parts, phase.name
    for one_host in (cfg, _qwen7b_job(tmp_path, "--weight_sync", "full")):
        assert all(
            "weight-sync mirror" not in p.parts for p in plan_job(one_host, 2, 512 * GIB, False)
        )
    delta = _qwen7b_job(tmp_path, "--weight_sync", "delta")
    assert all("weight-sync mirror" in p.parts for p in plan_job(delta, 2, 512 * GIB, False))
    async_job = _qwen7b_job(tmp_path, "--async_train")
    assert async_job.weight_sync_mode("cuda", 2) == "delta"
    assert async_job.weight_sync_mode("cuda", 1) == "full"
