"""RL step: `fsdp-rlhf ppo` (GRPO, vLLM or HF rollouts; PPO with critic) against TRL's
`GRPOTrainer`, plus the phase breakdown, weight-sync rate and scaling runs of ours.

Tokens per second per rank is MindSpeed RL's e2e_tps formula, (prompt + response tokens) of the
step's samples / ranks / seconds, with seconds taken between step log lines for both sides
(ours also logs e2e_tps from its own step timer, reported beside it).
"""

from __future__ import annotations

import json
from pathlib import Path

from fsdp_rlhf.testing.launch import local_torchrun
from scripts.benchkit.launch import REPO, Job, bench_env, cli, run_job
from scripts.benchkit.rates import median, steady_window
from scripts.benchkit.workload import Sizes, Workload

LR = 1e-6
BETA = 0.001  # KL coefficient; > 0 so that TRL also runs its reference model, as ours always does
SEED = 42
PROMPT_MAX_LEN = 128
# Phases that compute; the rest of a step (weight sync, offload/onload, untimed glue) is overhead.
COMPUTE_PHASES = (
    "rollout",
    "old_log_p",
    "reference_model",
    "reward_model",
    "critic_model",
    "rule_reward",
    "adv",
    "update",
    "update_critic",
)


def ours_cmd(
    w: Workload,
    s: Sizes,
    out: Path,
    *,
    nproc: int,
    engine: str = "vllm",
    resp_len: int | None = None,
    rm: Path | None = None,
    compile: bool = True,
    bf16: bool = True,
    lora_rank: int = 0,
) -> list[str]:
    """GRPO with the rule reward, or (``rm`` given) PPO with GAE: RM scores, critic from it.
    With ``--torch_compile`` unless ``compile`` is False; fp32 (the CLI default) unless bf16;
    LoRA adapters of rank ``lora_rank`` on every linear layer when it is > 0."""
    flags = dict(
        pretrain=w.model, prompt_data=w.prompts, input_key="input", apply_chat_template=True,
        prompt_max_len=PROMPT_MAX_LEN, generate_max_len=resp_len or s.rl_resp_len,
        rollout_batch_size=s.rl_prompts, n_samples_per_prompt=s.rl_n,
        train_batch_size=s.rl_prompts * s.rl_n, micro_train_batch_size=s.rl_micro,
        micro_rollout_batch_size=s.rl_micro, max_steps=s.rl_steps, actor_learning_rate=LR,
        lr_warmup_ratio=0, bf16=bf16, rollout_engine=engine, save_path=out,
        ckpt_path=out / "ckpt", save_steps=-1, sample_log_steps=0, logging_steps=1, seed=SEED,
        torch_compile=compile, lora_rank=lora_rank or False,
    )  # fmt: skip
    if rm is None:
        flags.update(advantage_estimator="grpo", remote_rm_url=w.reward_py, use_kl_loss=True,
                     init_kl_coef=BETA)  # fmt: skip
    else:
        flags.update(advantage_estimator="gae", reward_pretrain=rm, critic_pretrain=rm,
                     critic_learning_rate=LR)  # fmt: skip
    return local_torchrun(nproc, cli("ppo", **flags))


def trl_cmd(w: Workload, s: Sizes, out: Path, nproc: int, bf16: bool = True) -> list[str]:
    per_rank = s.rl_prompts * s.rl_n // nproc
    cfg = dict(
        model=str(w.model),
        prompts=str(w.prompts),
        out=str(out),
        micro=s.rl_micro,
        grad_accum=per_rank // s.rl_micro,
        n=s.rl_n,
        resp_len=s.rl_resp_len,
        steps=s.rl_steps,
        beta=BETA,
        lr=LR,
        bf16=bf16,
        seed=SEED,
    )
    return local_torchrun(
        nproc, [str(REPO / "scripts" / "benchkit" / "trl_grpo_worker.py"), json.dumps(cfg)]
    )


def _phases(rows: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r if k.startswith("timing/")})
    return {k.removeprefix("timing/"): median([r[k] for r in rows if k in r]) for k in keys}


def _overhead(row: dict, step_s: float) -> float:
    compute = sum(row.get(f"timing/{p}", 0.0) for p in COMPUTE_PHASES)
    return (step_s - compute) / step_s


def summarize_ours(job: Job, s: Sizes, nproc: int) -> dict:
    rows, seconds = steady_window(job, s.rl_warmup)
    tokens = [
        (r["response_length/mean"] + r["prompt_length/mean"]) * s.rl_prompts * s.rl_n for r in rows
    ]
    # training FLOP/s of the actor update alone: 6 x params x tokens / update seconds (all ranks)
    update_tokens_per_s = median(
        [t / r["timing/update"] for t, r in zip(tokens, rows, strict=True) if r["timing/update"]]
    )
    wall_step = seconds / len(rows)
    memory = {
        k.removeprefix("memory/"): max(r[k] for r in job.rows if k in r)
        for k in job.rows[-1]
        if k.startswith("memory/")
    }
    return {
        "e2e_tps": sum(tokens) / nproc / seconds,
        "e2e_tps_logged": median([r["e2e_tps"] for r in rows]),
        "update_tokens_per_s": update_tokens_per_s,
        "step_s": median([r["timing/all"] for r in rows]),
        "wall_step_s": wall_step,
        "phases_s": _phases(rows),
        "overhead_frac": median([_overhead(r, r["timing/all"]) for r in rows]),
        "wall_overhead_frac": median([_overhead(r, wall_step) for r in rows]),
        "weight_sync_gbps": median(
            [r["rollout/weight_sync_gbps"] for r in rows if "rollout/weight_sync_gbps" in r]
        ),
        "weight_sync_bytes": median(
            [r["rollout/weight_sync_bytes"] for r in rows if "rollout/weight_sync_bytes" in r]
        ),
        "response_len": median([r["response_length/mean"] for r in rows]),
        "prompt_len": median([r["prompt_length/mean"] for r in rows]),
        "peak_rss_gib_by_phase": memory,
        "peak_rss_gib": job.peak_rss_gib,
        "wall_s": job.wall_s,
    }


def summarize_trl(job: Job, s: Sizes, nproc: int) -> dict:
    rows, seconds = steady_window(job, s.rl_warmup)
    before = job.rows[s.rl_warmup - 1]["num_tokens"]
    return {
        "e2e_tps": (rows[-1]["num_tokens"] - before) / nproc / seconds,
        "wall_step_s": seconds / len(rows),
        "response_len": median([r["completions/mean_length"] for r in rows]),
        "peak_rss_gib": job.peak_rss_gib,
        "wall_s": job.wall_s,
    }


def run_ours(
    name: str,
    w: Workload,
    s: Sizes,
    work: Path,
    nproc: int,
    env: dict[str, str] | None = None,
    **kw,
) -> dict:
    out = work / name
    job = run_job(
        name,
        ours_cmd(w, s, out, nproc=nproc, **kw),
        work / f"{name}.log",
        out / "metrics.jsonl",
        {**bench_env(work), **(env or {})},
    )
    return summarize_ours(job, s, nproc)


def run_trl(
    name: str,
    w: Workload,
    s: Sizes,
    work: Path,
    nproc: int,
    env: dict[str, str] | None = None,
    bf16: bool = True,
) -> dict:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    env = {**bench_env(work), **(env or {})}
    cmd = trl_cmd(w, s, out, nproc, bf16=bf16)
    job = run_job(name, cmd, work / f"{name}.log", out / "steps.jsonl", env)
    return summarize_trl(job, s, nproc)


def run_pair(
    w: Workload,
    s: Sizes,
    work: Path,
    tag: str,
    with_trl: bool,
    *,
    bf16: bool = True,
    env: dict[str, str] | None = None,
) -> dict[str, dict]:
    """One interleaved repetition of the GRPO comparison: ours, then TRL (when installed)."""
    out = {"ours": run_ours(f"grpo_ours_{tag}", w, s, work, s.nproc, env=env, bf16=bf16)}
    if with_trl:
        out["trl"] = run_trl(f"grpo_trl_{tag}", w, s, work, s.nproc, env=env, bf16=bf16)
    return out
