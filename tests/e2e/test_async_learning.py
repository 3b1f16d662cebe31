"""`--async_train` learns per step about as much as colocated, by default (#57).

GRPO on tiny published-shape models, the same task, seed and settings colocated (2 ranks)
and asynchronous (1 training rank + 1 rollout rank, one version off policy), defaults
otherwise: the asynchronous gain (mean score of the last 5 steps minus the first 5) is at
least 0.8x the colocated one. The tasks and step counts are the benchmark's
(benchmarks/2026-12-01-async-correction.md, ``scripts/benchkit/async_correction.py``), where
the previous default (the PPO ratio against the trainer's old log-probs) fell to 0.38-0.60x on
the MoE VLM in 3 of 4 runs, the case this suite is built around; the dense text task guards
the other side (a correction too tight learns too slowly there: the plain clip around the
behaviour policy reached 0.55x).

Each model runs once per placement, and its asynchronous run asserts the rest too: the
pairing audit checked every row of every update (FSDP_RLHF_PAIRING_AUDIT), the staleness
metrics are there, and the correction acted (the clip silenced some tokens).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from fsdp_rlhf.testing.synthetic import prompt_rows, write_jsonl, write_reward_file
from fsdp_rlhf.trainers.ppo import pairing
from tests.e2e.helpers import read_metrics, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.asynchronous]

K = 5  # steps averaged at each end
ASYNC = ["--async_train", "--vllm_num_engines", "1", "--async_queue_size", "1"]


def _common(model: str, data: Path, save: Path, steps: int, lr: str, seed: int) -> list[str]:
    return [
        *("--pretrain", model, "--remote_rm_url", str(data / "reward.py")),
        *("--prompt_data", str(data / "prompts.jsonl"), "--advantage_estimator", "grpo"),
        *("--rollout_batch_size", "16", "--n_samples_per_prompt", "8"),
        *("--train_batch_size", "128", "--micro_train_batch_size", "32"),
        *("--micro_rollout_batch_size", "32", "--max_steps", str(steps)),
        *("--lr_warmup_ratio", "0", "--init_kl_coef", "0", "--actor_learning_rate", lr),
        *("--seed", str(seed), "--save_path", str(save), "--save_steps", "-1"),
    ]


def _text(root: Path, steps: int):
    """Tiny Qwen2 (no head_dim in its config), fp32; reward: the share of positive words."""
    from fsdp_rlhf.testing.tiny import build_model

    model = str(build_model(root / "model", "qwen2"))
    write_jsonl(prompt_rows(1024, chat=True), root / "prompts.jsonl")
    write_reward_file(root / "reward.py", "positive")

    def flags(save: Path) -> list[str]:
        extra = ["--input_key", "input", "--generate_max_len", "16", "--prompt_max_len", "32"]
        return [*_common(model, root, save, steps, "5e-3", 1), *extra, "--packing_samples"]

    return flags


def _vision(root: Path, steps: int, arch: str, lr: str, seed: int, extra: tuple[str, ...] = ()):
    """A tiny VLM of ``arch`` on the colour task (only the pixels tell the answer)."""
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model, colour_rows, write_rows
    from tests.vlm.conftest import COLOUR_REWARD, COLOUR_WORDS

    model = str(build_vl_model(root / "model", arch, words=COLOUR_WORDS, seed=3))
    write_rows(colour_rows(96, root / "images", seed=0), root / "prompts.jsonl")
    (root / "reward.py").write_text(COLOUR_REWARD)

    def flags(save: Path) -> list[str]:
        vision = [
            *("--input_key", "prompt", "--label_key", "label", "--image_key", "images"),
            *("--apply_chat_template", "--generate_max_len", "4", "--prompt_max_len", "24"),
            *("--num_episodes", "100", "--vllm_kvcache_space_gib", "0.25"),
        ]
        return [*_common(model, root, save, steps, lr, seed), *vision, *extra]

    return flags


def _runs(root: Path, flags) -> dict[str, list[dict]]:
    """The colocated run and the asynchronous one (pairing audit on), their metrics rows."""
    rows = {}
    for name, extra, nproc in (("colocated", [], 2), ("async", ASYNC, 2)):
        save = root / name
        env = {pairing.ENV: "1"} if name == "async" else None
        proc = torchrun(["ppo", *flags(save), *extra], nproc=nproc, env=env, timeout=1800)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        rows[name] = read_metrics(save)
    return rows


def _gain(rows: list[dict]) -> float:
    scores = [r["critic/score/mean"] for r in rows]
    return statistics.fmean(scores[-K:]) - statistics.fmean(scores[:K])


def _check(rows: dict[str, list[dict]], steps: int, samples: int = 128) -> None:
    colocated, asynchronous = rows["colocated"], rows["async"]
    assert [r["step"] for r in asynchronous] == list(range(1, steps + 1))
    base, gain = _gain(colocated), _gain(asynchronous)
    print(f"gain: colocated {base:.3f}, async {gain:.3f} ({gain / base:.2f}x)")
    assert base > 0.3, base  # the task is learned: the comparison means something
    assert gain >= 0.8 * base, (gain, base)
    # the mechanics around it, on the same run
    assert all(r["pairing/rows_checked"] == samples for r in asynchronous)
    assert "rollout/logprob_diff/staleness_0" in asynchronous[0]
    assert all("rollout/logprob_diff/staleness_1" in r for r in asynchronous[1:])
    assert max(r["actor/behaviour_clipfrac"] for r in asynchronous) > 0  # the clip acted
    assert max(r["actor/behaviour_ratio_max"] for r in asynchronous) > 1.2  # a stale batch


TEXT_STEPS = 30  # the default catches up from its slower start by then (24 steps: 0.81-0.84x)
MOE_STEPS = 30


def test_dense_text_async_learns_like_colocated(tmp_path):
    """Tiny Qwen2, fp32, lr 5e-3: the share of positive words rises from ~0.02 to ~0.98 in 30
    colocated steps; the default asynchronous run measured 0.93-0.94x of that gain."""
    _check(_runs(tmp_path, _text(tmp_path, TEXT_STEPS)), TEXT_STEPS)


def test_moe_vlm_async_learns_like_colocated(tmp_path):
    """Tiny Qwen3.5-MoE VLM (gated-delta-net and attention layers, 16 experts top 4, a shared
    expert, a vision tower), bf16, lr 5e-3. Its runs scatter from seed to seed: the previous
    default fell below 0.8x in 3 of 4 (0.38-0.60x; the policy's entropy collapsed, 0.04 by
    step 30 where colocated keeps 0.41) and reached 1.55x in one; the default 0.94-1.55x in 3.
    Seed 3 is one where the previous default falls (0.60x) and the default reaches 1.55x, so
    this case fails on the previous default here (runs repeat exactly on one machine)."""
    extra = ("--bf16", "--enforce_eager")
    flags = _vision(tmp_path, MOE_STEPS, "qwen3_5_moe", "5e-3", 3, extra)
    _check(_runs(tmp_path, flags), MOE_STEPS)


@pytest.mark.long
def test_dense_vlm_async_learns_like_colocated(tmp_path):
    """Tiny Qwen2.5-VL, fp32, lr 3e-3 (where every correction measured passed)."""
    _check(_runs(tmp_path, _vision(tmp_path, 30, "qwen2_5_vl", "3e-3", 1)), 30)
