"""Training steps through the real CLI under torchrun: SFT, DPO, two PPO configurations and
doctor, on a model whose vocabulary (499 tokens) and MLP width (333 on CPU, 1533 on the GPU)
do not divide the world size. One rank per GPU on CUDA (NCCL: host-side statistics must reach the
GPU, the phase offload of the critic and the reference crosses PCIe); 2 gloo ranks on CPU,
where the shards are uneven. The PPO checks print the doctor's per-phase estimate beside the
peaks each phase measured."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fsdp_rlhf.testing.synthetic import continuation_rows, preference_rows, write_jsonl
from tests.gpu.suite import (
    HAVE,
    SIZES,
    WORLD,
    build_odd_model,
    census_env,
    census_rows,
    cli,
    estimate_beside_measured,
    first_dims,
    format_census,
    metrics,
    ppo_flags,
)

BF16 = ["--bf16"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_odd_model(tmp_path_factory.mktemp("odd") / "model")


def _steps(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def _dims(model: str) -> str:
    return ", ".join(f"{k} {v}" for k, v in first_dims(model).items()) + f" on {WORLD} rank(s)"


def test_sft_step(model, tmp_path, detail):
    """On NCCL the token count of host masks must be reduced on the GPU (issue #36, finding 1:
    "No backend type associated with device type cpu", at world size 1 too)."""
    write_jsonl(continuation_rows(16), tmp_path / "train.jsonl")
    out = tmp_path / "sft"
    cli([
        "sft", "--pretrain", model, "--dataset", str(tmp_path / "train.jsonl"),
        "--input_key", "input", "--output_key", "output", "--save_path", str(out),
        "--train_batch_size", "8", "--micro_train_batch_size", "2", "--max_len", "64",
        "--learning_rate", "1e-3", "--logging_steps", "1", "--max_epochs", "1",
        "--zero_stage", "3", *BF16,
    ])  # fmt: skip
    loss = _steps(metrics(out), "loss")
    assert len(loss) == 2 and all(math.isfinite(x) for x in loss), loss
    detail(f"2 steps, loss {loss[0]:.3f} -> {loss[1]:.3f}; {_dims(model)}")


def test_dpo_step(model, tmp_path, detail):
    rows = [
        {"prompt": r["prompt"], "chosen": r["chosen_reply"], "rejected": r["rejected_reply"]}
        for r in preference_rows(16)
    ]
    write_jsonl(rows, tmp_path / "pairs.jsonl")
    out = tmp_path / "dpo"
    cli([
        "dpo", "--pretrain", model, "--dataset", str(tmp_path / "pairs.jsonl"),
        "--prompt_key", "prompt", "--save_path", str(out), "--train_batch_size", "8",
        "--micro_train_batch_size", "2", "--max_len", "64", "--learning_rate", "1e-4",
        "--logging_steps", "1", "--beta", "0.1", "--zero_stage", "3", *BF16,
    ])  # fmt: skip
    loss = _steps(metrics(out), "loss")
    assert len(loss) == 2 and all(math.isfinite(x) for x in loss), loss
    assert abs(loss[0] - math.log(2)) < 0.05, loss  # policy == reference at step 1
    detail(f"2 steps, loss {loss[0]:.4f} -> {loss[1]:.4f} (log 2 = 0.6931); {_dims(model)}")


PPO_CONFIGS = {
    "zero3_ref_reward_offload": ["--zero_stage", "3", "--ref_reward_offload", "--packing_samples"],
    "zero2_adam_offload": ["--zero_stage", "2", "--adam_offload"],
}


@pytest.mark.parametrize("config", sorted(PPO_CONFIGS))
def test_ppo_step(model, tmp_path, detail, config):
    """Two PPO steps with a critic (offloaded between its updates) and, at ZeRO-3, the
    reference offloaded too: shards of odd first dimensions go to host memory and back."""
    flags = [*ppo_flags(model, tmp_path, SIZES), *BF16, *PPO_CONFIGS[config]]
    if HAVE["vllm"] and HAVE["cuda"]:
        flags += ["--vllm_gpu_memory_utilization", "0.3"]  # this process holds memory too
    cli(["ppo", *flags], env=census_env())
    rows = metrics(tmp_path / "out")
    assert len(rows) == 2, rows
    for key in ("actor/pg_loss", "critic/vf_loss"):
        assert all(math.isfinite(r[key]) for r in rows), (key, rows)
    engine = "hf" if "--rollout_engine" in flags else "vllm"
    detail(f"2 steps ({engine} engine), {' '.join(PPO_CONFIGS[config])}; {_dims(model)}")
    detail("doctor's estimate beside the measured peaks of step 2:")
    detail("\n".join(estimate_beside_measured(flags, rows[-1])))
    census = census_rows(rows[-1])
    detail("on the device at each phase's end, by owner (memory census):")
    detail("\n".join(format_census(census)))
    assert {"rollout", "update", "update_critic"} <= set(census), sorted(census)
    # the actor's shards are on the census's device, unless CPUOffloadPolicy keeps them on
    # the host of a GPU job
    on_host = HAVE["cuda"] and "--adam_offload" in flags
    assert (census["update"]["actor params"] > 0) != on_host, census["update"]


def test_doctor(model, tmp_path, detail):
    flags = ppo_flags(model, tmp_path / "doctor", SIZES, steps=0)
    proc = cli(["doctor", *flags, *BF16])
    lines = proc.stdout.splitlines()
    verdict = [x for x in lines if x.startswith("VERDICT")]
    assert verdict and verdict[-1].startswith("VERDICT: READY"), proc.stdout[-2000:]
    wake = [x for x in lines if "wakes beside the sharded models" in x]
    assert wake and "PASS" in wake[0], lines
    estimate = [x for x in lines if "memory estimate" in x]
    detail(verdict[-1])
    if estimate:
        detail(estimate[-1].split(": ", 1)[-1])


def test_model_dims_do_not_divide_the_world(model):
    dims = first_dims(model)
    assert dims["vocab_size"] % 2 and dims["intermediate_size"] % 2, dims
    assert Path(model, "config.json").is_file()
