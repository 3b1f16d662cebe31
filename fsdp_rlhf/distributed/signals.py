"""Graceful stop on SIGTERM / SIGUSR1: checkpoint at the next step boundary, then exit 0.

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM before killing a job, some ranks
sooner than others. The handler only sets a flag; at each step boundary every rank calls
:meth:`GracefulStop.agreed`, one all-reduce that makes all ranks stop at the same step, so the
checkpoint they write together is consistent and no rank is left waiting in a collective.
Repeated signals are absorbed (Slurm and torchrun both deliver SIGTERM); a stuck job is ended
by the SIGKILL that both send after their grace period.

The window between the signal and that SIGKILL must hold the rest of the current step plus one
checkpoint. A PPO step is long, so trainers may also vote right before the update phase (the
rollout of that step is then discarded and the checkpoint is the previous step's state).
:class:`SaveTimer` measures checkpoint writes and warns when one would not fit the window
(:func:`stop_window_s`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from types import FrameType

from fsdp_rlhf.distributed.env import all_reduce_scalars

log = logging.getLogger("fsdp_rlhf")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class GracefulStop:
    """A context manager that turns stop signals into a flag.

    Usage::

        with GracefulStop() as stop:
            for step in ...:
                train_step(...)
                if stop.agreed():   # collective: every rank, every step
                    save_checkpoint(...)
                    break
    """

    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
        also: Callable[[], bool] | None = None,
    ) -> None:
        self.signals = signals
        self.also = also  # another way this rank learns of a stop (local; polled at the vote)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> GracefulStop:
        # signal.signal only works in the main thread; trainers run there.
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Reinstall the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Repeats are expected, not an escalation: at a Slurm time limit every process of the
        # step gets SIGTERM and torchrun forwards its own copy to the workers. Dying on the
        # second one would lose the checkpoint; a stuck job still ends by SIGKILL.
        if self.received is None:
            self.received = signal.Signals(signum)
            self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        """Whether this rank received a stop signal, or ``also`` says another process of the
        job did (local; no communication)."""
        return self.received is not None or (self.also is not None and self.also())

    def agreed(self) -> bool:
        """Collective: True on every rank if any rank received a stop signal.

        Every rank must call it at the same points (e.g. after each step and, in PPO, once
        more before the update phase); it costs one small all-reduce.
        """
        return all_reduce_scalars({"stop": float(self.requested)}, op="max")["stop"] > 0

    def seconds_since_signal(self) -> float | None:
        """Seconds since this rank's first stop signal (None: none received); for the log."""
        return None if self.received_at is None else time.monotonic() - self.received_at


def stop_window_s() -> float | None:
    """Seconds between a stop signal and the SIGKILL that follows, as far as this process can
    tell: ``FSDP_RLHF_STOP_WINDOW_S`` if set, else torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``
    (the launchers set it to their signal lead). None when unknown."""
    for var in ("FSDP_RLHF_STOP_WINDOW_S", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        with contextlib.suppress(KeyError, ValueError):
            return float(os.environ[var])
    return None


class SaveTimer:
    """Times checkpoint writes; warns when one takes more than half the stop window, because
    the save after a stop signal must also fit there after the current step.

    Usage::

        timer = SaveTimer()
        with timer():
            save_checkpoint(...)
        metrics.update(timer.metrics())
    """

    def __init__(self, window_s: float | None = None) -> None:
        self.window_s = window_s if window_s is not None else stop_window_s()
        self.last_s: float | None = None
        self.max_s = 0.0

    @contextlib.contextmanager
    def __call__(self, what: str = "checkpoint") -> Iterator[None]:
        start = time.monotonic()
        yield
        self.last_s = time.monotonic() - start
        self.max_s = max(self.max_s, self.last_s)
        if self.window_s and self.last_s > 0.5 * self.window_s:
            log.warning(
                "%s took %.0f s, more than half the %.0f s between a stop signal and SIGKILL; "
                "raise the launcher's window (--signal=B:USR1@, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "
                "terminationGracePeriodSeconds) or a stop may lose the checkpoint",
                what,
                self.last_s,
                self.window_s,
            )

    def metrics(self) -> dict[str, float]:
        return {} if self.last_s is None else {"timing/save_checkpoint": self.last_s}
