"""``distributed/signals.py``: the graceful stop (a flag, handlers restored, repeats ignored),
when the signal came, and how long saves take against the stop window."""

from __future__ import annotations

import logging
import signal
import time

from fsdp_rlhf.distributed.signals import GracefulStop, SaveTimer, stop_window_s


def test_seconds_since_signal():
    with GracefulStop() as stop:
        assert stop.seconds_since_signal() is None
        signal.raise_signal(signal.SIGUSR1)
        first = stop.seconds_since_signal()
        time.sleep(0.02)
        signal.raise_signal(signal.SIGTERM)  # a repeat does not restart the clock
        assert first is not None and stop.seconds_since_signal() >= first + 0.015


def test_stop_window_from_environment(monkeypatch):
    monkeypatch.delenv("FSDP_RLHF_STOP_WINDOW_S", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert stop_window_s() is None
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
    assert stop_window_s() == 300.0
    monkeypatch.setenv("FSDP_RLHF_STOP_WINDOW_S", "120")
    assert stop_window_s() == 120.0


def test_save_timer_warns_when_a_save_would_not_fit(caplog):
    timer = SaveTimer(window_s=0.02)
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"), timer():
        time.sleep(0.03)
    assert "checkpoint took" in caplog.text and "SIGKILL" in caplog.text
    assert timer.metrics()["timing/save_checkpoint"] >= 0.03
    caplog.clear()
    quiet = SaveTimer(window_s=100)
    with caplog.at_level(logging.WARNING, logger="fsdp_rlhf"), quiet():
        pass
    assert caplog.text == "" and quiet.max_s < 1


def test_graceful_stop_sets_a_flag_and_restores_handlers():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with GracefulStop() as stop:
            assert not stop.requested and not stop.agreed()
            signal.raise_signal(signal.SIGUSR1)
            assert stop.requested and stop.agreed()  # no process group: the local flag
            assert stop.received == signal.SIGUSR1 and seen == []
            # a repeat (Slurm and torchrun both forward SIGTERM) must not kill the process
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGTERM)
            assert seen == [] and stop.received == signal.SIGUSR1
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # restored on exit
    finally:
        signal.signal(signal.SIGUSR1, previous)
