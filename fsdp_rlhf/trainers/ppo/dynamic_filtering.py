"""DAPO dynamic sampling on one PPO step (``--dynamic_filtering``).

After scoring, prompt groups whose scores carry no signal are dropped
(:func:`~fsdp_rlhf.algorithms.dynamic_filter_groups`) and more prompts are drawn, generated and
scored until every rank holds its ``rollout_batch_size / world`` groups, or the round cap is hit.

SPMD: scoring runs the reward model under FSDP and generation runs vLLM TP groups, both
collective, so all ranks run the same number of rounds: after each round they all-reduce
"is anyone still short", and every rank generates and scores a full per-rank batch each round
even when it is already full. Each rank then keeps its first ``target`` kept groups; if the cap
is hit, dropped groups fill the rest (reported as ``dynamic_filter/filled_groups``).

Prompts come from the step's :class:`~fsdp_rlhf.data.prompts.PromptSampler`, which simply moves
on (and wraps into its next epoch order); its position is checkpointed after the step, so a
resumed run draws exactly what the uninterrupted one did. The number of training steps does
not change: filtering consumes prompts faster, not steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_rlhf.algorithms import dynamic_filter_groups, expand_group_mask
from fsdp_rlhf.config import PPOAlgoConfig
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.distributed.env import all_reduce_scalars
from fsdp_rlhf.models.vision import ImageBatch
from fsdp_rlhf.rollout.routing import no_expert
from fsdp_rlhf.trainers.experience import Experience

log = logging.getLogger("fsdp_rlhf")

# --max_num_gen_batches 0 means "until full" (OpenRLHF); a reward that never separates a group
# (constant, or a broken verifier) would then loop forever, so 0 stops after this many rounds.
MAX_ROUNDS_WHEN_UNLIMITED = 32

# generate_and_score(prompts, round) -> (scored experience, rollout metrics)
GenerateAndScore = Callable[[list[Prompt], int], tuple[Experience, dict[str, float]]]


def round_cap(max_num_gen_batches: int) -> int:
    """Generation rounds allowed in one step (``0``: :data:`MAX_ROUNDS_WHEN_UNLIMITED`)."""
    return max_num_gen_batches if max_num_gen_batches > 0 else MAX_ROUNDS_WHEN_UNLIMITED


def concat_experiences(parts: list[Experience], pad_id: int) -> Experience:
    """Stack batches of different widths: prompts stay left-padded, responses right-padded.

    Every part must have the same fields set. Padding positions get ``pad_id`` in
    ``input_ids`` and 0 in every mask and per-token field.
    """
    P = max(e.input_ids.shape[1] - e.response_len for e in parts)
    T = max(e.response_len for e in parts)
    out: dict[str, list[torch.Tensor]] = {}
    for e in parts:
        left, right = P - (e.input_ids.shape[1] - e.response_len), T - e.response_len
        for f in fields(e):
            value = getattr(e, f.name)
            if value is None:
                continue
            if isinstance(value, ImageBatch):
                out.setdefault(f.name, []).append(value)
                continue
            if f.name in ("input_ids", "attention_mask"):
                pad = pad_id if f.name == "input_ids" else 0
                value = F.pad(value, (left, right), value=pad)
            elif f.name == "routed_experts":  # (N, P+T, Lm, k): no routing at the padding
                value = F.pad(value, (0, 0, 0, 0, left, right), value=no_expert(value.dtype))
            elif value.dim() == 2 and f.name != "sample_marks":  # (N, T) per-token field
                value = F.pad(value, (0, right), value=0)
            out.setdefault(f.name, []).append(value)

    def cat(values: list) -> torch.Tensor | ImageBatch:
        return ImageBatch.cat(values) if isinstance(values[0], ImageBatch) else torch.cat(values)

    return replace(parts[0], **{name: cat(values) for name, values in out.items()})


@dataclass
class GroupPool:
    """The groups one rank has generated this step, split into kept and dropped."""

    n: int  # samples per prompt (rows of a group are contiguous)
    target: int  # groups this rank needs
    kept: list[tuple[Experience, list[Prompt]]] = field(default_factory=list)
    dropped: list[tuple[Experience, list[Prompt]]] = field(default_factory=list)
    kept_groups: int = 0
    seen_groups: int = 0

    def add(self, exp: Experience, prompts: list[Prompt], keep: torch.Tensor) -> None:
        """File one round's groups; ``keep`` is the (G,) mask of the filter."""
        self.seen_groups += len(prompts)
        self.kept_groups += int(keep.sum())
        for mask, bucket in ((keep, self.kept), (~keep, self.dropped)):
            groups = mask.nonzero().flatten().tolist()
            if groups:
                rows = expand_group_mask(mask, self.n).nonzero().flatten()
                bucket.append(
                    (exp.rows(rows.to(exp.input_ids.device)), [prompts[g] for g in groups])
                )

    @property
    def short(self) -> bool:
        return self.kept_groups < self.target

    def take(self, pad_id: int) -> tuple[Experience, list[Prompt], int]:
        """The first ``target`` kept groups in drawing order, topped up with dropped ones when
        too few were kept. Returns ``(experience, prompts, filled groups)``."""
        exps, prompts = [], []
        for exp, group_prompts in [*self.kept, *self.dropped]:
            room = self.target - len(prompts)
            if room <= 0:
                break
            take = min(room, len(group_prompts))
            exps.append(exp.rows(torch.arange(take * self.n, device=exp.input_ids.device)))
            prompts += group_prompts[:take]
        filled = max(0, self.target - self.kept_groups)
        return concat_experiences(exps, pad_id), prompts, filled


def dynamic_sample(
    first: list[Prompt],
    draw: Callable[[], list[Prompt]],
    generate_and_score: GenerateAndScore,
    algo: PPOAlgoConfig,
    n: int,
    pad_id: int,
    data_group: dist.ProcessGroup | None = None,
) -> tuple[Experience, list[Prompt], dict[str, float]]:
    """Generate, score and filter until every rank is full (collective, see the module doc).

    Returns this rank's experience (``len(first)`` groups, scored), its prompts, and the
    rollout metrics plus ``dynamic_filter/*`` (global: summed over ``data_group``, the
    layout's one rank per sequence-parallel group; None: every rank).
    """
    pool = GroupPool(n=n, target=len(first))
    reward_range = tuple(algo.dynamic_filtering_reward_range) or None
    cap, prompts, rounds, metrics = round_cap(algo.max_num_gen_batches), first, 0, {}
    while True:
        exp, round_metrics = generate_and_score(prompts, rounds)
        metrics.update(round_metrics)
        rounds += 1
        pool.add(exp, prompts, dynamic_filter_groups(exp.scores, n, reward_range).cpu())
        anyone_short = all_reduce_scalars({"short": float(pool.short)}, "max")["short"] > 0
        if not anyone_short or rounds >= cap:
            break
        prompts = draw()
    exp, prompts, filled = pool.take(pad_id)
    counts = all_reduce_scalars(
        {"kept": pool.kept_groups, "seen": pool.seen_groups, "filled": filled}, "sum", data_group
    )
    if counts["filled"] > 0:
        log.warning(
            "dynamic filtering: %d generation rounds (the cap) left %d groups short; filled "
            "with groups the filter dropped",
            rounds,
            int(counts["filled"]),
        )
    metrics.update(
        {
            "dynamic_filter/gen_rounds": float(rounds),
            "dynamic_filter/prompts_drawn": counts["seen"],
            "dynamic_filter/kept_frac": counts["kept"] / max(counts["seen"], 1.0),
            "dynamic_filter/filled_groups": counts["filled"],
        }
    )
    return exp, prompts, metrics
