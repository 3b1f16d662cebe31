"""The PPO step's side of multi-turn rollouts: one wake-up of the engine for all turns, the
``multiturn/*`` and ``agent/*`` statistics, and the runner built from the config. The turns
themselves (the engine across turns, the trajectories) are :mod:`fsdp_rlhf.rollout.multiturn`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.rollout.agent import load_agent
from fsdp_rlhf.rollout.engine import RolloutOutput, SamplingConfig
from fsdp_rlhf.rollout.env import load_environment
from fsdp_rlhf.rollout.multiturn import Generate, MultiTurnRollout, TurnBudget, trajectory_stats
from fsdp_rlhf.trainers.ppo.metrics import StatCollector
from fsdp_rlhf.trainers.ppo.rollout import RolloutSession


def multiturn_rollout(
    runner: MultiTurnRollout,
    session: RolloutSession,
    prompts: Sequence[Prompt],
    sampling: SamplingConfig,
    metrics: dict[str, float],
    stats: StatCollector,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    images: Sequence | None = None,
) -> tuple[RolloutOutput, torch.Tensor]:
    """One wake-up (and weight sync) of ``session``'s engine for all turns; returns the batch
    and the (N,) summed environment rewards. ``stats`` gets ``multiturn/*`` (reduced with the
    step's other statistics). Collective: one scalar all-reduce per turn. A VLM's prompts:
    ``prompt_ids`` expanded and ``images`` (see ``MultiTurnRollout.run``)."""
    with session.awake(metrics) as engine:
        return run_multiturn(
            runner, engine.generate, prompts, sampling, stats, prompt_ids=prompt_ids, images=images
        )


def run_multiturn(
    runner: MultiTurnRollout,
    generate: Generate,
    prompts: Sequence[Prompt],
    sampling: SamplingConfig,
    stats: StatCollector,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    images: Sequence | None = None,
) -> tuple[RolloutOutput, torch.Tensor]:
    """All turns with ``generate``; the batch, the (N,) summed rewards and ``multiturn/*``."""
    out, trajs = runner.run(generate, prompts, sampling, prompt_ids=prompt_ids, images=images)
    s = trajectory_stats(trajs)
    logs = runner.env.trajectory_logs()
    if logs is not None:  # the same on every rank: it depends on the environment's kind
        add_agent_logs(stats, logs)
    stats.add("multiturn/turns", s["turns"])
    stats.add("multiturn/env_tokens", s["env_tokens"])
    stats.add_mean("multiturn/tool_error_ratio", s["errors"])
    return out, s["scores"]


def add_agent_logs(stats: StatCollector, logs: Sequence[dict[str, float]]) -> None:
    """``agent/<key>``: the global mean of each number an agent's last step reported in
    ``extra_logs``, over the trajectories that reported it. Collective: ranks agree on the
    keys first (a rank whose trajectories all failed has none)."""
    keys = sorted({k for row in logs for k in row})
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, keys)
        keys = sorted({k for ks in everyone for k in ks})
    for key in keys:
        values = [row[key] for row in logs if key in row]
        mean = sum(values) / len(values) if values else 0.0
        stats.add_weighted_mean(f"agent/{key}", mean, float(len(values)))


def build_multiturn(cfg: PPOConfig, tokenizer, timer: PhaseTimer) -> MultiTurnRollout | None:
    """The runner of ``--env_file`` or ``--agent_func_path`` (None without either)."""
    mt = cfg.multiturn
    if mt.env_file is not None:
        env = load_environment(mt.env_file, mt.env_timeout_s)
    elif mt.agent_func_path is not None:
        env = load_agent(mt.agent_func_path, mt.env_timeout_s)
    else:
        return None
    budget = TurnBudget(mt.max_turns, cfg.total_len, cfg.rollout.generate_max_len)
    return MultiTurnRollout(env, tokenizer, budget, timer)
