"""Graceful stop on SIGTERM / SIGUSR1: checkpoint at the next step boundary, then exit 0.

Schedulers (SLURM, Kubernetes, torchrun's agent) send SIGTERM before killing a job, some ranks
sooner than others. The handler only sets a flag; at each step boundary every rank calls
:meth:`GracefulStop.agreed`, one all-reduce that makes all ranks stop at the same step, so the
checkpoint they write together is consistent and no rank is left waiting in a collective.
Repeated signals are absorbed (Slurm and torchrun both deliver SIGTERM); a stuck job is ended
by the SIGKILL that both send after their grace period.
"""

from __future__ import annotations

import signal
from types import FrameType

from fsdp_rlhf.distributed.env import all_reduce_scalars

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

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
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

    @property
    def requested(self) -> bool:
        """Whether this rank received a stop signal (local; no communication)."""
        return self.received is not None

    def agreed(self) -> bool:
        """Collective: True on every rank if any rank received a stop signal."""
        return all_reduce_scalars({"stop": float(self.requested)}, op="max")["stop"] > 0
