"""Injected time: the daemon runs on `RealClock`, the simulator runs the same loop on `VirtualClock`."""

from __future__ import annotations

import threading
import time
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
    """Time moves only when the loop waits: a 30-minute run takes as long as its ticks' work."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, dt_s: float) -> None:
        if dt_s < 0:
            raise ValueError(f"cannot move a clock backwards by {dt_s} s")
        self._now += dt_s

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        if event.is_set():
            return True
        self.advance(max(0.0, timeout_s))
        return event.is_set()
