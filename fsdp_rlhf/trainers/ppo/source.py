"""Where a PPO step's experiences come from: the step asks its *source* for a scored batch and
tells it when the actor changed; everything between (reference and old log-probs, values,
advantages, updates) is the same whichever source it is.

Two sources:

    ColocatedSource (colocated.py)    the engine beside the actor on this rank: sync the
                                      actor's weights into it, generate, score
    AsyncSource (async_train.py)      the queue that the rollout ranks of ``--async_train``
                                      fill: receive the batch, score what they did not,
                                      measure its staleness; publish each new actor

A source is opened by the trainer once its models, optimizers and prompts exist
(:class:`SourceInputs`: what the trainer lends it), and asked, step by step::

    sample(step, stats)          the step's batch, scored (rollout metrics beside it)
    settle(sampled, trained)     the step finished, or was abandoned before its update
    after_update(step, changed)  the actor's new weights go where the next rollouts need them
    throughput(metrics, times)   tokens per second, counted where this source generates
    evaluate(evaluator, ...)     ``eval/*`` of the step's new weights, from wherever an engine
                                 holds them (here; the rollout ranks under --async_train)
    state_dict / load_state_dict where the data stands, for a checkpoint and a resume
    close()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.sequence_parallel import SequenceParallel
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.trainers.experience import Experience
from fsdp_rlhf.trainers.ppo.metrics import StatCollector

if TYPE_CHECKING:
    from fsdp_rlhf.trainers.ppo.eval import Evaluator

# fills exp.scores for the batch's prompts (prompt i owns rows i*n .. i*n+n-1): the reward
# model and the rule reward, clipped (the trainer's: the reward model lives with the trainer)
Score = Callable[[Experience, list[Prompt]], None]


@dataclass(frozen=True)
class SourceInputs:
    """What the trainer lends its source (built after the models and optimizers).

    Attributes:
        actor, actor_optimizer: the policy whose weights the rollouts use.
        tokenizer: the actor's.
        prompts: the prompt data, in data order (a batch names its prompts by index).
        images: a VLM's ``ppo.vision.StepImages`` (None: text).
        parallel: the run's parallel layout (the ranks of a sequence-parallel group draw the
            same prompts: the data shard is ``dp_rank`` of ``dp_size``; dynamic filtering
            counts over ``data_group``).
        timer: the step's phase timer.
        score: the trainer's scoring of a batch.
        total_steps: the run's steps.
    """

    cfg: PPOConfig
    env: DistEnv
    actor: nn.Module
    actor_optimizer: torch.optim.Optimizer
    tokenizer: Any
    prompts: list[Prompt]
    images: Any
    parallel: ParallelLayout
    timer: PhaseTimer
    score: Score
    total_steps: int

    @property
    def sp(self) -> SequenceParallel:
        """The sequence-parallel group (its ranks share their rows)."""
        return self.parallel.sp


@dataclass
class Sampled:
    """One step's batch from a source.

    Attributes:
        exp: the batch, scored (and shaped by the length penalties).
        prompts: its prompts, one per group of ``n`` rows.
        metrics: the rollout's metrics (engine, rewards, ``async/*``).
        position: the source's record of where the data stands, for :meth:`settle`.
    """

    exp: Experience
    prompts: list[Prompt]
    metrics: dict[str, float]
    position: dict[Any, Any] = field(default_factory=dict)


class ExperienceSource(Protocol):
    """See the module docstring."""

    def sample(self, step: int, stats: StatCollector) -> Sampled: ...

    def settle(self, sampled: Sampled, trained: bool) -> None:
        """``trained``: step finished (its data is consumed); else it was abandoned before
        its update and a resumed run draws its prompts again."""
        ...

    def after_update(self, step: int, actor_updated: bool) -> dict[str, float]:
        """The step's updates are done (``actor_updated``: the actor's weights changed);
        returns metrics of what it did with them."""
        ...

    def throughput(
        self, metrics: dict[str, float], times: dict[str, float]
    ) -> dict[str, float]: ...

    def evaluate(
        self, evaluator: Evaluator, score: Callable[..., None], step: int
    ) -> dict[str, float]:
        """``eval/*`` for the weights after step ``step``'s update (collective over the
        training ranks); ``score`` fills an eval batch's ``scores`` (exp, prompts, n)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Collective over the training ranks: the data position for a checkpoint."""
        ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


OpenSource = Callable[[SourceInputs], ExperienceSource]
