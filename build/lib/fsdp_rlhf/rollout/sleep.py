"""Sleep/wake bookkeeping of a colocated engine, as pure logic (testable without a GPU).

The order on a colocated rank is: ``sleep()`` after generation; before the next rollout
``wake_up(["weights"])``, weight sync, then ``wake_up(["kv_cache"])`` so the KV cache is not
allocated while the gathered weights are alive. Level 1 backs weights up to host memory;
level 2 discards them, so after waking the weights are garbage until a *full* weight sync
(vLLM issue 29341: generating from woken level-2 weights gives gibberish).
"""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_rlhf.rollout.engine import WAKE_TAGS, check_wake_tags


class SleepTracker:
    """Which engine allocations are asleep and whether the weights must be re-sent.

    Args:
        enabled: sleep mode is on (CUDA only); when False every call is a no-op.
        level: 1 (offload weights to host) or 2 (discard weights).
    """

    def __init__(self, enabled: bool, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.enabled = enabled
        self.level = level
        self.asleep: set[str] = set()
        self.weights_stale = False

    def sleep(self) -> bool:
        """Record a sleep; returns whether the engine must actually be put to sleep."""
        if not self.enabled or self.asleep:
            return False
        self.asleep = set(WAKE_TAGS)
        self.weights_stale = self.level == 2
        return True

    def wake(self, tags: Sequence[str] | None) -> list[str]:
        """Record a wake-up; returns the tags the engine must actually wake (maybe none)."""
        wanted = check_wake_tags(tags)
        todo = [t for t in wanted if t in self.asleep]
        self.asleep -= set(todo)
        return todo

    def on_weight_update(self) -> None:
        """Record a full weight sync (called before it starts): the weights must be awake."""
        if "weights" in self.asleep:
            raise RuntimeError(
                "update_weights while the engine's weights sleep: call wake_up(['weights']) first"
            )
        self.weights_stale = False

    def check_ready(self) -> None:
        """Raise unless the engine can generate."""
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} sleep: call wake_up first")
        if self.weights_stale:
            raise RuntimeError(
                "sleep level 2 discarded the engine's weights: a full update_weights must "
                "follow wake_up before generate"
            )
