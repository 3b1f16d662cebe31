"""The step loop both commands share: periodic checkpoints, and a stop signal that either ends
a finished step or abandons one before its update (PPO), saving without repeating a save."""

from __future__ import annotations

import os
import signal

from fsdp_rlhf.trainers.common import fit, save_due


class FakeTrainer:
    """Records what fit() asks of it; sends itself SIGTERM at ``signal_at`` (before or after
    the vote inside the step, like a signal arriving during the rollout or the update)."""

    def __init__(self, total: int, signal_at: int | None = None, during_rollout: bool = False):
        self.step, self.total_steps = 0, total
        self.signal_at, self.during_rollout = signal_at, during_rollout
        self.updated: list[int] = []
        self.saved: list[int] = []
        self.finished = False

    def train_step(self, stop_agreed) -> bool:
        if self.step == self.signal_at and self.during_rollout:
            os.kill(os.getpid(), signal.SIGTERM)
        if stop_agreed():  # the PPO vote before the update
            return False
        self.updated.append(self.step)
        if self.step == self.signal_at and not self.during_rollout:
            os.kill(os.getpid(), signal.SIGTERM)
        return True

    def save_checkpoint(self) -> None:
        self.saved.append(self.step)

    def finish(self) -> None:
        self.finished = True


def test_runs_to_the_end_with_periodic_saves():
    t = FakeTrainer(5)
    assert fit(t, save_steps=2) == 0
    assert t.updated == [1, 2, 3, 4, 5] and t.saved == [2, 4, 5] and t.finished
    assert [s for s in range(1, 8) if save_due(s, 7, 3)] == [3, 6, 7]
    assert not any(save_due(s, 7, -1) for s in range(1, 8))


def test_signal_during_the_update_finishes_the_step_then_saves_it():
    t = FakeTrainer(5, signal_at=3)
    assert fit(t, save_steps=-1) == 0
    assert t.updated == [1, 2, 3] and t.saved == [3] and t.step == 3 and not t.finished


def test_signal_during_the_rollout_abandons_the_step_and_saves_the_previous_one():
    t = FakeTrainer(5, signal_at=3, during_rollout=True)
    assert fit(t, save_steps=-1) == 0
    # step 3 never updated: the checkpoint is step 2's state, so a resume redoes step 3
    assert t.updated == [1, 2] and t.saved == [2] and t.step == 2 and not t.finished


def test_abandoned_step_does_not_rewrite_a_checkpoint_already_on_disk():
    t = FakeTrainer(5, signal_at=3, during_rollout=True)
    fit(t, save_steps=2)
    assert t.saved == [2]  # step 2 was saved on schedule; no second write of the same step
    first = FakeTrainer(5, signal_at=1, during_rollout=True)
    fit(first, save_steps=-1)
    assert first.saved == [] and first.step == 0  # nothing finished: nothing to save
