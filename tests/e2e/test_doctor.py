"""`fsdp-rlhf doctor` on 2 CPU ranks under torchrun, and its memory arithmetic."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.config_base import build_config
from fsdp_rlhf.distributed.memory import ModelShape, plan_phases, verdict
from fsdp_rlhf.distributed.memory_plan import job_flags
from tests.e2e.helpers import torchrun
from tests.unit.test_memory_model import LLAMA_7B


@pytest.mark.slow
def test_doctor_reports_every_check_on_two_ranks(tiny_qwen2, trained_rm):
    flags = [
        "--pretrain",
        tiny_qwen2,
        "--reward_pretrain",
        trained_rm,
        "--prompt_max_len",
        "32",
        "--generate_max_len",
        "16",
        # the engine starts with LoRA slots; doctor says what the missing ref copy saves
        "--lora_rank",
        "8",
        # the models are prepared split, as the job would; doctor prints activations per N
        "--sequence_parallel_size",
        "2",
    ]
    proc = torchrun(["doctor", *flags])
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + out[-3000:]
    for check in (
        "all-reduce",
        "--pretrain loads",
        "--reward_pretrain loads",
        "rollout engine starts",
        "rollout engine wakes beside the sharded models",
        "memory estimate fits",
        "LoRA reference",
        "--sequence_parallel_size",
        "sequence parallelism",
    ):
        for rank in (0, 1):
            assert f"[rank {rank}] PASS {check}" in out, (check, out[-3000:])
    # the job's order: the engine starts (and sleeps) before the models load, then wakes
    order = [out.index(f"[rank 0] PASS {c}") for c in (
        "rollout engine starts", "--pretrain loads", "rollout engine wakes beside",
    )]  # fmt: skip
    assert order == sorted(order), out[-3000:]
    assert "bus bandwidth" in out and "torch" in out and "VERDICT: READY" in out
    assert "no reference copy" in out and "GiB less per device" in out
    assert "allocator" in out  # the devices table says which malloc each rank runs on
    assert "1 groups of 2 ranks" in out and "activations per rank at 48 tokens" in out
    assert "N=1: " in out and "N=2: " in out and "fits without splitting (set: 2)" in out
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_doctor_fails_loudly_on_a_model_without_value_head(tiny_qwen2):
    # A causal LM is not a reward model: the check must fail and the verdict must say so.
    proc = torchrun(
        [
            "doctor",
            "--pretrain",
            tiny_qwen2,
            "--reward_pretrain",
            tiny_qwen2,
            "--rollout_engine",
            "hf",
            "--prompt_max_len",
            "32",
        ]
    )
    assert proc.returncode == 1
    assert "FAIL --reward_pretrain loads" in proc.stdout and "VERDICT: NOT READY" in proc.stdout


def _launcher_flags() -> list[str]:
    """The TRAINING_ARGS of examples/ppo.sh, shell variables replaced by placeholders (8 ranks on
    one node; one vLLM engine per rank)."""
    text = (Path(__file__).parents[2] / "examples" / "ppo.sh").read_text()
    body = text.split("TRAINING_ARGS=(", 1)[1].split("\n)", 1)[0]
    args = shlex.split(body, comments=True)
    values = {"$NNODES": "1", "$GPUS_PER_NODE": "8", "$VLLM_NUM_ENGINES": "8"}
    values["$VLLM_TENSOR_PARALLEL_SIZE"] = "1"
    values["$SAVE_STEPS"] = "20"  # the launchers' default
    return [values.get(a, "x" if a.startswith("$") else a) for a in args]


def _plan(flags: list[str], world: int = 8, gib: int = 80):
    cfg, _ = build_config(PPOConfig, flags)
    m = ModelShape.from_hf_config(LLAMA_7B)
    f = job_flags(cfg, world, gib * 2**30)
    return f, verdict(plan_phases(f, m, m if f.critic else None, [m, m]))


def test_launcher_flags_on_8x80gb_memory_table():
    flags = _launcher_flags()
    assert "--adam_offload" in flags and "--zero_stage" in flags  # parsed the real launcher
    f, (fits, line) = _plan(flags)
    assert (f.zero_stage, f.bf16, f.adam_offload, f.ref_reward_offload) == (3, True, True, True)
    assert (f.micro_train_batch_size, f.seq_len, f.gradient_checkpointing) == (8, 2048, True)
    assert f.gpu_memory_utilization == 0.9
    # Under the memory model these flags fit (ZeRO-3 + CPU Adam + offloaded frozen models).
    assert fits, line
    # Without the offloads the trainer's shards + vLLM's 90 % overflow the rollout...
    no_offload = [a for a in flags if a not in ("--adam_offload", "--ref_reward_offload")]
    _, (fits, line) = _plan(no_offload)
    assert not fits and "change --vllm_gpu_memory_utilization" in line, line
    # ... and a lower vLLM fraction is the fix the verdict names
    i = no_offload.index("--vllm_gpu_memory_utilization")
    _, (fits, line) = _plan(no_offload[: i + 1] + ["0.85"] + no_offload[i + 2 :])
    assert fits, line
    # without recomputation, 8 x 2048-token micro-batches now just fit the actor update (its
    # logits are read chunk by chunk, no fp32 copy); 16 do not
    no_recompute = [a for a in flags if a != "--gradient_checkpointing"]
    _, (fits, line) = _plan(no_recompute)
    assert fits, line
    i = no_recompute.index("--micro_train_batch_size")
    _, (fits, line) = _plan(no_recompute[: i + 1] + ["16"] + no_recompute[i + 2 :])
    assert not fits and "actor update" in line and "--micro_train_batch_size" in line, line
