"""A weight change in the middle of a step-by-step rollout, for the partial-rollout workers of
the tests (text, router replay, images): the rollout side's ``poll`` loads new weights in flight
after a set number of engine steps."""

from __future__ import annotations

from collections.abc import Callable

from fsdp_rlhf.distributed import weight_broadcast
from fsdp_rlhf.distributed.bridge import Bridge, Channel
from fsdp_rlhf.distributed.weight_broadcast import WeightLink


def switch_weights_after(engine, bridge: Bridge, link: WeightLink, steps: int) -> Callable[[], int]:
    """A ``poll`` for ``stream_rollout``: version 0 for the first ``steps`` engine steps; before
    the next one it tells the training side (an ``"in flight"`` message) and loads the weights
    that side then sends, in flight; version 1 from then on."""
    polls = 0

    def poll() -> int:
        nonlocal polls
        polls += 1
        if polls == steps + 1:
            bridge.send_object("in flight", 0, Channel.EXPERIENCE)
            engine.update_weights(weight_broadcast.receive(link), in_flight=True)
        return 0 if polls <= steps else 1

    return poll
