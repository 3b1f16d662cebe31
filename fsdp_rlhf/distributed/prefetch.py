"""Make the next item of a collective iterator while the caller uses this one: the weight
sync gathers bucket i+1 while the engine loads bucket i.

The iterator runs in one thread of its own, so each rank still issues its collectives in one
order. At most one item waits ahead of the one in use (peak memory: two buckets, as without
overlap plus the gather in flight). On CUDA the thread works on a stream of its own; the
caller's stream waits for an item's event before using it, and its tensors are marked as used
there so the allocator does not hand their memory back to the thread too early.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
_END = object()


@dataclass
class StageTimes:
    """Where a staged iteration's time went: making the items (the gathers, in the thread
    with overlap) and the caller waiting for the next one."""

    produce_s: float = 0.0
    wait_s: float = 0.0


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def staged(
    items: Iterable[T],
    times: StageTimes,
    *,
    overlap: bool,
    device: torch.device | None = None,
) -> Iterator[T]:
    """``items``, made one ahead in a thread when ``overlap`` (else in line), timed into
    ``times``. ``device``: where the items' tensors live (a CUDA device: stream handling).
    Items are lists of ``(name, tensor)`` pairs when they hold CUDA tensors."""
    if not overlap:
        it = iter(items)
        while True:
            t0 = time.perf_counter()
            item = next(it, _END)
            spent = time.perf_counter() - t0
            times.produce_s += spent
            times.wait_s += spent
            if item is _END:
                return
            yield item
        return
    yield from _ahead(items, times, device)


def _ahead(items: Iterable[T], times: StageTimes, device: torch.device | None) -> Iterator[T]:
    cuda = device is not None and device.type == "cuda"
    made: queue.Queue = queue.Queue()
    room = threading.Semaphore(1)  # items made beyond the one in use
    stop = threading.Event()

    def produce() -> None:
        try:
            stream = None
            if cuda:
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
            it = iter(items)
            while True:
                room.acquire()
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                with torch.cuda.stream(stream) if cuda else nullcontext():
                    item = next(it, _END)
                    event = torch.cuda.Event() if cuda else None
                    if event is not None:
                        event.record(stream)
                times.produce_s += time.perf_counter() - t0
                made.put((item, event))
                if item is _END:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            made.put((_Failed(e), None))

    thread = threading.Thread(target=produce, name="weight-sync-ahead", daemon=True)
    thread.start()
    try:
        while True:
            t0 = time.perf_counter()
            item, event = made.get()
            times.wait_s += time.perf_counter() - t0
            if isinstance(item, _Failed):
                raise item.error
            if item is _END:
                return
            if event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                for _, t in item:
                    if t.is_cuda:
                        t.record_stream(current)
            room.release()
            yield item
    finally:
        stop.set()
        room.release()
