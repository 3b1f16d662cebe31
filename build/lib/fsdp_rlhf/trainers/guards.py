"""Guards against non-finite numbers: skipped optimizer steps and poisoned reward scores.

A NaN/Inf gradient norm means the update would write NaN into every weight it touches, and a
NaN score spreads through advantage whitening to the whole batch. Both are caught here with one
clear line instead of a run that silently trains on garbage.

Every rank must reach the same decision (a rank that skips ``optimizer.step`` while another
steps would desynchronise the shards). The gradient norm from
:func:`fsdp_rlhf.distributed.fsdp.clip_grad_norm_` is already all-reduced, so it is the same
number on every rank and :meth:`BadStepGuard.check` needs no communication.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from fsdp_rlhf.distributed.fsdp import clip_grad_norm_
from fsdp_rlhf.errors import UserError


class NonFiniteError(UserError):
    """A NaN or infinite value where training cannot continue (reported as one line)."""


class BadStepGuard:
    """Decides whether an optimizer step may be taken, given the step's gradient norm.

    A non-finite norm skips the step (the caller still zeroes the gradients and advances the
    lr schedule, so the schedule stays aligned with the step count). ``max_bad_steps``
    non-finite steps in a row are tolerated; one more raises :class:`NonFiniteError`.
    ``max_bad_steps=0`` aborts at the first one.
    """

    def __init__(self, max_bad_steps: int, name: str = "model") -> None:
        if max_bad_steps < 0:
            raise ValueError(f"max_bad_steps must be >= 0, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.name = name
        self.in_a_row = 0
        self.skipped = 0

    def check(self, grad_norm: float | torch.Tensor, step: int) -> bool:
        """True: take the optimizer step. False: skip it. Raises after too many in a row."""
        norm = float(grad_norm)
        if math.isfinite(norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row > self.max_bad_steps:
            raise NonFiniteError(
                f"{self.name}: gradient norm is {norm} at step {step} "
                f"({self.in_a_row} non-finite step(s) in a row, --max_bad_steps "
                f"{self.max_bad_steps}); lower the learning rate or check the data and rewards"
            )
        return False

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Total steps skipped so far, e.g. ``{"actor/skipped_steps": 2.0}``."""
        return {f"{prefix}skipped_steps": float(self.skipped)}

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row = int(state.get("in_a_row", 0))
        self.skipped = int(state.get("skipped", 0))


def guarded_step(
    params: Iterable[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_norm: float,
    guard: BadStepGuard,
    step: int,
) -> float:
    """Clip, then take the optimizer step unless the global gradient norm is NaN/Inf.

    The schedule advances either way, so the learning rate stays tied to the step count.
    Returns the norm before clipping.
    """
    grad_norm = clip_grad_norm_(list(params), max_norm)
    if guard.check(grad_norm, step):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm


def finite_mean(values: list[float]) -> float:
    """Mean of the finite values (the steps actually taken); NaN when there are none."""
    kept = [v for v in values if math.isfinite(v)]
    return sum(kept) / len(kept) if kept else float("nan")


def check_finite_scores(scores: torch.Tensor, step: int | None, source: str) -> torch.Tensor:
    """Raise :class:`NonFiniteError` naming ``source`` (and ``step``) if any score is NaN/Inf.

    Returns ``scores`` so it can wrap an expression. Scores are per-rank: call it on every rank
    and let the UserError end the job (torchrun stops the other ranks).
    """
    flat = scores.detach().reshape(-1)
    bad = ~torch.isfinite(flat)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        where = f" at step {step}" if step is not None else ""
        raise NonFiniteError(
            f"{source} returned {int(bad.sum())} non-finite score(s){where} "
            f"(first: index {first} = {float(flat[first])})"
        )
    return scores
