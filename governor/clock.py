"""Injected time: the daemon runs on `RealClock`, the simulator runs the same loop on `VirtualClock`."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        """Wait until `event` is set or `timeout_s` passes; True if the event was set (tuned's terminate.wait)."""
        ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        return event.wait(max(0.0, timeout_s))


class VirtualClock:
    """Time moves only when the loop waits: a 30-minute run takes as long as its ticks' work.

    `call_at` schedules a callback at a virtual time (e.g. a simulated udev event that sets the loop's `wake`): a
    `wait` spanning it stops there, runs it, and returns early if that set the event, as a real wait would.
    """

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s
        self._alarms: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties run in the order they were scheduled

    def now(self) -> float:
        return self._now

    def advance(self, dt_s: float) -> None:
        if dt_s < 0:
            raise ValueError(f"cannot move a clock backwards by {dt_s} s")
        self._now += dt_s

    def call_at(self, t: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._alarms, (t, next(self._order), callback))

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        if event.is_set():
            return True
        deadline = self._now + max(0.0, timeout_s)
        while self._alarms and self._alarms[0][0] <= deadline:
            at, _, callback = heapq.heappop(self._alarms)
            self._now = max(self._now, at)
            callback()
            if event.is_set():
                return True
        self._now = deadline
        return event.is_set()
